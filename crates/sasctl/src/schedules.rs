//! `sasctl schedules`: durable schedules, managed in the state store
//! (see [`sas_store::schedules`]); the schedulers fire them.

use std::process::ExitCode;

use chrono::{DateTime, Utc};
use clap::{Args, Subcommand};
use sas_messages::OrderId;
use sas_store::schedules::{Change, Created, ScheduleAction, ScheduleAsk, ScheduleRow};
use sas_store::Store;

use crate::operate::{print_json, Output};

/// `sasctl schedules ...`
#[derive(Debug, Subcommand)]
pub enum SchedulesCommand {
    /// Create a schedule: the order it submits on each occurrence of a cron
    /// expression, read in a time zone.
    Create(CreateArgs),
    /// Every schedule (of one tenant with --tenant), with its next runs.
    List {
        /// Only this tenant's.
        #[arg(long)]
        tenant: Option<String>,
        /// How many next runs to show per schedule.
        #[arg(long, default_value_t = 3)]
        next: usize,
    },
    /// One schedule and its latest runs (started, skipped, missed).
    Show {
        /// Which.
        #[command(flatten)]
        which: Which,
        /// How many runs, newest first.
        #[arg(long, default_value_t = 20)]
        runs: i64,
    },
    /// Stop deciding occurrences until resumed (a trigger still runs).
    Pause(Which),
    /// Run again from the next occurrence after now (those while paused are not caught up).
    Resume(Which),
    /// Start a run now, whatever the expression, the overlap policy or a pause say.
    Trigger(Which),
    /// Delete a schedule: it starts nothing more; its runs' orders go on.
    Delete(Which),
}

/// One schedule, by tenant and name.
#[derive(Debug, Clone, Args)]
pub struct Which {
    /// The schedule's name.
    pub name: String,
    /// Its tenant.
    #[arg(long, default_value = sas_messages::ids::DEFAULT_TENANT)]
    pub tenant: String,
}

/// `sasctl schedules create`
#[derive(Debug, Clone, Args)]
pub struct CreateArgs {
    /// The schedule's name: 1 to 38 letters, digits, '_' or '-'. Its runs'
    /// orders are `<name>:<UTC time>` (`nightly:20261129T020000Z`).
    pub name: String,
    /// A cron expression of 5 fields (minute hour day-of-month month
    /// day-of-week) or 6 (seconds first), or a nickname (`@daily`).
    #[arg(long)]
    pub cron: String,
    /// The IANA time zone the expression is read in.
    #[arg(long, default_value = "UTC")]
    pub time_zone: String,
    /// The order each run submits, as JSON, without `order_id` (as
    /// `sasctl submit --file` reads one); `@PATH` reads it from a file.
    #[arg(long)]
    pub order: String,
    /// What an occurrence does while the last run goes on: `skip`,
    /// `buffer_one` (wait for it, one at most) or `allow`.
    #[arg(long, default_value = "skip")]
    pub overlap: String,
    /// After an outage, occurrences at most this many seconds old still
    /// start (in order, per the overlap policy); older ones are recorded as missed.
    #[arg(long, default_value_t = 3600)]
    pub catch_up_secs: u64,
    /// The tenant whose orders its runs are.
    #[arg(long, default_value = sas_messages::ids::DEFAULT_TENANT)]
    pub tenant: String,
    /// Create it paused.
    #[arg(long)]
    pub paused: bool,
}

/// Runs a `sasctl schedules` command.
///
/// # Errors
/// When the database cannot be reached, or the input is invalid.
pub async fn run(
    store: &Store,
    command: SchedulesCommand,
    actor: &str,
    output: Output,
) -> anyhow::Result<ExitCode> {
    let (which, action) = match command {
        SchedulesCommand::Create(args) => return create(store, args, actor).await,
        SchedulesCommand::List { tenant, next } => {
            return list(store, tenant.as_deref(), next, output).await
        }
        SchedulesCommand::Show { which, runs } => return show(store, &which, runs, output).await,
        SchedulesCommand::Pause(which) => (which, ScheduleAction::Pause),
        SchedulesCommand::Resume(which) => (which, ScheduleAction::Resume),
        SchedulesCommand::Trigger(which) => (which, ScheduleAction::Trigger),
        SchedulesCommand::Delete(which) => (which, ScheduleAction::Delete),
    };
    let change = store
        .schedules()
        .act(&which.tenant, &which.name, action, actor)
        .await?;
    match change {
        Change::Done => {
            println!("schedule {}/{} {}", which.tenant, which.name, action.done());
            Ok(ExitCode::SUCCESS)
        }
        Change::NotFound => {
            eprintln!("no schedule {}/{}", which.tenant, which.name);
            Ok(ExitCode::FAILURE)
        }
    }
}

/// Checks a schedule's definition as the schedulers will read it, and
/// stores it.
async fn create(store: &Store, args: CreateArgs, actor: &str) -> anyhow::Result<ExitCode> {
    let text = match args.order.strip_prefix('@') {
        Some(path) => std::fs::read_to_string(path)
            .map_err(|error| anyhow::anyhow!("cannot read the order file {path}: {error}"))?,
        None => args.order.clone(),
    };
    let order = serde_json::from_str(&text)
        .map_err(|error| anyhow::anyhow!("--order is not JSON: {error}"))?;
    let schedule = ScheduleAsk {
        tenant: args.tenant.clone(),
        name: args.name.clone(),
        cron: args.cron,
        time_zone: args.time_zone,
        order,
        overlap: args.overlap,
        catch_up_secs: Some(args.catch_up_secs),
        paused: args.paused,
    }
    .check()?;
    match store.schedules().create(&schedule, actor).await? {
        Created::Created(first) => {
            let first = first.map_or_else(|| "none to come".to_owned(), |at| at.to_rfc3339());
            println!(
                "schedule {}/{} created; first run {first}",
                args.tenant, args.name
            );
            Ok(ExitCode::SUCCESS)
        }
        refused => {
            let why = refused.refusal().unwrap_or_default();
            eprintln!("schedule {}/{} not created: {why}", args.tenant, args.name);
            Ok(ExitCode::FAILURE)
        }
    }
}

/// A schedule as listed: its row and its next runs.
#[derive(serde::Serialize)]
struct Listed<'a> {
    #[serde(flatten)]
    row: &'a ScheduleRow,
    next_runs: Vec<DateTime<Utc>>,
}

async fn list(
    store: &Store,
    tenant: Option<&str>,
    next: usize,
    output: Output,
) -> anyhow::Result<ExitCode> {
    let rows = store.schedules().list(tenant).await?;
    let mut listed = Vec::with_capacity(rows.len());
    for row in &rows {
        let next_runs = row.next_runs(next)?;
        listed.push(Listed { row, next_runs });
    }
    if output == Output::Json {
        print_json(&listed)?;
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:<12} {:<24} {:<20} {:<16} {:<10} {:<8} NEXT RUNS",
        "TENANT", "NAME", "CRON", "ZONE", "OVERLAP", "STATE"
    );
    for Listed { row, next_runs } in &listed {
        let state = if row.paused { "paused" } else { "active" };
        let runs: Vec<String> = next_runs.iter().map(DateTime::to_rfc3339).collect();
        println!(
            "{:<12} {:<24} {:<20} {:<16} {:<10} {:<8} {}",
            row.tenant,
            row.name,
            row.cron,
            row.time_zone,
            row.overlap,
            state,
            runs.join(", ")
        );
    }
    Ok(ExitCode::SUCCESS)
}

async fn show(store: &Store, which: &Which, runs: i64, output: Output) -> anyhow::Result<ExitCode> {
    let schedules = store.schedules();
    let Some(row) = schedules.get(&which.tenant, &which.name).await? else {
        eprintln!("no schedule {}/{}", which.tenant, which.name);
        return Ok(ExitCode::FAILURE);
    };
    let recorded = schedules.runs(&which.tenant, &which.name, runs).await?;
    if output == Output::Json {
        print_json(&serde_json::json!({ "schedule": row, "runs": recorded }))?;
        return Ok(ExitCode::SUCCESS);
    }
    println!("schedule   {}/{}", row.tenant, row.name);
    println!("workflow   {}", row.workflow);
    println!("cron       {} ({})", row.cron, row.time_zone);
    println!(
        "overlap    {}; catch-up {} s",
        row.overlap,
        row.catch_up_ms / 1000
    );
    println!("paused     {}", row.paused);
    let at = |time: Option<DateTime<Utc>>| time.map_or_else(|| "-".to_owned(), |t| t.to_rfc3339());
    println!("next run   {}", at(row.next_run));
    println!("buffered   {}", at(row.buffered));
    let last = row.last_order_id.as_deref().map_or_else(
        || "-".to_owned(),
        |id| OrderId::from(id).client_id().to_owned(),
    );
    println!("last order {last}");
    println!(
        "\n{:<26} {:<8} {:<30} DETAIL",
        "OCCURRENCE", "OUTCOME", "ORDER"
    );
    for run in &recorded {
        let order = run
            .order_id
            .as_deref()
            .map_or_else(String::new, |id| OrderId::from(id).client_id().to_owned());
        let detail = run.detail();
        println!(
            "{:<26} {:<8} {:<30} {detail}",
            run.occurrence.to_rfc3339(),
            run.outcome,
            order
        );
    }
    Ok(ExitCode::SUCCESS)
}

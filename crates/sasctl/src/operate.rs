//! `sasctl bulk`, `stats`, `alerts acknowledge|resolve`, `dead-letters
//! replay|discard`: what the console does, from the command line, through
//! the same store transitions and rules.

use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Args, Subcommand, ValueEnum};
use sas_announce::bulk::{run_bulk, Bulk, BulkError};
use sas_announce::replay::{replay_dead_letter, ReplayError};
use sas_announce::Announcer;
use sas_store::reads::search::OrderFilter;
use sas_store::writes::dead_letters::Disposition;
use sas_store::{ProcessState, Store};

use crate::inspect::Announce;
use crate::Target;

/// How tables are printed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// Aligned columns for people.
    #[default]
    Table,
    /// JSON for scripts.
    Json,
}

/// Which orders: the console's filters, as options.
#[derive(Debug, Clone, Default, Args)]
pub struct FilterArgs {
    /// In one of these states (repeat or separate with commas).
    #[arg(long = "state", value_delimiter = ',')]
    pub states: Vec<String>,
    /// Of this customer.
    #[arg(long)]
    pub customer: Option<String>,
    /// Submitted at or after (RFC 3339, or 2026-11-23T08:00 read as UTC).
    #[arg(long)]
    pub from: Option<String>,
    /// Submitted before.
    #[arg(long)]
    pub to: Option<String>,
    /// With at least this many failures.
    #[arg(long)]
    pub min_failures: Option<String>,
    /// Whose current step (in flight, being undone, or refused) is this one.
    #[arg(long)]
    pub step: Option<String>,
    /// Of this priority (0 to 9).
    #[arg(long)]
    pub priority: Option<String>,
    /// Whose id starts with this.
    #[arg(long)]
    pub id: Option<String>,
    /// Started by a child step of this order (its id exactly, with
    /// @tenant for a tenant's order).
    #[arg(long)]
    pub parent: Option<String>,
}

impl FilterArgs {
    /// The filter, checked as the console checks it.
    ///
    /// # Errors
    /// A message naming the option and what it should hold.
    pub fn filter(&self) -> anyhow::Result<OrderFilter> {
        let mut pairs: Vec<(&str, &str)> =
            self.states.iter().map(|s| ("state", s.as_str())).collect();
        for (name, value) in [
            ("customer", &self.customer),
            ("from", &self.from),
            ("to", &self.to),
            ("min_failures", &self.min_failures),
            ("step", &self.step),
            ("priority", &self.priority),
            ("id", &self.id),
            ("parent", &self.parent),
        ] {
            if let Some(value) = value {
                pairs.push((name, value.as_str()));
            }
        }
        OrderFilter::from_pairs(pairs, &[])
            .map_err(|e| anyhow::anyhow!("{e} (option --{})", e.parameter.replace('_', "-")))
    }
}

/// What a bulk action does to each order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BulkAction {
    /// Orders that ended error or compensated go back into the workflow.
    Resubmit,
    /// Orders stopped in error start again from their failed step (needs
    /// --reason).
    Resume,
    /// Pending or processing orders are undone (compensation now).
    Cancel,
}

impl BulkAction {
    fn eligible(self) -> &'static [ProcessState] {
        sas_store::writes::operator::OrderAction::from(self).eligible()
    }
}

impl From<BulkAction> for sas_store::writes::operator::OrderAction {
    fn from(action: BulkAction) -> Self {
        match action {
            BulkAction::Resubmit => Self::Resubmit,
            BulkAction::Resume => Self::Resume,
            BulkAction::Cancel => Self::Cancel,
        }
    }
}

/// `sasctl bulk ...`.
#[derive(Debug, Args)]
pub struct BulkArgs {
    /// What to do with each order.
    #[arg(value_enum)]
    pub action: BulkAction,
    /// Which orders.
    #[command(flatten)]
    pub filter: FilterArgs,
    /// Act, once you have seen the count: the number the preview printed.
    /// Without it, only the count is printed. When more orders match now,
    /// nothing is done.
    #[arg(long)]
    pub confirm: Option<i64>,
    /// Why, recorded in each order's history: what was fixed (resume,
    /// required), or why (cancel).
    #[arg(long)]
    pub reason: Option<String>,
}

/// Prints `value` as pretty JSON on stdout (`-o json`).
pub(crate) fn print_json<T: serde::Serialize>(value: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

/// `sasctl bulk`: the preview, or with `--confirm N` the action.
///
/// # Errors
/// When the filter is bad or the database cannot be reached.
pub async fn bulk(target: &Target, args: BulkArgs, output: Output) -> anyhow::Result<ExitCode> {
    let actor = target.actor()?;
    let filter = args.filter.filter()?;
    let store = target.store()?;
    let eligible = args.action.eligible();
    let count = sas_announce::bulk::preview(&store, args.action.into(), &filter).await?;
    let action = format!("{:?}", args.action).to_lowercase();
    let Some(confirmed) = args.confirm else {
        if output == Output::Json {
            print_json(&serde_json::json!({ "action": action, "count": count }))?;
        } else {
            let states: Vec<&str> = eligible.iter().map(|s| s.as_str()).collect();
            println!(
                "{count} orders match among those in state {}.",
                states.join(" or ")
            );
            if count > 0 {
                println!("To {action} them, run the same command with --confirm {count}.");
            }
        }
        return Ok(ExitCode::SUCCESS);
    };
    let reason = match (args.action, args.reason.clone()) {
        (_, Some(reason)) if !reason.trim().is_empty() => reason,
        (BulkAction::Resume, _) => anyhow::bail!(
            "resume needs --reason: say what was fixed (it is recorded in each order's history)"
        ),
        (BulkAction::Cancel, _) => "cancelled in bulk by an operator".to_owned(),
        (BulkAction::Resubmit, _) => String::new(),
    };
    let announce = match args.action {
        BulkAction::Cancel => Some(Announce::open(target).await),
        BulkAction::Resubmit | BulkAction::Resume => None,
    };
    let bulk = Bulk {
        action: args.action.into(),
        filter: &filter,
        confirmed,
        limit: confirmed,
        reason: &reason,
        actor: &actor,
    };
    let announcer = Announcer::new(&target.amqp());
    let publisher = announce.as_ref().and_then(Announce::publisher);
    let outcome = match run_bulk(&store, &announcer, publisher, bulk).await {
        Ok(outcome) => outcome,
        Err(refused @ BulkError::Unconfirmed { .. }) => {
            eprintln!("{refused}");
            return Ok(ExitCode::FAILURE);
        }
        Err(BulkError::Store(error)) => return Err(error.into()),
    };
    if output == Output::Json {
        print_json(&serde_json::json!({
            "action": action,
            "applied": outcome.applied,
            "skipped": outcome.skipped,
            "unannounced": outcome.unannounced,
        }))?;
        return Ok(ExitCode::SUCCESS);
    }
    for order_id in &outcome.applied {
        println!("{order_id}");
    }
    for (order_id, why) in &outcome.skipped {
        eprintln!("{order_id}: skipped ({why})");
    }
    if !outcome.unannounced.is_empty() {
        eprintln!("the messages of {} cancelled orders were not sent: their compensation starts when the supervisor finds their deadline passed", outcome.unannounced.len());
    }
    eprintln!(
        "{action}: {} applied, {} skipped",
        outcome.applied.len(),
        outcome.skipped.len()
    );
    Ok(ExitCode::SUCCESS)
}

/// `sasctl alerts acknowledge|resolve`.
#[derive(Debug, Subcommand)]
pub enum AlertsCommand {
    /// Mark an alert acknowledged (someone is on it).
    Acknowledge {
        /// Alert id.
        id: i64,
    },
    /// Resolve an alert, saying what was found or done.
    Resolve {
        /// Alert id.
        id: i64,
        /// What was found or done (required).
        #[arg(long)]
        note: String,
    },
}

/// Runs `sasctl alerts acknowledge|resolve`: exit 1 when the alert does not
/// exist or is resolved already.
///
/// # Errors
/// When the database cannot be reached.
pub async fn alert(store: &Store, command: AlertsCommand, actor: &str) -> anyhow::Result<ExitCode> {
    use sas_store::writes::alerts::AlertAction;
    let (id, outcome, done) = match command {
        AlertsCommand::Acknowledge { id } => (
            id,
            store.writes().acknowledge_alert(id, actor).await?,
            "acknowledged",
        ),
        AlertsCommand::Resolve { id, note } => {
            anyhow::ensure!(
                !note.trim().is_empty(),
                "--note must say what was found or done"
            );
            (
                id,
                store.writes().resolve_alert(id, note.trim(), actor).await?,
                "resolved",
            )
        }
    };
    match outcome {
        AlertAction::Done => {
            println!("alert #{id} {done}");
            Ok(ExitCode::SUCCESS)
        }
        AlertAction::NotFound => {
            eprintln!("no alert #{id}");
            Ok(ExitCode::FAILURE)
        }
        AlertAction::AlreadyResolved => {
            eprintln!("alert #{id} is already resolved");
            Ok(ExitCode::FAILURE)
        }
    }
}

/// `sasctl dead-letters replay|discard`.
#[derive(Debug, Subcommand)]
pub enum DeadLettersCommand {
    /// Publish a dead letter's recorded body again to its source queue.
    Replay {
        /// Dead letter id.
        id: i64,
    },
    /// Record that nothing will be done with a dead letter.
    Discard {
        /// Dead letter id.
        id: i64,
    },
}

/// Runs `sasctl dead-letters replay|discard`: exit 1 when it cannot be
/// replayed (saying why) or was dealt with already.
///
/// # Errors
/// When the database or the broker cannot be reached.
pub async fn dead_letter(target: &Target, command: DeadLettersCommand) -> anyhow::Result<ExitCode> {
    let actor = target.actor()?;
    let store = target.store()?;
    match command {
        DeadLettersCommand::Replay { id } => {
            let settings = target.amqp();
            // A letter that cannot be replayed is refused without the broker.
            if let Err(refusal) = store.reads().replay_of(id, &settings.names()).await? {
                eprintln!("{refusal}");
                return Ok(ExitCode::FAILURE);
            }
            let connection = sas_broker::connect(&settings, "sasctl")
                .await
                .context("cannot connect to RabbitMQ")?;
            let mut publisher =
                sas_broker::Publisher::open(&connection, settings.operation_timeout()).await?;
            if let Some(user) = settings.user() {
                publisher = publisher.identified_as(user);
            }
            let replayed =
                replay_dead_letter(&store, &settings.names(), &publisher, id, &actor).await;
            let _ = connection.close(200, "done".into()).await;
            let queue = match replayed {
                Ok(queue) => queue,
                Err(ReplayError::Refused(refusal)) => {
                    eprintln!("{refusal}");
                    return Ok(ExitCode::FAILURE);
                }
                Err(error) => return Err(error.into()),
            };
            println!("dead letter #{id} replayed to {queue}");
            Ok(ExitCode::SUCCESS)
        }
        DeadLettersCommand::Discard { id } => {
            if store
                .writes()
                .dispose_dead_letter(id, Disposition::Discarded, &actor)
                .await?
            {
                println!("dead letter #{id} discarded");
                Ok(ExitCode::SUCCESS)
            } else {
                eprintln!(
                    "no dead letter #{id} left to discard (none, or already replayed or discarded)"
                );
                Ok(ExitCode::FAILURE)
            }
        }
    }
}

/// `sasctl stats`: orders by state, the last hour's milestones, open alerts
/// and dead letters nobody has dealt with.
///
/// # Errors
/// When the database cannot be reached.
pub async fn stats(store: &Store, output: Output) -> anyhow::Result<ExitCode> {
    let activity = store.reads().activity().await?;
    let lines = store.admission().lines().await?;
    let keys = store.admission().key_lines(KEY_LINES_SHOWN).await?;
    if output == Output::Json {
        // The activity's keys, and the lines beside them under `admission`
        // and `keys`.
        let mut json = serde_json::to_value(&activity)?;
        json["admission"] = serde_json::to_value(&lines)?;
        json["keys"] = serde_json::to_value(&keys)?;
        print_json(&json)?;
        return Ok(ExitCode::SUCCESS);
    }
    println!("{:<14} {:>10}", "STATE", "ORDERS");
    for state in ProcessState::ALL {
        let n = activity
            .by_state
            .iter()
            .find(|(s, _)| *s == state)
            .map_or(0, |(_, n)| *n);
        println!("{:<14} {n:>10}", state.as_str());
    }
    println!("\n{:<22} {:>10}", "LAST HOUR", "COUNT");
    for event in sas_store::reads::overview::MILESTONES {
        let n: i64 = activity
            .per_minute
            .iter()
            .filter(|m| m.event == event)
            .map(|m| m.count)
            .sum();
        println!("{event:<22} {n:>10}");
    }
    print_admission(&lines);
    print_key_lines(&keys);
    println!(
        "\nopen alerts {}, dead letters to look at {}",
        activity.open_alerts, activity.pending_dead_letters
    );
    Ok(ExitCode::SUCCESS)
}

/// The most key lines `sasctl stats` shows.
const KEY_LINES_SHOWN: i64 = 20;

/// The busiest keys of the workflows' concurrency limits: waiting first,
/// then in flight (keys with neither have no state).
fn print_key_lines(keys: &[sas_store::admission::KeyLine]) {
    if keys.is_empty() {
        println!("\nno key has an attempt in flight or an order waiting");
        return;
    }
    println!(
        "\n{:<32} {:>8} {:>10} {:>9} {:>8} {:>12} {:>22}",
        "KEY", "WAITING", "IN FLIGHT", "LIMIT", "RATE/S", "OLDEST WAIT", "PAUSED UNTIL"
    );
    for key in keys {
        let oldest = key
            .oldest_wait_secs
            .map_or_else(|| "-".to_owned(), |secs| format!("{secs:.1}s"));
        let dash = |n: Option<i32>| n.map_or_else(|| "-".to_owned(), |n| n.to_string());
        let paused = key.paused_until.map_or_else(
            || "-".to_owned(),
            |until| until.format("%Y-%m-%d %H:%M:%S").to_string(),
        );
        println!(
            "{:<32} {:>8} {:>10} {:>9} {:>8} {:>12} {:>22}",
            key.key,
            key.waiting,
            key.in_flight,
            key.limit_shown(),
            dash(key.per_second),
            oldest,
            paused
        );
    }
}

/// The agents' lines: the real backlog, which admission control keeps in
/// Postgres (the agent queues stay short however many orders wait), and
/// the cap up to which urgent orders pass a full limit.
fn print_admission(lines: &[sas_store::admission::AdmissionLine]) {
    println!(
        "\n{:<14} {:>8} {:>10} {:>6} {:>6} {:>8} {:>12}",
        "AGENT", "WAITING", "IN FLIGHT", "LIMIT", "CAP", "CEILING", "OLDEST WAIT"
    );
    for line in lines {
        let oldest = line
            .oldest_wait_secs
            .map_or_else(|| "-".to_owned(), |secs| format!("{secs:.1}s"));
        println!(
            "{:<14} {:>8} {:>10} {:>6} {:>6} {:>8} {:>12}",
            line.agent,
            line.waiting,
            line.in_flight,
            line.admit_limit,
            line.admit_cap,
            line.ceiling,
            oldest
        );
    }
}

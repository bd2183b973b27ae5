//! `sasctl`: submit orders, watch them, inspect the state store.
//!
//! - [`submit`]: publish one order, a file of orders, or N generated ones.
//! - [`watch`]: follow one order's status messages live.
//! - [`inspect`]: orders, alerts and dead letters from the state store.
//! - [`operate`]: bulk actions by filter, alerts, dead-letter replays, stats.
//! - [`probe`]: a minimal HTTP health check for containers.
//! - [`schedules`]: durable schedules: create, list, pause, resume, trigger, delete.

pub mod inspect;
pub mod moves;
pub mod operate;
pub mod probe;
pub mod schedules;
pub mod signal;
pub mod submit;
pub mod watch;

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use sas_broker::AmqpSettings;
use sas_store::connect::SslMode;
use sas_store::{DatabaseSettings, DeadlineSettings, Store};

/// Operate a Scheduler Agent Supervisor deployment: submit orders, watch
/// them, inspect orders, alerts and dead letters.
#[derive(Debug, Parser)]
#[command(version, about, long_about = None, after_help = EXIT_CODES)]
pub struct Cli {
    /// Where the deployment is.
    #[command(flatten)]
    pub target: Target,
    /// How tables are printed: `table`, or `json` for scripts.
    #[arg(long, short = 'o', global = true, value_enum, default_value_t = operate::Output::Table)]
    pub output: operate::Output,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// What each exit code means, shown under `--help` and in docs/sasctl.md.
pub const EXIT_CODES: &str = "Exit codes:
  0  done (for watch and submit --watch: the order was processed)
  1  failed: the broker or the database cannot be reached, the input is invalid,
     or the action was refused (the message says which)
  2  the command line is wrong (an unknown option, a missing argument)
  3  watch, submit --watch: the order ended compensated or failed
  4  watch, submit --watch: no terminal status in time (watch --timeout-secs, 300 s)";

/// Connection settings, named like the services' environment variables.
#[derive(Debug, Clone, Args)]
pub struct Target {
    /// RabbitMQ URL.
    #[arg(
        long,
        global = true,
        env = "SAS_AMQP__URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    pub amqp_url: String,
    /// The other RabbitMQ nodes of a cluster (`host:port,host:port`), tried
    /// in turn when the URL's node cannot be reached.
    #[arg(long, global = true, env = "SAS_AMQP__NODES", value_delimiter = ',')]
    pub amqp_nodes: Vec<String>,
    /// A PEM file of the CA that signed the broker's certificate, for an
    /// `amqps://` URL the system's roots do not vouch for.
    #[arg(long, global = true, env = "SAS_AMQP__TLS_CA_FILE", default_value = "")]
    pub amqp_tls_ca_file: String,
    /// Queue name prefix of the deployment.
    #[arg(long, global = true, env = "SAS_AMQP__PREFIX", default_value = "")]
    pub prefix: String,
    /// Postgres URL of the state store.
    #[arg(
        long,
        global = true,
        env = "SAS_DATABASE__URL",
        default_value = "postgres://postgres@127.0.0.1:5432/sas"
    )]
    pub database_url: String,
    /// File holding the database password (a mounted secret). Without it the
    /// password comes from `SAS_DATABASE__PASSWORD`, or from the URL. There
    /// is no option for the password itself: a command line is visible to
    /// every user of the machine (`ps`) and lands in shell history.
    #[arg(long, global = true, env = "SAS_DATABASE__PASSWORD_FILE")]
    pub database_password_file: Option<std::path::PathBuf>,
    /// Who is acting, recorded in the history of every order, alert and
    /// dead letter an action touches as `sasctl:<actor>` (default: the
    /// operating-system user).
    #[arg(long, global = true, env = "SAS_ACTOR")]
    pub actor: Option<String>,
    /// The deployment's `deadlines.start_margin_ms`, checked with the grace
    /// and the skew as the services check them.
    #[arg(long, global = true, env = "SAS_DEADLINES__START_MARGIN_MS", default_value_t = DeadlineSettings::default().start_margin_ms)]
    pub deadlines_start_margin_ms: u64,
    /// The deployment's `deadlines.grace_ms`: a cancel names, and holds the
    /// order until, an action's deadline plus this as the earliest its undo
    /// may go, as the services do, and `stats` counts an attempt let go of
    /// for this long.
    #[arg(long, global = true, env = "SAS_DEADLINES__GRACE_MS", default_value_t = DeadlineSettings::default().grace_ms)]
    pub deadlines_grace_ms: u64,
    /// The deployment's `deadlines.max_clock_skew_ms`, checked with the
    /// other two as the services check them.
    #[arg(long, global = true, env = "SAS_DEADLINES__MAX_CLOCK_SKEW_MS", default_value_t = DeadlineSettings::default().max_clock_skew_ms)]
    pub deadlines_max_clock_skew_ms: u64,
}

/// Environment variable holding the database password, as the services read it.
pub const DATABASE_PASSWORD_VAR: &str = "SAS_DATABASE__PASSWORD";

impl Target {
    /// Who acts, as recorded: `sasctl:<--actor>`, or `sasctl:<the OS user>`
    /// (`$USER`, `$LOGNAME`, else the name of the effective user id).
    ///
    /// # Errors
    /// When `--actor` is empty, longer than 64 characters, or holds a control character.
    pub fn actor(&self) -> anyhow::Result<String> {
        let name = match &self.actor {
            Some(actor) => actor.clone(),
            None => ["USER", "LOGNAME"]
                .iter()
                .find_map(|var| std::env::var(var).ok().filter(|v| !v.is_empty()))
                .or_else(|| {
                    nix::unistd::User::from_uid(nix::unistd::geteuid())
                        .ok()
                        .flatten()
                        .map(|user| user.name)
                })
                .unwrap_or_else(|| "unknown".to_owned()),
        };
        anyhow::ensure!(
            !name.trim().is_empty()
                && name.chars().count() <= 64
                && !name.chars().any(char::is_control),
            "--actor (SAS_ACTOR) must be 1 to 64 characters without control characters: {name:?}"
        );
        Ok(format!("sasctl:{name}"))
    }

    /// AMQP settings for a short-lived client.
    pub fn amqp(&self) -> AmqpSettings {
        AmqpSettings {
            url: self.amqp_url.clone(),
            nodes: self.amqp_nodes.clone(),
            prefix: self.prefix.clone(),
            prefetch: 64,
            operation_timeout_ms: 10_000,
            // The services' default; a queue they declared with another
            // limit is used as it is (topology::declare).
            delivery_limit: 20,
            max_message_bytes: 65_536,
            reconnect_base_ms: 200,
            reconnect_max_ms: 5_000,
            status_exchange: true,
            tls_ca_file: self.amqp_tls_ca_file.clone(),
        }
    }

    /// A store handle, deciding with the deployment's deadlines.
    ///
    /// # Errors
    /// When the URL is not a Postgres URL, or the deadlines do not fit
    /// together (the message names the keys).
    pub fn store(&self) -> anyhow::Result<Store> {
        let settings = DatabaseSettings {
            url: self.database_url.clone(),
            password: self.database_password()?,
            max_connections: 4,
            acquire_timeout_ms: 5_000,
            statement_timeout_ms: 10_000,
            migrate: false,
            ssl_mode: SslMode::Prefer,
            ssl_root_cert: String::new(),
            // Ad hoc queries: the planner's own choice.
            index_plans: false,
            idle_in_transaction_timeout_ms: 5_000,
            keepalive_secs: 10,
        };
        settings.validate().map_err(anyhow::Error::msg)?;
        let deadlines = DeadlineSettings {
            start_margin_ms: self.deadlines_start_margin_ms,
            grace_ms: self.deadlines_grace_ms,
            max_clock_skew_ms: self.deadlines_max_clock_skew_ms,
        };
        deadlines.validate(None).map_err(anyhow::Error::msg)?;
        Ok(Store::connect_lazy(&settings, "sasctl")?.with_deadlines(deadlines))
    }
}

impl Target {
    /// The database password: the file of `--database-password-file` (or
    /// `SAS_DATABASE__PASSWORD_FILE`, trailing newline removed), else
    /// `SAS_DATABASE__PASSWORD`, else none (the URL may hold one).
    ///
    /// # Errors
    /// When the password file cannot be read.
    pub fn database_password(&self) -> anyhow::Result<Option<String>> {
        if let Some(path) = &self.database_password_file {
            let text = std::fs::read_to_string(path).map_err(|error| {
                anyhow::anyhow!(
                    "cannot read the database password file {}: {error}",
                    path.display()
                )
            })?;
            return Ok(Some(text.trim_end_matches(['\r', '\n']).to_owned()));
        }
        Ok(std::env::var(DATABASE_PASSWORD_VAR)
            .ok()
            .filter(|password| !password.is_empty()))
    }
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Publish orders to the orders queue (one, a file of them, or N generated).
    Submit(submit::SubmitArgs),
    /// Send an event to an order's wait step (`sasctl signal ORDER approved
    /// --data '{"by": "ann"}'`); kept for the order if it does not wait yet.
    Signal(signal::SignalArgs),
    /// Follow one order's status messages live until it ends.
    Watch {
        /// Order id.
        order_id: String,
        /// Give up after this many seconds.
        #[arg(long, default_value_t = 300)]
        timeout_secs: u64,
    },
    /// List or show orders.
    #[command(subcommand)]
    Orders(OrdersCommand),
    /// Operator alerts (unresolved ones unless --all); `acknowledge ID`,
    /// `resolve ID --note ...`.
    Alerts {
        /// Acknowledge or resolve one.
        #[command(subcommand)]
        action: Option<operate::AlertsCommand>,
        /// Include resolved alerts.
        #[arg(long)]
        all: bool,
        /// Print JSON (as `-o json`).
        #[arg(long)]
        json: bool,
    },
    /// Resubmit, resume or cancel every order a filter selects: prints the count;
    /// with `--confirm COUNT`, acts.
    Bulk(operate::BulkArgs),
    /// Orders by state, the last hour's milestones, open alerts, dead letters.
    Stats,
    /// Put an order that ended `error` or `compensated` back into the
    /// workflow, once the cause is fixed: a failed compensation resumes, any
    /// other order runs its workflow again with fresh idempotency keys.
    Resubmit {
        /// Order id.
        order_id: String,
    },
    /// Start an order stopped in `error` again from the step that failed,
    /// once the cause is fixed: completed steps are not called again; the
    /// failed step keeps its idempotency key when an earlier attempt's
    /// outcome is unknown, and gets a fresh one when its remote refused.
    /// Refused once the order's compensation began (use resubmit).
    Resume {
        /// Order id.
        order_id: String,
        /// What was fixed, recorded in the order's history.
        #[arg(long)]
        reason: String,
    },
    /// Cancel a pending or processing order, or one stopped in `error`
    /// before any undo began: what was done is undone (compensation), after
    /// any step in flight has passed its deadline.
    Cancel {
        /// Order id.
        order_id: String,
        /// Why, recorded in the order's history.
        #[arg(long, default_value = "cancelled by an operator")]
        reason: String,
    },
    /// Exit 0 when an HTTP URL answers 200 within 3 s, 1 otherwise: the
    /// container health check (the images carry no curl).
    Probe {
        /// `http://host:port/path`, such as `http://127.0.0.1:9101/readyz`
        /// (or `https://`, with `--ca-file`).
        url: String,
        /// The PEM CA of an `https://` service's certificate.
        #[arg(long)]
        ca_file: Option<String>,
    },
    /// Prints the shell completion script for `shell` (bash, zsh, fish,
    /// elvish, powershell): `sasctl completions bash > /etc/bash_completion.d/sasctl`.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Durable schedules: a workflow run on a cron expression in a time
    /// zone, each occurrence once (`create`, `list`, `show`, `pause`,
    /// `resume`, `trigger`, `delete`).
    #[command(subcommand)]
    Schedules(schedules::SchedulesCommand),
    /// Recorded dead letters, newest first; `replay ID`, `discard ID`.
    DeadLetters {
        /// Replay or discard one.
        #[command(subcommand)]
        action: Option<operate::DeadLettersCommand>,
        /// How many.
        #[arg(long, default_value_t = 20)]
        limit: i64,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

/// `sasctl orders ...`
#[derive(Debug, Subcommand)]
pub enum OrdersCommand {
    /// Orders a filter selects, newest first, a page at a time.
    List {
        /// Which orders.
        #[command(flatten)]
        filter: operate::FilterArgs,
        /// Continue after this cursor (printed at the end of the previous page).
        #[arg(long)]
        after: Option<String>,
        /// How many (1 to 500).
        #[arg(long, default_value_t = 20)]
        limit: i64,
        /// Print JSON (as `-o json`).
        #[arg(long)]
        json: bool,
    },
    /// One order: state, steps, attempts, history.
    Show {
        /// Order id.
        order_id: String,
        /// Print JSON (as `-o json`).
        #[arg(long)]
        json: bool,
    },
    /// Move the waiting orders of one workflow version to another: prints
    /// what would move and what could not (and why); with `--confirm
    /// COUNT`, moves them, each recorded in its history.
    Move(moves::MoveArgs),
}

/// Runs a command; the exit codes are [`EXIT_CODES`].
///
/// # Errors
/// When the broker or the database cannot be reached, or input is invalid.
pub async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let json = |flag: bool| flag || cli.output == operate::Output::Json;
    match cli.command {
        Command::Submit(args) => submit::run(&cli.target, args).await,
        Command::Signal(args) => signal::run(&cli.target, args).await,
        Command::Watch {
            order_id,
            timeout_secs,
        } => watch::run(&cli.target, &order_id, Duration::from_secs(timeout_secs)).await,
        Command::Orders(OrdersCommand::List {
            filter,
            after,
            limit,
            json: as_json,
        }) => {
            let page = sas_store::reads::search::Page::from_pairs(
                [
                    ("after", after.as_deref().unwrap_or("")),
                    ("limit", &limit.to_string()),
                ],
                limit,
            )?;
            inspect::list(
                &cli.target.store()?,
                &filter.filter()?,
                &page,
                json(as_json),
            )
            .await
        }
        Command::Orders(OrdersCommand::Move(args)) => {
            moves::run(&cli.target, args, cli.output).await
        }
        Command::Orders(OrdersCommand::Show {
            order_id,
            json: as_json,
        }) => inspect::show(&cli.target.store()?, &order_id, json(as_json)).await,
        Command::Alerts {
            action: Some(action),
            ..
        } => operate::alert(&cli.target.store()?, action, &cli.target.actor()?).await,
        Command::Alerts {
            action: None,
            all,
            json: as_json,
        } => inspect::alerts(&cli.target.store()?, all, json(as_json)).await,
        Command::Bulk(args) => operate::bulk(&cli.target, args, cli.output).await,
        Command::Stats => operate::stats(&cli.target.store()?, cli.output).await,
        Command::Probe { url, ca_file } => probe::run(&url, ca_file.as_deref()).await,
        Command::Resubmit { order_id } => {
            inspect::resubmit(&cli.target.store()?, &order_id, &cli.target.actor()?).await
        }
        Command::Completions { shell } => {
            use clap::CommandFactory as _;
            clap_complete::generate(shell, &mut Cli::command(), "sasctl", &mut std::io::stdout());
            Ok(ExitCode::SUCCESS)
        }
        Command::Resume { order_id, reason } => {
            inspect::resume(
                &cli.target.store()?,
                &order_id,
                &reason,
                &cli.target.actor()?,
            )
            .await
        }
        Command::Cancel { order_id, reason } => {
            inspect::cancel(&cli.target, &order_id, &reason).await
        }
        Command::Schedules(command) => {
            schedules::run(
                &cli.target.store()?,
                command,
                &cli.target.actor()?,
                cli.output,
            )
            .await
        }
        Command::DeadLetters {
            action: Some(action),
            ..
        } => operate::dead_letter(&cli.target, action).await,
        Command::DeadLetters {
            action: None,
            limit,
            json: as_json,
        } => inspect::dead_letters(&cli.target.store()?, limit, json(as_json)).await,
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::Cli;

    #[test]
    fn the_database_password_comes_from_a_file_not_the_command_line() {
        let file = std::env::temp_dir().join(format!("sasctl-password-{}", std::process::id()));
        std::fs::write(&file, "s3cret\n").unwrap();
        let cli = Cli::try_parse_from([
            "sasctl",
            "--database-password-file",
            file.to_str().unwrap(),
            "alerts",
        ])
        .unwrap();
        assert_eq!(
            cli.target.database_password().unwrap().as_deref(),
            Some("s3cret")
        );
        std::fs::remove_file(&file).unwrap();
        assert!(
            Cli::try_parse_from(["sasctl", "--database-password", "x", "alerts"]).is_err(),
            "no option takes the password itself"
        );
        let missing = Cli::try_parse_from([
            "sasctl",
            "--database-password-file",
            "/nonexistent/sas-password",
            "alerts",
        ])
        .unwrap();
        let error = missing.target.database_password().unwrap_err().to_string();
        assert!(error.contains("/nonexistent/sas-password"), "{error}");
    }
}

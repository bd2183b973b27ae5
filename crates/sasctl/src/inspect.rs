//! `sasctl orders`, `alerts`, `dead-letters`: read the state store.

use sas_store::machine::kind::Kind;
use std::process::ExitCode;

use sas_store::Store;

fn print_json<T: serde::Serialize>(value: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

/// `sasctl orders list`: one page; the cursor of the next, if any, on stderr.
///
/// # Errors
/// When the database cannot be reached.
pub async fn list(
    store: &Store,
    filter: &sas_store::reads::search::OrderFilter,
    page: &sas_store::reads::search::Page,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let found = store.reads().search_orders(filter, page).await?;
    if json {
        print_json(&found)?;
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:<40} {:<16} {:<13} {:<16} {:>8} {:<24} LAST ERROR",
        "ORDER", "CUSTOMER", "STATE", "STEP", "FAILURES", "UPDATED"
    );
    for order in &found.orders {
        println!(
            "{:<40} {:<16} {:<13} {:<16} {:>8} {:<24} {}",
            order.order_id,
            order.customer_id.as_deref().unwrap_or("-"),
            order.state.as_str(),
            order.current_step.as_deref().unwrap_or("-"),
            order.failure_count,
            order.updated_at.format("%Y-%m-%d %H:%M:%S%.3f"),
            order.last_error.as_deref().unwrap_or("")
        );
    }
    if let Some(next) = &found.next {
        eprintln!("more: the same command with --after {next}");
    }
    Ok(ExitCode::SUCCESS)
}

/// `sasctl orders show`: exit 1 when there is no such order.
///
/// # Errors
/// When the database cannot be reached.
pub async fn show(store: &Store, order_id: &str, json: bool) -> anyhow::Result<ExitCode> {
    let Some(detail) = store.reads().order_detail(order_id).await? else {
        eprintln!("no order {order_id}");
        return Ok(ExitCode::FAILURE);
    };
    if json {
        print_json(&detail)?;
        return Ok(ExitCode::SUCCESS);
    }
    let s = &detail.summary;
    println!("order       {}", s.order_id);
    println!("state       {}", s.state);
    println!(
        "workflow    {} (version {})",
        s.workflow, s.workflow_version
    );
    println!("locked by   {}", s.locked_by.as_deref().unwrap_or("-"));
    println!(
        "complete by {}",
        s.complete_by.map_or("-".to_owned(), |t| t.to_rfc3339())
    );
    println!("failures    {}", s.failure_count);
    println!("last error  {}", s.last_error.as_deref().unwrap_or("-"));
    if let Some(parent) = &detail.parent {
        println!("parent      {} (its step {})", parent.order_id, parent.step);
    }
    for child in &detail.children {
        println!("child       {} (step {})", child.order_id, child.step);
    }
    println!("\nSTEPS");
    for step in &detail.steps {
        // A wait step has no agent: what it waits for, and until when.
        let does = match &step.kind {
            Kind::Wait(wait) => format!("wait:{}", wait.event),
            Kind::Delay(_) => "delay".to_owned(),
            Kind::Child(child) => format!("child:{}", child.workflow),
            Kind::Call(call) => call.agent.clone(),
        };
        // A child step names the order it started last (`sasctl inspect`
        // it), from the stored links: a refused start stored none.
        let started = sas_store::reads::queries::ChildLink::latest(&detail.children, &step.name)
            .map(|child| format!("  (child order {})", child.order_id))
            .unwrap_or_default();
        let until = if step.kind.parks() && step.state == sas_store::StepState::Running {
            step.complete_by
                .map(|at| format!("  (until {})", at.to_rfc3339()))
                .unwrap_or_default()
        } else {
            String::new()
        };
        // Members of a parallel group run side by side.
        let beside = step
            .group
            .as_deref()
            .map(|group| format!("  (group {group})"))
            .unwrap_or_default();
        println!(
            "  {} {:<16} {:<10} {:<13} attempt {} key {}{}{until}{beside}{started}",
            step.position,
            step.name,
            does,
            step.state.as_str(),
            step.attempt,
            step.idempotency_key,
            step.last_error
                .as_deref()
                .map(|e| format!("  ({e})"))
                .unwrap_or_default()
        );
    }
    println!("\nHISTORY");
    for entry in &detail.history {
        println!(
            "  {}  {:<20} {:<24} {} {}",
            entry.at.format("%H:%M:%S%.3f"),
            entry.actor,
            entry.event,
            entry.step.as_deref().unwrap_or(""),
            entry.detail.as_deref().unwrap_or("")
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `sasctl alerts`.
///
/// # Errors
/// When the database cannot be reached.
pub async fn alerts(store: &Store, all: bool, json: bool) -> anyhow::Result<ExitCode> {
    let alerts = store.reads().alerts(all, 1000).await?;
    if json {
        print_json(&alerts)?;
    } else if alerts.is_empty() {
        println!("no alerts");
    } else {
        for alert in alerts {
            println!(
                "#{} {} {} order {}: {}",
                alert.id,
                alert.raised_at.format("%Y-%m-%d %H:%M:%S"),
                alert.kind,
                alert.order_id.as_deref().unwrap_or("-"),
                alert.message
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `sasctl dead-letters`.
///
/// # Errors
/// When the database cannot be reached.
pub async fn dead_letters(store: &Store, limit: i64, json: bool) -> anyhow::Result<ExitCode> {
    let letters = store.reads().dead_letters(limit).await?;
    if json {
        print_json(&letters)?;
    } else {
        for letter in letters {
            println!(
                "#{} {} from {} order {}: {}\n    {}",
                letter.id,
                letter.at.format("%Y-%m-%d %H:%M:%S"),
                letter.source_queue.as_deref().unwrap_or("-"),
                letter.order_id.as_deref().unwrap_or("-"),
                letter.reason,
                letter.body.chars().take(200).collect::<String>()
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `sasctl resubmit`: exit 1 when the order does not exist or has not failed.
///
/// # Errors
/// When the database cannot be reached.
pub async fn resubmit(store: &Store, order_id: &str, actor: &str) -> anyhow::Result<ExitCode> {
    match store.writes().resubmit(order_id, actor).await? {
        sas_store::writes::operator::Resubmit::Resubmitted { what, fresh_keys } => {
            let keys = match (what, fresh_keys.is_empty()) {
                (_, true) => String::new(),
                (sas_store::machine::ResubmitAction::CompensationResumed, false) => {
                    format!("; fresh undo keys for {}", fresh_keys.join(", "))
                }
                (sas_store::machine::ResubmitAction::WorkflowRestarted, false) => {
                    format!("; fresh keys for {}", fresh_keys.join(", "))
                }
            };
            println!("order {order_id} resubmitted: {what}{keys}");
            Ok(ExitCode::SUCCESS)
        }
        sas_store::writes::operator::Resubmit::NotFound => {
            eprintln!("no order {order_id}");
            Ok(ExitCode::FAILURE)
        }
        sas_store::writes::operator::Resubmit::NotFailed(state) => {
            eprintln!("order {order_id} is {state}: only orders that ended error or compensated can be resubmitted");
            Ok(ExitCode::FAILURE)
        }
        sas_store::writes::operator::Resubmit::NotResubmittable(why) => {
            eprintln!("{why}");
            Ok(ExitCode::FAILURE)
        }
    }
}

/// `sasctl resume`: exit 1 when the order does not exist, is not stopped
/// in error, or its steps do not allow it (with why).
///
/// # Errors
/// When the database cannot be reached, or the reason is empty.
pub async fn resume(
    store: &Store,
    order_id: &str,
    reason: &str,
    actor: &str,
) -> anyhow::Result<ExitCode> {
    use sas_store::writes::operator::Resume;
    anyhow::ensure!(
        !reason.trim().is_empty(),
        "--reason is empty: say what was fixed (it is recorded in the order's history)"
    );
    match store.writes().resume(order_id, reason, actor).await? {
        Resume::Resumed { from, key_kept } => {
            let key = if key_kept {
                "its key kept (an earlier attempt's outcome is unknown)"
            } else {
                "a fresh key"
            };
            println!("order {order_id} resumed from step {from}, with {key}");
            Ok(ExitCode::SUCCESS)
        }
        Resume::NotFound => {
            eprintln!("no order {order_id}");
            Ok(ExitCode::FAILURE)
        }
        Resume::NotStopped(state) => {
            eprintln!("order {order_id} is {state}: only orders stopped in error can be resumed");
            Ok(ExitCode::FAILURE)
        }
        Resume::NotResumable(why) => {
            eprintln!("order {order_id} cannot be resumed: {why}");
            Ok(ExitCode::FAILURE)
        }
    }
}

/// `sasctl cancel`: exit 1 when the order does not exist or is not running.
/// The client's `compensating` status is sent when the broker is reachable;
/// the cancellation itself is committed either way.
///
/// # Errors
/// When the database cannot be reached.
pub async fn cancel(
    target: &crate::Target,
    order_id: &str,
    reason: &str,
) -> anyhow::Result<ExitCode> {
    match target
        .store()?
        .writes()
        .cancel(order_id, reason, &target.actor()?)
        .await?
    {
        sas_store::writes::operator::Cancel::Cancelled(progress) => {
            println!("order {order_id} cancelled: its completed steps are being undone");
            if let Err(error) = announce(target, &progress).await {
                eprintln!("the client's status message was not sent: {error:#}");
            }
            Ok(ExitCode::SUCCESS)
        }
        sas_store::writes::operator::Cancel::NotFound => {
            eprintln!("no order {order_id}");
            Ok(ExitCode::FAILURE)
        }
        sas_store::writes::operator::Cancel::NotRunning(state) => {
            eprintln!(
                "order {order_id} is {state}: only pending or processing orders, or orders stopped in error before any undo began, can be cancelled"
            );
            Ok(ExitCode::FAILURE)
        }
    }
}

/// One broker connection for the status messages of many transitions (a
/// bulk cancel); without the broker, the transitions stand and the
/// messages are not sent, as for one cancel.
pub struct Announce {
    connection: Option<sas_broker::lapin::Connection>,
    publisher: Option<sas_broker::Publisher>,
    announcer: sas_announce::Announcer,
}

impl Announce {
    /// Connects, or says on stderr why the status messages will not be sent.
    pub async fn open(target: &crate::Target) -> Self {
        let settings = target.amqp();
        let announcer = sas_announce::Announcer::new(&settings);
        let opened = async {
            let connection = sas_broker::connect(&settings, "sasctl").await?;
            let publisher =
                sas_broker::Publisher::open(&connection, settings.operation_timeout()).await?;
            Ok::<_, sas_broker::BrokerError>((connection, publisher))
        }
        .await;
        match opened {
            Ok((connection, publisher)) => Self {
                connection: Some(connection),
                publisher: Some(publisher),
                announcer,
            },
            Err(error) => {
                eprintln!("the clients' status messages will not be sent: {error}");
                Self {
                    connection: None,
                    publisher: None,
                    announcer,
                }
            }
        }
    }

    /// The publisher of the connection, if it opened.
    pub fn publisher(&self) -> Option<&sas_broker::Publisher> {
        self.publisher.as_ref()
    }

    /// Sends what one transition asks for.
    pub async fn send(&self, progress: &sas_store::Progress) {
        if let Err(error) = self
            .announcer
            .announce(self.publisher.as_ref(), progress)
            .await
        {
            eprintln!("a client's status message was not sent: {error}");
        }
    }
}

impl Drop for Announce {
    fn drop(&mut self) {
        // The connection closes with the process; nothing waits on it.
        let _ = self.connection.take();
    }
}

/// Publishes what an operator's transition asks for, as the services do.
async fn announce(target: &crate::Target, progress: &sas_store::Progress) -> anyhow::Result<()> {
    let settings = target.amqp();
    let connection = sas_broker::connect(&settings, "sasctl").await?;
    let publisher = sas_broker::Publisher::open(&connection, settings.operation_timeout()).await?;
    sas_announce::Announcer::new(&settings)
        .announce(Some(&publisher), progress)
        .await?;
    let _ = connection.close(200, "done".into()).await;
    Ok(())
}

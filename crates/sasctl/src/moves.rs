//! `sasctl orders move`: move the waiting orders of one workflow version to
//! another, after a look at what it would do.

use std::collections::BTreeMap;
use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use sas_store::writes::moves::{MoveReport, MoveRequest};

use crate::operate::{print_json, Output};
use crate::Target;

/// Arguments of `sasctl orders move`.
#[derive(Debug, Args)]
pub struct MoveArgs {
    /// The workflow.
    #[arg(long)]
    pub workflow: String,
    /// The version the orders have now.
    #[arg(long)]
    pub from: i32,
    /// The version to move them to (registered by a scheduler that runs it).
    #[arg(long)]
    pub to: i32,
    /// A step renamed in the new version: OLD=NEW (repeat for several); a
    /// step not named keeps its name.
    #[arg(long = "map", value_parser = parse_pair)]
    pub mapping: Vec<(String, String)>,
    /// At most this many orders.
    #[arg(long, default_value_t = 1000)]
    pub limit: i64,
    /// Move them: the number of orders the look without it said would move
    /// (refused when more would move now).
    #[arg(long)]
    pub confirm: Option<usize>,
}

fn parse_pair(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((old, new)) if !old.is_empty() && !new.is_empty() => {
            Ok((old.to_owned(), new.to_owned()))
        }
        _ => Err(format!("{text:?} is not OLD=NEW")),
    }
}

/// Without `--confirm`: prints which waiting orders would move and which
/// could not, and why. With it: moves them (each recorded in its history),
/// unless more would move than were confirmed.
///
/// # Errors
/// An unknown version, or the database cannot be reached.
pub async fn run(target: &Target, args: MoveArgs, output: Output) -> anyhow::Result<ExitCode> {
    let store = target.store()?;
    let mapping: BTreeMap<String, String> = args.mapping.iter().cloned().collect();
    let mut request = MoveRequest {
        workflow: &args.workflow,
        from: args.from,
        to: args.to,
        mapping: &mapping,
        limit: args.limit,
        apply: false,
        confirmed: None,
    };
    let look = store
        .writes()
        .move_orders(&request, &target.actor()?)
        .await
        .context("cannot look at the move")?;
    let Some(confirmed) = args.confirm else {
        report(&look, false, output)?;
        if !look.moved.is_empty() && output != Output::Json {
            println!(
                "To move them, run the same command with --confirm {}.",
                look.moved.len()
            );
        }
        return Ok(ExitCode::SUCCESS);
    };
    anyhow::ensure!(
        look.moved.len() <= confirmed,
        "{} orders would move now, more than the {confirmed} confirmed: look again without --confirm",
        look.moved.len()
    );
    request.apply = true;
    request.confirmed = Some(confirmed);
    let done = store
        .writes()
        .move_orders(&request, &target.actor()?)
        .await
        .context("cannot move the orders")?;
    report(&done, true, output)?;
    Ok(ExitCode::SUCCESS)
}

fn report(report: &MoveReport, applied: bool, output: Output) -> anyhow::Result<()> {
    if output == Output::Json {
        return print_json(&serde_json::json!({
            "applied": applied,
            "moved": report.moved.iter().map(|(id, detail)| serde_json::json!({"order_id": id, "detail": detail})).collect::<Vec<_>>(),
            "refused": report.refused.iter().map(|(id, reason)| serde_json::json!({"order_id": id, "reason": reason})).collect::<Vec<_>>(),
            "not_waiting": report.not_waiting,
        }));
    }
    let verb = if applied { "moved" } else { "would move" };
    for (order_id, detail) in &report.moved {
        println!("{order_id}: {verb} ({detail})");
    }
    for (order_id, reason) in &report.refused {
        println!("{order_id}: stays: {reason}");
    }
    println!(
        "{} {verb}, {} refused; {} of that version do not wait now (running or ended) and are not touched.",
        report.moved.len(),
        report.refused.len(),
        report.not_waiting
    );
    Ok(())
}

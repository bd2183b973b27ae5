//! What the simulated services decided per idempotency key, and the side
//! effects they applied, optionally journaled to a file.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};

use anyhow::Context;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

/// The answer given to a key, repeated for every later call with that key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "decision", rename_all = "snake_case")]
pub enum Decision {
    /// The effect was applied; this is the answer.
    Applied {
        /// Answer body.
        result: serde_json::Value,
    },
    /// Refused for good; nothing applied.
    Refused {
        /// HTTP status.
        status: u16,
        /// Reason.
        error: String,
    },
}

/// One decided key, as journaled and as listed by `GET /side-effects`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    /// The idempotency key.
    pub key: String,
    /// `inventory`, `payment` or `shipping`.
    pub service: String,
    /// Operation, such as `reserve`.
    pub operation: String,
    /// Order the call was about, if the payload named one.
    pub order_id: Option<String>,
    /// What was decided.
    #[serde(flatten)]
    pub decision: Decision,
    /// When it was decided.
    pub at: DateTime<Utc>,
    /// When the effect was applied (wall clock, microseconds), for an
    /// applied decision: tests check that an undo landed after its action.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub applied_at: Option<DateTime<Utc>>,
}

/// Counters of what the simulator saw.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Stats {
    /// Calls received.
    pub calls: u64,
    /// Calls answered from an earlier decision (nothing applied).
    pub deduplicated: u64,
    /// 503s returned.
    pub transient_faults: u64,
    /// Keys refused for good.
    pub permanent_faults: u64,
    /// Calls that applied their effect and never answered.
    pub hangs: u64,
    /// Side effects applied.
    pub applied: u64,
    /// Strict mode: 409s for a key in flight.
    pub in_progress: u64,
    /// Strict mode: actions applied at once and answered late.
    pub late_answers: u64,
    /// Strict mode: 404s for the undo of a key never applied.
    pub nothing_to_undo: u64,
    /// Strict mode: action keys refused for good because their undo came first.
    pub tombstones: u64,
}

/// Decisions per key, in order, with an optional journal.
#[derive(Debug, Default)]
pub struct Ledger {
    by_key: HashMap<String, usize>,
    entries: Vec<Entry>,
    journal: Option<File>,
    /// Counters.
    pub stats: Stats,
}

impl Ledger {
    /// An empty ledger, or the one journaled at `path` (created if missing).
    ///
    /// # Errors
    /// When the journal cannot be opened or holds a line that does not parse.
    pub fn open(path: &str) -> anyhow::Result<Self> {
        let mut ledger = Self::default();
        if path.is_empty() {
            return Ok(ledger);
        }
        if let Ok(file) = File::open(path) {
            for (number, line) in BufReader::new(file).lines().enumerate() {
                let line = line.with_context(|| format!("reading journal {path}"))?;
                if line.trim().is_empty() {
                    continue;
                }
                match serde_json::from_str::<Entry>(&line) {
                    Ok(entry) => ledger.remember(entry),
                    // A torn last line (killed mid-write) is skipped: its
                    // call was never answered, so the caller will retry.
                    Err(error) => {
                        tracing::warn!(path, line = number + 1, error = %error, "skipping unreadable journal line")
                    }
                }
            }
        }
        ledger.journal = Some(
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .with_context(|| format!("opening journal {path} (sim.journal_file)"))?,
        );
        Ok(ledger)
    }

    fn remember(&mut self, entry: Entry) {
        if matches!(entry.decision, Decision::Applied { .. }) {
            self.stats.applied += 1;
        }
        self.by_key.insert(entry.key.clone(), self.entries.len());
        self.entries.push(entry);
    }

    /// The decision already taken for `key`, if any.
    pub fn decided(&self, key: &str) -> Option<&Decision> {
        self.by_key
            .get(key)
            .map(|&index| &self.entries[index].decision)
    }

    /// Records a decision (journaling it first, so that an answered call is
    /// never forgotten by a restart).
    ///
    /// # Errors
    /// When the journal cannot be written.
    pub fn decide(&mut self, entry: Entry) -> anyhow::Result<()> {
        if let Some(journal) = &mut self.journal {
            let mut line = serde_json::to_vec(&entry)?;
            line.push(b'\n');
            journal.write_all(&line).context("writing the journal")?;
        }
        self.remember(entry);
        Ok(())
    }

    /// Every decision, oldest first.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }
}

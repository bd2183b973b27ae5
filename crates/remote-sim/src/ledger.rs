//! What the simulated services decided per idempotency key, and the side
//! effects they applied, optionally journaled to a file.

use std::collections::{HashMap, VecDeque};
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
    /// Order the call was about: the body's `order.order_id`, if it has one.
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
    /// The trace id of the deciding call's `traceparent` header, if it sent
    /// a valid one: tests check that a caller passes its trace on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<String>,
    /// The deciding call's HTTP method (`POST`, `PUT` or `PATCH`); absent
    /// for a tombstone (no call of its action was made) and in journal
    /// lines written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    /// The deciding call's JSON body, as received, when `sim.record_bodies`
    /// is on; null otherwise, for a tombstone, and in journal lines written
    /// before it was recorded.
    #[serde(default)]
    pub body: serde_json::Value,
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
    /// Calls answered 429 with `Retry-After` while their service was
    /// throttled (`PUT /admin/throttle/{service}`); nothing applied.
    pub throttled: u64,
}

/// Decisions per key, in order, with an optional journal.
#[derive(Debug, Default)]
pub struct Ledger {
    /// Each key's position in the whole history (forgotten entries included).
    by_key: HashMap<String, usize>,
    entries: VecDeque<Entry>,
    /// Entries dropped from the front, so that `by_key` positions stay valid.
    forgotten: usize,
    /// How long a key is remembered; `None` remembers every key.
    keep_for: Option<chrono::Duration>,
    journal: Option<File>,
    /// Counters.
    pub stats: Stats,
}

impl Ledger {
    /// An empty ledger, or the one journaled at `path` (created if missing),
    /// remembering each key for `keep_secs` after it was decided (0: for ever).
    ///
    /// # Errors
    /// When the journal cannot be opened or holds a line that does not parse.
    pub fn open(path: &str, keep_secs: u64) -> anyhow::Result<Self> {
        let mut ledger = Self {
            keep_for: (keep_secs > 0)
                .then(|| chrono::Duration::seconds(i64::try_from(keep_secs).unwrap_or(i64::MAX))),
            ..Self::default()
        };
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
        self.by_key
            .insert(entry.key.clone(), self.forgotten + self.entries.len());
        let newest = entry.at;
        self.entries.push_back(entry);
        self.forget_before(newest);
    }

    /// Drops the keys decided longer than `keep_for` before `now`, as a real
    /// API forgets its idempotency keys (Stripe after 24 hours): without it a
    /// long soak's simulator grows by every key it has seen.
    fn forget_before(&mut self, now: DateTime<Utc>) {
        let Some(keep_for) = self.keep_for else {
            return;
        };
        while let Some(oldest) = self.entries.front() {
            if now - oldest.at <= keep_for {
                break;
            }
            let position = self.forgotten;
            if let Some(oldest) = self.entries.pop_front() {
                if self.by_key.get(&oldest.key) == Some(&position) {
                    self.by_key.remove(&oldest.key);
                }
            }
            self.forgotten += 1;
        }
    }

    /// The decision already taken for `key`, if any.
    pub fn decided(&self, key: &str) -> Option<&Decision> {
        self.by_key
            .get(key)
            .and_then(|&position| self.entries.get(position - self.forgotten))
            .map(|entry| &entry.decision)
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

    /// Every decision still remembered, oldest first.
    pub fn entries(&self) -> impl Iterator<Item = &Entry> {
        self.entries.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(key: &str, at_secs: i64) -> Entry {
        Entry {
            key: key.to_owned(),
            service: "payment".to_owned(),
            operation: "charge".to_owned(),
            order_id: None,
            decision: Decision::Applied {
                result: serde_json::json!({}),
            },
            at: DateTime::from_timestamp(at_secs, 0).expect("a time"),
            applied_at: None,
            trace_id: None,
            method: Some("POST".to_owned()),
            body: serde_json::json!({ "order": { "order_id": "o1" } }),
        }
    }

    #[test]
    fn keys_are_forgotten_only_after_they_have_been_kept_long_enough() {
        let mut ledger = Ledger::open("", 60).expect("in memory");
        ledger.decide(entry("a", 1_000)).unwrap();
        ledger.decide(entry("b", 1_030)).unwrap();
        ledger.decide(entry("c", 1_060)).unwrap();
        assert!(ledger.decided("a").is_some(), "60 s old: still kept");
        ledger.decide(entry("d", 1_061)).unwrap();
        assert!(ledger.decided("a").is_none(), "61 s old: forgotten");
        assert!(ledger.decided("b").is_some() && ledger.decided("d").is_some());
        let keys: Vec<_> = ledger.entries().map(|e| e.key.as_str()).collect();
        assert_eq!(keys, ["b", "c", "d"]);
        assert_eq!(ledger.stats.applied, 4, "the counters keep counting");
    }

    #[test]
    fn a_key_decided_again_is_not_forgotten_with_its_first_entry() {
        let mut ledger = Ledger::open("", 10).expect("in memory");
        ledger.decide(entry("a", 0)).unwrap();
        ledger.decide(entry("a", 8)).unwrap();
        ledger.decide(entry("b", 15)).unwrap();
        assert!(ledger.decided("a").is_some(), "its newer entry is 7 s old");
        ledger.decide(entry("b", 19)).unwrap();
        assert!(ledger.decided("a").is_none());
    }

    #[test]
    fn zero_keeps_every_key() {
        let mut ledger = Ledger::open("", 0).expect("in memory");
        ledger.decide(entry("a", 0)).unwrap();
        ledger.decide(entry("b", 100_000_000)).unwrap();
        assert!(ledger.decided("a").is_some());
        assert_eq!(ledger.entries().count(), 2);
    }

    #[test]
    fn a_journal_line_written_before_methods_and_bodies_were_recorded_still_loads() {
        let line = r#"{"key":"o1:charge","service":"payment","operation":"charge","order_id":"o1","decision":"applied","result":{"id":"c-1"},"at":"2026-01-01T00:00:00Z"}"#;
        let entry: Entry = serde_json::from_str(line).unwrap();
        assert_eq!(entry.method, None);
        assert_eq!(entry.body, serde_json::Value::Null);
        assert_eq!(entry.order_id.as_deref(), Some("o1"));
        let new = entry_with_body();
        let text = serde_json::to_string(&new).unwrap();
        assert_eq!(serde_json::from_str::<Entry>(&text).unwrap(), new);
    }

    fn entry_with_body() -> Entry {
        Entry {
            method: Some("PUT".to_owned()),
            body: serde_json::json!({ "amount_cents": 250 }),
            ..entry("o1:credit", 0)
        }
    }
}

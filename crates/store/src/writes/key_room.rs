//! The room of the workflows' key lines (see
//! [`crate::machine::concurrency`]) as a batch of decisions sees it: each
//! key read once, under its lock, and what the batch's decisions so far
//! take from it; then what the batch leaves behind (the rates' arrival
//! times, the pauses the remotes asked for).
//!
//! A key's attempts in flight are counted from the steps themselves
//! ([`KEY_IN_FLIGHT`]), so whatever ends an attempt gives its slot back.

use std::collections::{BTreeMap, HashMap};

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

use super::apply::Decided;
use crate::machine::concurrency::{key_has_room, KeyLimits};
use crate::machine::key_learning::Learnt;
use crate::machine::{Decision, ProcessRow, StepRow};
use crate::model::{ProcessState, StepState};
use crate::StoreError;

/// Takes key `$1`'s lock for the rest of the transaction if it is free
/// (true), or says it is not (false): a transaction that took it again
/// holds it still.
pub(crate) const KEY_LOCK: &str =
    "SELECT pg_try_advisory_xact_lock(hashtextextended('sas.key:' || $1, 0))";

/// The attempts in flight in a key line (`s.limit_key`, compared by the
/// statement that uses it): an attempt whose order a scheduler holds (as
/// [`crate::machine::admission::slots_held`] counts an agent's), and one
/// its order let go of (a cancel, a refused group member) while its call
/// may still be running, until its deadline plus the grace (`$2`, seconds)
/// has passed. The FROM and WHERE clauses of a statement that counts them;
/// the state test lets the partial index `steps_limit_key_in_flight` serve.
pub(crate) const KEY_IN_FLIGHT: &str = "
      FROM steps s
      JOIN order_process op ON op.order_id = s.order_id
     WHERE s.state IN ('running', 'compensating')
       AND ((op.state IN ('processing', 'compensating')
             AND op.locked_by IS NOT NULL AND op.complete_by IS NOT NULL
             AND s.state = CASE op.state WHEN 'processing' THEN 'running'::step_state
                                         ELSE 'compensating'::step_state END)
            OR s.complete_by > now() - make_interval(secs => $2))";

/// A key line as a transaction read it, under its lock.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KeyRead {
    /// Attempts in flight in it.
    pub(crate) in_flight: i64,
    /// Whether orders wait in its line.
    pub(crate) waiting: bool,
    /// Its rate's theoretical arrival time, when one was kept.
    pub(crate) tat: Option<DateTime<Utc>>,
    /// The limit it learnt, when it is adaptive and one was kept.
    pub(crate) learnt: Option<Learnt>,
}

impl KeyRead {
    /// The most attempts the key lets in flight under `limits`: the
    /// declared limit, or what an adaptive key learnt within it.
    pub(crate) fn in_flight_limit(&self, limits: KeyLimits<'_>) -> Option<i32> {
        let ceiling = limits.in_flight?;
        Some(if limits.adaptive {
            self.learnt.unwrap_or_default().limit(ceiling)
        } else {
            ceiling
        })
    }
}

/// Locks key `line` for the rest of the transaction, if no other holds it,
/// and reads it. `None` when another transaction holds the key, or its
/// remote asked it to rest (`key_pauses`): it has no room now. `grace`:
/// how long after its deadline an attempt let go of may still be calling.
///
/// # Errors
/// When the database fails.
pub(crate) async fn read_key_line(
    conn: &mut PgConnection,
    line: &str,
    grace: std::time::Duration,
) -> Result<Option<KeyRead>, StoreError> {
    let locked: bool = sqlx::query_scalar(KEY_LOCK)
        .bind(line)
        .fetch_one(&mut *conn)
        .await?;
    if !locked {
        return Ok(None);
    }
    let row: KeyRow = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT (SELECT count(*) {KEY_IN_FLIGHT} AND s.limit_key = $1) AS in_flight,
                EXISTS (SELECT 1 FROM order_process WHERE waiting_key = $1) AS waiting,
                EXISTS (SELECT 1 FROM key_pauses WHERE key = $1 AND until > now()) AS paused,
                (SELECT tat FROM key_rates WHERE key = $1) AS tat,
                l.learnt_limit, l.base_ms, l.recent_ms, l.cut_at
           FROM (SELECT 1) one
           LEFT JOIN key_learnt l ON l.key = $1"
    )))
    .bind(line)
    .bind(grace.as_secs_f64())
    .fetch_one(&mut *conn)
    .await?;
    // A key its remote asked to rest has no room until then.
    Ok((!row.paused).then_some(KeyRead {
        in_flight: row.in_flight,
        waiting: row.waiting,
        tat: row.tat,
        learnt: row.learnt.learnt(),
    }))
}

/// A key line's row as [`read_key_line`] reads it.
#[derive(sqlx::FromRow)]
struct KeyRow {
    in_flight: i64,
    waiting: bool,
    paused: bool,
    tat: Option<DateTime<Utc>>,
    #[sqlx(flatten)]
    learnt: LearntRow,
}

/// A `key_learnt` row's columns (all null for a key without one).
#[derive(sqlx::FromRow)]
struct LearntRow {
    learnt_limit: Option<f64>,
    base_ms: Option<f64>,
    recent_ms: Option<f64>,
    cut_at: Option<DateTime<Utc>>,
}

impl LearntRow {
    fn learnt(&self) -> Option<Learnt> {
        Some(Learnt {
            limit: self.learnt_limit?,
            base_ms: self.base_ms?,
            recent_ms: self.recent_ms?,
            cut_at: self.cut_at,
        })
    }
}

/// The batch's view of the key lines its decisions start attempts in.
#[derive(Debug)]
pub(crate) struct KeyRoom {
    /// The transaction's clock.
    now: DateTime<Utc>,
    /// How long after its deadline an attempt let go of may still call.
    grace: std::time::Duration,
    /// Each key as read (`None`: no room for this transaction).
    read: HashMap<String, Option<KeyRead>>,
    /// Attempts the batch's decisions so far started in each key.
    taken: HashMap<String, i64>,
    /// Each rate-limited key's arrival time after the batch's starts so
    /// far: written back with the batch.
    tat: HashMap<String, DateTime<Utc>>,
}

impl KeyRoom {
    /// Nothing read yet, for a batch deciding at `now`.
    pub(crate) fn new(now: DateTime<Utc>, grace: std::time::Duration) -> Self {
        Self {
            now,
            grace,
            read: HashMap::new(),
            taken: HashMap::new(),
            tat: HashMap::new(),
        }
    }

    /// Whether key `line` has room for `demand` more attempts under
    /// `limits` ([`key_has_room`], and the rate's), after what the batch
    /// took; `replaced` of them start again steps of the deciding order
    /// that the read counted in flight ([`KeyRoom::counted`]: a retry after
    /// a transient failure, whose answered call is over), which they do
    /// not add to. The key is locked for the rest of the transaction first (an
    /// advisory lock on its name), so that two schedulers never both count
    /// the last slot free; a key another transaction holds has no room
    /// now: the order waits in its line, and the claim that serves the
    /// line starts it (a lock that waited could deadlock against a batch
    /// taking keys in another order).
    pub(crate) async fn has_room(
        &mut self,
        conn: &mut PgConnection,
        line: &str,
        limits: KeyLimits<'_>,
        first_in_line: bool,
        demand: i64,
        replaced: i64,
    ) -> Result<bool, StoreError> {
        let read = match self.read.get(line) {
            Some(read) => *read,
            None => {
                let read = read_key_line(&mut *conn, line, self.grace).await?;
                self.read.insert(line.to_owned(), read);
                read
            }
        };
        let Some(read) = read else {
            return Ok(false);
        };
        let taken = self.taken.get(line).copied().unwrap_or_default();
        let in_flight_room = read.in_flight_limit(limits).is_none_or(|limit| {
            key_has_room(
                read.in_flight - replaced + taken + demand - 1,
                limit,
                read.waiting,
                first_in_line,
            )
        });
        let tat = self.tat.get(line).copied().or(read.tat);
        let rate_room = limits.rate.is_none_or(|rate| {
            rate.room(tat, self.now) >= demand && (!read.waiting || first_in_line)
        });
        Ok(in_flight_room && rate_room)
    }

    /// Whether step `step` of an order whose process record is `process`
    /// is one [`KEY_IN_FLIGHT`] counts: held in flight, or let go of
    /// within its deadline plus the grace.
    pub(crate) fn counted(&self, process: &ProcessRow, step: &StepRow) -> bool {
        let in_flight = match process.state {
            ProcessState::Processing => StepState::Running,
            ProcessState::Compensating => StepState::Compensating,
            _ => StepState::NotStarted,
        };
        let held =
            process.locked_by.is_some() && process.complete_by.is_some() && step.state == in_flight;
        let grace = chrono::Duration::from_std(self.grace).unwrap_or(chrono::Duration::zero());
        matches!(step.state, StepState::Running | StepState::Compensating)
            && (held || step.complete_by.is_some_and(|by| by > self.now - grace))
    }

    /// Counts the attempts `decision` starts in key lines, and moves each
    /// rate-limited key's arrival time on. A key its remote asked to rest
    /// has no room for the rest of the batch either.
    pub(crate) fn take(&mut self, decision: &Decision) {
        if let Some(pause) = &decision.key_pause {
            self.read.insert(pause.key.clone(), None);
        }
        for (line, limits, _) in decision.takes_keys() {
            *self.taken.entry(line.to_owned()).or_default() += 1;
            if let Some(rate) = limits.rate {
                let before = self
                    .tat
                    .get(line)
                    .copied()
                    .or_else(|| self.read.get(line).copied().flatten().and_then(|r| r.tat));
                self.tat
                    .insert(line.to_owned(), rate.after_start(before, self.now));
            }
        }
    }

    /// Writes the rate-limited keys' arrival times the batch moved on.
    ///
    /// # Errors
    /// When the database fails.
    pub(crate) async fn write(&self, conn: &mut PgConnection) -> Result<(), StoreError> {
        if self.tat.is_empty() {
            return Ok(());
        }
        let (keys, tats): (Vec<&str>, Vec<DateTime<Utc>>) = self
            .tat
            .iter()
            .map(|(key, tat)| (key.as_str(), *tat))
            .unzip();
        sqlx::query("SELECT sas_set_key_rates($1, $2)")
            .bind(&keys)
            .bind(&tats)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }
}

/// Pauses the keys the batch's remotes asked to rest (see
/// [`crate::machine::concurrency::KeyPause`]).
///
/// # Errors
/// When the database fails.
pub(crate) async fn pause_keys(
    conn: &mut PgConnection,
    decided: &[Decided],
) -> Result<(), StoreError> {
    let (keys, untils): (Vec<&str>, Vec<DateTime<Utc>>) = decided
        .iter()
        .filter_map(|d| d.decision.key_pause.as_ref())
        .map(|pause| (pause.key.as_str(), pause.until))
        .unzip();
    if keys.is_empty() {
        return Ok(());
    }
    sqlx::query("SELECT sas_pause_keys($1, $2)")
        .bind(&keys)
        .bind(&untils)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Moves the adaptive keys' learnt limits with what the batch's replies
/// said of their remotes (see [`crate::machine::key_learning`]), each key's
/// attempts in flight read with it (whether its limit is in use). Each
/// key is locked first with a *try* lock held to the commit (as the keys'
/// room is, [`KEY_LOCK`]): one batch at a time writes a key, a key without
/// a row included, and no batch ever waits for another; a batch that finds
/// a key held leaves its answers for that key unlearnt. `grace`: as
/// [`read_key_line`]'s.
///
/// # Errors
/// When the database fails.
pub(crate) async fn learn_keys(
    conn: &mut PgConnection,
    decided: &[Decided],
    grace: std::time::Duration,
) -> Result<(), StoreError> {
    let samples: Vec<_> = decided
        .iter()
        .filter_map(|d| Some((d.decision.key_sample.as_ref()?, d.now)))
        .collect();
    if samples.is_empty() {
        return Ok(());
    }
    // Answers per key in this batch, with the key's ceiling.
    let mut answers: BTreeMap<&str, (i64, i32)> = BTreeMap::new();
    for (sample, _) in &samples {
        answers
            .entry(sample.key.as_str())
            .or_insert((0, sample.ceiling))
            .0 += 1;
    }
    let keys: Vec<&str> = answers.keys().copied().collect();
    // Only the keys this transaction could lock: one another holds (or a
    // frozen process holds, until its transaction is ended) is learnt by
    // the next batch instead. A lost answer, never a wait.
    let rows: Vec<KeyedLearnt> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "WITH mine AS (
             SELECT k FROM unnest($1::text[]) AS u(k)
              WHERE pg_try_advisory_xact_lock(hashtextextended('sas.learn:' || k, 0)))
         SELECT m.k AS key,
                (SELECT count(*) {KEY_IN_FLIGHT} AND s.limit_key = m.k) AS in_flight,
                l.learnt_limit, l.base_ms, l.recent_ms, l.cut_at
           FROM mine m
           LEFT JOIN key_learnt l ON l.key = m.k"
    )))
    .bind(&keys)
    .bind(grace.as_secs_f64())
    .fetch_all(&mut *conn)
    .await?;
    let mut learnt: BTreeMap<&str, (Learnt, bool)> = BTreeMap::new();
    for row in &rows {
        let Some((&key, &(answered, ceiling))) = answers.get_key_value(row.key.as_str()) else {
            continue;
        };
        let known = row.learnt.learnt().unwrap_or_default();
        // In use: it was full before this batch's answers came (they no
        // longer count in flight). Orders waiting in its line are not
        // enough: while the claims refill it, it may run far below.
        let in_use = row.in_flight + answered >= i64::from(known.limit(ceiling));
        learnt.insert(key, (known, in_use));
    }
    for (sample, now) in samples {
        if let Some((known, in_use)) = learnt.get_mut(sample.key.as_str()) {
            known.learn(sample.signal, sample.ceiling, *in_use, now);
        }
    }
    let mut columns = LearntColumns::default();
    for (key, (known, _)) in &learnt {
        columns.key.push(key);
        columns.limit.push(known.limit);
        columns.base_ms.push(known.base_ms);
        columns.recent_ms.push(known.recent_ms);
        columns.cut_at.push(known.cut_at);
    }
    sqlx::query(
        "INSERT INTO key_learnt AS k (key, learnt_limit, base_ms, recent_ms, cut_at)
         SELECT * FROM UNNEST($1::text[], $2::float8[], $3::float8[], $4::float8[],
                              $5::timestamptz[])
         ON CONFLICT (key) DO UPDATE
            SET learnt_limit = EXCLUDED.learnt_limit, base_ms = EXCLUDED.base_ms,
                recent_ms = EXCLUDED.recent_ms, cut_at = EXCLUDED.cut_at, seen_at = now()",
    )
    .bind(&columns.key)
    .bind(&columns.limit)
    .bind(&columns.base_ms)
    .bind(&columns.recent_ms)
    .bind(&columns.cut_at)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// A `key_learnt` row (all null for a key without one) with its key, and
/// the key's attempts in flight.
#[derive(sqlx::FromRow)]
struct KeyedLearnt {
    key: String,
    in_flight: i64,
    #[sqlx(flatten)]
    learnt: LearntRow,
}

/// [`learn_keys`]' rows, by column, in key order.
#[derive(Default)]
struct LearntColumns<'a> {
    key: Vec<&'a str>,
    limit: Vec<f64>,
    base_ms: Vec<f64>,
    recent_ms: Vec<f64>,
    cut_at: Vec<Option<DateTime<Utc>>>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::machine::kind::{CallStep, Kind};
    use crate::machine::Snapshot;
    use crate::NewStep;

    #[test]
    fn a_key_its_remote_asked_to_rest_has_no_room_for_the_rest_of_the_batch() {
        let now = DateTime::from_timestamp(1_800_000_000, 0).unwrap();
        let mut room = KeyRoom::new(now, std::time::Duration::from_secs(2));
        room.read.insert(
            "payment:m-1".into(),
            Some(KeyRead {
                in_flight: 0,
                waiting: false,
                tat: None,
                learnt: None,
            }),
        );
        let paused = Decision {
            verdict: crate::machine::Verdict::Applied,
            process: None,
            steps: Vec::new(),
            history: Vec::new(),
            alert: None,
            resolve_alerts: false,
            progress: crate::model::Progress::default(),
            admission: Vec::new(),
            used_event: None,
            wait_key: None,
            moved: None,
            key_pause: Some(crate::machine::concurrency::KeyPause {
                key: "payment:m-1".into(),
                until: now + chrono::Duration::seconds(2),
            }),
            key_sample: None,
            child: None,
        };
        room.take(&paused);
        assert!(matches!(room.read.get("payment:m-1"), Some(None)));
    }

    #[test]
    fn a_step_counts_in_flight_while_held_or_let_go_of_within_its_deadline_and_the_grace() {
        let t = |s: i64| DateTime::from_timestamp(1_800_000_000 + s, 0).unwrap();
        let step = NewStep {
            name: "charge".into(),
            kind: Kind::Call(CallStep::new("payment", "charge", None)),
            timeout: std::time::Duration::from_secs(5),
            group: None,
        };
        let mut order =
            Snapshot::new_order("o-1", serde_json::json!({}), None, None, 0, &[step], t(0));
        let room = KeyRoom::new(t(100), std::time::Duration::from_secs(2));
        let mut charge = order.steps[0].clone();
        charge.state = StepState::Running;
        charge.complete_by = Some(t(90));
        // Held by a scheduler, its deadline passed (the supervisor has not
        // acted yet): counted.
        order.process.state = ProcessState::Processing;
        order.process.locked_by = Some("scheduler-0".into());
        order.process.complete_by = Some(t(90));
        assert!(room.counted(&order.process, &charge));
        // Let go of (a cancel, a retry due): counted until its deadline
        // plus the grace, no longer.
        order.process.state = ProcessState::Pending;
        order.process.locked_by = None;
        order.process.complete_by = None;
        assert!(!room.counted(&order.process, &charge), "deadline 10 s ago");
        charge.complete_by = Some(t(99));
        assert!(room.counted(&order.process, &charge), "within the grace");
        charge.state = StepState::Completed;
        assert!(!room.counted(&order.process, &charge), "answered");
    }
}

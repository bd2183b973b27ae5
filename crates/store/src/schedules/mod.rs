//! Durable schedules (migration 0029): a workflow run on a cron expression
//! in a time zone, stored in Postgres and fired by whichever scheduler's
//! tick gets to it first.
//!
//! - [`spec`]: a schedule's definition, checked (name, [`spec::Timing`],
//!   [`spec::Overlap`], the id of each occurrence's order).
//! - [`plan`]: what becomes of the due occurrences, pure.
//! - [`manage`]: creating and changing them (operators directly; a
//!   tenant's client through a command a scheduler applies once).
//! - [`Schedules`] (here): reading the rows, and deciding the due ones
//!   (schedulers).
//!
//! Firing is in two steps so that no occurrence is lost or doubled:
//! [`Schedules::decide_due`] records each due occurrence's fate and moves
//! the schedule on in one transaction; the scheduler then stores each
//! started run's order through intake, whose id is derived from the
//! occurrence (so storing it twice stores it once), and marks the run
//! fired ([`Schedules::mark_fired`]). A run left unfired (the scheduler
//! died or froze in between) is fired by any scheduler's next tick
//! ([`Schedules::unfired`]).

pub mod manage;
pub mod plan;
pub mod spec;

use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use serde::Serialize;
use sqlx::types::Json;
use sqlx::AssertSqlSafe;

use crate::{Store, StoreError};
use plan::{Due, Outcome};
use spec::{occurrence_order_id, Overlap, Timing};

/// The schedules of a [`Store`] (see [`Store::schedules`]).
#[derive(Debug, Clone, Copy)]
pub struct Schedules<'a> {
    store: &'a Store,
}

/// A schedule to create, checked.
#[derive(Debug, Clone)]
pub struct NewSchedule {
    /// The tenant whose orders its runs are.
    pub tenant: String,
    /// Its name, unique within the tenant ([`spec::check_name`]).
    pub name: String,
    /// When it runs.
    pub timing: Timing,
    /// What an occurrence does while the last run goes on.
    pub overlap: Overlap,
    /// How old an occurrence may be and still start (after an outage).
    pub catch_up: Duration,
    /// The order each run submits, without its `order_id` (a
    /// [`sas_messages::SubmitOrder`] as JSON, checked by the caller).
    pub order: serde_json::Map<String, serde_json::Value>,
    /// Whether it starts paused.
    pub paused: bool,
}

/// A schedule as an operator or a tenant's client asks for it, unchecked
/// (sasctl's options, the console's form and API): [`ScheduleAsk::check`]
/// makes it a [`NewSchedule`] or says what is wrong.
#[derive(Debug, Clone, Default, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleAsk {
    /// The tenant whose orders its runs are (`default` when empty).
    #[serde(default)]
    pub tenant: String,
    /// Its name.
    pub name: String,
    /// The cron expression.
    pub cron: String,
    /// The IANA time zone (`UTC` when empty).
    #[serde(default)]
    pub time_zone: String,
    /// The order each run submits, without `order_id`.
    pub order: serde_json::Value,
    /// `skip` (when empty), `buffer_one` or `allow`.
    #[serde(default)]
    pub overlap: String,
    /// The catch-up window in seconds ([`spec::DEFAULT_CATCH_UP_SECS`] when absent).
    #[serde(default)]
    pub catch_up_secs: Option<u64>,
    /// Create it paused.
    #[serde(default)]
    pub paused: bool,
}

impl ScheduleAsk {
    /// The schedule a [`sas_messages::ScheduleCommand`]'s `definition`
    /// asks for, `name` in `tenant`.
    pub fn from_definition(
        tenant: &str,
        name: &str,
        definition: &sas_messages::ScheduleDefinition,
    ) -> Self {
        Self {
            tenant: tenant.to_owned(),
            name: name.to_owned(),
            cron: definition.cron.clone(),
            time_zone: definition.time_zone.clone(),
            order: definition.order.clone(),
            overlap: definition.overlap.clone(),
            catch_up_secs: definition.catch_up_secs,
            paused: definition.paused,
        }
    }

    /// The schedule asked for, checked as the schedulers will read it.
    ///
    /// # Errors
    /// [`spec::InvalidSchedule`] naming what is wrong.
    pub fn check(&self) -> Result<NewSchedule, spec::InvalidSchedule> {
        let or = |value: &str, default: &str| {
            if value.trim().is_empty() {
                default.to_owned()
            } else {
                value.trim().to_owned()
            }
        };
        spec::check_name(&self.name)?;
        let tenant = or(&self.tenant, sas_messages::ids::DEFAULT_TENANT);
        spec::check_tenant(&tenant)?;
        let catch_up_secs = self.catch_up_secs.unwrap_or(spec::DEFAULT_CATCH_UP_SECS);
        if catch_up_secs > spec::MAX_CATCH_UP_SECS {
            return Err(spec::InvalidSchedule(format!(
                "a catch-up window is at most {} seconds (31 days; got {catch_up_secs})",
                spec::MAX_CATCH_UP_SECS
            )));
        }
        let timing = Timing::parse(&self.cron, &or(&self.time_zone, "UTC"))?;
        let overlap: Overlap = or(&self.overlap, Overlap::Skip.as_str()).parse()?;
        let order = spec::check_order(&self.order, &self.name)?;
        Ok(NewSchedule {
            tenant,
            name: self.name.clone(),
            timing,
            overlap,
            catch_up: Duration::from_secs(catch_up_secs),
            order,
            paused: self.paused,
        })
    }
}

/// One schedule, as stored.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct ScheduleRow {
    /// Its tenant.
    pub tenant: String,
    /// Its name.
    pub name: String,
    /// The workflow its runs follow.
    pub workflow: String,
    /// The cron expression.
    pub cron: String,
    /// The IANA time zone it is read in.
    pub time_zone: String,
    /// The order each run submits, without its id.
    pub order_template: Json<serde_json::Value>,
    /// `skip`, `buffer_one` or `allow`.
    pub overlap: String,
    /// The catch-up window, in milliseconds.
    pub catch_up_ms: i64,
    /// Paused: no occurrence is decided (a run asked by hand still starts).
    pub paused: bool,
    /// The first occurrence not decided yet.
    pub next_run: Option<DateTime<Utc>>,
    /// An occurrence waiting for the last run to end (`buffer_one`).
    pub buffered: Option<DateTime<Utc>>,
    /// A run asked by hand, not decided yet.
    pub trigger_at: Option<DateTime<Utc>>,
    /// The stored id of the last run's order.
    pub last_order_id: Option<String>,
    /// Who created it.
    pub created_by: String,
    /// When.
    pub created_at: DateTime<Utc>,
    /// Who changed it last.
    pub updated_by: String,
    /// When.
    pub updated_at: DateTime<Utc>,
}

/// One decided occurrence of a schedule, as recorded.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct RunRow {
    /// When it was due (or asked for).
    pub occurrence: DateTime<Utc>,
    /// Asked by hand.
    pub by_hand: bool,
    /// `started`, `skipped` or `missed`.
    pub outcome: String,
    /// Why skipped.
    pub reason: Option<String>,
    /// Started: the stored id of its order.
    pub order_id: Option<String>,
    /// Missed: the last occurrence of the stretch.
    pub missed_through: Option<DateTime<Utc>>,
    /// Missed: how many.
    pub missed_count: Option<i32>,
    /// Which scheduler decided it.
    pub recorded_by: String,
    /// When.
    pub recorded_at: DateTime<Utc>,
    /// Started: when intake stored (or refused) its order.
    pub fired_at: Option<DateTime<Utc>>,
    /// Started: why intake refused its order.
    pub refusal: Option<String>,
}

impl RunRow {
    /// What became of the run beyond its outcome, said for people: how many
    /// were missed, why one was skipped, or whether its order was stored.
    pub fn detail(&self) -> String {
        let at =
            |time: Option<DateTime<Utc>>| time.map_or_else(|| "-".to_owned(), |t| t.to_rfc3339());
        match self.outcome.as_str() {
            "missed" => format!(
                "{} missed, through {}",
                self.missed_count.unwrap_or(0),
                at(self.missed_through)
            ),
            "skipped" => self.reason.clone().unwrap_or_default(),
            _ => match (&self.refusal, self.fired_at, self.by_hand) {
                (Some(refusal), _, _) => format!("refused: {refusal}"),
                (None, None, _) => "not stored yet".to_owned(),
                (None, Some(_), true) => "asked by hand".to_owned(),
                (None, Some(_), false) => String::new(),
            },
        }
    }
}

/// A started run whose order is to be stored: the order as its run row
/// holds it.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct Intent {
    /// The schedule's tenant.
    pub tenant: String,
    /// The schedule's name.
    pub name: String,
    /// The occurrence.
    pub occurrence: DateTime<Utc>,
    /// Asked by hand.
    pub by_hand: bool,
    /// The order, its client id set (not qualified by the tenant).
    pub order_body: Json<serde_json::Value>,
}

/// What became of a change asked of one schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// Done.
    Done,
    /// No such schedule (or deleted).
    NotFound,
}

/// What an operator (or a tenant's client) may do to one schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScheduleAction {
    /// Decide no occurrence until resumed (see [`Schedules::act`]).
    Pause,
    /// Run again from the first occurrence after now.
    Resume,
    /// Start a run now.
    Trigger,
    /// Start nothing more; the name may be used again.
    Delete,
}

impl ScheduleAction {
    /// Its name in paths and commands.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pause => "pause",
            Self::Resume => "resume",
            Self::Trigger => "trigger",
            Self::Delete => "delete",
        }
    }

    /// What was done, said after the schedule's name.
    pub fn done(self) -> &'static str {
        match self {
            Self::Pause => "paused",
            Self::Resume => "resumed from its next occurrence after now",
            Self::Trigger => "triggered: a scheduler starts its run within a tick",
            Self::Delete => "deleted",
        }
    }
}

impl std::str::FromStr for ScheduleAction {
    type Err = spec::InvalidSchedule;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        [Self::Pause, Self::Resume, Self::Trigger, Self::Delete]
            .into_iter()
            .find(|action| action.as_str() == text)
            .ok_or_else(|| {
                spec::InvalidSchedule(format!(
                    "no schedule action {text:?}: pause, resume, trigger or delete"
                ))
            })
    }
}

/// What [`Schedules::create`] did.
#[derive(Debug, Clone, PartialEq)]
pub enum Created {
    /// Stored; its first occurrence (none if the expression has none to come).
    Created(Option<DateTime<Utc>>),
    /// A schedule of that name exists in the tenant: nothing changed.
    Exists,
    /// No scheduler runs the workflow its order names: nothing stored.
    /// The names they do run, sorted.
    UnknownWorkflow(Vec<String>),
}

impl Created {
    /// Why nothing was created, said for the one who asked (`None`: created).
    pub fn refusal(&self) -> Option<String> {
        match self {
            Self::Created(_) => None,
            Self::Exists => Some(
                "a schedule of that name exists in the tenant: delete it first to replace it"
                    .into(),
            ),
            Self::UnknownWorkflow(known) => Some(format!(
                "no scheduler runs the workflow the order names; they run: {}",
                if known.is_empty() {
                    "nothing yet (start a scheduler first)".to_owned()
                } else {
                    known.join(", ")
                }
            )),
        }
    }
}

impl<'a> Schedules<'a> {
    pub(crate) fn new(store: &'a Store) -> Self {
        Self { store }
    }

    fn pool(&self) -> &'a sqlx::PgPool {
        self.store.pool()
    }
}

/// The columns of [`ScheduleRow`].
const SCHEDULE_COLUMNS: &str = "tenant, name, workflow, cron, time_zone, order_template, overlap,
    catch_up_ms, paused, next_run, buffered, trigger_at, last_order_id, created_by, created_at,
    updated_by, updated_at";

impl Schedules<'_> {
    /// The schedules of `tenant` (of every tenant when `None`), by tenant and name.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn list(self, tenant: Option<&str>) -> Result<Vec<ScheduleRow>, StoreError> {
        Ok(sqlx::query_as(AssertSqlSafe(format!(
            "SELECT {SCHEDULE_COLUMNS} FROM schedules
              WHERE deleted_at IS NULL AND ($1::text IS NULL OR tenant = $1)
              ORDER BY tenant, name"
        )))
        .bind(tenant)
        .fetch_all(self.pool())
        .await?)
    }

    /// One schedule, if it exists.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn get(self, tenant: &str, name: &str) -> Result<Option<ScheduleRow>, StoreError> {
        Ok(sqlx::query_as(AssertSqlSafe(format!(
            "SELECT {SCHEDULE_COLUMNS} FROM schedules
              WHERE deleted_at IS NULL AND tenant = $1 AND name = $2"
        )))
        .bind(tenant)
        .bind(name)
        .fetch_optional(self.pool())
        .await?)
    }

    /// The latest `limit` decided occurrences of one schedule, newest first.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn runs(
        self,
        tenant: &str,
        name: &str,
        limit: i64,
    ) -> Result<Vec<RunRow>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT r.occurrence, r.by_hand, r.outcome, r.reason, r.order_id, r.missed_through,
                    r.missed_count, r.recorded_by, r.recorded_at, r.fired_at, r.refusal
               FROM schedule_runs r JOIN schedules s USING (tenant, name)
              WHERE r.tenant = $1 AND r.name = $2 AND s.deleted_at IS NULL
                AND r.recorded_at >= s.created_at
              ORDER BY r.occurrence DESC, r.by_hand DESC LIMIT $3",
        )
        .bind(tenant)
        .bind(name)
        .bind(limit.clamp(1, 1000))
        .fetch_all(self.pool())
        .await?)
    }
}

/// A due schedule as the deciding transaction reads it, locked.
#[derive(sqlx::FromRow)]
struct DueRow {
    tenant: String,
    name: String,
    cron: String,
    time_zone: String,
    order_template: Json<serde_json::Map<String, serde_json::Value>>,
    overlap: String,
    catch_up_ms: i64,
    paused: bool,
    next_run: Option<DateTime<Utc>>,
    buffered: Option<DateTime<Utc>>,
    trigger_at: Option<DateTime<Utc>>,
    last_order_id: Option<String>,
    now: DateTime<Utc>,
}

/// The rows one decision writes.
#[derive(Default)]
struct Decided {
    tenants: Vec<String>,
    names: Vec<String>,
    occurrences: Vec<DateTime<Utc>>,
    by_hand: Vec<bool>,
    outcomes: Vec<&'static str>,
    reasons: Vec<Option<&'static str>>,
    order_ids: Vec<Option<String>>,
    bodies: Vec<Option<Json<serde_json::Value>>>,
    missed_through: Vec<Option<DateTime<Utc>>>,
    missed_count: Vec<Option<i32>>,
}

impl Decided {
    fn push(&mut self, row: &DueRow, run: &plan::Run, order: Option<(String, serde_json::Value)>) {
        let (outcome, reason, through, count) = match run.outcome {
            Outcome::Start => ("started", None, None, None),
            Outcome::Skip(reason) => ("skipped", Some(reason), None, None),
            Outcome::Missed { through, count } => (
                "missed",
                None,
                Some(through),
                Some(i32::try_from(count).unwrap_or(i32::MAX)),
            ),
        };
        self.tenants.push(row.tenant.clone());
        self.names.push(row.name.clone());
        self.occurrences.push(run.occurrence);
        self.by_hand.push(run.by_hand);
        self.outcomes.push(outcome);
        self.reasons.push(reason);
        self.missed_through.push(through);
        self.missed_count.push(count);
        let (order_id, body) = order.unzip();
        self.order_ids.push(order_id);
        self.bodies.push(body.map(Json));
    }
}

/// The schedules due now, locked, their due conditions checked again on
/// the row as locked (a row changed since the statement's snapshot, by a
/// scheduler that decided it or an operator who paused or deleted it, is
/// returned as it is now, and left out if it is no longer due). An
/// occurrence buffered behind a run is due once that run's order ended.
const LOCK_DUE: &str = "WITH due AS (
         SELECT tenant, name FROM schedules
          WHERE deleted_at IS NULL AND NOT paused AND next_run <= now()
         UNION
         SELECT s.tenant, s.name FROM schedules s
           LEFT JOIN order_process p ON p.order_id = s.last_order_id
          WHERE s.deleted_at IS NULL
            AND (s.trigger_at IS NOT NULL
                 OR (s.buffered IS NOT NULL AND NOT s.paused
                     AND coalesce(p.state IN ('processed', 'compensated', 'error'), true))))
     SELECT s.tenant, s.name, s.cron, s.time_zone, s.order_template, s.overlap, s.catch_up_ms,
            s.paused, s.next_run, s.buffered, s.trigger_at, s.last_order_id, now() AS now
       FROM schedules s JOIN due USING (tenant, name)
      WHERE s.deleted_at IS NULL
        AND ((NOT s.paused AND (s.next_run <= now() OR s.buffered IS NOT NULL))
             OR s.trigger_at IS NOT NULL)
      ORDER BY s.next_run NULLS LAST
      LIMIT $1
        FOR UPDATE OF s SKIP LOCKED";

/// Of the locked schedules `$1`/`$2` (tenants, names), those whose last
/// run (started by the expression, not by hand) has not ended: its order
/// is not `processed`, `compensated` or `error`, or is not stored yet. Read
/// after the lock, by a statement with a snapshot of its own, so that a
/// run another scheduler committed just before is seen.
const STILL_RUNNING: &str = "SELECT s.tenant, s.name FROM schedules s
       LEFT JOIN order_process p ON p.order_id = s.last_order_id
      WHERE (s.tenant, s.name) IN (SELECT * FROM UNNEST($1::text[], $2::text[]))
        AND coalesce(p.state NOT IN ('processed', 'compensated', 'error'),
                     EXISTS (SELECT 1 FROM schedule_runs r
                              WHERE r.order_id = s.last_order_id
                                AND r.outcome = 'started' AND r.fired_at IS NULL))";

impl Schedules<'_> {
    /// Decides up to `limit` due schedules (those whose next occurrence has
    /// come, with a run asked by hand, or with an occurrence buffered
    /// behind a run that ended), in one transaction: each occurrence is
    /// recorded once as started, skipped or missed ([`plan::plan`]), and
    /// each schedule moves on. Schedules another scheduler is deciding are
    /// skipped (`SKIP LOCKED`). The catch-up window is never taken as less
    /// than `least_catch_up` (the caller's two ticks and a second: an
    /// occurrence is not missed only because the tick that decides it
    /// comes after it). A schedule whose stored definition no longer parses
    /// is paused, with an error logged, and the others are decided.
    /// Returns the started runs, whose orders the caller stores.
    ///
    /// # Errors
    /// When the database fails: nothing was decided.
    pub async fn decide_due(
        self,
        actor: &str,
        limit: i64,
        least_catch_up: Duration,
    ) -> Result<Vec<Intent>, StoreError> {
        let mut tx = self.pool().begin().await?;
        let due: Vec<DueRow> = sqlx::query_as(LOCK_DUE)
            .bind(limit)
            .fetch_all(&mut *tx)
            .await?;
        if due.is_empty() {
            return Ok(Vec::new());
        }
        let tenants: Vec<&str> = due.iter().map(|row| row.tenant.as_str()).collect();
        let names: Vec<&str> = due.iter().map(|row| row.name.as_str()).collect();
        let running: Vec<(String, String)> = sqlx::query_as(STILL_RUNNING)
            .bind(&tenants)
            .bind(&names)
            .fetch_all(&mut *tx)
            .await?;
        let least_catch_up = TimeDelta::from_std(least_catch_up).unwrap_or(TimeDelta::MAX);
        let mut decided = Decided::default();
        let mut intents = Vec::new();
        for row in &due {
            let parsed = Timing::parse(&row.cron, &row.time_zone)
                .and_then(|timing| Ok((timing, row.overlap.parse::<Overlap>()?)));
            let (timing, overlap) = match parsed {
                Ok(parsed) => parsed,
                Err(error) => {
                    tracing::error!(tenant = %row.tenant, schedule = %row.name, %error, "a stored schedule no longer parses; it is paused");
                    sqlx::query(
                        "UPDATE schedules SET paused = true, updated_by = $3, updated_at = now()
                          WHERE tenant = $1 AND name = $2",
                    )
                    .bind(&row.tenant)
                    .bind(&row.name)
                    .bind(actor)
                    .execute(&mut *tx)
                    .await?;
                    continue;
                }
            };
            let last_running = running
                .iter()
                .any(|(tenant, name)| *tenant == row.tenant && *name == row.name);
            let plan = plan::plan(
                &Due {
                    next_run: row.next_run,
                    buffered: row.buffered,
                    trigger_at: row.trigger_at,
                    paused: row.paused,
                    overlap,
                    catch_up: TimeDelta::milliseconds(row.catch_up_ms).max(least_catch_up),
                    last_running,
                },
                &timing,
                row.now,
            );
            if plan.runs.is_empty()
                && plan.next_run == row.next_run
                && plan.buffered == row.buffered
            {
                // A buffered occurrence whose run had not ended after all:
                // nothing to write.
                continue;
            }
            let mut last_order_id = row.last_order_id.clone();
            for run in &plan.runs {
                if run.outcome != Outcome::Start {
                    decided.push(row, run, None);
                    continue;
                }
                let client_id = occurrence_order_id(&row.name, run.occurrence, run.by_hand);
                let stored_id = sas_messages::OrderId::from(client_id.clone())
                    .qualified(&row.tenant)
                    .to_string();
                let mut body = row.order_template.0.clone();
                body.insert("order_id".into(), client_id.into());
                let body = serde_json::Value::Object(body);
                // The overlap policy follows the runs of the expression; a
                // run asked by hand is the operator's, outside it.
                if !run.by_hand {
                    last_order_id = Some(stored_id.clone());
                }
                decided.push(row, run, Some((stored_id, body.clone())));
                intents.push(Intent {
                    tenant: row.tenant.clone(),
                    name: row.name.clone(),
                    occurrence: run.occurrence,
                    by_hand: run.by_hand,
                    order_body: Json(body),
                });
            }
            sqlx::query(
                "UPDATE schedules SET next_run = $3, buffered = $4, trigger_at = NULL,
                        last_order_id = $5
                  WHERE tenant = $1 AND name = $2",
            )
            .bind(&row.tenant)
            .bind(&row.name)
            .bind(plan.next_run)
            .bind(plan.buffered)
            .bind(last_order_id)
            .execute(&mut *tx)
            .await?;
        }
        let recorded = sqlx::query(
            "INSERT INTO schedule_runs (tenant, name, occurrence, by_hand, outcome, reason, order_id,
                                        order_body, missed_through, missed_count, recorded_by)
             SELECT *, $11 FROM UNNEST($1::text[], $2::text[], $3::timestamptz[], $4::bool[],
                                       $5::text[], $6::text[], $7::text[], $8::jsonb[],
                                       $9::timestamptz[], $10::int4[])
             ON CONFLICT DO NOTHING",
        )
        .bind(&decided.tenants)
        .bind(&decided.names)
        .bind(&decided.occurrences)
        .bind(&decided.by_hand)
        .bind(&decided.outcomes)
        .bind(&decided.reasons)
        .bind(&decided.order_ids)
        .bind(&decided.bodies)
        .bind(&decided.missed_through)
        .bind(&decided.missed_count)
        .bind(actor)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if recorded != decided.tenants.len() as u64 {
            // Under the schedules' locks, an occurrence is decided once: a
            // run already recorded means a bug, and nothing is fired.
            return Err(StoreError::Invariant(format!(
                "{} of {} decided schedule runs were recorded before",
                decided.tenants.len() as u64 - recorded,
                decided.tenants.len()
            )));
        }
        tx.commit().await?;
        Ok(intents)
    }

    /// Started runs whose orders were not stored `older_than` after they
    /// were decided (their scheduler died or froze in between), oldest
    /// first: any scheduler stores them (at worst again, which intake
    /// takes as the duplicate it is).
    ///
    /// # Errors
    /// When the database fails.
    pub async fn unfired(
        self,
        older_than: Duration,
        limit: i64,
    ) -> Result<Vec<Intent>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT tenant, name, occurrence, by_hand, order_body FROM schedule_runs
              WHERE outcome = 'started' AND fired_at IS NULL
                AND recorded_at < now() - make_interval(secs => $1)
              ORDER BY recorded_at LIMIT $2",
        )
        .bind(older_than.as_secs_f64())
        .bind(limit)
        .fetch_all(self.pool())
        .await?)
    }

    /// Whether `intent`'s run is still to be stored: not fired by another
    /// scheduler meanwhile, and not retired since. Checked just before a
    /// run is stored, so that a scheduler that wakes from a freeze does
    /// not store a run another stored (and retention perhaps deleted,
    /// order and all) while it slept.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn is_unfired(self, intent: &Intent) -> Result<bool, StoreError> {
        Ok(sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM schedule_runs
                             WHERE tenant = $1 AND name = $2 AND occurrence = $3
                               AND by_hand = $4 AND fired_at IS NULL)",
        )
        .bind(&intent.tenant)
        .bind(&intent.name)
        .bind(intent.occurrence)
        .bind(intent.by_hand)
        .fetch_one(self.pool())
        .await?)
    }

    /// Records that intake stored `intent`'s order, or refused it for `refusal`.
    ///
    /// # Errors
    /// When the database fails (the run is then fired again later, which
    /// stores nothing new).
    pub async fn mark_fired(
        self,
        intent: &Intent,
        refusal: Option<&str>,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE schedule_runs SET fired_at = now(), refusal = $5
              WHERE tenant = $1 AND name = $2 AND occurrence = $3 AND by_hand = $4
                AND fired_at IS NULL",
        )
        .bind(&intent.tenant)
        .bind(&intent.name)
        .bind(intent.occurrence)
        .bind(intent.by_hand)
        .bind(refusal)
        .execute(self.pool())
        .await?;
        Ok(())
    }
}

impl ScheduleRow {
    /// Its next `count` runs (none while paused).
    ///
    /// # Errors
    /// [`StoreError::Invariant`] when the stored definition no longer parses.
    pub fn next_runs(&self, count: usize) -> Result<Vec<DateTime<Utc>>, StoreError> {
        let (false, Some(first)) = (self.paused, self.next_run) else {
            return Ok(Vec::new());
        };
        let mut runs = vec![first];
        runs.extend(self.timing()?.upcoming(first, count.saturating_sub(1)));
        runs.truncate(count);
        Ok(runs)
    }

    /// Its timing, parsed again from what is stored.
    ///
    /// # Errors
    /// [`StoreError::Invariant`] when the stored definition no longer parses.
    pub fn timing(&self) -> Result<Timing, StoreError> {
        Timing::parse(&self.cron, &self.time_zone).map_err(|error| {
            StoreError::Invariant(format!(
                "schedule {}/{}: the stored definition no longer parses: {error}",
                self.tenant, self.name
            ))
        })
    }
}

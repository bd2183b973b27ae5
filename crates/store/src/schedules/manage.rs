//! Managing schedules: create, pause, resume, trigger, delete, each in
//! one transaction; and a [`Command`] (a change sent over the broker by a
//! client that may not write here) applied once per command id, its
//! outcome recorded with it (migration 0032) for the sender to read.

use std::str::FromStr;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::types::Json;
use sqlx::{AssertSqlSafe, PgConnection};

use sas_messages::ScheduleDefinition;

use super::spec::{InvalidSchedule, Timing};
use super::{Change, Created, NewSchedule, ScheduleAction, Schedules};
use crate::StoreError;

/// One change sent as a command: who sent it, under which id, for which
/// schedule (see [`Schedules::apply`]).
#[derive(Debug, Clone, Copy)]
pub struct Command<'a> {
    /// The tenant it acts within: the sender's.
    pub tenant: &'a str,
    /// The sender's id for it: once per tenant.
    pub command_id: &'a str,
    /// The schedule's name.
    pub name: &'a str,
    /// `create`, `pause`, `resume`, `trigger` or `delete`.
    pub action: &'a str,
    /// A create's definition, as sent: recorded with it.
    pub definition: Option<&'a ScheduleDefinition>,
    /// The sender's identity (`gateway:shop`), recorded.
    pub sent_by: &'a str,
}

/// What a command asks, as its applier checked it.
#[derive(Debug, Clone, Copy)]
pub enum Asked<'a> {
    /// Create this schedule.
    Create(&'a NewSchedule),
    /// Do this to the schedule.
    Act(ScheduleAction),
    /// Nothing, for this reason (an invalid definition, a workflow the
    /// sender may not start): recorded so that the sender learns why.
    Refused(&'a str),
}

/// What became of a command, as recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CommandOutcome {
    /// Applied.
    Done,
    /// No such schedule in the tenant.
    NotFound,
    /// A create whose name is taken in the tenant.
    Exists,
    /// Refused: the detail says why.
    Refused,
}

impl CommandOutcome {
    /// Its stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Done => "done",
            Self::NotFound => "not_found",
            Self::Exists => "exists",
            Self::Refused => "refused",
        }
    }
}

impl FromStr for CommandOutcome {
    type Err = StoreError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        [Self::Done, Self::NotFound, Self::Exists, Self::Refused]
            .into_iter()
            .find(|outcome| outcome.as_str() == text)
            .ok_or_else(|| StoreError::Invariant(format!("unknown command outcome {text:?}")))
    }
}

/// A command's recorded outcome: the first, however often it came.
#[derive(Debug, Clone, PartialEq)]
pub struct Recorded {
    /// The schedule it named.
    pub name: String,
    /// What it asked.
    pub action: String,
    /// What became of it.
    pub outcome: CommandOutcome,
    /// Why it was refused, or the first run a create set.
    pub detail: Option<String>,
    /// A create's definition, as sent.
    pub definition: Option<ScheduleDefinition>,
}

impl Schedules<'_> {
    /// Stores `schedule`, its first occurrence the first after now
    /// (database clock); a deleted schedule of the same name is replaced.
    /// Refused when no scheduler has registered the workflow its order
    /// names (its attributes are checked when each run is stored).
    ///
    /// # Errors
    /// When the database fails.
    pub async fn create(self, schedule: &NewSchedule, actor: &str) -> Result<Created, StoreError> {
        let mut tx = self.pool().begin().await?;
        let created = create_in(&mut tx, schedule, actor).await?;
        tx.commit().await?;
        Ok(created)
    }

    /// Does `action` to one schedule: pause (no occurrence is decided
    /// until resumed; a run asked by hand still starts, and an occurrence
    /// buffered behind the last run keeps its place); resume (from the
    /// first occurrence after now: those while paused are not caught up);
    /// trigger (a run now, whatever the expression, the overlap policy or
    /// a pause say, started by the next tick of any scheduler, once however
    /// often asked before then); delete (it decides nothing more, its name
    /// may be used again, the runs it started go on as ordinary orders).
    ///
    /// # Errors
    /// When the database fails, or (resume) the stored expression no
    /// longer parses.
    pub async fn act(
        self,
        tenant: &str,
        name: &str,
        action: ScheduleAction,
        actor: &str,
    ) -> Result<Change, StoreError> {
        let mut tx = self.pool().begin().await?;
        let change = act_in(&mut tx, tenant, name, action, actor).await?;
        tx.commit().await?;
        Ok(change)
    }

    /// Applies `command` once: what `asked` says is done and the outcome
    /// recorded in one transaction, unless the command was recorded before
    /// (the broker delivered it again, or its sender retried it), when
    /// nothing changes and the first outcome is answered. `actor` is
    /// recorded as the schedule's creator or changer.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn apply(
        self,
        command: &Command<'_>,
        asked: Asked<'_>,
        actor: &str,
    ) -> Result<Recorded, StoreError> {
        let mut tx = self.pool().begin().await?;
        if let Some(first) = recorded_in(&mut tx, command.tenant, command.command_id).await? {
            return Ok(first);
        }
        let (outcome, detail) = match asked {
            Asked::Create(schedule) => match create_in(&mut tx, schedule, actor).await? {
                Created::Created(first) => (
                    CommandOutcome::Done,
                    first.map(|first| format!("first run at {}", first.to_rfc3339())),
                ),
                refused @ Created::Exists => (CommandOutcome::Exists, refused.refusal()),
                refused @ Created::UnknownWorkflow(_) => {
                    (CommandOutcome::Refused, refused.refusal())
                }
            },
            Asked::Act(action) => {
                match act_in(&mut tx, command.tenant, command.name, action, actor).await? {
                    Change::Done => (CommandOutcome::Done, None),
                    Change::NotFound => (CommandOutcome::NotFound, None),
                }
            }
            Asked::Refused(why) => (CommandOutcome::Refused, Some(why.to_owned())),
        };
        let recorded = sqlx::query(
            "INSERT INTO schedule_commands (tenant, command_id, name, action, outcome, detail,
                                            definition, sent_by, recorded_by)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
             ON CONFLICT (tenant, command_id) DO NOTHING",
        )
        .bind(command.tenant)
        .bind(command.command_id)
        .bind(command.name)
        .bind(command.action)
        .bind(outcome.as_str())
        .bind(&detail)
        .bind(command.definition.map(Json))
        .bind(command.sent_by)
        .bind(actor)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if recorded == 0 {
            // Another applier of the same command committed first (its
            // insert held ours until then): ours rolls back, theirs stands.
            drop(tx);
            return self
                .command(command.tenant, command.command_id)
                .await?
                .ok_or_else(|| {
                    StoreError::Invariant(format!(
                        "schedule command {} of {} conflicted on recording, yet is not recorded",
                        command.command_id, command.tenant
                    ))
                });
        }
        tx.commit().await?;
        Ok(Recorded {
            name: command.name.to_owned(),
            action: command.action.to_owned(),
            outcome,
            detail,
            definition: command.definition.cloned(),
        })
    }

    /// A command's recorded outcome, if a scheduler has applied it.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn command(
        self,
        tenant: &str,
        command_id: &str,
    ) -> Result<Option<Recorded>, StoreError> {
        let mut connection = self.pool().acquire().await?;
        recorded_in(&mut connection, tenant, command_id).await
    }
}

/// A command's recorded outcome, read on `connection`.
async fn recorded_in(
    connection: &mut PgConnection,
    tenant: &str,
    command_id: &str,
) -> Result<Option<Recorded>, StoreError> {
    type Row = (
        String,
        String,
        String,
        Option<String>,
        Option<Json<ScheduleDefinition>>,
    );
    let row: Option<Row> = sqlx::query_as(
        "SELECT name, action, outcome, detail, definition FROM schedule_commands
          WHERE tenant = $1 AND command_id = $2",
    )
    .bind(tenant)
    .bind(command_id)
    .fetch_optional(&mut *connection)
    .await?;
    row.map(|(name, action, outcome, detail, definition)| {
        Ok(Recorded {
            name,
            action,
            outcome: outcome.parse()?,
            detail,
            definition: definition.map(|json| json.0),
        })
    })
    .transpose()
}

/// [`Schedules::create`] within `connection`'s transaction.
async fn create_in(
    connection: &mut PgConnection,
    schedule: &NewSchedule,
    actor: &str,
) -> Result<Created, StoreError> {
    let workflow = schedule
        .order
        .get("workflow")
        .and_then(|w| w.as_str())
        .unwrap_or(sas_messages::order::DEFAULT_WORKFLOW);
    let known: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT name FROM workflow_plans ORDER BY name")
            .fetch_all(&mut *connection)
            .await?;
    if !known.iter().any(|name| name == workflow) {
        return Ok(Created::UnknownWorkflow(known));
    }
    let now: DateTime<Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(&mut *connection)
        .await?;
    let next_run = schedule.timing.next_after(now);
    let stored = sqlx::query(
        "INSERT INTO schedules (tenant, name, workflow, cron, time_zone, order_template, overlap,
                                catch_up_ms, paused, next_run, created_by, updated_by)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $11)
         ON CONFLICT (tenant, name) DO UPDATE
            SET workflow = EXCLUDED.workflow, cron = EXCLUDED.cron,
                time_zone = EXCLUDED.time_zone, order_template = EXCLUDED.order_template,
                overlap = EXCLUDED.overlap, catch_up_ms = EXCLUDED.catch_up_ms,
                paused = EXCLUDED.paused, next_run = EXCLUDED.next_run, buffered = NULL,
                trigger_at = NULL, last_order_id = NULL, created_by = EXCLUDED.created_by,
                created_at = now(), updated_by = EXCLUDED.updated_by, updated_at = now(),
                deleted_at = NULL
          WHERE schedules.deleted_at IS NOT NULL",
    )
    .bind(&schedule.tenant)
    .bind(&schedule.name)
    .bind(workflow)
    .bind(schedule.timing.expression())
    .bind(schedule.timing.zone())
    .bind(Json(&schedule.order))
    .bind(schedule.overlap.as_str())
    .bind(i64::try_from(schedule.catch_up.as_millis()).unwrap_or(i64::MAX))
    .bind(schedule.paused)
    .bind(next_run)
    .bind(actor)
    .execute(&mut *connection)
    .await?
    .rows_affected();
    Ok(if stored == 1 {
        Created::Created(next_run)
    } else {
        Created::Exists
    })
}

/// [`Schedules::act`] within `connection`'s transaction.
async fn act_in(
    connection: &mut PgConnection,
    tenant: &str,
    name: &str,
    action: ScheduleAction,
    actor: &str,
) -> Result<Change, StoreError> {
    let set = match action {
        ScheduleAction::Pause => "paused = true",
        ScheduleAction::Resume => return resume_in(connection, tenant, name, actor).await,
        // Once, however often asked before a tick decides it.
        ScheduleAction::Trigger => "trigger_at = coalesce(trigger_at, now())",
        ScheduleAction::Delete => "deleted_at = now()",
    };
    let changed = sqlx::query(AssertSqlSafe(format!(
        "UPDATE schedules SET {set}, updated_by = $3, updated_at = now()
          WHERE tenant = $1 AND name = $2 AND deleted_at IS NULL"
    )))
    .bind(tenant)
    .bind(name)
    .bind(actor)
    .execute(&mut *connection)
    .await?
    .rows_affected();
    Ok(if changed == 0 {
        Change::NotFound
    } else {
        Change::Done
    })
}

/// Resumes a paused schedule from the first occurrence after now (one not
/// paused keeps its next occurrence).
async fn resume_in(
    connection: &mut PgConnection,
    tenant: &str,
    name: &str,
    actor: &str,
) -> Result<Change, StoreError> {
    let row: Option<(String, String, bool, DateTime<Utc>)> = sqlx::query_as(
        "SELECT cron, time_zone, paused, now() FROM schedules
          WHERE tenant = $1 AND name = $2 AND deleted_at IS NULL FOR UPDATE",
    )
    .bind(tenant)
    .bind(name)
    .fetch_optional(&mut *connection)
    .await?;
    let Some((cron, zone, paused, now)) = row else {
        return Ok(Change::NotFound);
    };
    if paused {
        let timing = Timing::parse(&cron, &zone).map_err(|error: InvalidSchedule| {
            StoreError::Invariant(format!(
                "schedule {tenant}/{name}: the stored definition no longer parses: {error}"
            ))
        })?;
        sqlx::query(
            "UPDATE schedules SET paused = false, next_run = $4, updated_by = $3, updated_at = now()
              WHERE tenant = $1 AND name = $2",
        )
        .bind(tenant)
        .bind(name)
        .bind(actor)
        .bind(timing.next_after(now))
        .execute(&mut *connection)
        .await?;
    }
    Ok(Change::Done)
}

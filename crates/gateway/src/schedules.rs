//! Durable schedules over HTTP, within the caller's tenant (see
//! docs/schedules.md): `GET /v1/schedules` and `GET /v1/schedules/{name}`
//! read them with their next and latest runs; `POST /v1/schedules`
//! creates one, `POST /v1/schedules/{name}/{pause|resume|trigger}` and
//! `DELETE /v1/schedules/{name}` change one.
//!
//! The gateway's database role only reads, so a change travels as a
//! [`ScheduleCommand`] over the broker, as events do; a scheduler applies
//! it once per command id and records its outcome, which the gateway reads
//! back and answers with (up to [`COMMAND_WAIT`]). The command id is the
//! request's `Idempotency-Key` (or a new one, sent back in that header):
//! the same request again with the same key changes nothing more and is
//! answered with the first outcome.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use chrono::{DateTime, Utc};
use sas_broker::publish::{json_properties, string_headers};
use sas_messages::schedule::{MAX_COMMAND_ID_LEN, SCHEDULE_COMMAND_TYPE};
use sas_messages::{ScheduleCommand, ScheduleDefinition, ScheduleVerb, SCHEMA_VERSION};
use sas_store::schedules::manage::{CommandOutcome, Recorded};
use sas_store::schedules::{ScheduleAsk, ScheduleRow, Schedules};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::orders::{
    not_confirmed, problem, publish_confirmed, store_unavailable, unreadable_body,
};
use crate::{Caller, Gateway};

/// How many next runs, and latest runs, each schedule shows.
const RUNS: usize = 5;

/// How long a change waits for a scheduler to apply it before it is
/// answered 202 (send it again with the same `Idempotency-Key` to learn
/// its outcome).
pub const COMMAND_WAIT: Duration = Duration::from_secs(5);

/// How soon the outcome of a change is first looked for while it waits;
/// each look after waits twice as long, up to [`COMMAND_POLL_MAX`].
const COMMAND_POLL: Duration = Duration::from_millis(20);

/// The longest wait between two looks for a change's outcome.
const COMMAND_POLL_MAX: Duration = Duration::from_millis(320);

/// The request header naming a change's command id.
const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// One schedule of the caller's tenant.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct ScheduleView {
    /// Its name.
    pub name: String,
    /// The workflow its runs follow.
    pub workflow: String,
    /// The cron expression (5 or 6 fields).
    pub cron: String,
    /// The IANA time zone it is read in.
    pub time_zone: String,
    /// `skip`, `buffer_one` or `allow`.
    pub overlap: String,
    /// Paused: no run starts but one asked by hand.
    pub paused: bool,
    /// Its next runs (none while paused).
    pub next_runs: Vec<DateTime<Utc>>,
    /// Its latest decided occurrences, newest first.
    pub latest_runs: Vec<RunView>,
}

/// One decided occurrence.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct RunView {
    /// When it was due (or asked for).
    pub occurrence: DateTime<Utc>,
    /// `started`, `skipped` or `missed`.
    pub outcome: String,
    /// Started: its order, by the id this client reads it with (`GET /v1/orders/{order_id}`).
    pub order_id: Option<String>,
    /// What became of it beyond its outcome (why skipped, how many missed, a refusal).
    pub detail: String,
}

/// A schedule to create, as a client sends it.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ScheduleSubmission {
    /// Must equal the system's schema version (1), as on every body.
    #[schemars(extend("const" = SCHEMA_VERSION))]
    pub schema_version: u32,
    /// Its name in the tenant: 1 to 38 letters, digits, `_` or `-`. Its
    /// runs' orders are `<name>:<UTC time>` (`nightly:20261129T020000Z`).
    pub name: String,
    /// A cron expression of 5 fields (minute hour day-of-month month
    /// day-of-week) or 6 (seconds first), or a nickname (`@daily`).
    pub cron: String,
    /// The IANA time zone the expression is read in (`UTC` when absent).
    #[serde(default)]
    pub time_zone: String,
    /// The order each run submits, as `POST /v1/orders` takes one, without `order_id`.
    pub order: serde_json::Value,
    /// What an occurrence does while the last run goes on: `skip` (when
    /// absent), `buffer_one` or `allow`.
    #[serde(default)]
    pub overlap: String,
    /// After an outage, occurrences at most this many seconds old still
    /// start, in order; older ones are recorded as missed (3600 when absent).
    #[serde(default)]
    pub catch_up_secs: Option<u64>,
    /// Create it paused.
    #[serde(default)]
    pub paused: bool,
}

/// What became of a change.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct CommandAnswer {
    /// The change's id (its `Idempotency-Key`).
    pub command_id: String,
    /// The schedule.
    pub schedule: String,
    /// `create`, `pause`, `resume`, `trigger` or `delete`.
    pub action: String,
    /// `done`, `not_found`, `exists`, `refused`; `pending` when no
    /// scheduler applied it in time (send it again with the same key).
    pub outcome: String,
    /// Why it was refused, or (create) its first run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// Where the schedule is read.
    pub schedule_url: String,
}

/// `GET /v1/schedules`.
pub async fn list(
    State(gateway): State<Arc<Gateway>>,
    Extension(caller): Extension<Caller>,
) -> Response {
    let tenant = match gateway.tenant_of(&caller) {
        Ok(tenant) => tenant,
        Err(refused) => return *refused,
    };
    let schedules = gateway.store.schedules();
    let rows = match schedules.list(Some(&tenant)).await {
        Ok(rows) => rows,
        Err(error) => return store_unavailable(&error),
    };
    let mut views = Vec::with_capacity(rows.len());
    for row in rows {
        match view(schedules, &tenant, row).await {
            Ok(view) => views.push(view),
            Err(error) => return store_unavailable(&error),
        }
    }
    Json(views).into_response()
}

/// `GET /v1/schedules/{name}`.
pub async fn show(
    State(gateway): State<Arc<Gateway>>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
) -> Response {
    let tenant = match gateway.tenant_of(&caller) {
        Ok(tenant) => tenant,
        Err(refused) => return *refused,
    };
    let schedules = gateway.store.schedules();
    match schedules.get(&tenant, &name).await {
        Ok(Some(row)) => match view(schedules, &tenant, row).await {
            Ok(view) => Json(view).into_response(),
            Err(error) => store_unavailable(&error),
        },
        Ok(None) => no_schedule(&name),
        Err(error) => store_unavailable(&error),
    }
}

/// `POST /v1/schedules`.
pub async fn create(
    State(gateway): State<Arc<Gateway>>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match body {
        Ok(body) => body,
        Err(rejection) => return unreadable_body(&rejection),
    };
    let submission: ScheduleSubmission =
        match sas_messages::decode::decode(&body, gateway.settings.amqp.max_message_bytes) {
            Ok(submission) => submission,
            Err(error @ sas_messages::decode::DecodeError::TooLarge { .. }) => {
                return problem(StatusCode::PAYLOAD_TOO_LARGE, error.to_string())
            }
            Err(error) => return problem(StatusCode::BAD_REQUEST, error.to_string()),
        };
    if submission.schema_version != SCHEMA_VERSION {
        return problem(
            StatusCode::BAD_REQUEST,
            format!(
                "unsupported schema_version {} (this system reads {SCHEMA_VERSION})",
                submission.schema_version
            ),
        );
    }
    let definition = ScheduleDefinition {
        cron: submission.cron,
        time_zone: submission.time_zone,
        order: submission.order,
        overlap: submission.overlap,
        catch_up_secs: submission.catch_up_secs,
        paused: submission.paused,
    };
    // Checked here as the schedulers check it, so that a mistake is
    // answered at once (the tenant is checked by the scheduler).
    let ask = ScheduleAsk::from_definition("", &submission.name, &definition);
    if let Err(invalid) = ask.check() {
        return problem(StatusCode::BAD_REQUEST, invalid.0);
    }
    send(
        &gateway,
        &caller,
        &headers,
        submission.name,
        ScheduleVerb::Create,
        Some(definition),
    )
    .await
}

/// `POST /v1/schedules/{name}/{pause|resume|trigger}`.
pub async fn act(
    State(gateway): State<Arc<Gateway>>,
    Extension(caller): Extension<Caller>,
    Path((name, action)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    let verb = match action.as_str() {
        "pause" => ScheduleVerb::Pause,
        "resume" => ScheduleVerb::Resume,
        "trigger" => ScheduleVerb::Trigger,
        _ => {
            return problem(
                StatusCode::NOT_FOUND,
                format!("no schedule action {action:?}: pause, resume or trigger (DELETE /v1/schedules/{{name}} deletes)"),
            )
        }
    };
    send(&gateway, &caller, &headers, name, verb, None).await
}

/// `DELETE /v1/schedules/{name}`.
pub async fn delete(
    State(gateway): State<Arc<Gateway>>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Response {
    send(
        &gateway,
        &caller,
        &headers,
        name,
        ScheduleVerb::Delete,
        None,
    )
    .await
}

/// Sends one change as a command on the caller's behalf and answers with
/// its outcome: at once when the same command was applied before, else
/// once a scheduler has applied it, or 202 after [`COMMAND_WAIT`].
async fn send(
    gateway: &Gateway,
    caller: &Caller,
    headers: &HeaderMap,
    name: String,
    action: ScheduleVerb,
    definition: Option<ScheduleDefinition>,
) -> Response {
    let tenant = match gateway.tenant_of(caller) {
        Ok(tenant) => tenant,
        Err(refused) => return *refused,
    };
    let command_id = match command_id(headers) {
        Ok(id) => id,
        Err(reason) => return problem(StatusCode::BAD_REQUEST, reason),
    };
    let command = ScheduleCommand {
        schema_version: SCHEMA_VERSION,
        command_id,
        schedule: name,
        action,
        definition,
    };
    if let Err(invalid) = command.validate() {
        return problem(StatusCode::BAD_REQUEST, invalid.0);
    }
    let schedules = gateway.store.schedules();
    match schedules.command(&tenant, &command.command_id).await {
        Ok(Some(first)) => return answer(&command, Some(&first)),
        Ok(None) => {}
        Err(error) => return store_unavailable(&error),
    }
    let identity = caller.identity();
    let properties = json_properties(&format!("gateway-schedule-{}", command.command_id))
        .with_type(SCHEDULE_COMMAND_TYPE.into())
        .with_headers(string_headers([(
            sas_messages::headers::SENDER,
            identity.as_str(),
        )]));
    let body = serde_json::to_vec(&command).expect("wire types always serialize");
    if let Err(error) = publish_confirmed(gateway, gateway.names.events(), body, properties).await {
        tracing::warn!(schedule = %command.schedule, %error, "schedule command not confirmed by the broker");
        return not_confirmed(&format!("the change was not accepted: the broker did not confirm it ({error}); send it again with the same Idempotency-Key ({}), which is safe", command.command_id));
    }
    let deadline = tokio::time::Instant::now() + COMMAND_WAIT;
    let mut pause = COMMAND_POLL;
    loop {
        match schedules.command(&tenant, &command.command_id).await {
            Ok(Some(recorded)) => return answer(&command, Some(&recorded)),
            Ok(None) if tokio::time::Instant::now() >= deadline => return answer(&command, None),
            Ok(None) => {}
            // Sent: a failed read is told as not applied yet.
            Err(error) => {
                tracing::warn!(%error, "cannot read a schedule command's outcome");
                return answer(&command, None);
            }
        }
        tokio::select! {
            () = tokio::time::sleep(pause) => pause = (pause * 2).min(COMMAND_POLL_MAX),
            () = gateway.shutdown.cancelled() => return answer(&command, None),
        }
    }
}

/// The request's `Idempotency-Key`, or a new command id.
///
/// # Errors
/// Why the key given cannot be one.
fn command_id(headers: &HeaderMap) -> Result<String, String> {
    let Some(value) = headers.get(IDEMPOTENCY_KEY) else {
        return Ok(format!("gw-{}", uuid::Uuid::now_v7().simple()));
    };
    match value.to_str() {
        Ok(key) if !key.is_empty() && key.len() <= MAX_COMMAND_ID_LEN => Ok(key.to_owned()),
        _ => Err(format!(
            "Idempotency-Key must be 1 to {MAX_COMMAND_ID_LEN} visible ASCII characters"
        )),
    }
}

/// The response telling `command`'s outcome (`None`: not applied yet).
fn answer(command: &ScheduleCommand, recorded: Option<&Recorded>) -> Response {
    let schedule_url = format!("/v1/schedules/{}", command.schedule);
    if let Some(recorded) = recorded.filter(|r| {
        r.name != command.schedule
            || r.action != command.action.as_str()
            || r.definition != command.definition
    }) {
        return problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!(
                "Idempotency-Key {:?} was used for another change ({} of schedule {}, or another definition): use a new key for a new change",
                command.command_id, recorded.action, recorded.name
            ),
        );
    }
    let status = match recorded.map(|r| r.outcome) {
        None => StatusCode::ACCEPTED,
        Some(CommandOutcome::Done) if command.action == ScheduleVerb::Create => StatusCode::CREATED,
        Some(CommandOutcome::Done) => StatusCode::OK,
        Some(CommandOutcome::NotFound) => StatusCode::NOT_FOUND,
        Some(CommandOutcome::Exists) => StatusCode::CONFLICT,
        Some(CommandOutcome::Refused) => StatusCode::UNPROCESSABLE_ENTITY,
    };
    metrics::counter!("sas_gateway_schedule_commands_total", "status" => status.as_str().to_owned())
        .increment(1);
    let body = CommandAnswer {
        command_id: command.command_id.clone(),
        schedule: command.schedule.clone(),
        action: command.action.as_str().to_owned(),
        outcome: recorded.map_or("pending", |r| r.outcome.as_str()).to_owned(),
        detail: match recorded {
            Some(recorded) => recorded.detail.clone(),
            None => Some(format!(
                "no scheduler applied it within {} s: send it again with the same Idempotency-Key to learn its outcome",
                COMMAND_WAIT.as_secs()
            )),
        },
        schedule_url: schedule_url.clone(),
    };
    let mut response = (status, Json(body)).into_response();
    let headers = response.headers_mut();
    if let Ok(value) = HeaderValue::from_str(&command.command_id) {
        headers.insert(IDEMPOTENCY_KEY, value);
    }
    if status == StatusCode::CREATED {
        if let Ok(value) = HeaderValue::from_str(&schedule_url) {
            headers.insert(header::LOCATION, value);
        }
    }
    response
}

/// 404 for a schedule the tenant does not have.
fn no_schedule(name: &str) -> Response {
    problem(
        StatusCode::NOT_FOUND,
        format!("no schedule {name:?} in your tenant"),
    )
}

/// `row` as a client reads it, with its next and latest runs.
async fn view(
    schedules: Schedules<'_>,
    tenant: &str,
    row: ScheduleRow,
) -> Result<ScheduleView, sas_store::StoreError> {
    let runs = schedules.runs(tenant, &row.name, RUNS as i64).await?;
    // A stored definition that no longer parses (the schedulers pause
    // it): shown without next runs.
    let next_runs = row.next_runs(RUNS).unwrap_or_default();
    Ok(ScheduleView {
        latest_runs: runs
            .iter()
            .map(|run| RunView {
                occurrence: run.occurrence,
                outcome: run.outcome.clone(),
                order_id: run
                    .order_id
                    .as_deref()
                    .map(|id| sas_messages::ids::client_id(id).to_owned()),
                detail: run.detail(),
            })
            .collect(),
        name: row.name,
        workflow: row.workflow,
        cron: row.cron,
        time_zone: row.time_zone,
        overlap: row.overlap,
        paused: row.paused,
        next_runs,
    })
}

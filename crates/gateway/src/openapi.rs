//! The OpenAPI 3.1 document of the client API, built from the same types
//! the handlers read and write (schemars), served at `/v1/openapi.json`
//! and checked in as `contract/openapi.json` (a test fails when they
//! differ: regenerate with `cargo run -p sas-gateway -- openapi`).

use schemars::generate::SchemaSettings;
use serde_json::{json, Value};

use crate::events::{EventAccepted, EventSubmission};
use crate::orders::{OrderStatusView, Problem, RejectedView, Submitted};
use crate::schedules::{CommandAnswer, ScheduleSubmission, ScheduleView};

/// The document.
pub fn document() -> Value {
    let mut generator = SchemaSettings::draft2020_12()
        .with(|settings| settings.definitions_path = "/components/schemas".into())
        .into_generator();
    let submit = generator.subschema_for::<sas_messages::SubmitOrder>();
    let submitted = generator.subschema_for::<Submitted>();
    let status = generator.subschema_for::<OrderStatusView>();
    let rejected = generator.subschema_for::<RejectedView>();
    let problem = generator.subschema_for::<Problem>();
    let event = generator.subschema_for::<EventSubmission>();
    let event_accepted = generator.subschema_for::<EventAccepted>();
    let schedules = generator.subschema_for::<Vec<ScheduleView>>();
    let schedule = generator.subschema_for::<ScheduleView>();
    let new_schedule = generator.subschema_for::<ScheduleSubmission>();
    let command = generator.subschema_for::<CommandAnswer>();
    let schemas = generator.take_definitions(true);
    let error = |description: &str| {
        json!({
            "description": description,
            "content": { "application/json": { "schema": problem } },
        })
    };
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "sas gateway",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Submit orders over HTTP and follow them, for clients that do not speak AMQP. \
                Every request but this document needs Authorization: Bearer <client secret> (gateway.clients).",
        },
        "servers": [{ "url": "http://127.0.0.1:9105" }],
        "components": {
            "schemas": schemas,
            "securitySchemes": { "client": { "type": "http", "scheme": "bearer" } },
        },
        "security": [{ "client": [] }],
        "paths": {
            "/v1/orders": {
                "post": {
                    "operationId": "submitOrder",
                    "summary": "Submit an order (idempotent on order_id)",
                    "description": "Validated as AMQP intake validates it, then published to the orders queue and confirmed by the broker. \
                        The same order again is answered 200; another order under a stored id 409.",
                    "requestBody": {
                        "required": true,
                        "content": { "application/json": { "schema": submit } },
                    },
                    "responses": {
                        "202": {
                            "description": "Accepted: intake will store and run it; its status is at Location.",
                            "headers": { "Location": { "schema": { "type": "string" } } },
                            "content": { "application/json": { "schema": submitted } },
                        },
                        "200": {
                            "description": "Already accepted with the same content; its status is at Location.",
                            "headers": { "Location": { "schema": { "type": "string" } } },
                            "content": { "application/json": { "schema": submitted } },
                        },
                        "400": error("Not a valid order: the reason names the field, an unknown workflow, the attributes' path that does not match the workflow's schema, or (with tenants configured) a reply_to."),
                        "401": error("No client secret, or a wrong one."),
                        "403": error("The client's tenant may not use this workflow or priority, or the client belongs to no tenant."),
                        "409": error("The id names an order of this client's tenant with other content."),
                        "413": error("The body exceeds amqp.max_message_bytes."),
                        "429": error("Too many failed authentications from this address, or the client's tenant is over its quota (tenants.<t>.quota): see Retry-After; nothing was sent."),
                        "503": error("The broker did not confirm or the store cannot be reached: send the same order again (see Retry-After)."),
                    },
                },
            },
            "/v1/orders/{order_id}": {
                "get": {
                    "operationId": "getOrder",
                    "summary": "An order's status, or its outcome once it ends (?wait=SECONDS)",
                    "parameters": [
                        { "name": "order_id", "in": "path", "required": true, "schema": { "type": "string" } },
                        {
                            "name": "wait", "in": "query", "required": false,
                            "description": "Wait up to this many seconds (at most gateway.max_wait_secs) for the order to end, or to be stored.",
                            "schema": { "type": "integer", "minimum": 0 },
                        },
                    ],
                    "responses": {
                        "200": {
                            "description": "Its status now (outcome set once it ended).",
                            "content": { "application/json": { "schema": status } },
                        },
                        "401": error("No client secret, or a wrong one."),
                        "404": error("No such order of this client's tenant (yet): another tenant's order of the same id is not this client's."),
                        "422": {
                            "description": "Intake refused the order (an unknown workflow, attributes against its schema, ...): it was not stored; state is rejected, reason says why.",
                            "content": { "application/json": { "schema": rejected } },
                        },
                        "429": error("Too many failed authentications from this address (see Retry-After), or, with ?wait, as many waiting reads of this client as gateway.max_long_polls_per_client allows."),
                        "503": error("The store cannot be reached: ask again (see Retry-After)."),
                    },
                },
            },
            "/v1/orders/{order_id}/events": events_path(&event, &event_accepted, &error, EventsFor::Order),
            "/v1/correlation-keys/{key}/events": events_path(&event, &event_accepted, &error, EventsFor::Key),
            "/v1/schedules": {
                "get": {
                    "operationId": "listSchedules",
                    "summary": "This client's tenant's schedules, with their next and latest runs",
                    "description": "Each started run is an order of this tenant, read with GET /v1/orders/{order_id}.",
                    "responses": {
                        "200": {
                            "description": "The schedules, by name: five next runs each (none while paused) and the five latest decided, newest first.",
                            "content": { "application/json": { "schema": schedules } },
                        },
                        "401": error("No client secret, or a wrong one."),
                        "403": error("The client belongs to no tenant."),
                        "429": error("Too many failed authentications from this address (see Retry-After)."),
                        "503": error("The store cannot be reached: ask again (see Retry-After)."),
                    },
                },
                "post": {
                    "operationId": "createSchedule",
                    "summary": "Create a schedule in this client's tenant",
                    "description": "Checked here as sasctl checks one, then sent to the schedulers, which check its order against the tenant's workflows and priorities, \
                        store it and record the outcome once per Idempotency-Key (a new key when none is sent; it is echoed). \
                        The same request with the same key is answered with the first outcome.",
                    "parameters": [idempotency_key()],
                    "requestBody": {
                        "required": true,
                        "content": { "application/json": { "schema": new_schedule } },
                    },
                    "responses": command_responses(&command, &error, "201", "Created: its first run is in detail; it is read at Location."),
                },
            },
            "/v1/schedules/{name}": {
                "parameters": [schedule_name()],
                "get": {
                    "operationId": "getSchedule",
                    "summary": "One schedule of this client's tenant, with its next and latest runs",
                    "responses": {
                        "200": {
                            "description": "The schedule.",
                            "content": { "application/json": { "schema": schedule } },
                        },
                        "401": error("No client secret, or a wrong one."),
                        "403": error("The client belongs to no tenant."),
                        "404": error("No schedule of that name in this tenant."),
                        "503": error("The store cannot be reached: ask again (see Retry-After)."),
                    },
                },
                "delete": {
                    "operationId": "deleteSchedule",
                    "summary": "Delete a schedule: it starts nothing more; its runs' orders go on",
                    "parameters": [idempotency_key()],
                    "responses": command_responses(&command, &error, "200", "Deleted."),
                },
            },
            "/v1/schedules/{name}/{action}": {
                "parameters": [schedule_name(), {
                    "name": "action", "in": "path", "required": true,
                    "description": "pause (decide no occurrence until resumed; a trigger still runs), resume (from the next occurrence after now), or trigger (a run now, whatever the expression, the overlap policy or a pause say).",
                    "schema": { "type": "string", "enum": ["pause", "resume", "trigger"] },
                }],
                "post": {
                    "operationId": "changeSchedule",
                    "summary": "Pause, resume or trigger a schedule",
                    "parameters": [idempotency_key()],
                    "responses": command_responses(&command, &error, "200", "Done."),
                },
            },
        },
    })
}

/// The `Idempotency-Key` header of a change to a schedule.
fn idempotency_key() -> Value {
    json!({
        "name": "Idempotency-Key", "in": "header", "required": false,
        "description": "The change's id, 1 to 128 visible ASCII characters: the same key again is the same change, applied once and answered with its first outcome. Without it the gateway makes one and sends it back in this header.",
        "schema": { "type": "string", "minLength": 1, "maxLength": 128 },
    })
}

/// The `{name}` of a schedule's paths.
fn schedule_name() -> Value {
    json!({
        "name": "name", "in": "path", "required": true,
        "description": "The schedule's name in this client's tenant.",
        "schema": { "type": "string", "pattern": "^[A-Za-z0-9_-]{1,38}$" },
    })
}

/// The answers to a change to a schedule: `done` as `done_status`.
fn command_responses(
    command: &schemars::Schema,
    error: &dyn Fn(&str) -> Value,
    done_status: &str,
    done: &str,
) -> Value {
    let answer = |description: &str| {
        json!({
            "description": description,
            "content": { "application/json": { "schema": command } },
        })
    };
    json!({
        (done_status): answer(done),
        "202": answer("No scheduler applied it within 5 s (outcome pending): it is kept on the broker; send the same request with the same Idempotency-Key to learn its outcome."),
        "400": error("The body, the name or the Idempotency-Key is invalid (the reason says which)."),
        "401": error("No client secret, or a wrong one."),
        "403": error("The client belongs to no tenant."),
        "404": answer("No schedule of that name in this tenant (outcome not_found)."),
        "409": answer("Create: a schedule of that name exists in this tenant (outcome exists)."),
        "422": answer("Refused by the schedulers (outcome refused: a workflow nobody runs or the tenant may not start, attributes the workflow refuses), or an Idempotency-Key used before for another change."),
        "503": error("The broker did not confirm the change, or the store cannot be reached: send it again with the same Idempotency-Key."),
    })
}

/// Whom an events path addresses.
enum EventsFor {
    /// One order, by id.
    Order,
    /// The orders waiting with a business key.
    Key,
}

/// `POST /v1/orders/{order_id}/events`: an event for the order's wait step;
/// `POST /v1/correlation-keys/{key}/events`: one for the orders waiting
/// with a business key.
fn events_path(
    event: &schemars::Schema,
    accepted: &schemars::Schema,
    error: &dyn Fn(&str) -> Value,
    to: EventsFor,
) -> Value {
    let (operation, summary, parameter, whom) = match to {
        EventsFor::Order => (
            "sendEvent",
            "Send an event to the order's wait step (a webhook, an approval)",
            "order_id",
            "The order keeps it in its mailbox once per event_id: sending it again is safe; one that comes before the order reaches its wait, \
             or before the order exists, is kept for it (scheduler.event_ttl_secs). The order is checked first, as the console and sasctl check it: \
             nothing is sent when every wait of the order for this event refuses the client (403), or when nothing in the order will use it (409: \
             the order ended, or no wait for it is ahead).",
        ),
        EventsFor::Key => (
            "sendEventForKey",
            "Send an event to the orders waiting with a business key (a payment id in a provider's webhook)",
            "key",
            "Every order parked at a wait whose correlation_key gave this key keeps it in its mailbox once per event_id; \
             when none waits with it yet, it is kept (once per key and event_id) for the first that parks with it (scheduler.event_ttl_secs).",
        ),
    };
    json!({
        "post": {
            "operationId": operation,
            "summary": summary,
            "description": format!("Validated as the schedulers validate it, then published to the events queue and confirmed by the broker, on the client's behalf: it reaches only orders of the client's tenant, and a wait step that names its senders refuses it from anyone else (recorded in the order's history). {whom}"),
            "parameters": [
                { "name": parameter, "in": "path", "required": true, "schema": { "type": "string" } },
            ],
            "requestBody": {
                "required": true,
                "content": { "application/json": { "schema": event } },
            },
            "responses": {
                "202": {
                    "description": "Accepted: the order will use it when it waits for it.",
                    "content": { "application/json": { "schema": accepted } },
                },
                "400": error("Not a valid event: the reason names the field."),
                "401": error("No client secret, or a wrong one."),
                "403": error("The client belongs to no tenant, or (for an order) every wait of the order for this event accepts it only from others: nothing was sent."),
                "409": error("For an order: nothing in it will use this event (it ended, or no wait for it is ahead): nothing was sent."),
                "413": error("The body exceeds amqp.max_message_bytes."),
                "429": error("Too many failed authentications from this address: see Retry-After."),
                "503": error("The broker did not confirm it, or the state store could not be read: send the same event again (see Retry-After)."),
            },
        },
    })
}

/// The document as checked in: pretty JSON with a final newline.
pub fn text() -> String {
    let mut text = serde_json::to_string_pretty(&document()).expect("JSON");
    text.push('\n');
    text
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_checked_in_document_is_the_generated_one() {
        let checked_in = include_str!("../../../contract/openapi.json");
        assert!(
            checked_in == super::text(),
            "contract/openapi.json is stale: run `cargo run -p sas-gateway -- openapi > contract/openapi.json`"
        );
    }

    #[test]
    fn every_reference_points_into_the_document() {
        let text = super::text();
        let document = super::document();
        for piece in text.split("\"$ref\": \"#/").skip(1) {
            let pointer = format!("/{}", &piece[..piece.find('"').unwrap()]);
            assert!(document.pointer(&pointer).is_some(), "{pointer} is missing");
        }
    }
}

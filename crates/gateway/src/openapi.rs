//! The OpenAPI 3.1 document of the client API, built from the same types
//! the handlers read and write (schemars), served at `/v1/openapi.json`
//! and checked in as `contract/openapi.json` (a test fails when they
//! differ: regenerate with `cargo run -p sas-gateway -- openapi`).

use schemars::generate::SchemaSettings;
use serde_json::{json, Value};

use crate::orders::{OrderStatusView, Problem, Submitted};

/// The document.
pub fn document() -> Value {
    let mut generator = SchemaSettings::draft2020_12()
        .with(|settings| settings.definitions_path = "/components/schemas".into())
        .into_generator();
    let submit = generator.subschema_for::<sas_messages::SubmitOrder>();
    let submitted = generator.subschema_for::<Submitted>();
    let status = generator.subschema_for::<OrderStatusView>();
    let problem = generator.subschema_for::<Problem>();
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
                        "400": error("Not a valid order: the reason names the field."),
                        "401": error("No client secret, or a wrong one."),
                        "409": error("The id names an order with other content."),
                        "413": error("The body exceeds amqp.max_message_bytes."),
                        "429": error("Too many failed authentications from this address: see Retry-After."),
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
                        "404": error("No such order (yet)."),
                        "429": error("Too many failed authentications from this address: see Retry-After."),
                        "503": error("The store cannot be reached: ask again (see Retry-After)."),
                    },
                },
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

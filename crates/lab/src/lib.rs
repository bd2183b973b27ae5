//! The lab: the whole system run as local processes, the real binaries of
//! `target/<profile>/`, on a private Postgres database and a private queue
//! prefix of the machine's RabbitMQ, removed again when done.
//!
//! It exists so that the end-to-end tests (`sas-tests`) and the benchmark
//! (`sas-bench`) start the system the same way, without the benchmark, a
//! program of its own, depending on the test harness: the tests add their
//! assertions and fault injection on top of it, the benchmark its load and
//! its measurements.
//!
//! - [`console`]: the operator console and its users.
//! - [`env`](mod@env): [`TestEnv`], the database, the prefix, and the teardown.
//! - [`process`]: spawning, SIGTERM-ing and kill -9-ing the services.
//! - [`servers`]: [`ServerGuard`], the machine's RabbitMQ and Postgres shared
//!   between the tests of one process, or held by one alone.
//! - [`settings`]: [`Setting`], the services' settings, typed.
//! - [`sim`]: reading remote-sim's record of side effects.
//! - [`verbs`]: what a test does to a running system and asks of it (an
//!   order's state, waiting for it, a client's queue).
//! - [`wait`]: polling for a condition with a deadline.

pub mod console;
pub mod env;
pub mod process;
pub mod servers;
pub mod settings;
pub mod sim;
pub mod verbs;
pub mod wait;

pub use env::{database_settings, pool, TestEnv};
pub use process::Service;
pub use servers::ServerGuard;
pub use settings::Setting;
pub use verbs::{consume, hand_back, wait_for_state_in};
pub use wait::wait_until;

/// Makes rustls on ring the process's crypto provider (reqwest is built
/// without one); calling it again does nothing.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// A plain HTTP client, after [`install_crypto_provider`].
///
/// # Panics
/// When the client cannot be built.
pub fn http_client() -> reqwest::Client {
    install_crypto_provider();
    reqwest::Client::new()
}

/// GETs `url` with a fresh [`http_client`] (what `reqwest::get` does, with a
/// crypto provider installed first).
///
/// # Errors
/// As `reqwest::get`.
pub async fn http_get(url: impl reqwest::IntoUrl) -> reqwest::Result<reqwest::Response> {
    http_client().get(url).send().await
}

/// The status and body of `GET http://127.0.0.1:<port><path>` (a service's
/// `/readyz`, `/healthz`), or `None` while nothing answers there.
pub async fn local_status(port: u16, path: &str) -> Option<(u16, String)> {
    let response = http_get(format!("http://127.0.0.1:{port}{path}"))
        .await
        .ok()?;
    let status = response.status().as_u16();
    Some((status, response.text().await.unwrap_or_default()))
}

/// An event `name` for order `order_id`, with id `event_id` and no data.
pub fn event(order_id: &str, name: &str, event_id: &str) -> sas_messages::OrderEvent {
    sas_messages::OrderEvent {
        schema_version: sas_messages::SCHEMA_VERSION,
        order_id: Some(order_id.into()),
        correlation_key: None,
        name: name.into(),
        event_id: event_id.into(),
        data: None,
    }
}

/// An event `name` for the orders waiting with business key `key`, with
/// id `event_id` and no data.
pub fn keyed_event(key: &str, name: &str, event_id: &str) -> sas_messages::OrderEvent {
    sas_messages::OrderEvent {
        order_id: None,
        correlation_key: Some(key.into()),
        ..event("-", name, event_id)
    }
}

/// A valid order with the given id.
pub fn order(order_id: &str) -> sas_messages::SubmitOrder {
    sas_messages::SubmitOrder {
        schema_version: sas_messages::SCHEMA_VERSION,
        order_id: order_id.into(),
        customer_id: "cust-1".into(),
        items: vec![sas_messages::OrderLine {
            sku: "SKU-1".into(),
            quantity: 1,
        }],
        amount_cents: 1999,
        currency: "EUR".into(),
        reply_to: None,
        priority: None,
        workflow: None,
        attributes: None,
    }
}

//! The test harness: each test gets its own Postgres database and its own
//! queue-name prefix, runs the real binaries as processes against them, and
//! removes both when it ends (even when it fails).
//!
//! - [`browser`]: headless chromium through chromedriver, and screenshots.
//! - [`console`]: the operator console and its users.
//! - [`env`]: [`TestEnv`], the database, the prefix, and the teardown.
//! - [`postgres_pair`]: a throwaway Postgres primary and its standby.
//! - [`process`]: spawning, SIGTERM-ing and kill -9-ing the services.
//! - [`proxy`]: a proxy in front of RabbitMQ that swallows confirms and cuts connections.
//! - [`sim`]: reading remote-sim's record of side effects.
//! - [`wait`]: polling for a condition with a deadline.

pub mod browser;
pub mod console;
pub mod env;
pub mod postgres_pair;
pub mod process;
pub mod proxy;
pub mod sim;
pub mod wait;

pub use env::{database_settings, TestEnv};
pub use process::Service;
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
    }
}

/// Reads status messages from `consumer` until one of event `until`, and
/// returns their events in order.
///
/// # Panics
/// When no message arrives for 20 seconds, or one is not a status message.
pub async fn status_events(
    consumer: &mut sas_broker::lapin::Consumer,
    until: sas_messages::StatusEvent,
) -> Vec<sas_messages::StatusEvent> {
    use futures_util::StreamExt;
    let mut events = Vec::new();
    while events.last() != Some(&until) {
        let delivery = tokio::time::timeout(std::time::Duration::from_secs(20), consumer.next())
            .await
            .expect("a status message within 20 s")
            .expect("the consumer is open")
            .expect("a delivery");
        let status: sas_messages::OrderStatus =
            serde_json::from_slice(&delivery.data).expect("a status message");
        events.push(status.event);
    }
    events
}

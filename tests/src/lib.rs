//! The test harness: each test gets its own Postgres database and its own
//! queue-name prefix, runs the real binaries as processes against them, and
//! removes both when it ends (even when it fails).
//!
//! Starting the system is [`sas_lab`]'s, shared with the benchmark and
//! re-exported here whole (`sas_tests::TestEnv`, `sas_tests::process`, ...);
//! what only the tests need is here:
//!
//! - [`browser`]: headless chromium through chromedriver, and screenshots.
//! - [`http_proxy`]: an HTTP proxy before a remote service that holds chosen calls and delivers them late, after their caller hung up.
//! - [`postgres_pair`]: a throwaway Postgres primary and its standby, and one that takes TLS only.
//! - [`proxy`]: a proxy in front of RabbitMQ that swallows confirms and cuts connections.
//! - [`status_events`]: a client's status messages, read until one event.
//! - [`strict_remote`]: a strict payment API (refunds by the charge's id, answers late, 409 while in progress).
//! - [`tcp_delay`]: a TCP proxy that slows every round trip (a service's link to Postgres).
//! - [`tls_proxy`]: a TLS front for a plain TCP server (the broker's `amqps://` side).

pub use sas_lab::*;

/// The status events a client reads for an order of the built-in workflow
/// that runs through: what the examples and `sasctl watch` print.
pub const PROCESSED_EVENTS: [&str; 5] = [
    "received",
    "step_completed",
    "step_completed",
    "step_completed",
    "processed",
];

/// The `disposition` of dead letter `id` in a JSON list of dead letters
/// (the console's API and `sasctl dead-letters -o json` alike).
///
/// # Panics
/// When `letters` is not a list or holds no dead letter `id`.
pub fn disposition_of(letters: &serde_json::Value, id: i64) -> serde_json::Value {
    letters
        .as_array()
        .expect("a list of dead letters")
        .iter()
        .find(|letter| letter["id"] == id)
        .unwrap_or_else(|| panic!("dead letter #{id} is listed"))["disposition"]
        .clone()
}

pub mod browser;
pub mod http_proxy;
pub mod postgres_pair;
pub mod proxy;
pub mod strict_remote;
pub mod tcp_delay;
pub mod tls_proxy;

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

/// Serves `app` on a free port of 127.0.0.1, in a task of its own, for as
/// long as the test runs (or until the task is aborted): a test's own fake
/// of a remote service. Returns the port and the task.
///
/// # Panics
/// When no port can be bound.
pub async fn serve_locally(app: axum::Router) -> (u16, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a port of 127.0.0.1");
    let port = listener.local_addr().expect("the bound address").port();
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (port, server)
}

/// The workspace's root folder, where the files the tests read against the
/// code live (README.md, deploy/, examples/, contract/).
///
/// # Panics
/// When the harness's folder has no parent.
pub fn repo_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ is inside the workspace")
        .to_path_buf()
}

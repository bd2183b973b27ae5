//! The test harness: each test gets its own Postgres database and its own
//! queue-name prefix, runs the real binaries as processes against them, and
//! removes both when it ends (even when it fails).
//!
//! Starting the system is [`sas_lab`]'s, shared with the benchmark and
//! re-exported here whole (`sas_tests::TestEnv`, `sas_tests::process`, ...);
//! what only the tests need is here:
//!
//! - [`browser`]: headless chromium through chromedriver, and screenshots.
//! - [`postgres_pair`]: a throwaway Postgres primary and its standby.
//! - [`proxy`]: a proxy in front of RabbitMQ that swallows confirms and cuts connections.
//! - [`status_events`]: a client's status messages, read until one event.

pub use sas_lab::*;

pub mod browser;
pub mod postgres_pair;
pub mod proxy;

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

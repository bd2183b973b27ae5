//! What every service binary does the same way.
//!
//! - [`allocator`]: jemalloc for the services that carry the load
//!   ([`use_jemalloc!`]).
//! - [`backoff`]: the one growing, jittered wait between tries;
//!   [`periodic`]: the one periodic loop, with a tick tests can call.
//! - [`batch`]: group commit, many callers' items in one statement.
//! - [`settings`]: defaults, then a file, then `SAS_*` environment variables.
//! - [`telemetry`]: structured logs, text or JSON.
//! - [`ops`]: the operations HTTP endpoint: `/metrics`, `/healthz`, `/readyz`.
//! - [`shutdown`]: a cancellation token fired by SIGTERM or SIGINT.
//! - [`secret`]: secrets stored as argon2 hashes, checked and remembered;
//!   [`login_limit`]: failed logins slowed down.
//! - [`tenancy`]: which identity belongs to which tenant, what each
//!   tenant may start, who holds which role.
//! - [`service`]: the `main` of a service, in the order CLI, settings, logs,
//!   operations endpoint, run until a signal, exit code.

pub mod allocator;
pub mod backoff;
pub mod batch;
pub mod login_limit;
pub mod ops;
pub mod periodic;
pub mod retry;
pub mod secret;
pub mod service;
pub mod settings;
pub mod shutdown;
pub mod telemetry;
pub mod tenancy;
pub mod tls;

/// Makes rustls on ring the process's crypto provider, unless one is
/// installed already. reqwest is built without a provider of its own
/// (`rustls-no-provider`: no aws-lc build), so every process that builds a
/// client must call this first; calling it again does nothing.
pub fn install_crypto_provider() {
    // An error means a provider is installed already: that one stays.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// The name of this instance in logs, the broker's connection list and the
/// store's locks: `configured` when set, else `<kind>-<8 random hex digits>`.
pub fn instance_id(kind: &str, configured: &str) -> String {
    if configured.is_empty() {
        format!("{kind}-{}", &uuid::Uuid::new_v4().simple().to_string()[..8])
    } else {
        configured.to_owned()
    }
}

pub use backoff::{Backoff, Jitter};
pub use batch::Batcher;
pub use ops::{OpsServer, Readiness};
pub use periodic::{every, every_or_woken, Next};
pub use retry::retry_transient;
pub use service::{run_service, HasLog, ServiceArgs};
pub use settings::{load_settings, HttpSettings, LogFormat, LogSettings, Validate};

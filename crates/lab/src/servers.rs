//! Who may use the machine's RabbitMQ and Postgres right now. Every
//! [`TestEnv`](crate::TestEnv) of one process shares them with the others
//! (a database and a queue prefix of its own keep them apart); a test that
//! restarts them, cuts connections on them, or loads the whole machine has
//! them alone, so that no other test sees its outage or measures its load.
//!
//! One process-wide [`tokio::sync::RwLock`]: a shared holder takes it for
//! reading, an exclusive one for writing. It is fair (first come, first
//! served), so an exclusive holder waits only for the shared ones already
//! in, and shared holders arriving after it wait for it: it is never
//! starved. A program with one env at a time (the benchmark) never waits.
//!
//! A test holds one guard at a time: a second shared guard taken while an
//! exclusive one waits would wait behind it, for ever. So an exclusive test
//! makes its env with [`TestEnv::exclusive`](crate::TestEnv::exclusive), not
//! a guard of its own and then an env.

use std::sync::{Arc, LazyLock};

use tokio::sync::{OwnedRwLockReadGuard, OwnedRwLockWriteGuard, RwLock};

/// The process's lock on the servers.
static SERVERS: LazyLock<Arc<RwLock<()>>> = LazyLock::new(|| Arc::new(RwLock::new(())));

/// A hold on the shared RabbitMQ and Postgres, released when dropped.
#[derive(Debug)]
pub enum ServerGuard {
    /// Beside other shared holders: the test's own database and prefix
    /// are all it touches.
    Shared(OwnedRwLockReadGuard<()>),
    /// Alone: no other holder runs until it is dropped.
    Exclusive(OwnedRwLockWriteGuard<()>),
}

impl ServerGuard {
    /// Waits for a shared hold (while no exclusive one is held or waiting).
    pub async fn shared() -> Self {
        Self::Shared(SERVERS.clone().read_owned().await)
    }

    /// Waits until every other holder has let go, and holds the servers
    /// alone.
    pub async fn exclusive() -> Self {
        let lock = SERVERS.clone();
        match lock.clone().try_write_owned() {
            Ok(guard) => Self::Exclusive(guard),
            Err(_) => {
                eprintln!("waiting for the other tests to leave RabbitMQ and Postgres alone");
                Self::Exclusive(lock.write_owned().await)
            }
        }
    }

    /// [`ServerGuard::shared`], for a test without an async runtime.
    ///
    /// # Panics
    /// When called on an async runtime's thread.
    pub fn shared_blocking() -> Self {
        block_on(Self::shared())
    }

    /// [`ServerGuard::exclusive`], for a test without an async runtime.
    ///
    /// # Panics
    /// When called on an async runtime's thread.
    pub fn exclusive_blocking() -> Self {
        block_on(Self::exclusive())
    }

    /// Whether no other holder runs beside this one.
    pub fn is_exclusive(&self) -> bool {
        matches!(self, Self::Exclusive(_))
    }
}

fn block_on<T>(future: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime to wait for the servers")
        .block_on(future)
}

//! The soak: a long steady load with retention set short, to show that a
//! deployment running for years levels off. Every sample gives the database
//! size and rows per table, the throughput since the last sample, and the
//! resident memory of each binary; sizes must stop growing once retention
//! runs, and throughput must not decline.

use sqlx::AssertSqlSafe;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::drive::{counter_sum, publish};
use crate::system::{memory_mib, BenchSystem};
use sas_lab::Setting;
use sas_lab::TestEnv;

/// Tables sampled, in the order printed.
const TABLES: [&str; 6] = [
    "orders",
    "order_process",
    "steps",
    "history",
    "alerts",
    "dead_letters",
];

/// One sample of the soak.
#[derive(Debug, Clone, Serialize)]
pub struct SoakSample {
    /// Seconds since the load started.
    pub at_secs: f64,
    /// Orders processed so far.
    pub processed: f64,
    /// Orders processed per second since the previous sample.
    pub orders_per_sec: f64,
    /// `pg_database_size`, MiB.
    pub database_mib: f64,
    /// Live rows per table (Postgres's statistics: approximate).
    pub rows: Vec<(String, i64)>,
    /// Resident memory per binary, MiB (agents: the largest).
    pub rss_mib: Vec<(String, f64)>,
}

/// The settings the soak gives every service: retention `secs` short,
/// remote-sim forgetting idempotency keys four times that long after it
/// decided them, so that the simulator's memory levels off like the
/// services'. The soak's remote is lenient and never fails, so no call is
/// retried that long after its first one. The schedulers remember the
/// orders they acknowledged for half of `secs`: an order retention deleted
/// must not look lost to their audit.
pub fn settings(secs: u64) -> [Setting; 5] {
    [
        Setting::RetentionFinishedSecs(secs),
        Setting::RetentionDeadLettersSecs(secs),
        Setting::RetentionIntervalMs(1000),
        Setting::SimKeysKeptSecs(secs * 4),
        Setting::SchedulerAcknowledgedAuditSecs(secs / 2),
    ]
}

/// Runs `orders` orders at `rate` a second through a fresh system (started
/// with [`settings`] among its extra settings), sampling every `every`.
///
/// # Errors
/// When the orders are not all processed within twice the expected time
/// plus five minutes.
pub async fn run(orders: usize, rate: f64, every: Duration) -> anyhow::Result<Vec<SoakSample>> {
    let env = TestEnv::new().await;
    let (_connection, publisher) = env.broker().await;
    let system = BenchSystem::start(&env, 2).await;
    let ids: Vec<String> = (0..orders).map(|i| format!("soak-{i}")).collect();
    let started = Instant::now();
    let limit = Duration::from_secs_f64(orders as f64 / rate * 2.0 + 300.0);
    // Deleted rows leave dead tuples until a vacuum makes their space
    // reusable. A default Postgres runs autovacuum (naptime 1 min); where
    // it is off, as on our CI machines, the soak vacuums every minute in
    // its place, or the database would grow whatever retention deletes.
    let autovacuum: String = sqlx::query_scalar("SHOW autovacuum")
        .fetch_one(&env.db)
        .await?;
    let stand_in = autovacuum != "on";
    if stand_in {
        eprintln!("soak: autovacuum is off on this Postgres: vacuuming every 60 s in its place");
    }
    let mut last_vacuum = Instant::now();
    let sampling = async {
        let mut samples: Vec<SoakSample> = Vec::new();
        loop {
            tokio::time::sleep(every).await;
            if stand_in && last_vacuum.elapsed() >= Duration::from_secs(60) {
                last_vacuum = Instant::now();
                sqlx::query(AssertSqlSafe(format!(
                    "VACUUM (ANALYZE) {}",
                    TABLES.join(", ")
                )))
                .execute(&env.db)
                .await?;
            }
            let sample = sample(&env, &system, started).await?;
            let previous = samples
                .last()
                .map_or((0.0, 0.0), |s| (s.at_secs, s.processed));
            let rate = (sample.processed - previous.1) / (sample.at_secs - previous.0).max(0.001);
            let done = sample.processed >= orders as f64;
            eprintln!(
                "soak {:>6.0} s: {:>7.0} processed, {rate:>6.0}/s, database {:>6.1} MiB, rows {:?}, rss {:?}",
                sample.at_secs, sample.processed, sample.database_mib, sample.rows, sample.rss_mib
            );
            samples.push(SoakSample {
                orders_per_sec: rate,
                ..sample
            });
            if done {
                return Ok::<_, anyhow::Error>(samples);
            }
            anyhow::ensure!(
                started.elapsed() < limit,
                "soak: {} of {orders} orders processed after {:.0} s",
                samples.last().map_or(0.0, |s| s.processed),
                started.elapsed().as_secs_f64()
            );
        }
    };
    let (_, samples) = tokio::join!(publish(&env, &publisher, &ids, rate, None), sampling);
    samples
}

async fn sample(
    env: &TestEnv,
    system: &BenchSystem,
    started: Instant,
) -> anyhow::Result<SoakSample> {
    let pool = &env.db;
    let database_bytes: i64 = sqlx::query_scalar("SELECT pg_database_size(current_database())")
        .fetch_one(pool)
        .await?;
    let mut rows = Vec::new();
    for table in TABLES {
        let n: i64 = sqlx::query_scalar(
            "SELECT coalesce(max(n_live_tup), 0) FROM pg_stat_user_tables WHERE relname = $1",
        )
        .bind(table)
        .fetch_one(pool)
        .await?;
        rows.push((table.to_owned(), n));
    }
    let mut rss_mib: Vec<(String, f64)> = Vec::new();
    for (binary, pid) in system.processes() {
        let (resident, _) = memory_mib(pid);
        match rss_mib.iter_mut().find(|(name, _)| name == binary) {
            Some((_, most)) => *most = most.max(resident),
            None => rss_mib.push((binary.to_owned(), resident)),
        }
    }
    let processed = counter_sum(
        system.scheduler_port,
        "sas_orders_finished_total{event=\"processed\"}",
    )
    .await;
    Ok(SoakSample {
        at_secs: started.elapsed().as_secs_f64(),
        processed,
        orders_per_sec: 0.0,
        database_mib: database_bytes as f64 / (1024.0 * 1024.0),
        rows,
        rss_mib,
    })
}

//! The machine's own limits, measured the same run: persistent, confirmed
//! messages through one quorum queue and back, and single-row commits; and
//! what the same bare work, paced at a given rate, costs RabbitMQ and
//! Postgres in CPU.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures_util::{stream, StreamExt, TryStreamExt};
use sas_broker::lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueDeleteOptions,
};
use sas_broker::lapin::types::FieldTable;
use sas_broker::lapin::{BasicProperties, Channel, Connection, Consumer};
use sas_broker::{topology, Publisher};
use sas_lab::TestEnv;

use crate::system::cpu_secs_by_program;

/// A quorum queue of the benchmark's own with a consumer on it, and a
/// confirmed publisher: what the broker's calibrations send through.
struct CalibrationQueue {
    connection: Connection,
    channel: Channel,
    consumer: Consumer,
    publisher: Publisher,
    queue: String,
}

impl CalibrationQueue {
    /// Declares `<prefix><name>` as the services declare their work queues,
    /// and starts consuming it.
    async fn open(env: &TestEnv, name: &str) -> anyhow::Result<Self> {
        let settings = env.amqp();
        let queue = format!("{}{name}", env.prefix);
        let connection = sas_broker::connect(&settings, "bench-calibration").await?;
        let channel = connection.create_channel().await?;
        topology::declare_common(&channel, &settings).await?;
        topology::declare_work_queue(&channel, &settings, &queue).await?;
        channel.basic_qos(256, BasicQosOptions::default()).await?;
        let consumer = channel
            .basic_consume(
                queue.as_str().into(),
                "calibration".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let publisher = Publisher::open(&connection, settings.operation_timeout()).await?;
        Ok(Self {
            connection,
            channel,
            consumer,
            publisher,
            queue,
        })
    }

    /// Deletes the queue and closes the connection.
    async fn close(self) -> anyhow::Result<()> {
        self.channel
            .queue_delete(self.queue.as_str().into(), QueueDeleteOptions::default())
            .await?;
        let _ = self.connection.close(200, "calibrated".into()).await;
        Ok(())
    }
}

/// Receives `messages` deliveries, acknowledging each on its own.
async fn consume(consumer: &mut Consumer, messages: usize) -> anyhow::Result<()> {
    for _ in 0..messages {
        let Some(Ok(delivery)) = consumer.next().await else {
            anyhow::bail!("the calibration consumer stopped");
        };
        anyhow::ensure!(
            delivery.ack(BasicAckOptions::default()).await?,
            "a calibration delivery could not be acknowledged"
        );
    }
    Ok(())
}

/// Publishes `messages` persistent messages to `queue`, each at the time
/// `due(i)` returns (at once for `None`), up to 256 waiting for their
/// confirms at once.
async fn publish(
    publisher: &Publisher,
    queue: &str,
    messages: usize,
    due: impl Fn(usize) -> Option<tokio::time::Instant>,
) -> anyhow::Result<()> {
    let body = vec![b'x'; 300];
    stream::iter(0..messages)
        .map(|i| {
            let (body, due) = (&body, due(i));
            async move {
                if let Some(due) = due {
                    tokio::time::sleep_until(due).await;
                }
                publisher
                    .publish(
                        "",
                        queue,
                        body,
                        BasicProperties::default().with_delivery_mode(2),
                        true,
                    )
                    .await
            }
        })
        .buffer_unordered(256)
        .try_for_each(|()| std::future::ready(Ok(())))
        .await?;
    Ok(())
}

/// Messages per second published (confirmed, persistent) to one quorum
/// queue and consumed back (acknowledged one by one), publishing and
/// consuming at once, as the services do.
pub async fn broker_limit(env: &TestEnv, messages: usize) -> anyhow::Result<f64> {
    let mut calibration = CalibrationQueue::open(env, "bench.calibration").await?;
    let started = Instant::now();
    // A publish that fails ends the wait for the deliveries too.
    tokio::try_join!(
        consume(&mut calibration.consumer, messages),
        publish(&calibration.publisher, &calibration.queue, messages, |_| {
            None
        }),
    )?;
    let rate = messages as f64 / started.elapsed().as_secs_f64();
    calibration.close().await?;
    Ok(rate)
}

/// RabbitMQ's CPU milliseconds per message when persistent, confirmed
/// messages go through one quorum queue at `per_sec`, evenly spaced, each
/// consumed and acknowledged on its own, for `seconds` ([`Pace`]): what
/// the broker costs for bare messages at that rate, each in a batch of its
/// own as far as the pace allows.
///
/// # Errors
/// When the rate or duration is not positive, the broker fails, or the
/// messages could not keep the pace.
pub async fn broker_cpu_at(env: &TestEnv, per_sec: f64, seconds: f64) -> anyhow::Result<f64> {
    let pace = Pace::new(per_sec, seconds)?;
    let mut calibration = CalibrationQueue::open(env, "bench.bare").await?;
    let before = cpu_secs_by_program();
    let started = tokio::time::Instant::now();
    tokio::try_join!(
        consume(&mut calibration.consumer, pace.items),
        publish(
            &calibration.publisher,
            &calibration.queue,
            pace.items,
            |i| Some(pace.due(started, i))
        ),
    )?;
    let used = cpu_used(&before, "rabbitmq");
    pace.kept(started)?;
    calibration.close().await?;
    Ok(used * 1000.0 / pace.items as f64)
}

/// An even pace for a calibration: `per_sec` items for `seconds`, at least
/// 10 items (so a very low rate takes longer).
#[derive(Debug, Clone, Copy)]
struct Pace {
    per_sec: f64,
    items: usize,
}

impl Pace {
    fn new(per_sec: f64, seconds: f64) -> anyhow::Result<Self> {
        anyhow::ensure!(
            per_sec.is_finite() && per_sec > 0.0 && seconds.is_finite() && seconds > 0.0,
            "a paced calibration needs a positive, finite rate and duration (got {per_sec}/s for {seconds} s)"
        );
        Ok(Self {
            per_sec,
            items: ((per_sec * seconds).round() as usize).max(10),
        })
    }

    /// When item `i` is due, the first at `started`.
    fn due(&self, started: tokio::time::Instant, i: usize) -> tokio::time::Instant {
        started + Duration::from_secs_f64(i as f64 / self.per_sec)
    }

    /// Fails when the items took much longer than the pace planned: the
    /// calibration then measured a backlog, not the rate.
    fn kept(&self, started: tokio::time::Instant) -> anyhow::Result<()> {
        let planned = (self.items - 1) as f64 / self.per_sec;
        let took = started.elapsed().as_secs_f64();
        anyhow::ensure!(
            took <= planned * 1.25 + 0.5,
            "could not keep a pace of {:.0}/s: {} items took {took:.1} s, planned {planned:.1} s",
            self.per_sec,
            self.items
        );
        Ok(())
    }
}

/// CPU seconds `program` used since `before` ([`cpu_secs_by_program`]).
fn cpu_used(before: &BTreeMap<String, f64>, program: &str) -> f64 {
    cpu_secs_by_program()
        .get(program)
        .copied()
        .unwrap_or_default()
        - before.get(program).copied().unwrap_or_default()
}

/// The update both Postgres calibrations commit, one row at a time.
const COUNTER_UPDATE: &str = "UPDATE bench_counter SET value = value + 1 WHERE id = $1";

/// A pool of `connections` to the benchmark's database, with a 64-row
/// counter table made for the calibration.
async fn counter_table(env: &TestEnv, connections: u32) -> anyhow::Result<sqlx::PgPool> {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(connections)
        .connect(&env.database_url)
        .await?;
    sqlx::query("CREATE TABLE bench_counter (id int PRIMARY KEY, value bigint NOT NULL)")
        .execute(&pool)
        .await?;
    sqlx::query("INSERT INTO bench_counter SELECT g, 0 FROM generate_series(0, 63) g")
        .execute(&pool)
        .await?;
    Ok(pool)
}

/// Drops the counter table and closes the pool.
async fn drop_counter_table(pool: sqlx::PgPool) -> anyhow::Result<()> {
    sqlx::query("DROP TABLE bench_counter")
        .execute(&pool)
        .await?;
    pool.close().await;
    Ok(())
}

/// Single-row committed updates per second, from 8 connections.
pub async fn postgres_limit(env: &TestEnv, seconds: f64) -> anyhow::Result<f64> {
    let pool = counter_table(env, 8).await?;
    let started = Instant::now();
    let workers = (0..8).map(|worker| {
        let pool = pool.clone();
        async move {
            let mut done = 0u64;
            while started.elapsed().as_secs_f64() < seconds {
                sqlx::query(COUNTER_UPDATE)
                    .bind((worker * 8 + done as i32 % 8) % 64)
                    .execute(&pool)
                    .await?;
                done += 1;
            }
            Ok::<_, sqlx::Error>(done)
        }
    });
    let counts = futures_util::future::try_join_all(workers).await?;
    let rate = counts.iter().sum::<u64>() as f64 / started.elapsed().as_secs_f64();
    drop_counter_table(pool).await?;
    Ok(rate)
}

/// Postgres's CPU milliseconds per commit when single-row updates are
/// committed at `per_sec`, evenly spaced, from up to 4 connections opened
/// beforehand, for `seconds` ([`Pace`]): what Postgres costs for a bare
/// commit at that rate.
///
/// # Errors
/// When the rate or duration is not positive, Postgres fails, or the
/// commits could not keep the pace.
pub async fn postgres_cpu_at(env: &TestEnv, per_sec: f64, seconds: f64) -> anyhow::Result<f64> {
    const CONNECTIONS: u32 = 4;
    let pace = Pace::new(per_sec, seconds)?;
    let pool = counter_table(env, CONNECTIONS).await?;
    // Every connection opened before the clock starts: a backend's start
    // is not a commit's cost.
    let opened =
        futures_util::future::try_join_all((0..CONNECTIONS).map(|_| pool.acquire())).await?;
    drop(opened);
    let before = cpu_secs_by_program();
    let started = tokio::time::Instant::now();
    stream::iter(0..pace.items)
        .map(|i| {
            let pool = &pool;
            async move {
                tokio::time::sleep_until(pace.due(started, i)).await;
                sqlx::query(COUNTER_UPDATE)
                    .bind((i % 64) as i32)
                    .execute(pool)
                    .await
            }
        })
        .buffer_unordered(16)
        .try_for_each(|_| std::future::ready(Ok(())))
        .await?;
    let used = cpu_used(&before, "postgres");
    pace.kept(started)?;
    drop_counter_table(pool).await?;
    Ok(used * 1000.0 / pace.items as f64)
}

//! The machine's own limits, measured the same run: persistent, confirmed
//! messages through one quorum queue and back, and single-row commits.

use std::time::Instant;

use futures_util::{stream, StreamExt};
use sas_broker::lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueDeleteOptions,
};
use sas_broker::lapin::types::FieldTable;
use sas_broker::lapin::BasicProperties;
use sas_broker::{topology, Publisher};
use sas_lab::TestEnv;

/// Messages per second published (confirmed, persistent) to one quorum
/// queue and consumed back (acknowledged one by one), publishing and
/// consuming at once, as the services do.
pub async fn broker_limit(env: &TestEnv, messages: usize) -> anyhow::Result<f64> {
    let settings = env.amqp();
    let queue = format!("{}bench.calibration", env.prefix);
    let connection = sas_broker::connect(&settings, "bench-calibration").await?;
    let channel = connection.create_channel().await?;
    topology::declare_common(&channel, &settings).await?;
    topology::declare_work_queue(&channel, &settings, &queue).await?;
    channel.basic_qos(256, BasicQosOptions::default()).await?;
    let mut consumer = channel
        .basic_consume(
            queue.as_str().into(),
            "calibration".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let publisher = Publisher::open(&connection, settings.operation_timeout()).await?;
    let body = vec![b'x'; 300];
    let started = Instant::now();
    let consuming = async {
        let mut received = 0;
        while received < messages {
            let Some(Ok(delivery)) = consumer.next().await else {
                anyhow::bail!("the calibration consumer stopped");
            };
            anyhow::ensure!(
                delivery.ack(BasicAckOptions::default()).await?,
                "a calibration delivery could not be acknowledged"
            );
            received += 1;
        }
        Ok(())
    };
    let publishing = stream::iter(0..messages)
        .map(|_| {
            publisher.publish(
                "",
                &queue,
                &body,
                BasicProperties::default().with_delivery_mode(2),
                true,
            )
        })
        .buffer_unordered(256)
        .for_each(|result| async move {
            result.expect("calibration publish");
        });
    let (consumed, ()) = tokio::join!(consuming, publishing);
    consumed?;
    let rate = messages as f64 / started.elapsed().as_secs_f64();
    channel
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await?;
    let _ = connection.close(200, "calibrated".into()).await;
    Ok(rate)
}

/// Single-row committed updates per second, from 8 connections.
pub async fn postgres_limit(env: &TestEnv, seconds: f64) -> anyhow::Result<f64> {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect(&env.database_url)
        .await?;
    sqlx::query("CREATE TABLE bench_counter (id int PRIMARY KEY, value bigint NOT NULL)")
        .execute(&pool)
        .await?;
    sqlx::query("INSERT INTO bench_counter SELECT g, 0 FROM generate_series(0, 63) g")
        .execute(&pool)
        .await?;
    let started = Instant::now();
    let workers = (0..8).map(|worker| {
        let pool = pool.clone();
        async move {
            let mut done = 0u64;
            while started.elapsed().as_secs_f64() < seconds {
                sqlx::query("UPDATE bench_counter SET value = value + 1 WHERE id = $1")
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
    sqlx::query("DROP TABLE bench_counter")
        .execute(&pool)
        .await?;
    pool.close().await;
    Ok(rate)
}

//! Driving load: publishing orders, and seeing them finish.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::{stream, StreamExt};
use sas_broker::lapin::BasicProperties;
use sas_broker::{topology, Publisher};
use sas_lab::{order, TestEnv};
use sas_messages::{OrderStatus, StatusEvent, SubmitOrder};

/// Publishes the orders `ids` with confirms, up to 256 unconfirmed at once,
/// at `rate` orders per second (0: as fast as the broker confirms). Returns
/// when each was published.
pub async fn publish(
    env: &TestEnv,
    publisher: &Publisher,
    ids: &[String],
    rate: f64,
    reply_to: Option<&str>,
) -> HashMap<String, Instant> {
    publish_with_priority(env, publisher, ids, rate, reply_to, |_| None).await
}

/// [`publish`], each order with the priority `priority_of` gives its index.
pub async fn publish_with_priority(
    env: &TestEnv,
    publisher: &Publisher,
    ids: &[String],
    rate: f64,
    reply_to: Option<&str>,
    priority_of: impl Fn(usize) -> Option<u8>,
) -> HashMap<String, Instant> {
    publish_each(env, publisher, ids, rate, |index, id| {
        let mut submitted = order(id);
        submitted.reply_to = reply_to.map(str::to_owned);
        submitted.priority = priority_of(index);
        (submitted, sas_broker::publish::json_properties(id))
    })
    .await
}

/// Publishes one order per id in `ids`, as `make` builds it and its message
/// properties from its index and id, with confirms, up to 256 unconfirmed
/// at once, at `rate` orders per second (0: as fast as the broker
/// confirms). Returns when each was published.
pub async fn publish_each(
    env: &TestEnv,
    publisher: &Publisher,
    ids: &[String],
    rate: f64,
    make: impl Fn(usize, &str) -> (SubmitOrder, BasicProperties),
) -> HashMap<String, Instant> {
    let queue = env.amqp().names().orders();
    let started = Instant::now();
    let sent = Arc::new(Mutex::new(HashMap::with_capacity(ids.len())));
    stream::iter(ids.iter().enumerate())
        .map(|(index, id)| {
            let (queue, sent) = (queue.clone(), sent.clone());
            let make = &make;
            async move {
                if rate > 0.0 {
                    tokio::time::sleep_until(
                        (started + Duration::from_secs_f64(index as f64 / rate)).into(),
                    )
                    .await;
                }
                let (submitted, properties) = make(index, id);
                let body = serde_json::to_vec(&submitted).expect("order");
                let at = Instant::now();
                publisher
                    .publish("", &queue, &body, properties, true)
                    .await
                    .expect("publish an order");
                sent.lock().expect("lock").insert(id.clone(), at);
            }
        })
        .buffer_unordered(256)
        .collect::<()>()
        .await;
    Arc::try_unwrap(sent)
        .expect("all published")
        .into_inner()
        .expect("lock")
}

/// Orders whose id starts with `prefix` and that are processed.
pub async fn processed(env: &TestEnv, prefix: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM order_process WHERE state = 'processed' AND order_id LIKE $1 || '%'",
    )
    .bind(prefix)
    .fetch_one(&env.db)
    .await
    .unwrap_or(0)
}

/// Waits until the `n` orders `<prefix>0` .. `<prefix><n-1>` are processed;
/// returns when.
///
/// It watches the last order by primary key every 10 ms (counting every
/// order by a scan that often would load Postgres and skew the figures) and
/// counts them all only once the last one is done, or once a second.
///
/// # Errors
/// When that takes longer than `timeout`.
pub async fn wait_processed(
    env: &TestEnv,
    prefix: &str,
    n: usize,
    timeout: Duration,
) -> anyhow::Result<Instant> {
    let deadline = Instant::now() + timeout;
    let last = format!("{prefix}{}", n.saturating_sub(1));
    let mut last_count = Instant::now();
    loop {
        let last_done: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM order_process WHERE order_id = $1 AND state = 'processed')",
        )
        .bind(&last)
        .fetch_one(&env.db)
        .await
        .unwrap_or(false);
        if last_done || last_count.elapsed() >= Duration::from_secs(1) {
            last_count = Instant::now();
            let done = processed(env, prefix).await;
            if done >= n as i64 {
                return Ok(Instant::now());
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "only {done} of {n} orders {prefix}* processed within {timeout:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A client listening to every order's status messages, recording when
/// each order's `processed` arrived.
pub struct StatusListener {
    /// The queue to name as `reply_to`.
    pub queue: String,
    /// Arrival of each order's `processed` status.
    pub processed: Arc<Mutex<HashMap<String, Instant>>>,
    /// Arrival of each order's first `step_completed` status: up to it, the
    /// order waited to be admitted and for its first call; after it, the
    /// later steps.
    pub first_step: Arc<Mutex<HashMap<String, Instant>>>,
    /// How long each order's `processed` status waited in this queue, ms
    /// (from its `x-sas-published-at` header): a line of the latency budget.
    pub status_wait_ms: Arc<Mutex<HashMap<String, f64>>>,
    _task: tokio::task::JoinHandle<()>,
}

impl StatusListener {
    /// A private queue that orders name as their `reply_to`, as a client
    /// that wants its status messages does (it works whether or not the
    /// status exchange is on).
    pub async fn start(env: &TestEnv) -> anyhow::Result<Self> {
        Self::bound(env, &[]).await
    }

    /// [`StatusListener::start`], its queue bound to the status exchange
    /// with each of `routing_keys` (`order.<id>`: one order's statuses, as a
    /// client with no `reply_to` to name hears them; `order.*`: every
    /// order's, as an operator's watcher does).
    pub async fn bound(env: &TestEnv, routing_keys: &[&str]) -> anyhow::Result<Self> {
        let settings = env.amqp();
        let connection = sas_broker::connect(&settings, "bench-status").await?;
        let (queue, mut consumer) =
            topology::status_consumer(&connection, &settings, routing_keys).await?;
        let processed = Arc::new(Mutex::new(HashMap::new()));
        let first_step = Arc::new(Mutex::new(HashMap::new()));
        let status_wait_ms = Arc::new(Mutex::new(HashMap::new()));
        let (record, record_first, record_wait) = (
            processed.clone(),
            first_step.clone(),
            status_wait_ms.clone(),
        );
        let task = tokio::spawn(async move {
            let _connection = connection;
            while let Some(Ok(delivery)) = consumer.next().await {
                let Ok(status) = serde_json::from_slice::<OrderStatus>(&delivery.data) else {
                    continue;
                };
                if status.event == StatusEvent::StepCompleted {
                    record_first
                        .lock()
                        .expect("lock")
                        .entry(status.order_id.into_string())
                        .or_insert_with(Instant::now);
                    continue;
                }
                if status.event != StatusEvent::Processed {
                    continue;
                }
                let order_id = status.order_id.into_string();
                if let Some(waited) = sas_broker::publish::published_ago(&delivery.properties) {
                    record_wait
                        .lock()
                        .expect("lock")
                        .insert(order_id.clone(), waited.as_secs_f64() * 1000.0);
                }
                record
                    .lock()
                    .expect("lock")
                    .insert(order_id, Instant::now());
            }
        });
        Ok(Self {
            queue,
            processed,
            first_step,
            status_wait_ms,
            _task: task,
        })
    }

    /// Waits until `n` orders' `processed` statuses have arrived, or
    /// `within` has passed: a status may trail the state store a little.
    pub async fn wait_for_processed(&self, n: usize, within: Duration) {
        let deadline = Instant::now() + within;
        while self.processed.lock().expect("lock").len() < n && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A service's `/metrics` page (empty when it does not answer).
pub async fn metrics_page(port: u16) -> String {
    match sas_lab::http_get(format!("http://127.0.0.1:{port}/metrics")).await {
        Ok(response) => response.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// Sums every sample of a counter (all label sets) on a `/metrics` page.
pub async fn counter_sum(port: u16, name: &str) -> f64 {
    metrics_page(port)
        .await
        .lines()
        .filter(|line| {
            line.starts_with(name) && matches!(line.as_bytes().get(name.len()), Some(b' ' | b'{'))
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

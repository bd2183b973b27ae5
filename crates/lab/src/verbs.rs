//! What a test (or the benchmark) does to a running system and asks of it,
//! in the system's words: a burst of orders, an order's state and detail,
//! waiting for an order to reach a state or to be stored, waiting for dead
//! letters, and a client's own reply queue. One version each, instead of a
//! copy per test file.

use std::time::Duration;

use sas_broker::lapin::options::{
    BasicConsumeOptions, BasicNackOptions, BasicQosOptions, QueueDeclareOptions,
};
use sas_broker::lapin::types::FieldTable;
use sas_broker::lapin::{Channel, Connection, Consumer};
use sas_broker::Publisher;
use sas_store::reads::queries::OrderDetail;
use sas_store::{ProcessState, Store};

use crate::{wait_until, TestEnv};

impl TestEnv {
    /// Publishes `n` valid orders ([`crate::order`]) with ids `<prefix>-0`
    /// to `<prefix>-<n - 1>`, one after another, each confirmed.
    ///
    /// # Panics
    /// When the broker does not confirm one.
    pub async fn publish_orders(&self, publisher: &Publisher, prefix: &str, n: usize) {
        for i in 0..n {
            self.publish_order(publisher, &crate::order(&format!("{prefix}-{i}")))
                .await;
        }
    }

    /// The order's detail (process record, steps, the order as submitted).
    ///
    /// # Panics
    /// When the database cannot be read or the order is not stored.
    pub async fn detail(&self, order_id: &str) -> OrderDetail {
        self.store
            .reads()
            .order_detail(order_id)
            .await
            .expect("read the order")
            .unwrap_or_else(|| panic!("{order_id} is not stored"))
    }

    /// The order's state, or `None` while it is not stored.
    ///
    /// # Panics
    /// When the database cannot be read.
    pub async fn state_of(&self, order_id: &str) -> Option<ProcessState> {
        self.store
            .reads()
            .order_detail(order_id)
            .await
            .expect("read the order")
            .map(|detail| detail.summary.state)
    }

    /// Waits until the order is in `state`.
    ///
    /// # Panics
    /// When it is not by `timeout`, naming the state it is in (and its last
    /// error) or that it is not stored.
    pub async fn wait_for_state(&self, order_id: &str, state: ProcessState, timeout: Duration) {
        wait_for_state_in(&self.store, order_id, state, timeout).await;
    }

    /// Waits until the order is stored, in whatever state.
    ///
    /// # Panics
    /// When it is not by `timeout`.
    pub async fn wait_stored(&self, order_id: &str, timeout: Duration) {
        wait_until(&format!("{order_id} to be stored"), timeout, || async {
            match self.store.reads().order_detail(order_id).await {
                Ok(Some(_)) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        })
        .await;
    }

    /// Waits until `count`, a `SELECT count(*) ...` on the test's
    /// database, finds none: rows something in the background must remove
    /// (`what` names them).
    ///
    /// # Panics
    /// When some are still there at `timeout`.
    pub async fn wait_for_none(&self, what: &str, count: &'static str, timeout: Duration) {
        wait_until(&format!("no {what} left"), timeout, || async {
            let left: i64 = sqlx::query_scalar(count)
                .fetch_one(&self.db)
                .await
                .map_err(|e| e.to_string())?;
            if left == 0 {
                Ok(())
            } else {
                Err(format!("{left} {what} left"))
            }
        })
        .await;
    }

    /// Waits until at least `n` dead letters are recorded.
    ///
    /// # Panics
    /// When they are not by `timeout`.
    pub async fn wait_for_dead_letters(&self, n: usize, timeout: Duration) {
        wait_until(&format!("{n} recorded dead letters"), timeout, || async {
            let letters = self
                .store
                .reads()
                .dead_letters(100)
                .await
                .map_err(|e| e.to_string())?;
            if letters.len() >= n {
                Ok(())
            } else {
                Err(format!("{}", letters.len()))
            }
        })
        .await;
    }

    /// A client's own queue `<prefix><name>` on a new channel of
    /// `connection`, declared exclusive: it goes with the connection (the
    /// teardown deletes only the topology it knows). Returns its name and
    /// the channel.
    ///
    /// # Panics
    /// When RabbitMQ refuses.
    pub async fn client_queue(&self, connection: &Connection, name: &str) -> (String, Channel) {
        let channel = connection.create_channel().await.expect("a channel");
        let queue = format!("{}{name}", self.prefix);
        channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    exclusive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("declare the client's queue");
        (queue, channel)
    }
}

/// Waits until the order is in `state` in `store` (a store other than the
/// env's: a promoted standby's), as [`TestEnv::wait_for_state`].
///
/// # Panics
/// When it is not by `timeout`.
pub async fn wait_for_state_in(
    store: &Store,
    order_id: &str,
    state: ProcessState,
    timeout: Duration,
) {
    wait_until(&format!("{order_id} to be {state}"), timeout, || async {
        match store.reads().order_detail(order_id).await {
            Ok(Some(d)) if d.summary.state == state => Ok(()),
            Ok(Some(d)) => Err(format!("{} ({:?})", d.summary.state, d.summary.last_error)),
            Ok(None) => Err("not stored".into()),
            Err(error) => Err(error.to_string()),
        }
    })
    .await;
}

/// Plays a consumer of `queue` that takes the next message `times` times
/// and hands it back each time (a nack with requeue), as a consumer that
/// crashes on it, or services that stop while they hold it, do: each
/// return counts towards the queue's delivery limit, so `limit + 1` times
/// makes RabbitMQ dead-letter it.
///
/// # Panics
/// When RabbitMQ refuses, or no message comes within 20 s.
pub async fn hand_back(connection: &Connection, queue: &str, times: usize) {
    use futures_util::StreamExt as _;
    let channel = connection.create_channel().await.expect("a channel");
    channel
        .basic_qos(1, BasicQosOptions::default())
        .await
        .expect("qos");
    let mut consumer = channel
        .basic_consume(
            queue.into(),
            "handing-back".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("consume");
    for _ in 0..times {
        let delivery = tokio::time::timeout(Duration::from_secs(20), consumer.next())
            .await
            .expect("the message comes (back)")
            .expect("the consumer is open")
            .expect("a delivery");
        let requeued = delivery
            .nack(BasicNackOptions {
                requeue: true,
                ..Default::default()
            })
            .await
            .expect("nack");
        assert!(requeued, "the message was not handed back to the queue");
    }
    drop(consumer);
    let _ = channel.close(200, "handed back".into()).await;
}

/// A consumer of `queue` on `channel` that acknowledges nothing (the
/// broker counts a delivery as done when sent): how a client reads its
/// status messages or a test its replies.
///
/// # Panics
/// When RabbitMQ refuses.
pub async fn consume(channel: &Channel, queue: &str, tag: &str) -> Consumer {
    channel
        .basic_consume(
            queue.into(),
            tag.into(),
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("consume")
}

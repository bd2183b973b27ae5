//! The console's use of RabbitMQ: queue depths and consumers (passive
//! declares: they need no management plugin and change nothing), and
//! replaying a dead letter to its source queue.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use sas_broker::lapin::options::QueueDeclareOptions;
use sas_broker::lapin::types::FieldTable;
use sas_broker::lapin::Connection;
use serde::Serialize;

/// The connection of the broker session, while one is up.
#[derive(Clone, Default)]
pub struct CurrentConnection(Arc<RwLock<Option<Arc<Connection>>>>);

impl CurrentConnection {
    /// Records the connection of the session (or `None` when it is lost).
    pub fn set(&self, connection: Option<Arc<Connection>>) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = connection;
    }

    fn get(&self) -> Option<Arc<Connection>> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// One queue's depth and consumers, or why they could not be read.
#[derive(Debug, Clone, Serialize)]
pub struct QueueDepth {
    /// Queue name.
    pub queue: String,
    /// Messages ready for delivery (not those delivered and unacknowledged).
    pub messages: Option<u32>,
    /// Consumers attached.
    pub consumers: Option<u32>,
    /// Why the numbers are missing, if they are.
    pub error: Option<String>,
}

/// Reads the depth and consumers of each queue with a passive declare, each
/// on a channel of its own (a missing queue closes its channel).
pub async fn queue_depths(
    connection: &CurrentConnection,
    queues: &[String],
    timeout: Duration,
) -> Vec<QueueDepth> {
    let Some(connection) = connection.get() else {
        return queues
            .iter()
            .map(|queue| QueueDepth {
                queue: queue.clone(),
                messages: None,
                consumers: None,
                error: Some("not connected to RabbitMQ".into()),
            })
            .collect();
    };
    let mut depths = Vec::with_capacity(queues.len());
    for queue in queues {
        let read = async {
            let channel = connection.create_channel().await?;
            let declared = channel
                .queue_declare(
                    queue.as_str().into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..QueueDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await;
            if declared.is_ok() {
                let _ = channel.close(200, "read".into()).await;
            }
            declared
        };
        depths.push(match tokio::time::timeout(timeout, read).await {
            Ok(Ok(declared)) => QueueDepth {
                queue: queue.clone(),
                messages: Some(declared.message_count()),
                consumers: Some(declared.consumer_count()),
                error: None,
            },
            Ok(Err(error)) => QueueDepth {
                queue: queue.clone(),
                messages: None,
                consumers: None,
                error: Some(if error.to_string().contains("NOT_FOUND") {
                    "no such queue: not declared yet (no service of this deployment has started)"
                        .to_owned()
                } else {
                    error.to_string()
                }),
            },
            Err(_) => QueueDepth {
                queue: queue.clone(),
                messages: None,
                consumers: None,
                error: Some(format!("no answer within {timeout:?}")),
            },
        });
    }
    depths
}

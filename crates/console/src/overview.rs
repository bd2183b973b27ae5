//! The overview's numbers: orders by state and per minute, the agents'
//! admission lines (state store), queue depths and consumers (broker), open
//! alerts. Counting orders by
//! state reads every process record, so the numbers are computed at most
//! once per half live interval, whoever asks, and shared.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sas_store::admission::{AdmissionLine, KeyLine};
use sas_store::reads::overview::Activity;
use sas_store::reads::queries::Alert;
use serde::Serialize;

use crate::broker::QueueDepth;
use crate::error::Failure;
use crate::Console;

/// The most key lines the overview shows.
pub const KEY_LINES_SHOWN: i64 = 20;

/// Agents shown before any has been seen (the built-in workflow's).
const DEFAULT_AGENTS: [&str; 3] = ["inventory", "payment", "shipping"];

/// Everything the overview shows.
#[derive(Debug, Clone, Serialize)]
pub struct Overview {
    /// Orders by state, per minute, open alerts and dead letters counted.
    pub activity: Activity,
    /// Each agent's line: the real backlog, which admission control keeps
    /// in Postgres while the agent queues stay short.
    pub admission: Vec<AdmissionLine>,
    /// The busiest key lines of the workflows' concurrency limits (at most
    /// [`KEY_LINES_SHOWN`]).
    pub keys: Vec<KeyLine>,
    /// Each queue's depth and consumers.
    pub queues: Vec<QueueDepth>,
    /// The newest open alerts (at most 10).
    pub alerts: Vec<Alert>,
}

/// The last overview computed, and when.
#[derive(Default)]
pub struct Cache(tokio::sync::Mutex<Option<(Instant, Arc<Overview>)>>);

impl Console {
    /// The overview, at most half a live interval old.
    ///
    /// # Errors
    /// 503 when the state store fails.
    pub async fn overview(&self) -> Result<Arc<Overview>, Failure> {
        let fresh_for = Duration::from_millis(self.settings.console.live_interval_ms / 2);
        let mut cached = self.overview_cache.0.lock().await;
        if let Some((at, overview)) = cached.as_ref() {
            if at.elapsed() < fresh_for {
                return Ok(overview.clone());
            }
        }
        let activity = self.store.reads().activity().await?;
        let admission = self.store.admission().lines().await?;
        let keys = self.store.admission().key_lines(KEY_LINES_SHOWN).await?;
        let mut agents = self.store.reads().known_agents().await?;
        if agents.is_empty() {
            agents = DEFAULT_AGENTS.iter().map(|a| (*a).to_owned()).collect();
        }
        let mut queues = vec![self.names.orders(), self.names.scheduler_replies()];
        queues.extend(agents.iter().map(|agent| self.names.agent_requests(agent)));
        queues.push(self.names.dead_letters());
        queues.push(self.names.dead_letter_records());
        let queues = crate::broker::queue_depths(
            &self.connection,
            &queues,
            self.settings.amqp.operation_timeout(),
        )
        .await;
        let alerts = self.store.reads().alerts(false, 10).await?;
        let overview = Arc::new(Overview {
            activity,
            admission,
            keys,
            queues,
            alerts,
        });
        *cached = Some((Instant::now(), overview.clone()));
        Ok(overview)
    }
}

//! Reading remote-sim's record of side effects.

use std::collections::HashMap;

use serde::Deserialize;

/// One decided idempotency key, as `GET /side-effects` lists it.
#[derive(Debug, Clone, Deserialize)]
pub struct Entry {
    /// The idempotency key.
    pub key: String,
    /// Service.
    pub service: String,
    /// Operation.
    pub operation: String,
    /// Order, if the payload named one.
    pub order_id: Option<String>,
    /// `applied` or `refused`.
    pub decision: String,
}

/// remote-sim's counters.
#[derive(Debug, Clone, Copy, Deserialize)]
pub struct Stats {
    /// Calls received.
    pub calls: u64,
    /// Calls answered from an earlier decision.
    pub deduplicated: u64,
    /// 503s returned.
    pub transient_faults: u64,
    /// Keys refused for good.
    pub permanent_faults: u64,
    /// Calls that applied and never answered.
    pub hangs: u64,
    /// Side effects applied.
    pub applied: u64,
}

/// A client of one remote-sim process.
#[derive(Debug, Clone)]
pub struct SimClient {
    base: String,
    http: reqwest::Client,
}

impl SimClient {
    /// A client for remote-sim at `port` on localhost.
    pub fn new(port: u16) -> Self {
        Self {
            base: format!("http://127.0.0.1:{port}"),
            http: reqwest::Client::new(),
        }
    }

    /// The base URL, for agents.
    pub fn base_url(&self) -> &str {
        &self.base
    }

    /// Every decided key.
    ///
    /// # Errors
    /// When remote-sim cannot be reached.
    pub async fn side_effects(&self) -> anyhow::Result<Vec<Entry>> {
        Ok(self
            .http
            .get(format!("{}/side-effects", self.base))
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?)
    }

    /// Applied side effects per key: every value must be 1.
    ///
    /// # Errors
    /// When remote-sim cannot be reached.
    pub async fn applied_per_key(&self) -> anyhow::Result<HashMap<String, usize>> {
        let mut counts = HashMap::new();
        for entry in self.side_effects().await? {
            if entry.decision == "applied" {
                *counts.entry(entry.key).or_default() += 1;
            }
        }
        Ok(counts)
    }

    /// The counters.
    ///
    /// # Errors
    /// When remote-sim cannot be reached.
    pub async fn stats(&self) -> anyhow::Result<Stats> {
        Ok(self
            .http
            .get(format!("{}/stats", self.base))
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?)
    }

    /// Sets latency and fault rates for every service (`service` = None) or one.
    ///
    /// # Errors
    /// When remote-sim refuses.
    pub async fn set_faults(
        &self,
        service: Option<&str>,
        faults: serde_json::Value,
    ) -> anyhow::Result<()> {
        let url = match service {
            Some(service) => format!("{}/admin/faults/{service}", self.base),
            None => format!("{}/admin/faults", self.base),
        };
        self.http
            .put(url)
            .json(&faults)
            .send()
            .await?
            .error_for_status()?;
        Ok(())
    }
}

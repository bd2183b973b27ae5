//! Reading remote-sim's record of side effects.

use std::collections::HashMap;

pub use remote_sim::ledger::{Decision, Entry, Stats};

/// A client of one remote-sim process.
#[derive(Debug, Clone)]
pub struct SimClient {
    base: String,
    http: reqwest::Client,
    admin_token: Option<String>,
}

impl SimClient {
    /// A client for remote-sim at `port` on localhost.
    pub fn new(port: u16) -> Self {
        Self {
            base: format!("http://127.0.0.1:{port}"),
            http: crate::http_client(),
            admin_token: None,
        }
    }

    /// A client for remote-sim serving HTTPS at `port` on 127.0.0.1 (an IP
    /// address its certificate names), trusting only `ca_pem`.
    ///
    /// # Panics
    /// When `ca_pem` is not a PEM certificate.
    pub fn https(port: u16, ca_pem: &str) -> Self {
        crate::install_crypto_provider();
        let http = reqwest::Client::builder()
            .tls_backend_rustls()
            .tls_certs_only([reqwest::Certificate::from_pem(ca_pem.as_bytes()).expect("a PEM CA")])
            .build()
            .expect("an HTTPS client");
        Self {
            base: format!("https://127.0.0.1:{port}"),
            http,
            admin_token: None,
        }
    }

    /// This client, sending `Authorization: Bearer <token>` on the admin
    /// and ledger routes (remote-sim's `sim.admin_token`).
    pub fn with_admin_token(mut self, token: &str) -> Self {
        self.admin_token = Some(token.to_owned());
        self
    }

    fn admin(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.admin_token {
            Some(token) => request.bearer_auth(token),
            None => request,
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
            .admin(self.http.get(format!("{}/side-effects", self.base)))
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?)
    }

    /// When each applied key took effect (remote-sim's wall clock), to check
    /// that no undo landed before its action.
    ///
    /// # Panics
    /// When remote-sim cannot be reached.
    pub async fn applied_at(&self) -> HashMap<String, chrono::DateTime<chrono::Utc>> {
        self.side_effects()
            .await
            .expect("read remote-sim's side effects")
            .into_iter()
            .filter_map(|entry| entry.applied_at.map(|at| (entry.key, at)))
            .collect()
    }

    /// Panics naming the first undo that took effect before its action.
    ///
    /// # Panics
    /// When remote-sim cannot be reached, or an undo landed first.
    pub async fn assert_no_undo_before_its_action(&self) {
        let applied = self.applied_at().await;
        for (key, undone) in &applied {
            if let Some(done) = key
                .strip_suffix(":undo")
                .and_then(|action| applied.get(action))
            {
                assert!(undone > done, "the undo {key} landed before its action");
            }
        }
    }

    /// The keys of `order_id`'s applied side effects, in the order the
    /// ledger recorded them (an action before its undo).
    ///
    /// # Panics
    /// When remote-sim cannot be reached.
    pub async fn applied_keys(&self, order_id: &str) -> Vec<String> {
        let prefix = format!("{order_id}:");
        self.side_effects()
            .await
            .expect("read remote-sim's side effects")
            .into_iter()
            .filter(|e| e.key.starts_with(&prefix))
            .filter(|e| matches!(e.decision, Decision::Applied { .. }))
            .map(|e| e.key)
            .collect()
    }

    /// Applied side effects per key: every value must be 1.
    ///
    /// # Errors
    /// When remote-sim cannot be reached.
    pub async fn applied_per_key(&self) -> anyhow::Result<HashMap<String, usize>> {
        let mut counts = HashMap::new();
        for entry in self.side_effects().await? {
            if matches!(entry.decision, Decision::Applied { .. }) {
                *counts.entry(entry.key).or_default() += 1;
            }
        }
        Ok(counts)
    }

    /// Waits until the side effect of idempotency key `key` (`<order
    /// id>:<step>`) is applied: the request reached the remote, so it was
    /// published, which a row the scheduler committed before publishing
    /// does not say.
    ///
    /// # Panics
    /// When it is not within 20 s.
    pub async fn wait_applied(&self, key: &str) {
        crate::wait_until(
            &format!("{key} applied at the remote"),
            std::time::Duration::from_secs(20),
            || async {
                let applied = self.applied_per_key().await.map_err(|e| e.to_string())?;
                applied
                    .contains_key(key)
                    .then_some(())
                    .ok_or_else(|| format!("applied so far: {applied:?}"))
            },
        )
        .await;
    }

    /// Applied side effects per order, as (forward keys, compensation keys),
    /// after asserting that no key was applied twice.
    ///
    /// # Panics
    /// When remote-sim cannot be reached, or a key was applied twice.
    pub async fn effects_by_order(&self) -> HashMap<String, (usize, usize)> {
        let mut by_order: HashMap<String, (usize, usize)> = HashMap::new();
        for (key, count) in self
            .applied_per_key()
            .await
            .expect("read remote-sim's side effects")
        {
            assert_eq!(count, 1, "side effect {key} applied {count} times");
            let order_id = key.split(':').next().unwrap_or_default().to_owned();
            let entry = by_order.entry(order_id).or_default();
            if key.ends_with(":undo") {
                entry.1 += 1;
            } else {
                entry.0 += 1;
            }
        }
        by_order
    }

    /// Applied side effects per order, as [`SimClient::effects_by_order`],
    /// after asserting that every order applied each step of the workflow
    /// once and undid none: what a run leaves where every order was
    /// processed.
    ///
    /// # Panics
    /// When remote-sim cannot be reached, a key was applied twice, or an
    /// order applied other than every step once, or undid something.
    pub async fn assert_every_order_done_once(&self) -> HashMap<String, (usize, usize)> {
        let by_order = self.effects_by_order().await;
        let steps = crate::env::STEPS.len();
        assert!(
            by_order
                .values()
                .all(|&(forward, undo)| forward == steps && undo == 0),
            "{by_order:?}"
        );
        by_order
    }

    /// Calls in flight and the most at once, per `<service>:<merchant>`
    /// (see [`remote_sim::concurrency`]).
    ///
    /// # Errors
    /// When remote-sim cannot be reached.
    pub async fn concurrency(
        &self,
    ) -> anyhow::Result<std::collections::BTreeMap<String, remote_sim::concurrency::KeyCalls>> {
        Ok(self
            .admin(self.http.get(format!("{}/concurrency", self.base)))
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?)
    }

    /// The counters.
    ///
    /// # Errors
    /// When remote-sim cannot be reached.
    pub async fn stats(&self) -> anyhow::Result<Stats> {
        Ok(self
            .admin(self.http.get(format!("{}/stats", self.base)))
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
        self.admin(self.http.put(url))
            .json(&faults)
            .send()
            .await?
            .error_for_status()?;
        Ok(())
    }

    /// Makes `service` answer every call 429 with `Retry-After` for the
    /// next `for_ms` milliseconds (nothing applied).
    ///
    /// # Errors
    /// When remote-sim refuses.
    pub async fn throttle(&self, service: &str, for_ms: u64) -> anyhow::Result<()> {
        self.throttle_path(service, for_ms).await
    }

    /// Makes one merchant's calls to `service` answer 429 with
    /// `Retry-After` for `for_ms` (a merchant's API key rate-limited); the
    /// other merchants' calls go on.
    ///
    /// # Errors
    /// When remote-sim refuses.
    pub async fn throttle_merchant(
        &self,
        service: &str,
        merchant: &str,
        for_ms: u64,
    ) -> anyhow::Result<()> {
        self.throttle_path(&format!("{service}/{merchant}"), for_ms)
            .await
    }

    /// Makes `merchant`'s API of `service` serve `calls` at once, `call_ms`
    /// each, the others waiting there (`calls` 0: no limit).
    ///
    /// # Errors
    /// When remote-sim refuses.
    pub async fn set_merchant_capacity(
        &self,
        service: &str,
        merchant: &str,
        calls: u32,
        call_ms: u64,
    ) -> anyhow::Result<()> {
        self.admin(
            self.http
                .put(format!("{}/admin/capacity/{service}/{merchant}", self.base)),
        )
        .json(&serde_json::json!({ "calls": calls, "call_ms": call_ms }))
        .send()
        .await?
        .error_for_status()?;
        Ok(())
    }

    async fn throttle_path(&self, path: &str, for_ms: u64) -> anyhow::Result<()> {
        self.admin(
            self.http
                .put(format!("{}/admin/throttle/{path}", self.base)),
        )
        .json(&serde_json::json!({ "for_ms": for_ms }))
        .send()
        .await?
        .error_for_status()?;
        Ok(())
    }

    /// Sets the provider behaviour (`{"mode": "strict", "late_answer_rate":
    /// 0.1, "late_answer_ms": 6500, "late_action": "refuse"}`).
    ///
    /// # Errors
    /// When remote-sim refuses.
    pub async fn set_provider(&self, provider: serde_json::Value) -> anyhow::Result<()> {
        self.admin(self.http.put(format!("{}/admin/provider", self.base)))
            .json(&provider)
            .send()
            .await?
            .error_for_status()?;
        Ok(())
    }
}

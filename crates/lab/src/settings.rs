//! The services' settings as the lab passes them: typed values, each
//! turned into its `SAS_<SECTION>__<KEY>` environment variable in one place
//! ([`Setting::var`]), so that a test or the benchmark names a setting, not
//! a string that might be misspelt.

use std::fmt::Display;

/// Declares [`Setting`]: each variant with its doc and its variable, plus
/// `Listen` and `Raw`, which [`Setting::var`] formats by hand.
macro_rules! settings {
    ($( $(#[doc = $doc:expr])+ $variant:ident($ty:ty) => $var:literal, )+) => {
        /// One setting of a service, passed as its environment variable
        /// (each service reads the sections it has and ignores no key: a
        /// setting another service does not know is refused by that one).
        #[derive(Debug, Clone, PartialEq)]
        pub enum Setting {
            $( $(#[doc = $doc])+ $variant($ty), )+
            /// `http.listen` on 127.0.0.1: the port of `/metrics`, `/healthz`
            /// and `/readyz` (and of the console's, the gateway's and
            /// remote-sim's own routes); 0 for any free one.
            Listen(u16),
            /// Any variable, as it is: for a key no variant names (a
            /// misspelt or unknown one a test passes on purpose, or a
            /// one-off), and for `sas-bench --set`.
            Raw(&'static str, String),
        }

        impl Setting {
            /// The environment variable and value that pass this setting.
            pub fn var(&self) -> (&'static str, String) {
                match self {
                    $( Self::$variant(value) => ($var, text(value)), )+
                    Self::Listen(port) => ("SAS_HTTP__LISTEN", format!("127.0.0.1:{port}")),
                    Self::Raw(key, value) => (*key, value.clone()),
                }
            }
        }
    };
}

fn text(value: &impl Display) -> String {
    value.to_string()
}

settings! {
    /// `amqp.url`: the broker to connect to (a proxy in front of it, a
    /// role user's URL).
    AmqpUrl(String) => "SAS_AMQP__URL",
    /// `amqp.prefix`: the prefix of every queue and exchange name.
    AmqpPrefix(String) => "SAS_AMQP__PREFIX",
    /// `amqp.prefetch`: unacknowledged deliveries a consumer may hold.
    AmqpPrefetch(u16) => "SAS_AMQP__PREFETCH",
    /// `amqp.reconnect_base_ms`: the first wait before reconnecting.
    AmqpReconnectBaseMs(u64) => "SAS_AMQP__RECONNECT_BASE_MS",
    /// `amqp.reconnect_max_ms`: the longest wait before reconnecting.
    AmqpReconnectMaxMs(u64) => "SAS_AMQP__RECONNECT_MAX_MS",
    /// `amqp.operation_timeout_ms`: how long one broker operation may take.
    AmqpOperationTimeoutMs(u64) => "SAS_AMQP__OPERATION_TIMEOUT_MS",
    /// `amqp.delivery_limit`: returns of a message before RabbitMQ
    /// dead-letters it (every service must say the same: it is a queue
    /// argument).
    AmqpDeliveryLimit(u32) => "SAS_AMQP__DELIVERY_LIMIT",
    /// `amqp.status_exchange`: whether status messages also go to the
    /// status exchange.
    AmqpStatusExchange(bool) => "SAS_AMQP__STATUS_EXCHANGE",
    /// `amqp.agent_users`: the broker users of the agents, whose replies
    /// are applied (comma-separated).
    AmqpAgentUsers(String) => "SAS_AMQP__AGENT_USERS",
    /// `amqp.service_users`: the broker users of the schedulers and
    /// supervisors, whose dead letters are trusted (comma-separated).
    AmqpServiceUsers(String) => "SAS_AMQP__SERVICE_USERS",
    /// `amqp.delegating_users`: the broker users (the gateway's, the
    /// console's) whose `x-sas-sender` header names the sender.
    AmqpDelegatingUsers(String) => "SAS_AMQP__DELEGATING_USERS",
    /// `scheduler.tenancy_file`: the tenancy file.
    SchedulerTenancyFile(String) => "SAS_SCHEDULER__TENANCY_FILE",
    /// `gateway.tenancy_file`: the tenancy file.
    GatewayTenancyFile(String) => "SAS_GATEWAY__TENANCY_FILE",
    /// `gateway.ops_listen`: where the gateway serves `/metrics`,
    /// `/healthz` and `/readyz` apart from its clients.
    GatewayOpsListen(String) => "SAS_GATEWAY__OPS_LISTEN",
    /// `amqp.nodes`: more broker nodes (`host:port`, comma-separated),
    /// tried in turn after the URL's.
    AmqpNodes(String) => "SAS_AMQP__NODES",
    /// `database.url`: the Postgres database.
    DatabaseUrl(String) => "SAS_DATABASE__URL",
    /// `database.acquire_timeout_ms`: how long to wait for a pooled connection.
    DatabaseAcquireTimeoutMs(u64) => "SAS_DATABASE__ACQUIRE_TIMEOUT_MS",
    /// `database.migrate`: whether the service applies the migrations.
    DatabaseMigrate(bool) => "SAS_DATABASE__MIGRATE",
    /// `log.filter`: which log lines are written (`info`, `warn`, ...).
    LogFilter(String) => "SAS_LOG__FILTER",
    /// `log.format`: `text` or `json`.
    LogFormat(String) => "SAS_LOG__FORMAT",
    /// `log.otlp_endpoint`: where spans are exported over OTLP/HTTP.
    LogOtlpEndpoint(String) => "SAS_LOG__OTLP_ENDPOINT",
    /// `scheduler.id`: the scheduler's name in history and claims.
    SchedulerId(String) => "SAS_SCHEDULER__ID",
    /// `scheduler.workflow_file`: the workflow definition.
    SchedulerWorkflowFile(String) => "SAS_SCHEDULER__WORKFLOW_FILE",
    /// `scheduler.workflow_dir`: a folder of workflow definitions (set
    /// `SchedulerWorkflowFile` empty beside it).
    SchedulerWorkflowDir(String) => "SAS_SCHEDULER__WORKFLOW_DIR",
    /// `scheduler.event_ttl_secs`: how long an event waits for its order.
    SchedulerEventTtlSecs(u64) => "SAS_SCHEDULER__EVENT_TTL_SECS",
    /// `scheduler.claim_interval_ms`: how often due orders are claimed.
    SchedulerClaimIntervalMs(u64) => "SAS_SCHEDULER__CLAIM_INTERVAL_MS",
    /// `scheduler.schedule_interval_ms`: how often due schedules are looked for.
    SchedulerScheduleIntervalMs(u64) => "SAS_SCHEDULER__SCHEDULE_INTERVAL_MS",
    /// `scheduler.claim_batch`: orders claimed in one statement.
    SchedulerClaimBatch(u32) => "SAS_SCHEDULER__CLAIM_BATCH",
    /// `scheduler.admission_initial`: an agent's first admission limit.
    SchedulerAdmissionInitial(u32) => "SAS_SCHEDULER__ADMISSION_INITIAL",
    /// `scheduler.admission_ceiling`: the highest admission limit.
    SchedulerAdmissionCeiling(u32) => "SAS_SCHEDULER__ADMISSION_CEILING",
    /// `scheduler.drain_ms`: how long SIGTERM waits for work in hand.
    SchedulerDrainMs(u64) => "SAS_SCHEDULER__DRAIN_MS",
    /// `scheduler.acknowledged_audit_secs`: how long acknowledged order
    /// ids are remembered, to check after a failover.
    SchedulerAcknowledgedAuditSecs(u64) => "SAS_SCHEDULER__ACKNOWLEDGED_AUDIT_SECS",
    /// `supervisor.id`: the supervisor's name in history.
    SupervisorId(String) => "SAS_SUPERVISOR__ID",
    /// `supervisor.interval_ms`: how often missed deadlines are scanned for.
    SupervisorIntervalMs(u64) => "SAS_SUPERVISOR__INTERVAL_MS",
    /// `supervisor.backoff_base_ms`: the first retry's wait.
    SupervisorBackoffBaseMs(u64) => "SAS_SUPERVISOR__BACKOFF_BASE_MS",
    /// `supervisor.backoff_max_ms`: the longest retry wait.
    SupervisorBackoffMaxMs(u64) => "SAS_SUPERVISOR__BACKOFF_MAX_MS",
    /// `supervisor.max_failures`: missed deadlines of a step before its
    /// order is compensated.
    SupervisorMaxFailures(u32) => "SAS_SUPERVISOR__MAX_FAILURES",
    /// `supervisor.admission_window_ms`: how often admission limits adapt.
    SupervisorAdmissionWindowMs(u64) => "SAS_SUPERVISOR__ADMISSION_WINDOW_MS",
    /// `supervisor.admission_reconcile_ms`: how often admission counters
    /// are recounted from the orders.
    SupervisorAdmissionReconcileMs(u64) => "SAS_SUPERVISOR__ADMISSION_RECONCILE_MS",
    /// `supervisor.key_metrics`: key lines exported with a `key` label.
    SupervisorKeyMetrics(String) => "SAS_SUPERVISOR__KEY_METRICS",
    /// `supervisor.drain_ms`: how long SIGTERM waits for work in hand.
    SupervisorDrainMs(u64) => "SAS_SUPERVISOR__DRAIN_MS",
    /// `deadlines.start_margin_ms`: the part of a step's deadline kept for
    /// its answer.
    DeadlinesStartMarginMs(u64) => "SAS_DEADLINES__START_MARGIN_MS",
    /// `deadlines.grace_ms`: how long after a deadline the supervisor acts.
    DeadlinesGraceMs(u64) => "SAS_DEADLINES__GRACE_MS",
    /// `deadlines.max_clock_skew_ms`: the clock skew allowed between hosts.
    DeadlinesMaxClockSkewMs(u64) => "SAS_DEADLINES__MAX_CLOCK_SKEW_MS",
    /// `agent.name`: the agent queue(s) served (comma-separated).
    AgentName(String) => "SAS_AGENT__NAME",
    /// `agent.id`: the agent process's name.
    AgentId(String) => "SAS_AGENT__ID",
    /// `agent.remote_url`: the remote service called (`{agent}` stands
    /// for the agent's name).
    AgentRemoteUrl(String) => "SAS_AGENT__REMOTE_URL",
    /// `agent.remote_ca_file`: a CA the agent trusts for the remote.
    AgentRemoteCaFile(String) => "SAS_AGENT__REMOTE_CA_FILE",
    /// `agent.remote_auth_header_file`: a file holding the `Authorization`
    /// value sent to the remote.
    AgentRemoteAuthHeaderFile(String) => "SAS_AGENT__REMOTE_AUTH_HEADER_FILE",
    /// `agent.remote_client_cert_file`: the agent's client certificate
    /// for the remote (mutual TLS).
    AgentRemoteClientCertFile(String) => "SAS_AGENT__REMOTE_CLIENT_CERT_FILE",
    /// `agent.remote_client_key_file`: that certificate's key.
    AgentRemoteClientKeyFile(String) => "SAS_AGENT__REMOTE_CLIENT_KEY_FILE",
    /// `agent.remote_headers`: headers added to every call to the remote
    /// (`Name: value` pairs separated by `;` or newlines).
    AgentRemoteHeaders(String) => "SAS_AGENT__REMOTE_HEADERS",
    /// `agent.concurrency`: calls an agent process makes at once.
    AgentConcurrency(u32) => "SAS_AGENT__CONCURRENCY",
    /// `agent.call_timeout_ms`: how long one remote call may take.
    AgentCallTimeoutMs(u64) => "SAS_AGENT__CALL_TIMEOUT_MS",
    /// `agent.retry_base_ms`: the first wait before calling again.
    AgentRetryBaseMs(u64) => "SAS_AGENT__RETRY_BASE_MS",
    /// `agent.retry_max_ms`: the longest wait before calling again.
    AgentRetryMaxMs(u64) => "SAS_AGENT__RETRY_MAX_MS",
    /// `agent.clock_offset_ms`: a skew added to the agent's clock (negative:
    /// behind).
    AgentClockOffsetMs(i64) => "SAS_AGENT__CLOCK_OFFSET_MS",
    /// `agent.drain_ms`: how long SIGTERM waits for calls in flight.
    AgentDrainMs(u64) => "SAS_AGENT__DRAIN_MS",
    /// `circuit.failure_threshold`: failures in a row that open an agent's
    /// circuit.
    CircuitFailureThreshold(u32) => "SAS_CIRCUIT__FAILURE_THRESHOLD",
    /// `circuit.cool_down_ms`: how long an open circuit waits for its probe.
    CircuitCoolDownMs(u64) => "SAS_CIRCUIT__COOL_DOWN_MS",
    /// `retention.finished_secs`: how long finished orders are kept.
    RetentionFinishedSecs(u64) => "SAS_RETENTION__FINISHED_SECS",
    /// `retention.dead_letters_secs`: how long dead letters are kept.
    RetentionDeadLettersSecs(u64) => "SAS_RETENTION__DEAD_LETTERS_SECS",
    /// `retention.interval_ms`: how often old rows are deleted.
    RetentionIntervalMs(u64) => "SAS_RETENTION__INTERVAL_MS",
    /// `retention.batch`: rows deleted in one statement.
    RetentionBatch(u32) => "SAS_RETENTION__BATCH",
    /// `sim.journal_file`: where remote-sim journals its decisions.
    SimJournalFile(String) => "SAS_SIM__JOURNAL_FILE",
    /// `sim.mode`: remote-sim's provider behaviour (`lenient`, `strict`).
    SimMode(String) => "SAS_SIM__MODE",
    /// `sim.late_answer_rate`: the share of calls applied at once but
    /// answered late.
    SimLateAnswerRate(f64) => "SAS_SIM__LATE_ANSWER_RATE",
    /// `sim.late_answer_ms`: how late those are answered.
    SimLateAnswerMs(u64) => "SAS_SIM__LATE_ANSWER_MS",
    /// `sim.seed`: the seed of remote-sim's random faults.
    SimSeed(u64) => "SAS_SIM__SEED",
    /// `sim.faults.latency_ms`: the latency of every call.
    SimFaultsLatencyMs(u64) => "SAS_SIM__FAULTS__LATENCY_MS",
    /// `sim.faults.transient_fault_rate`: the share of calls failing
    /// transiently.
    SimFaultsTransientFaultRate(f64) => "SAS_SIM__FAULTS__TRANSIENT_FAULT_RATE",
    /// `sim.faults.hang_rate`: the share of calls never answered.
    SimFaultsHangRate(f64) => "SAS_SIM__FAULTS__HANG_RATE",
    /// `sim.keys_kept_secs`: how long remote-sim keeps idempotency keys.
    SimKeysKeptSecs(u64) => "SAS_SIM__KEYS_KEPT_SECS",
    /// `sim.record_bodies`: the ledger keeps each call's body (on for
    /// the tests' remote-sim, off for the benchmark's).
    SimRecordBodies(bool) => "SAS_SIM__RECORD_BODIES",
    /// `sim.tls_cert_file`: remote-sim's certificate (serves HTTPS).
    SimTlsCertFile(String) => "SAS_SIM__TLS_CERT_FILE",
    /// `sim.tls_key_file`: that certificate's key.
    SimTlsKeyFile(String) => "SAS_SIM__TLS_KEY_FILE",
    /// `sim.auth_token`: the bearer token remote-sim requires of callers.
    SimAuthToken(String) => "SAS_SIM__AUTH_TOKEN",
    /// `sim.admin_token`: the bearer token of its admin and ledger routes.
    SimAdminToken(String) => "SAS_SIM__ADMIN_TOKEN",
    /// `console.users`: the console's users (`name:role:secret`, comma-separated).
    ConsoleUsers(String) => "SAS_CONSOLE__USERS",
    /// `console.live_interval_ms`: how often live pages are checked.
    ConsoleLiveIntervalMs(u64) => "SAS_CONSOLE__LIVE_INTERVAL_MS",
    /// `console.anonymous`: the role of a request without credentials.
    ConsoleAnonymous(String) => "SAS_CONSOLE__ANONYMOUS",
    /// `console.login_failures_per_minute`: wrong secrets before 429.
    ConsoleLoginFailuresPerMinute(u32) => "SAS_CONSOLE__LOGIN_FAILURES_PER_MINUTE",
    /// `console.request_timeout_ms`: how long a page may take.
    ConsoleRequestTimeoutMs(u64) => "SAS_CONSOLE__REQUEST_TIMEOUT_MS",
    /// `gateway.clients`: the gateway's clients (`name:hash`, comma-separated).
    GatewayClients(String) => "SAS_GATEWAY__CLIENTS",
    /// `gateway.login_failures_per_minute`: wrong secrets before 429.
    GatewayLoginFailuresPerMinute(u32) => "SAS_GATEWAY__LOGIN_FAILURES_PER_MINUTE",
    /// `gateway.max_long_polls_per_client`.
    GatewayMaxLongPollsPerClient(u32) => "SAS_GATEWAY__MAX_LONG_POLLS_PER_CLIENT",
    /// `gateway.publish_timeout_ms`: how long a submission waits for the
    /// broker's confirm.
    GatewayPublishTimeoutMs(u64) => "SAS_GATEWAY__PUBLISH_TIMEOUT_MS",
}

#[cfg(test)]
mod tests {
    use super::Setting;

    #[test]
    fn each_setting_is_the_variable_and_the_text_the_services_read() {
        let var = |setting: Setting| setting.var();
        assert_eq!(
            var(Setting::Listen(9101)),
            ("SAS_HTTP__LISTEN", "127.0.0.1:9101".into())
        );
        assert_eq!(
            var(Setting::AgentConcurrency(4)),
            ("SAS_AGENT__CONCURRENCY", "4".into())
        );
        assert_eq!(
            var(Setting::AgentClockOffsetMs(-2000)),
            ("SAS_AGENT__CLOCK_OFFSET_MS", "-2000".into())
        );
        assert_eq!(
            var(Setting::SimLateAnswerRate(0.3)),
            ("SAS_SIM__LATE_ANSWER_RATE", "0.3".into())
        );
        assert_eq!(
            var(Setting::DatabaseMigrate(false)),
            ("SAS_DATABASE__MIGRATE", "false".into())
        );
        assert_eq!(
            var(Setting::Raw("SAS_SCHEDULR__ID", "x".into())),
            ("SAS_SCHEDULR__ID", "x".into())
        );
    }
}

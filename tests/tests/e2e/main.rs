//! Every end-to-end and fault-injection test, in one binary: one link of
//! the harness instead of one per file, and one process whose tests share
//! the machine's RabbitMQ and Postgres under one rule. Each test holds the
//! servers shared through its `TestEnv` (`TestEnv::new` and the like); the
//! few that restart them, cut connections with `rabbitmqctl`, or load the
//! whole machine hold them alone (`TestEnv::exclusive`, or
//! `ServerGuard::exclusive` without an env), so no other test runs beside
//! them (see `sas_lab::servers`).
//!
//! - [`batching`]: group commit in the state store and coalesced
//!   acknowledgements in the consumers.
//! - [`bench`]: the benchmark's quick mode runs with the tests, so that it
//!   cannot rot.
//! - [`console`]: the operator console's HTTP API against a real state store
//!   and broker.
//! - [`console_browser`]: the console in a real headless browser against a
//!   running system.
//! - [`console_waits`]: the console sends the event an order waits for,
//!   and moves waiting orders to a new workflow version.
//! - [`contract`]: the published contract, as clients in other languages
//!   meet it.
//! - [`deployment`]: the deployment files checked against the code, without
//!   a Docker engine.
//! - [`disruptive`]: faults that hit the shared RabbitMQ and PostgreSQL
//!   servers themselves (restarts, killed connections) and the chaos test.
//! - [`failover`]: reaching whichever broker node is alive, sending again
//!   what a dying connection left unconfirmed, and waiting for a Postgres
//!   primary rather than writing to a standby.
//! - [`gateway`]: the HTTP gateway end to end, against a running system.
//! - [`operations`]: what operators rely on: readiness, metrics, JSON logs
//!   and trace context.
//! - [`orders_flow`]: the end-to-end path: orders published to RabbitMQ run
//!   through scheduler, agents and supervisor processes.
//! - [`overload`]: overload slows orders down and never fails them.
//! - [`remote_contract`]: the contract between agents and real remote
//!   services.
//! - [`resilience`]: every failure the pattern names, injected for real.
//! - [`resume`]: an order stopped in error by its workflow, resumed from
//!   its failed step (or cancelled) by an operator.
//! - [`retention`]: finished orders and old dead letters are deleted, and
//!   everything else kept.
//! - [`sasctl_operate`]: `sasctl` does what the console does.
//! - [`schedules`]: durable schedules fired by three schedulers through a
//!   kill -9 and a freeze, caught up after an outage, managed with sasctl.
//! - [`security`]: secure by default, proven against the local RabbitMQ and
//!   Postgres.
//! - [`state_machine`]: the store's SQL paths held to the pure state
//!   machine.
//! - [`undo_proof`]: no undo before its action may have landed, on every
//!   road to one, and "undone" only with proof, against remotes whose late
//!   actions are real.
//! - [`throttle`]: a remote's `Retry-After` pauses the agent's lane, with
//!   no failure counted.
//! - [`traces`]: OpenTelemetry: one order's spans make one trace across the
//!   services.
//! - [`waits`]: steps that wait for an event or a time, the orders'
//!   mailboxes, and parked orders across kill -9.
//! - [`workflows`]: several workflows in one deployment, open order data
//!   checked by a workflow's schema, and requests shaped by templates.

mod batching;
mod bench;
mod children;
mod console;
mod console_browser;
mod console_waits;
mod contract;
mod deployment;
mod disruptive;
mod failover;
mod gateway;
mod key_limits;
mod operations;
mod orders_flow;
mod overload;
mod remote_contract;
mod resilience;
mod resume;
mod retention;
mod sasctl_operate;
mod schedules;
mod security;
mod state_machine;
mod tenant_quotas;
mod tenant_turns;
mod tenants;
mod throttle;
mod tls;
mod traces;
mod undo_proof;
mod waits;
mod workflows;

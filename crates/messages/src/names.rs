//! Queue, exchange and header names.
//!
//! Every name takes the deployment's prefix, so that several deployments (and
//! parallel test runs) can share one broker without seeing each other's messages.

/// Builds every queue and exchange name of one deployment from its prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueNames {
    prefix: String,
}

impl QueueNames {
    /// Names for the deployment whose names start with `prefix` (may be empty).
    pub fn new(prefix: impl Into<String>) -> Self {
        Self {
            prefix: prefix.into(),
        }
    }

    /// Quorum queue where clients publish [`crate::SubmitOrder`] messages.
    pub fn orders(&self) -> String {
        format!("{}sas.orders", self.prefix)
    }

    /// Durable quorum queue of [`crate::OrderEvent`]s, consumed by the
    /// schedulers; clients publish to the fanout exchange of the same name
    /// bound to it.
    pub fn events(&self) -> String {
        format!("{}sas.events", self.prefix)
    }

    /// Durable quorum queue shared by every scheduler instance, named in the
    /// `reply_to` of every step request: a reply survives the death of the
    /// scheduler that sent the request.
    pub fn scheduler_replies(&self) -> String {
        format!("{}sas.scheduler.replies", self.prefix)
    }

    /// Quorum queue of step requests for the agent named `agent`; its replicas
    /// are competing consumers on it.
    pub fn agent_requests(&self, agent: &str) -> String {
        format!("{}sas.agent.{agent}", self.prefix)
    }

    /// Fanout exchange every queue dead-letters into, and where services publish
    /// messages they reject (with a reason header).
    pub fn dead_letter_exchange(&self) -> String {
        format!("{}sas.dead-letter", self.prefix)
    }

    /// Queue that keeps dead letters for operators to inspect or replay.
    pub fn dead_letters(&self) -> String {
        format!("{}sas.dead-letters", self.prefix)
    }

    /// Queue the supervisor drains to record each dead letter in the state
    /// store and settle the order it belongs to.
    pub fn dead_letter_records(&self) -> String {
        format!("{}sas.dead-letters.record", self.prefix)
    }

    /// Topic exchange that receives every [`crate::OrderStatus`] with the routing
    /// key [`QueueNames::status_routing_key`]; `sasctl watch` binds to it.
    pub fn status_exchange(&self) -> String {
        format!("{}sas.status", self.prefix)
    }

    /// Routing key of one order's status messages on the status exchange.
    pub fn status_routing_key(order_id: &str) -> String {
        format!("order.{order_id}")
    }

    /// How the queues of broker user `user` start: `<prefix>sas.client.<user>.`,
    /// the only queues RabbitMQ lets a client declare and read
    /// (deploy/rabbitmq/setup-users.sh), and, with tenancy configured, the
    /// only `reply_to` its orders may name.
    pub fn client_queue_prefix(&self, user: &str) -> String {
        format!("{}sas.client.{user}.", self.prefix)
    }

    /// Every queue a deployment with these `agents` declares; used by teardown
    /// in tests and by operators cleaning up a prefix.
    pub fn all_queues<'a>(&self, agents: impl IntoIterator<Item = &'a str>) -> Vec<String> {
        let mut queues = vec![
            self.orders(),
            self.events(),
            self.scheduler_replies(),
            self.dead_letters(),
            self.dead_letter_records(),
        ];
        queues.extend(agents.into_iter().map(|agent| self.agent_requests(agent)));
        queues
    }

    /// True when `queue` is one of the deployment's own queues (orders,
    /// replies, an agent's requests, dead letters): a client's `reply_to`
    /// may not name one, or status messages would land where services
    /// read work, replies or dead letters.
    pub fn is_own_queue(&self, queue: &str) -> bool {
        queue == self.orders()
            || queue == self.events()
            || queue == self.scheduler_replies()
            || queue == self.dead_letters()
            || queue == self.dead_letter_records()
            || queue.starts_with(&self.agent_requests(""))
    }

    /// Every exchange a deployment declares.
    pub fn all_exchanges(&self) -> Vec<String> {
        vec![self.dead_letter_exchange(), self.status_exchange()]
    }
}

/// AMQP header names set by this system.
pub mod headers {
    /// Why a message was dead-lettered, in words an operator can act on.
    pub const DEAD_LETTER_REASON: &str = "x-sas-reason";
    /// Queue the dead-lettered message was consumed from.
    pub const DEAD_LETTER_SOURCE_QUEUE: &str = "x-sas-source-queue";
    /// On a dead letter from one of our services: the `user_id` of the
    /// message it copies (the dead letter's own `user_id` is the service's).
    pub const ORIGINAL_USER: &str = "x-sas-original-user";
    /// Order a message belongs to, when known, so a dead letter can settle it.
    pub const ORDER_ID: &str = "x-sas-order-id";
    /// Who a message was sent for, when a service of ours sends it on
    /// someone's behalf: `gateway:<client>` from the gateway,
    /// `console:<user>` from the console. Believed only from the broker
    /// users `amqp.delegating_users` names; anyone else is known by the
    /// `user_id` RabbitMQ validated (`amqp:<user>`).
    pub const SENDER: &str = "x-sas-sender";
    /// W3C trace context, so one order's spans join up across services.
    pub const TRACEPARENT: &str = "traceparent";
    /// On a step reply: milliseconds from the request's `dispatched_at` to
    /// the agent's first call for it (see [`crate::StepReply::queued_ms`]).
    /// A header, not a body field, so that a scheduler that does not know
    /// it, which refuses unknown body fields, ignores it.
    pub const QUEUED_MS: &str = "x-sas-queued-ms";
    /// On a step reply: milliseconds the request's calls waited for the
    /// agent's call slots (see [`crate::StepReply::slot_wait_ms`]).
    pub const SLOT_WAIT_MS: &str = "x-sas-slot-wait-ms";
    /// On a `not_started` step reply to a request limited by key: how long
    /// the remote asked the key to rest, in milliseconds (see
    /// [`crate::StepReply::retry_after_ms`]).
    pub const RETRY_AFTER_MS: &str = "x-sas-retry-after-ms";
    /// On a step reply: the milliseconds the attempt's last call took at
    /// the remote (see [`crate::StepReply::call_ms`]).
    pub const CALL_MS: &str = "x-sas-call-ms";
    /// When one of our services handed the message to the broker, in
    /// microseconds since the Unix epoch by its clock (a 64-bit integer):
    /// the receiver's `sas_queue_wait_seconds`, a line of the benchmark's
    /// latency budget. Informational: nothing decides on it, and between
    /// hosts it is only as good as their clocks' agreement.
    pub const PUBLISHED_AT: &str = "x-sas-published-at";
    /// Reason RabbitMQ itself gives when it dead-letters (e.g. `delivery_limit`).
    pub const FIRST_DEATH_REASON: &str = "x-first-death-reason";
    /// Queue RabbitMQ itself dead-lettered from.
    pub const FIRST_DEATH_QUEUE: &str = "x-first-death-queue";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_carries_the_prefix() {
        let names = QueueNames::new("t42.");
        for name in names
            .all_queues(["inventory"])
            .into_iter()
            .chain(names.all_exchanges())
        {
            assert!(name.starts_with("t42.sas."), "{name}");
        }
        assert_eq!(names.agent_requests("payment"), "t42.sas.agent.payment");
    }

    #[test]
    fn the_deployments_own_queues_are_told_from_a_clients() {
        let names = QueueNames::new("t42.");
        for own in names.all_queues(["payment", "not-in-this-workflow"]) {
            assert!(names.is_own_queue(&own), "{own}");
        }
        for client in [
            "t42.sas.client.alice.1",
            "sas.orders",
            "amq.gen-x",
            "t42.sas.status",
        ] {
            assert!(!names.is_own_queue(client), "{client}");
        }
    }
}

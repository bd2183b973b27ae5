//! Who sent a message to the scheduler, and where such a sender may be
//! answered: the identity comes from RabbitMQ's validated `user_id` (or,
//! from the gateway's and the console's broker users, the identity they
//! vouch for), never from the body; the tenancy file gives its tenant and
//! roles (see [`sas_runtime::tenancy`]).

use sas_broker::consume::Delivery;
use sas_runtime::tenancy::{identity_of, Sender};

use crate::Scheduler;

impl Scheduler {
    /// Who sent `delivery`.
    ///
    /// # Errors
    /// Why the sender cannot be told, when tenancy is configured: no
    /// `user_id`, or a delegating user that vouched for nobody. With open
    /// tenancy such a message is taken as before, from `amqp:anonymous`.
    pub(crate) fn sender_of(&self, delivery: &Delivery) -> Result<Sender, String> {
        let identity = identity_of(
            self.user_id(delivery),
            delivery.header(sas_messages::headers::SENDER).as_deref(),
            &self.settings.amqp.delegating_users,
        );
        match identity {
            Ok(identity) => Ok(self.tenancy.sender(&identity)),
            Err(reason) if self.tenancy.is_configured() => Err(reason),
            Err(_) => Ok(self.tenancy.sender("amqp:anonymous")),
        }
    }

    /// Why `queue` may not receive the status messages of an order (or the
    /// refusal) `delivery` sent, if it may not: with tenancy configured, a
    /// client is answered only on its own queues, `<prefix>sas.client.<its
    /// broker user>.*` (the ones RabbitMQ lets it declare and read), so it
    /// cannot fill another client's queue with genuine statuses. Orders
    /// sent through the gateway name no queue: their clients read over HTTP.
    pub(crate) fn foreign_reply_queue(&self, delivery: &Delivery, queue: &str) -> Option<String> {
        if !self.tenancy.is_configured() {
            return None;
        }
        let user = self.user_id(delivery).unwrap_or_default();
        if self
            .settings
            .amqp
            .delegating_users
            .iter()
            .any(|u| u == user)
        {
            return Some(format!("reply_to {queue:?}: an order sent on a client's behalf (through the gateway) names no reply queue; read its status over HTTP"));
        }
        let own = self.names.client_queue_prefix(user);
        (user.is_empty() || !queue.starts_with(&own)).then(|| {
            format!("reply_to {queue:?} is not one of your queues: name a queue starting {own:?} (your broker user's)")
        })
    }

    /// The `user_id` RabbitMQ validated on `delivery`, if it carries one.
    fn user_id<'d>(&self, delivery: &'d Delivery) -> Option<&'d str> {
        delivery
            .properties
            .user_id()
            .as_ref()
            .map(|user| user.as_str())
    }
}

//! Schedule commands: a change to a durable schedule sent over the broker
//! (a [`ScheduleCommand`], on the events queue with its own `type`) by a
//! client that may not write the state store, the HTTP gateway on its
//! clients' behalf. It acts within the sender's tenant, never another's:
//! the tenant comes from who sent it (see [`crate::senders`]). A create is
//! checked as sasctl checks one, and its order as intake would take it from
//! that tenant (its workflow, attributes and priority). The outcome is
//! recorded with the change, once per command id, for the sender to read
//! (see [`sas_store::schedules::manage`]).

use sas_broker::consume::{Consumed, Delivery};
use sas_messages::{decode, ScheduleCommand, ScheduleVerb};
use sas_store::schedules::manage::{Asked, Command};
use sas_store::schedules::{spec, NewSchedule, ScheduleAction, ScheduleAsk};

use crate::Scheduler;

impl Scheduler {
    /// Handles one schedule command: an unreadable one, or one from a
    /// sender of no tenant, is dead-lettered with the reason; any other is
    /// applied (or refused, with the reason recorded) and acknowledged
    /// after that commit.
    pub async fn handle_schedule_command(&self, delivery: &Delivery) -> Consumed {
        let command: ScheduleCommand =
            match decode(&delivery.body, self.settings.amqp.max_message_bytes) {
                Ok(command) => command,
                Err(error) => {
                    return Consumed::DeadLetter(format!("invalid schedule command: {error}"))
                }
            };
        if let Err(error) = command.validate() {
            return Consumed::DeadLetter(format!("invalid schedule command: {}", error.0));
        }
        let sender = match self.sender_of(delivery) {
            Ok(sender) => sender,
            Err(reason) => {
                return Consumed::DeadLetter(format!("schedule command refused: {reason}"))
            }
        };
        let Some(tenant) = sender.tenant.clone() else {
            return Consumed::DeadLetter(format!(
                "schedule command refused: {} belongs to no tenant, and a command acts within its sender's (operators manage every tenant's schedules with sasctl schedules or the console)",
                sender.identity
            ));
        };
        let checked = match (command.action, &command.definition) {
            (ScheduleVerb::Create, Some(definition)) => Some(
                ScheduleAsk::from_definition(&tenant, &command.schedule, definition)
                    .check()
                    .map_err(|invalid| invalid.0)
                    .and_then(|schedule| self.may_schedule(&schedule).map(|()| schedule)),
            ),
            _ => None,
        };
        let asked = match (command.action, &checked) {
            (_, Some(Ok(schedule))) => Asked::Create(schedule),
            (_, Some(Err(reason))) => Asked::Refused(reason),
            (ScheduleVerb::Pause, None) => Asked::Act(ScheduleAction::Pause),
            (ScheduleVerb::Resume, None) => Asked::Act(ScheduleAction::Resume),
            (ScheduleVerb::Trigger, None) => Asked::Act(ScheduleAction::Trigger),
            (ScheduleVerb::Delete, None) => Asked::Act(ScheduleAction::Delete),
            (ScheduleVerb::Create, None) => unreachable!("validated: a create has a definition"),
        };
        let recorded_command = Command {
            tenant: &tenant,
            command_id: &command.command_id,
            name: &command.schedule,
            action: command.action.as_str(),
            definition: command.definition.as_ref(),
            sent_by: &sender.identity,
        };
        let actor = &sender.identity;
        let applied = match self.apply_command(&recorded_command, asked, actor).await {
            // A change that can never be made (a stored definition that no
            // longer parses, for one): recorded as refused, with why, so
            // that its sender hears of it, rather than retried for ever.
            Some(Err(error)) if !error.is_transient() => {
                let why = format!("the change cannot be made: {error}");
                self.apply_command(&recorded_command, Asked::Refused(&why), actor)
                    .await
            }
            applied => applied,
        };
        match applied {
            None => Consumed::Requeue,
            Some(Ok(recorded)) => {
                metrics::counter!("sas_schedule_commands_total", "outcome" => recorded.outcome.as_str())
                    .increment(1);
                tracing::info!(
                    tenant = %tenant,
                    schedule = %command.schedule,
                    action = command.action.as_str(),
                    command_id = %command.command_id,
                    sender = %sender.identity,
                    outcome = recorded.outcome.as_str(),
                    detail = recorded.detail.as_deref().unwrap_or(""),
                    "schedule command applied"
                );
                Consumed::Ack
            }
            Some(Err(error)) => {
                tracing::error!(schedule = %command.schedule, command_id = %command.command_id, error = %error, "cannot apply a schedule command");
                Consumed::Requeue
            }
        }
    }

    /// Applies `command` as `asked`, again while the store fails for a
    /// while (`None`: shutdown came first).
    async fn apply_command(
        &self,
        command: &Command<'_>,
        asked: Asked<'_>,
        actor: &str,
    ) -> Option<Result<sas_store::schedules::manage::Recorded, sas_store::StoreError>> {
        sas_runtime::retry_transient(
            &self.shutdown,
            "applying a schedule command",
            |e: &sas_store::StoreError| e.is_transient(),
            || self.store.schedules().apply(command, asked, actor),
        )
        .await
    }

    /// Whether `schedule`'s tenant may start its runs' order: a workflow
    /// this deployment runs, with attributes it takes, within the tenant's
    /// workflows and priorities (as each run is checked when it starts).
    ///
    /// # Errors
    /// Why not, for the sender.
    fn may_schedule(&self, schedule: &NewSchedule) -> Result<(), String> {
        let order =
            spec::sample_order(&schedule.order, &schedule.name).map_err(|invalid| invalid.0)?;
        let workflow = self.workflow_of(&order)?;
        self.may_start(&order, &schedule.tenant, &workflow)
    }
}

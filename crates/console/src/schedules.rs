//! What operators do to durable schedules, for the pages and the JSON API
//! alike: create one, and pause, resume, trigger or delete it. The checks
//! and the rows are the state store's ([`sas_store::schedules`]), the ones
//! `sasctl schedules` uses; each change records the user as
//! `console:<user>`.

use sas_store::schedules::{Change, Created, ScheduleAction, ScheduleAsk};

use crate::actions::Done;
use crate::auth::Principal;
use crate::error::Failure;
use crate::Console;

impl From<sas_store::schedules::spec::InvalidSchedule> for Failure {
    fn from(error: sas_store::schedules::spec::InvalidSchedule) -> Self {
        Failure::bad_request(error.to_string())
    }
}

impl Console {
    /// Creates the schedule `ask` describes.
    ///
    /// # Errors
    /// 400 for a definition that does not hold (with what is wrong), 409
    /// for a name taken or a workflow no scheduler runs, 503 when the
    /// store fails.
    pub async fn create_schedule(
        &self,
        ask: &ScheduleAsk,
        who: &Principal,
    ) -> Result<Done, Failure> {
        let schedule = ask.check()?;
        let created = self
            .store
            .schedules()
            .create(&schedule, &who.actor())
            .await?;
        if let Some(why) = created.refusal() {
            return Err(Failure::conflict(format!(
                "schedule {}/{} not created: {why}",
                schedule.tenant, schedule.name
            )));
        }
        metrics::counter!("sas_console_actions_total", "action" => "schedule_create").increment(1);
        tracing::info!(tenant = %schedule.tenant, schedule = %schedule.name, user = %who.name, "schedule created");
        let first = match created {
            Created::Created(Some(at)) => format!("first run {}", crate::pages::when(at)),
            _ => "no run to come".to_owned(),
        };
        Ok(Done {
            message: format!(
                "schedule {}/{} created; {first}",
                schedule.tenant, schedule.name
            ),
        })
    }

    /// Does `action` (`pause`, `resume`, `trigger`, `delete`) to schedule
    /// `name` of `tenant`.
    ///
    /// # Errors
    /// 400 for an unknown action, 404 for no such schedule, 503 when the
    /// store fails.
    pub async fn act_on_schedule(
        &self,
        tenant: &str,
        name: &str,
        action: &str,
        who: &Principal,
    ) -> Result<Done, Failure> {
        let action: ScheduleAction = action.parse()?;
        match self
            .store
            .schedules()
            .act(tenant, name, action, &who.actor())
            .await?
        {
            Change::Done => {
                metrics::counter!("sas_console_actions_total", "action" => format!("schedule_{}", action.as_str())).increment(1);
                tracing::info!(tenant, schedule = name, user = %who.name, action = action.as_str(), "schedule changed");
                Ok(Done {
                    message: format!("schedule {tenant}/{name} {}", action.done()),
                })
            }
            Change::NotFound => Err(Failure::not_found(format!("schedule {tenant}/{name}"))),
        }
    }
}

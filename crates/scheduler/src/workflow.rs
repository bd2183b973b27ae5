//! Workflow definitions: the steps of an order, as data.

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use sas_store::machine::child::MAX_CHILDREN;
use sas_store::machine::concurrency::Rate;
use sas_store::machine::kind::{CallStep, ChildStep, DelayStep, Kind, WaitStep};
use sas_store::machine::park::OnTimeout;
use sas_store::{CallTemplate, Concurrency, NewStep, OnFailure, StepCalls};
use serde::Deserialize;

/// The built-in order workflow: reserve stock, charge payment, create shipment.
/// It is the workspace's `workflows/order.toml`, which docker compose also
/// mounts beside the other workflows.
pub const BUILT_IN: &str = include_str!("../../../workflows/order.toml");

/// A workflow definition file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Workflow {
    /// Name recorded on each order, and what a submission's `workflow` names.
    pub name: String,
    /// Version recorded on each order (1 when the file names none): each
    /// order keeps the plan it started with, so a new version changes only
    /// the orders submitted after it.
    #[serde(default = "first_version")]
    pub version: u32,
    /// What the workflow is for, shown to operators.
    #[serde(default)]
    pub description: String,
    /// A JSON Schema the orders' `attributes` must match (an order without
    /// attributes is checked as `{}`), written inline as a TOML table.
    #[serde(default)]
    pub attributes_schema: Option<serde_json::Value>,
    /// The same, read from a JSON file (relative to the workflow's file).
    #[serde(default)]
    pub attributes_schema_file: Option<String>,
    /// Steps, run in this order and compensated in reverse.
    pub steps: Vec<StepDefinition>,
}

const fn first_version() -> u32 {
    1
}

/// One step of a workflow.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepDefinition {
    /// Unique step name (part of the idempotency key).
    pub name: String,
    /// What the step does: call an agent (the default), wait for an
    /// event, or wait for a time.
    #[serde(default)]
    pub kind: StepType,
    /// Agent whose queue receives the requests (a `call` step).
    #[serde(default)]
    pub agent: String,
    /// Remote operation (a `call` step).
    #[serde(default)]
    pub action: String,
    /// Remote operation that undoes the action, if any (a `call` step).
    #[serde(default)]
    pub compensation: Option<String>,
    /// Deadline of one attempt (a `call` step), or how long a `wait` step
    /// waits for its event, in milliseconds.
    #[serde(default)]
    pub timeout_ms: u64,
    /// How the action is called, when not by default (`POST /<action>`
    /// with `{order, results}`): its method, path and body template.
    #[serde(default)]
    pub request: Option<CallTemplate>,
    /// How the compensation is called, when not by default.
    #[serde(default)]
    pub compensation_request: Option<CallTemplate>,
    /// The event a `wait` step waits for.
    #[serde(default)]
    pub event: Option<String>,
    /// What a `wait` step's timeout means (`compensate` when absent).
    #[serde(default)]
    pub on_timeout: Option<OnTimeout>,
    /// A JSON pointer giving the business key a `wait` step's events may
    /// name instead of the order id (`/results/charge_payment/payment_id`).
    #[serde(default)]
    pub correlation_key: Option<String>,
    /// Who may send a `wait` step's event: `"role:<role>"` (a role of the
    /// tenancy file), `"tenant"` (the order's own tenant's clients),
    /// `"tenant:<name>"`, or one identity (`"gateway:manager"`,
    /// `"amqp:warehouse"`, `"console:ann"`). Empty: whoever may address
    /// the order (its tenant's clients and the operators).
    #[serde(default)]
    pub senders: Vec<String>,
    /// How long a `delay` step waits after the previous step, in milliseconds.
    #[serde(default)]
    pub delay_ms: Option<u64>,
    /// A JSON pointer to a time in the order (RFC 3339) a `delay` step
    /// waits for at least (`/attributes/ship_after`).
    #[serde(default)]
    pub not_before: Option<String>,
    /// The parallel group of a `call` step (`checks`): consecutive steps
    /// with one group name start together, and the order moves on when all
    /// of them completed.
    #[serde(default)]
    pub group: Option<String>,
    /// What a `call` step's failure for good does to its order:
    /// `compensate` (the default) or `stop` (the order ends in `error`,
    /// nothing undone, for an operator to resume from this step).
    #[serde(default)]
    pub on_failure: Option<OnFailure>,
    /// How many of a `call` step's attempts may be in flight at once per
    /// key: `{ key = "/attributes/merchant_id", limit = 5 }` (one line per
    /// value, `default` for an order without one) or a fixed name shared
    /// across workflows (`{ key = "partner_api", limit = 2 }`).
    #[serde(default)]
    pub concurrency: Option<Concurrency>,
    /// How many of a `call` step's attempts may start a second per key:
    /// `{ key = "/attributes/merchant_id", per_second = 20, burst = 40 }`
    /// (the same key as `concurrency`, when both are set).
    #[serde(default)]
    pub rate: Option<Rate>,
    /// The workflow a `child` step starts an order of.
    #[serde(default)]
    pub workflow: Option<String>,
    /// A `child` step's attributes for its child order: a template over
    /// `{order, attributes, results}` as a call's body is
    /// (`{ sku = "${/attributes/sku}" }`); absent, the parent's attributes.
    #[serde(default)]
    pub attributes: Option<serde_json::Value>,
}

/// What a step does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepType {
    /// One request to an agent, which calls its remote service.
    #[default]
    Call,
    /// Waits for an event (`sasctl signal`, the console, any AMQP client).
    Wait,
    /// Waits for a time.
    Delay,
    /// Starts an order of another workflow, waits for it to end and takes
    /// its results; undone by undoing that order as a whole.
    Child,
}

/// The longest a wait step may wait: what a step's deadline column holds
/// (about 24 days).
const LONGEST_WAIT_MS: u64 = i32::MAX as u64;

/// Checks one of a wait step's `senders`.
fn check_sender(sender: &str) -> Result<(), String> {
    let ok = match sender.split_once(':') {
        None => sender == "tenant",
        Some(("role" | "tenant", name)) => sas_messages::ids::is_tenant_name(name),
        Some((kind, name)) => {
            sas_runtime::tenancy::IDENTITY_KINDS.contains(&kind) && !name.is_empty()
        }
    };
    if ok {
        Ok(())
    } else {
        Err(format!("senders holds {sender:?}: name \"tenant\", \"tenant:<name>\", \"role:<role>\" or an identity (amqp:<user>, gateway:<client>, console:<user>)"))
    }
}

/// Letters, digits, `_` or `-`, not empty: what names in queue names and
/// keys may hold.
fn is_plain_name(value: &str) -> bool {
    !value.is_empty()
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

impl StepDefinition {
    /// What the step does, in the store's form.
    fn store_kind(&self) -> Kind {
        match self.kind {
            StepType::Call => Kind::Call(CallStep {
                agent: self.agent.clone(),
                action: self.action.clone(),
                compensation: self.compensation.clone(),
                calls: self.calls().map(Box::new),
            }),
            StepType::Wait => Kind::Wait(WaitStep {
                event: self.event.clone().unwrap_or_default(),
                on_timeout: self.on_timeout.unwrap_or(OnTimeout::Compensate),
                correlation_key: self.correlation_key.clone(),
                senders: self.senders.clone(),
            }),
            StepType::Delay => Kind::Delay(DelayStep {
                delay_ms: self.delay_ms.unwrap_or(0),
                not_before: self.not_before.clone(),
            }),
            // The version is the catalog's (`Catalog::load` pins it).
            StepType::Child => Kind::Child(ChildStep {
                workflow: self.workflow.clone().unwrap_or_default(),
                version: 0,
                attributes: self.attributes.clone(),
                on_failure: self.on_failure.unwrap_or_default(),
            }),
        }
    }

    /// How a call step's requests are shaped and limited, when the file
    /// says more than the default.
    fn calls(&self) -> Option<StepCalls> {
        (self.request.is_some()
            || self.compensation_request.is_some()
            || self.on_failure.is_some_and(|o| !o.is_default())
            || self.concurrency.is_some()
            || self.rate.is_some())
        .then(|| StepCalls {
            action: self.request.clone(),
            compensation: self.compensation_request.clone(),
            on_failure: self.on_failure.unwrap_or_default(),
            concurrency: self.concurrency.clone(),
            rate: self.rate.clone(),
        })
    }

    /// Whether the step sets a field of a call (an agent, its action or
    /// undo, how they are called, limits per key).
    fn calls_an_agent(&self) -> bool {
        !self.agent.is_empty()
            || !self.action.is_empty()
            || self.compensation.is_some()
            || self.request.is_some()
            || self.compensation_request.is_some()
            || self.concurrency.is_some()
            || self.rate.is_some()
    }

    /// Whether the step sets a field of a wait or a delay.
    fn waits(&self) -> bool {
        self.event.is_some()
            || self.on_timeout.is_some()
            || self.correlation_key.is_some()
            || !self.senders.is_empty()
            || self.delay_ms.is_some()
            || self.not_before.is_some()
    }

    /// Checks a step of kind `child` (after the steps `earlier`); that its
    /// workflow exists, and the depth of the chain, are the catalog's.
    fn check_child(&self, earlier: &[StepDefinition]) -> Result<(), String> {
        if self.calls_an_agent() || self.group.is_some() {
            return Err("a child step calls no agent and runs alone: remove agent, action, compensation, request, concurrency, rate and group (its child's own steps call and undo)".into());
        }
        if self.waits() {
            return Err("event, on_timeout, correlation_key, senders, delay_ms and not_before belong to wait and delay steps".into());
        }
        let workflow = self.workflow.as_deref().unwrap_or_default();
        if !sas_messages::order::is_workflow_name(workflow) {
            return Err(format!(
                "workflow must name the workflow the child follows: 1 to 64 letters, digits, '_' or '-' (got {workflow:?})"
            ));
        }
        if !(100..=LONGEST_WAIT_MS).contains(&self.timeout_ms) {
            return Err(format!(
                "timeout_ms (how long the child may run before it is undone) must be between 100 and {LONGEST_WAIT_MS} (got {})",
                self.timeout_ms
            ));
        }
        if let Some(attributes) = &self.attributes {
            if !attributes.is_object() {
                return Err("attributes must be a table (the child's attributes)".into());
            }
            let template = CallTemplate {
                method: None,
                path: None,
                body: Some(attributes.clone()),
            };
            check_template(&template, earlier, None)
                .map_err(|reason| format!("attributes: {reason}"))?;
        }
        Ok(())
    }

    /// The key its `concurrency` or `rate` names (one key for both), if
    /// the step is limited by key.
    fn limit_key(&self) -> Option<&String> {
        self.concurrency
            .as_ref()
            .map(|c| &c.key)
            .or(self.rate.as_ref().map(|r| &r.key))
    }

    /// Checks a call step's `concurrency` and `rate`: each well formed, a
    /// pointer key reading what is known when the step starts, and one key
    /// for both.
    fn check_key_limits(&self, earlier: &[StepDefinition]) -> Result<(), String> {
        let keys = [
            self.concurrency
                .as_ref()
                .map(|c| ("concurrency", c.check(), &c.key, &c.default)),
            self.rate
                .as_ref()
                .map(|r| ("rate", r.check(), &r.key, &r.default)),
        ];
        for (field, checked, key, _) in keys.iter().flatten() {
            checked.clone()?;
            if key.starts_with('/') && !reads_what_is_known(key, earlier, None) {
                return Err(format!(
                    "{field}.key must be a JSON pointer into /order/..., /attributes/... or /results/<an earlier step>/..., or a fixed name (got {key:?})"
                ));
            }
        }
        if let [Some((_, _, a, a_default)), Some((_, _, b, b_default))] = &keys {
            if (a, a_default) != (b, b_default) {
                return Err(
                    "concurrency and rate of one step must name the same key (and default)".into(),
                );
            }
        }
        Ok(())
    }

    /// Checks a step of kind `call`.
    fn check_call(&self, earlier: &[StepDefinition]) -> Result<(), String> {
        for (field, value) in [
            ("agent", self.agent.as_str()),
            ("action", self.action.as_str()),
        ]
        .into_iter()
        .chain(self.compensation.as_deref().map(|c| ("compensation", c)))
        {
            if !is_plain_name(value) {
                return Err(format!(
                    "{field} must be non-empty letters, digits, '_' or '-' (got {value:?})"
                ));
            }
        }
        if !(100..=600_000).contains(&self.timeout_ms) {
            return Err(format!(
                "timeout_ms must be between 100 and 600000 (got {})",
                self.timeout_ms
            ));
        }
        if self.waits() {
            return Err("event, on_timeout, correlation_key, senders, delay_ms and not_before belong to wait and delay steps (set kind)".into());
        }
        if self.compensation.is_none() && self.compensation_request.is_some() {
            return Err("compensation_request needs a compensation".into());
        }
        if self.on_failure == Some(OnFailure::Stop) && self.group.is_some() {
            return Err("on_failure = \"stop\" is for a step that runs alone: a group's members are undone together when one fails".into());
        }
        self.check_key_limits(earlier)?;
        for (field, template, own) in [
            ("request", &self.request, false),
            ("compensation_request", &self.compensation_request, true),
        ] {
            if let Some(template) = template {
                check_template(template, earlier, own.then_some(self.name.as_str()))
                    .map_err(|reason| format!("{field}: {reason}"))?;
            }
        }
        Ok(())
    }

    /// Checks a step of kind `wait` or `delay` (after the steps `earlier`).
    fn check_park(&self, earlier: &[StepDefinition]) -> Result<(), String> {
        if self.calls_an_agent() || self.on_failure.is_some() {
            return Err("a wait or delay step calls no agent: remove agent, action, compensation, request, on_failure, concurrency and rate".into());
        }
        if self.kind == StepType::Wait {
            let event = self.event.as_deref().unwrap_or_default();
            if !is_plain_name(event) || event.len() > 64 {
                return Err(format!(
                    "event must be 1 to 64 letters, digits, '_' or '-' (got {event:?})"
                ));
            }
            if !(100..=LONGEST_WAIT_MS).contains(&self.timeout_ms) {
                return Err(format!(
                    "timeout_ms must be between 100 and {LONGEST_WAIT_MS} for a wait step (got {})",
                    self.timeout_ms
                ));
            }
            if self.delay_ms.is_some() || self.not_before.is_some() {
                return Err("delay_ms and not_before belong to delay steps".into());
            }
            for sender in &self.senders {
                check_sender(sender)?;
            }
            if let Some(pointer) = &self.correlation_key {
                if !reads_what_is_known(pointer, earlier, None) {
                    return Err(format!(
                        "correlation_key must be a JSON pointer into /order/..., /attributes/... or /results/<an earlier step>/... (got {pointer:?})"
                    ));
                }
            }
            return Ok(());
        }
        if self.event.is_some()
            || self.on_timeout.is_some()
            || self.correlation_key.is_some()
            || !self.senders.is_empty()
            || self.timeout_ms != 0
        {
            return Err("event, on_timeout, correlation_key, senders and timeout_ms belong to wait steps; a delay step has delay_ms and not_before".into());
        }
        if self.delay_ms.unwrap_or(0) > LONGEST_WAIT_MS {
            return Err(format!("delay_ms must be at most {LONGEST_WAIT_MS}"));
        }
        match self.not_before.as_deref() {
            None if self.delay_ms.is_none() => Err("a delay step needs delay_ms or not_before".into()),
            Some(pointer) if !(pointer.starts_with("/order/") || pointer.starts_with("/attributes/")) => Err(format!(
                "not_before must be a JSON pointer into the order, /order/... or /attributes/... (got {pointer:?})"
            )),
            _ => Ok(()),
        }
    }

    /// The step's deadline column: an attempt's deadline, a wait's timeout,
    /// a delay's length (at least 1 ms).
    fn timeout(&self) -> Duration {
        let ms = match self.kind {
            StepType::Delay => self.delay_ms.unwrap_or(0).max(1),
            StepType::Call | StepType::Wait | StepType::Child => self.timeout_ms,
        };
        Duration::from_millis(ms)
    }
}

impl Workflow {
    /// Reads `path`, or the built-in workflow when `path` is empty.
    ///
    /// # Errors
    /// When the file cannot be read, does not parse, or breaks a rule of [`Workflow::parse`].
    pub fn load(path: &str) -> anyhow::Result<Self> {
        if path.is_empty() {
            return Self::parse(BUILT_IN).context("the built-in workflow is invalid");
        }
        let text = std::fs::read_to_string(Path::new(path)).with_context(|| {
            format!("cannot read workflow file {path} (scheduler.workflow_file)")
        })?;
        Self::parse(&text).with_context(|| format!("workflow file {path} is invalid"))
    }

    /// Parses and checks a definition: a name usable on the wire, at least
    /// one step; unique step names; for a call, names
    /// usable in queue names and keys, a timeout between 100 ms and 10
    /// minutes (far below RabbitMQ's consumer timeout), request templates
    /// that read only the order, its attributes and earlier steps'
    /// results; for a wait, an event name and a timeout of at most about 24
    /// days; for a delay, a length or a time in the order.
    ///
    /// # Errors
    /// A message naming the offending step and field.
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        let workflow: Self = toml::from_str(text)?;
        anyhow::ensure!(
            sas_messages::order::is_workflow_name(&workflow.name),
            "name must be 1 to 64 letters, digits, '_' or '-' (got {:?})",
            workflow.name
        );
        anyhow::ensure!(
            (1..=i32::MAX as u32).contains(&workflow.version),
            "version must be at least 1"
        );
        anyhow::ensure!(
            !(workflow.attributes_schema.is_some() && workflow.attributes_schema_file.is_some()),
            "set attributes_schema or attributes_schema_file, not both"
        );
        anyhow::ensure!(
            !workflow.steps.is_empty(),
            "a workflow needs at least one step"
        );
        let mut seen = HashSet::new();
        for (index, step) in workflow.steps.iter().enumerate() {
            anyhow::ensure!(
                is_plain_name(&step.name),
                "steps[{index}].name must be non-empty letters, digits, '_' or '-' (got {:?})",
                step.name
            );
            anyhow::ensure!(
                seen.insert(&step.name),
                "steps[{index}].name {:?} is used twice",
                step.name
            );
            // A member's templates read the steps before its group: the
            // other members run beside it, their results not there yet.
            let before = group_start(&workflow.steps, index);
            let checked = match step.kind {
                StepType::Call => step.check_call(&workflow.steps[..before]),
                StepType::Wait | StepType::Delay => step.check_park(&workflow.steps[..before]),
                StepType::Child => step.check_child(&workflow.steps[..before]),
            };
            checked
                .map_err(|reason| anyhow::anyhow!("steps[{index}] ({}): {reason}", step.name))?;
        }
        check_groups(&workflow.steps)?;
        let children = workflow.children().count();
        anyhow::ensure!(
            children <= MAX_CHILDREN,
            "a workflow may have at most {MAX_CHILDREN} child steps (it has {children})"
        );
        Ok(workflow)
    }

    /// The workflows its child steps start, in order, with the steps' names.
    pub fn children(&self) -> impl Iterator<Item = (&str, &str)> {
        self.steps
            .iter()
            .filter(|s| s.kind == StepType::Child)
            .map(|s| (s.name.as_str(), s.workflow.as_deref().unwrap_or_default()))
    }

    /// The agents the workflow sends requests to, each once.
    pub fn agents(&self) -> Vec<&str> {
        let mut agents: Vec<&str> = Vec::new();
        for step in self.steps.iter().filter(|s| s.kind == StepType::Call) {
            if !agents.contains(&step.agent.as_str()) {
                agents.push(&step.agent);
            }
        }
        agents
    }

    /// The steps in the form the store copies onto each order.
    pub fn new_steps(&self) -> Vec<NewStep> {
        self.steps
            .iter()
            .map(|step| NewStep {
                name: step.name.clone(),
                kind: step.store_kind(),
                timeout: step.timeout(),
                group: step.group.clone(),
            })
            .collect()
    }
}

/// Where the group of step `index` starts (`index` for a step alone).
fn group_start(steps: &[StepDefinition], index: usize) -> usize {
    let Some(group) = steps[index].group.as_deref() else {
        return index;
    };
    steps[..index]
        .iter()
        .rposition(|s| s.group.as_deref() != Some(group))
        .map_or(0, |i| i + 1)
}

/// Checks the parallel groups: names usable in the history, call steps
/// only, each group's steps next to each other, at least two of them, and
/// not at the start (intake starts the first step alone).
fn check_groups(steps: &[StepDefinition]) -> anyhow::Result<()> {
    let mut seen: HashSet<&str> = HashSet::new();
    let mut index = 0;
    for run in steps.chunk_by(|a, b| a.group == b.group) {
        let first = index;
        index += run.len();
        let Some(group) = run[0].group.as_deref() else {
            continue;
        };
        let at = format!("steps[{first}] ({})", run[0].name);
        anyhow::ensure!(
            is_plain_name(group) && group.len() <= 64,
            "{at}: group must be 1 to 64 letters, digits, '_' or '-' (got {group:?})"
        );
        anyhow::ensure!(
            seen.insert(group),
            "{at}: the steps of group {group:?} must be next to each other"
        );
        anyhow::ensure!(
            run.len() >= 2,
            "{at}: group {group:?} has one step; a group runs two or more steps side by side"
        );
        anyhow::ensure!(
            first > 0,
            "{at}: the first step runs alone (intake starts it); put the group after it"
        );
        if let Some(k) = run.iter().position(|s| s.kind != StepType::Call) {
            anyhow::bail!(
                "steps[{}] ({}): only call steps run in a group (a wait or delay step waits alone)",
                first + k,
                run[k].name
            );
        }
        check_group_keys(run, &at)?;
    }
    Ok(())
}

/// A group starts whole or waits: its members that may meet in one key
/// line (one fixed name, or pointer keys of one agent) must fit under
/// that key's limit and burst at once, or the group would wait for ever.
fn check_group_keys(run: &[StepDefinition], at: &str) -> anyhow::Result<()> {
    for step in run {
        let Some(key) = step.limit_key() else {
            continue;
        };
        let same_line = |other: &&StepDefinition| {
            let other_key = other.limit_key();
            // Two pointer keys of one agent may give one line (equal
            // values, or both the default): counted together.
            match other_key {
                Some(other_key) if key.starts_with('/') => {
                    other_key.starts_with('/') && other.agent == step.agent
                }
                other_key => other_key == Some(key),
            }
        };
        let members = run.iter().filter(same_line).count();
        // A learnt limit may go down to one: the members could then never
        // start together.
        anyhow::ensure!(
            members < 2 || !step.concurrency.as_ref().is_some_and(|c| c.adaptive),
            "{at}: {members} members of the group share key {key:?}, whose adaptive limit may learn to let fewer in at once: make it not adaptive, or give each member its own key"
        );
        let room = [
            step.concurrency.as_ref().map(|c| c.limit),
            step.rate.as_ref().map(|r| r.burst),
        ]
        .into_iter()
        .flatten()
        .min()
        .unwrap_or(i32::MAX);
        anyhow::ensure!(
            i32::try_from(members).unwrap_or(i32::MAX) <= room,
            "{at}: {members} members of the group share key {key:?}, whose limit (or burst) of {room} cannot start them together"
        );
    }
    Ok(())
}

/// Checks a step's request template: its method and path, and that each
/// placeholder reads the order (`/order/...`), its attributes
/// (`/attributes/...`) or the result of an earlier step (`/results/<step>/...`;
/// a compensation may also read its own step's, named `own`).
fn check_template(
    template: &CallTemplate,
    earlier: &[StepDefinition],
    own: Option<&str>,
) -> Result<(), String> {
    template.check()?;
    for pointer in template.pointers()? {
        if !reads_what_is_known(&pointer, earlier, own) {
            return Err(format!(
                "placeholder ${{{pointer}}} must read /order/..., /attributes/... or /results/<an earlier step>/..."
            ));
        }
    }
    Ok(())
}

/// Whether JSON pointer `pointer` reads what a step knows when it runs:
/// the order (`/order/...`), its attributes (`/attributes/...`) or the
/// result of an earlier step (`/results/<step>/...`; a compensation also
/// its own step's, named `own`).
fn reads_what_is_known(pointer: &str, earlier: &[StepDefinition], own: Option<&str>) -> bool {
    let mut parts = pointer.split('/').skip(1);
    match parts.next() {
        Some("order" | "attributes") => true,
        Some("results") => parts
            .next()
            .is_some_and(|name| own == Some(name) || earlier.iter().any(|step| step.name == name)),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_built_in_workflow_reserves_charges_and_ships() {
        let workflow = Workflow::load("").unwrap();
        let names: Vec<_> = workflow.steps.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            ["reserve_stock", "charge_payment", "create_shipment"]
        );
        assert_eq!(workflow.agents(), ["inventory", "payment", "shipping"]);
    }

    #[test]
    fn a_duplicate_step_name_is_refused() {
        let text = r#"
            name = "w"
            [[steps]]
            name = "a"
            agent = "x"
            action = "do"
            timeout_ms = 1000
            [[steps]]
            name = "a"
            agent = "y"
            action = "do"
            timeout_ms = 1000
        "#;
        let error = Workflow::parse(text).unwrap_err().to_string();
        assert!(error.contains("used twice"), "{error}");
    }

    #[test]
    fn a_timeout_beyond_ten_minutes_is_refused_naming_the_step() {
        let text = r#"
            name = "w"
            [[steps]]
            name = "a"
            agent = "x"
            action = "do"
            timeout_ms = 3600000
        "#;
        let error = Workflow::parse(text).unwrap_err().to_string();
        assert!(error.contains("steps[0] (a): timeout_ms"), "{error}");
    }

    #[test]
    fn wait_and_delay_steps_are_checked() {
        let call = "[[steps]]\nname = \"a\"\nagent = \"x\"\naction = \"do\"\ntimeout_ms = 1000\n";
        let wait = "[[steps]]\nname = \"w\"\nkind = \"wait\"\nevent = \"approved\"\ntimeout_ms = 86400000\n";
        let ok = Workflow::parse(&format!("name = \"x\"\n{call}{wait}")).unwrap();
        // A wait may come first: intake parks the order at once.
        Workflow::parse(&format!("name = \"x\"\n{wait}{call}")).unwrap();
        assert!(matches!(
            ok.new_steps()[1].kind,
            Kind::Wait(WaitStep {
                on_timeout: OnTimeout::Compensate,
                ..
            })
        ));
        let gated = Workflow::parse(&format!(
            "name = \"x\"\n{call}{wait}senders = [\"role:approver\", \"tenant\", \"gateway:manager\"]\n"
        ))
        .unwrap();
        assert_eq!(
            gated.new_steps()[1]
                .kind
                .waits_for("approved")
                .unwrap()
                .senders,
            ["role:approver", "tenant", "gateway:manager"]
        );
        for (text, expected) in [
            ("name = \"x\"\nsteps = []\n".to_owned(), "at least one step"),
            (format!("name = \"x\"\n{call}{wait}agent = \"x\"\n"), "calls no agent"),
            (
                format!("name = \"x\"\n{call}[[steps]]\nname = \"d\"\nkind = \"delay\"\n"),
                "needs delay_ms or not_before",
            ),
            (
                format!("name = \"x\"\n{call}[[steps]]\nname = \"d\"\nkind = \"delay\"\nnot_before = \"/results/a\"\n"),
                "pointer into the order",
            ),
            (format!("name = \"x\"\n{call}event = \"approved\"\n"), "belong to wait and delay steps"),
            (format!("name = \"x\"\n{call}senders = [\"tenant\"]\n"), "belong to wait and delay steps"),
            (format!("name = \"x\"\n{call}{wait}senders = [\"approver\"]\n"), "senders holds \"approver\""),
            (format!("name = \"x\"\n{call}{wait}senders = [\"role:Boss\"]\n"), "senders holds"),
        ] {
            let error = format!("{:#}", Workflow::parse(&text).unwrap_err());
            assert!(error.contains(expected), "{expected}: {error}");
        }
    }

    #[test]
    fn parallel_groups_are_checked_and_their_members_read_no_sibling_s_result() {
        let call = |name: &str, group: &str| {
            format!("[[steps]]\nname = \"{name}\"\nagent = \"x\"\naction = \"do\"\ntimeout_ms = 1000\n{group}")
        };
        let g = "group = \"g\"\n";
        let ok = Workflow::parse(&format!(
            "name = \"x\"\n{}{}{}{}",
            call("a", ""),
            call("b", g),
            call("c", g),
            call("d", "")
        ))
        .unwrap();
        let groups: Vec<Option<&str>> = ok
            .new_steps()
            .iter()
            .map(|s| s.group.as_deref())
            .map(|g| g.map(|_| "g"))
            .collect();
        assert_eq!(groups, [None, Some("g"), Some("g"), None]);
        let wait = "[[steps]]\nname = \"w\"\nkind = \"wait\"\nevent = \"ok\"\ntimeout_ms = 1000\ngroup = \"g\"\n";
        let reads_sibling = format!(
            "{}request = {{ body = {{ id = \"${{/results/b/id}}\" }} }}\n",
            call("c", g)
        );
        for (text, expected) in [
            (
                format!("{}{}", call("a", g), call("b", g)),
                "steps[0] (a): the first step runs alone",
            ),
            (format!("{}{}", call("a", ""), call("b", g)), "has one step"),
            (
                format!(
                    "{}{}{}{}{}{}",
                    call("a", ""),
                    call("b", g),
                    call("c", g),
                    call("d", ""),
                    call("e", g),
                    call("f", g)
                ),
                "steps[4] (e): the steps of group \"g\" must be next to each other",
            ),
            (
                format!("{}{}{wait}", call("a", ""), call("b", g)),
                "steps[2] (w): only call steps run in a group",
            ),
            (
                format!("{}{}{}", call("a", ""), call("b", g), reads_sibling),
                "steps[2] (c): request",
            ),
            (
                format!(
                    "{}{}{}",
                    call("a", ""),
                    call("b", "group = \"a b\"\n"),
                    call("c", "group = \"a b\"\n")
                ),
                "group must be",
            ),
        ] {
            let error = Workflow::parse(&format!("name = \"x\"\n{text}"))
                .unwrap_err()
                .to_string();
            assert!(error.contains(expected), "{expected:?} not in {error}");
        }
    }

    #[test]
    fn a_call_s_concurrency_limit_is_kept_with_its_plan_and_checked() {
        let charge = |limit: &str| {
            format!("[[steps]]\nname = \"charge\"\nagent = \"payment\"\naction = \"charge\"\ntimeout_ms = 1000\nconcurrency = {limit}\n")
        };
        let ok = Workflow::parse(&format!(
            "name = \"x\"\n{}",
            charge("{ key = \"/attributes/merchant_id\", limit = 5, default = \"unknown\" }")
        ))
        .unwrap();
        let limit = ok.new_steps()[0]
            .kind
            .calls()
            .and_then(|calls| calls.concurrency.clone())
            .expect("the limit is kept with the plan");
        assert_eq!(
            (limit.key.as_str(), limit.limit, limit.default.as_deref()),
            ("/attributes/merchant_id", 5, Some("unknown"))
        );
        assert!(!limit.adaptive, "a limit is fixed unless declared adaptive");
        let adaptive = Workflow::parse(&format!(
            "name = \"x\"\n{}",
            charge("{ key = \"/attributes/merchant_id\", limit = 20, adaptive = true }")
        ))
        .unwrap();
        assert!(adaptive.new_steps()[0]
            .kind
            .calls()
            .and_then(|calls| calls.concurrency.as_ref())
            .is_some_and(|c| c.adaptive && c.limit == 20));
        let rated = Workflow::parse(&format!(
            "name = \"x\"\n{}rate = {{ key = \"/attributes/merchant_id\", per_second = 20, burst = 40, default = \"unknown\" }}\n",
            charge("{ key = \"/attributes/merchant_id\", limit = 5, default = \"unknown\" }")
        ))
        .unwrap();
        let rate = rated.new_steps()[0]
            .kind
            .calls()
            .and_then(|calls| calls.rate.clone())
            .expect("the rate is kept with the plan");
        assert_eq!((rate.per_second, rate.burst), (20, 40));
        let wait = "[[steps]]\nname = \"w\"\nkind = \"wait\"\nevent = \"ok\"\ntimeout_ms = 1000\n";
        for (text, expected) in [
            (
                charge("{ key = \"/attributes/merchant_id\", limit = 0 }"),
                "steps[0] (charge): concurrency.limit must be between 1 and 10000",
            ),
            (
                charge("{ key = \"/results/charge/id\", limit = 2 }"),
                "concurrency.key must be a JSON pointer into",
            ),
            (
                charge("{ key = \"partner api\", limit = 2 }"),
                "concurrency.key must be a JSON pointer (/attributes/merchant_id) or a name",
            ),
            (
                charge("{ key = \"partner\", limit = 2, default = \"x\" }"),
                "concurrency.default is for a key read from the order",
            ),
            (
                charge("{ key = \"partner\", limit = 2, scope = \"x\" }"),
                "unknown field `scope`",
            ),
            (
                format!("{wait}concurrency = {{ key = \"partner\", limit = 2 }}\n"),
                "a wait or delay step calls no agent",
            ),
            (
                charge("{ key = \"partner\", limit = 2 }\nrate = { key = \"partner\", per_second = 0 }"),
                "rate.per_second must be between 1 and 10000",
            ),
            (
                charge("{ key = \"partner\", limit = 2 }\nrate = { key = \"other\", per_second = 5 }"),
                "concurrency and rate of one step must name the same key",
            ),
            (
                format!(
                    "{}{}{}",
                    charge("{ key = \"first\", limit = 9 }"),
                    charge("{ key = \"partner\", limit = 1 }").replace("\"charge\"", "\"a\"") + "group = \"g\"\n",
                    charge("{ key = \"partner\", limit = 1 }").replace("\"charge\"", "\"b\"") + "group = \"g\"\n",
                ),
                "2 members of the group share key \"partner\", whose limit (or burst) of 1",
            ),
            (
                format!(
                    "{}{}{}",
                    charge("{ key = \"first\", limit = 9 }"),
                    charge("{ key = \"partner\", limit = 4, adaptive = true }").replace("\"charge\"", "\"a\"") + "group = \"g\"\n",
                    charge("{ key = \"partner\", limit = 4, adaptive = true }").replace("\"charge\"", "\"b\"") + "group = \"g\"\n",
                ),
                "2 members of the group share key \"partner\", whose adaptive limit may learn",
            ),
        ] {
            let error = Workflow::parse(&format!("name = \"x\"\n{text}"))
                .unwrap_err()
                .to_string();
            assert!(error.contains(expected), "{expected:?} not in {error}");
        }
    }

    #[test]
    fn a_wait_s_correlation_key_reads_only_what_is_known_when_it_waits() {
        let call =
            "[[steps]]\nname = \"charge\"\nagent = \"x\"\naction = \"do\"\ntimeout_ms = 1000\n";
        let wait = |key: &str| {
            format!("[[steps]]\nname = \"w\"\nkind = \"wait\"\nevent = \"ok\"\ntimeout_ms = 1000\ncorrelation_key = \"{key}\"\n")
        };
        let ok = Workflow::parse(&format!(
            "name = \"x\"\n{call}{}",
            wait("/results/charge/payment_id")
        ))
        .unwrap();
        assert!(matches!(
            &ok.new_steps()[1].kind,
            Kind::Wait(WaitStep { correlation_key: Some(key), .. }) if key == "/results/charge/payment_id"
        ));
        for (text, expected) in [
            (
                format!("name = \"x\"\n{call}{}", wait("/results/later/id")),
                "steps[1] (w): correlation_key must be a JSON pointer",
            ),
            (
                format!("name = \"x\"\n{call}{}", wait("invoice")),
                "correlation_key must be a JSON pointer",
            ),
            (
                format!("name = \"x\"\n{call}correlation_key = \"/order/order_id\"\n"),
                "steps[0] (charge): event, on_timeout, correlation_key",
            ),
        ] {
            let error = Workflow::parse(&text).unwrap_err().to_string();
            assert!(error.contains(expected), "{expected:?} not in {error}");
        }
    }

    #[test]
    fn an_agent_name_with_a_space_is_refused() {
        let text = r#"
            name = "w"
            [[steps]]
            name = "a"
            agent = "x y"
            action = "do"
            timeout_ms = 1000
        "#;
        assert!(Workflow::parse(text).is_err());
    }
}

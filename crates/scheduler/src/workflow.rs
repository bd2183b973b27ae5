//! Workflow definitions: the steps of an order, as data.

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use sas_store::NewStep;
use serde::Deserialize;

/// The built-in order workflow: reserve stock, charge payment, create shipment.
pub const BUILT_IN: &str = include_str!("../workflow.toml");

/// A workflow definition file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Workflow {
    /// Name recorded on each order.
    pub name: String,
    /// Steps, run in this order and compensated in reverse.
    pub steps: Vec<StepDefinition>,
}

/// One step of a workflow.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepDefinition {
    /// Unique step name (part of the idempotency key).
    pub name: String,
    /// Agent whose queue receives the requests.
    pub agent: String,
    /// Remote operation.
    pub action: String,
    /// Remote operation that undoes the action, if any.
    #[serde(default)]
    pub compensation: Option<String>,
    /// Deadline of one attempt, in milliseconds.
    pub timeout_ms: u64,
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

    /// Parses and checks a definition: at least one step, unique names,
    /// names usable in queue names and keys, timeouts between 100 ms and
    /// 10 minutes (far below RabbitMQ's consumer timeout).
    ///
    /// # Errors
    /// A message naming the offending step and field.
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        let workflow: Self = toml::from_str(text)?;
        anyhow::ensure!(
            !workflow.steps.is_empty(),
            "a workflow needs at least one step"
        );
        let mut seen = HashSet::new();
        for (index, step) in workflow.steps.iter().enumerate() {
            for (field, value) in [
                ("name", step.name.as_str()),
                ("agent", step.agent.as_str()),
                ("action", step.action.as_str()),
            ]
            .into_iter()
            .chain(step.compensation.as_deref().map(|c| ("compensation", c)))
            {
                anyhow::ensure!(
                    !value.is_empty()
                        && value
                            .bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-'),
                    "steps[{index}].{field} must be non-empty letters, digits, '_' or '-' (got {value:?})"
                );
            }
            anyhow::ensure!(
                seen.insert(&step.name),
                "steps[{index}].name {:?} is used twice",
                step.name
            );
            anyhow::ensure!(
                (100..=600_000).contains(&step.timeout_ms),
                "steps[{index}].timeout_ms must be between 100 and 600000 (got {})",
                step.timeout_ms
            );
        }
        Ok(workflow)
    }

    /// The agents the workflow sends requests to, each once.
    pub fn agents(&self) -> Vec<&str> {
        let mut agents: Vec<&str> = Vec::new();
        for step in &self.steps {
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
                agent: step.agent.clone(),
                action: step.action.clone(),
                compensation: step.compensation.clone(),
                timeout: Duration::from_millis(step.timeout_ms),
            })
            .collect()
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
        assert!(error.contains("steps[0].timeout_ms"), "{error}");
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

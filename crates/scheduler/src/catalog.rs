//! The workflows a scheduler runs: every definition in its folder
//! (`scheduler.workflow_dir`), or its one file (`scheduler.workflow_file`),
//! or the built-in order workflow; each with its steps as the store copies
//! them onto an order, and its attributes' JSON Schema compiled once.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use sas_messages::SubmitOrder;
use sas_store::machine::child::MAX_DEPTH;
use sas_store::machine::kind::{ChildStep, Kind};
use sas_store::{NewStep, Plan};

use crate::workflow::Workflow;

/// One workflow, ready for intake.
pub struct Entry {
    /// The definition as read.
    pub workflow: Workflow,
    /// Its steps in the form the store copies onto each order.
    pub steps: Vec<NewStep>,
    /// What the orders' attributes must match, if the workflow says.
    schema: Option<jsonschema::Validator>,
    /// The same schema as written, registered with the plan.
    schema_json: Option<serde_json::Value>,
}

impl Entry {
    fn new(workflow: Workflow, base: &Path) -> anyhow::Result<Self> {
        let schema = match (
            &workflow.attributes_schema,
            &workflow.attributes_schema_file,
        ) {
            (Some(schema), _) => Some(schema.clone()),
            (None, Some(file)) => {
                let path = base.join(file);
                let text = std::fs::read_to_string(&path).with_context(|| {
                    format!("cannot read attributes_schema_file {}", path.display())
                })?;
                Some(serde_json::from_str(&text).with_context(|| {
                    format!("attributes_schema_file {} is not JSON", path.display())
                })?)
            }
            (None, None) => None,
        };
        let schema_json = schema.clone();
        let schema = schema
            .map(|schema| {
                jsonschema::validator_for(&schema).map_err(|error| {
                    anyhow::anyhow!("attributes_schema is not a usable JSON Schema: {error}")
                })
            })
            .transpose()?;
        Ok(Self {
            steps: workflow.new_steps(),
            workflow,
            schema,
            schema_json,
        })
    }

    /// The plan an order of this workflow starts with.
    pub fn plan(&self) -> Plan<'_> {
        Plan::new(
            &self.workflow.name,
            i32::try_from(self.workflow.version).unwrap_or(i32::MAX),
            &self.steps,
        )
        .with_schema(self.schema_json.as_ref())
    }

    /// Why `order`'s attributes do not match the workflow's schema, naming
    /// the path of the first error, if they do not.
    fn attributes_refusal(&self, order: &SubmitOrder) -> Option<String> {
        let schema = self.schema.as_ref()?;
        let empty = serde_json::Map::new();
        let attributes = serde_json::Value::Object(order.attributes.clone().unwrap_or(empty));
        sas_messages::attributes::refusal(
            schema,
            &self.workflow.name,
            self.workflow.version,
            &attributes,
        )
    }
}

/// Every workflow a scheduler runs, by name.
pub struct Catalog {
    entries: BTreeMap<String, Entry>,
}

impl Catalog {
    /// Reads the workflows: every `*.toml` of `dir` when it is set, else
    /// `file`, else the built-in order workflow.
    ///
    /// # Errors
    /// Both settings given, an unreadable folder or file, a folder without
    /// a definition, two definitions of one name, or an invalid definition
    /// (naming its file).
    pub fn load(file: &str, dir: &str) -> anyhow::Result<Self> {
        anyhow::ensure!(
            file.is_empty() || dir.is_empty(),
            "set scheduler.workflow_file or scheduler.workflow_dir, not both"
        );
        let mut entries = BTreeMap::new();
        if dir.is_empty() {
            let workflow = Workflow::load(file)?;
            let base = Path::new(file).parent().unwrap_or(Path::new("."));
            let entry = Entry::new(workflow, base)
                .with_context(|| format!("workflow file {file:?} is invalid"))?;
            entries.insert(entry.workflow.name.clone(), entry);
            return Self::linked(entries);
        }
        let mut seen: BTreeMap<String, PathBuf> = BTreeMap::new();
        for path in definitions(dir)? {
            let shown = path.display().to_string();
            let workflow = Workflow::load(&shown)?;
            let entry = Entry::new(workflow, Path::new(dir))
                .with_context(|| format!("workflow file {shown} is invalid"))?;
            let name = entry.workflow.name.clone();
            if let Some(first) = seen.insert(name.clone(), path) {
                anyhow::bail!(
                    "workflow {name:?} is defined twice, in {} and {shown}: keep one file per workflow (its version says which plan new orders get)",
                    first.display()
                );
            }
            entries.insert(name, entry);
        }
        Self::linked(entries)
    }

    /// The catalog of `entries` with each child step's workflow checked
    /// and its version pinned (the version new children get), refusing a
    /// child step whose workflow is not here, a workflow that starts
    /// itself (directly or through others), and a chain of children deeper
    /// than [`MAX_DEPTH`].
    ///
    /// # Errors
    /// The offending workflow, step and chain.
    fn linked(mut entries: BTreeMap<String, Entry>) -> anyhow::Result<Self> {
        let versions: BTreeMap<String, i32> = entries
            .iter()
            .map(|(name, entry)| {
                let version = i32::try_from(entry.workflow.version).unwrap_or(i32::MAX);
                (name.clone(), version)
            })
            .collect();
        for (name, entry) in &mut entries {
            for step in &mut entry.steps {
                if let Kind::Child(ChildStep {
                    workflow, version, ..
                }) = &mut step.kind
                {
                    *version = *versions.get(workflow.as_str()).ok_or_else(|| {
                        anyhow::anyhow!(
                            "workflow {name:?}, step {:?}: its child workflow {workflow:?} is not one this scheduler runs ({}): add its file to the folder",
                            step.name,
                            versions.keys().map(String::as_str).collect::<Vec<_>>().join(", ")
                        )
                    })?;
                }
            }
        }
        let catalog = Self { entries };
        for name in catalog.entries.keys() {
            catalog.check_chain(&mut vec![name.as_str()])?;
        }
        Ok(catalog)
    }

    /// Follows the child steps from the last workflow of `chain`: none may
    /// start a workflow already in the chain, and the chain may not grow
    /// past [`MAX_DEPTH`] children.
    fn check_chain<'a>(&'a self, chain: &mut Vec<&'a str>) -> anyhow::Result<()> {
        let Some(entry) = chain.last().and_then(|name| self.entries.get(*name)) else {
            return Ok(());
        };
        for (step, child) in entry.workflow.children() {
            if chain.contains(&child) {
                anyhow::bail!(
                    "workflow {:?}, step {step:?}: starts {child:?}, which would start itself ({} -> {child}): a workflow may not start itself, directly or through others",
                    chain.last().copied().unwrap_or_default(),
                    chain.join(" -> ")
                );
            }
            if chain.len() > MAX_DEPTH {
                anyhow::bail!(
                    "workflow {:?}, step {step:?}: children {} deep ({} -> {child}); at most {MAX_DEPTH} are allowed",
                    chain.last().copied().unwrap_or_default(),
                    chain.len(),
                    chain.join(" -> ")
                );
            }
            chain.push(child);
            self.check_chain(chain)?;
            chain.pop();
        }
        Ok(())
    }

    /// The workflow named `name`, if the scheduler runs it.
    pub fn get(&self, name: &str) -> Option<&Entry> {
        self.entries.get(name)
    }

    /// Every workflow, by name.
    pub fn entries(&self) -> impl Iterator<Item = &Entry> {
        self.entries.values()
    }

    /// The workflow `order` follows, or why it is refused: a workflow the
    /// scheduler does not run (naming those it does), or attributes its
    /// schema refuses (naming the path of the first error).
    ///
    /// # Errors
    /// The reason, for the client.
    pub fn entry_for(&self, order: &SubmitOrder) -> Result<&Entry, String> {
        let name = order.workflow();
        let entry = self.entries.get(name).ok_or_else(|| {
            let known: Vec<&str> = self.entries.keys().map(String::as_str).collect();
            format!(
                "unknown workflow {name:?}: this deployment runs {}",
                known.join(", ")
            )
        })?;
        match entry.attributes_refusal(order) {
            Some(reason) => Err(reason),
            None => Ok(entry),
        }
    }

    /// Whether some workflow's wait for event `name` would take it from a
    /// sender named by `principals`, of `tenant` (the tenant of the orders
    /// it can address). True when no workflow waits for `name` at all (the
    /// event changes nothing, as before senders were checked).
    pub fn some_wait_accepts(&self, name: &str, principals: &[String], tenant: &str) -> bool {
        let mut waits = self
            .entries()
            .flat_map(|entry| &entry.steps)
            .filter_map(|step| step.kind.waits_for(name))
            .peekable();
        waits.peek().is_none() || waits.any(|wait| wait.accepts(principals, tenant))
    }

    /// Every agent some workflow sends to, each once, with the shortest
    /// deadline of its steps.
    pub fn agents(&self) -> Vec<(String, Duration)> {
        let mut agents: BTreeMap<&str, u64> = BTreeMap::new();
        for step in self
            .entries()
            .flat_map(|entry| &entry.workflow.steps)
            .filter(|step| step.kind == crate::workflow::StepType::Call)
        {
            let shortest = agents.entry(&step.agent).or_insert(step.timeout_ms);
            *shortest = (*shortest).min(step.timeout_ms);
        }
        agents
            .into_iter()
            .map(|(agent, ms)| (agent.to_owned(), Duration::from_millis(ms)))
            .collect()
    }

    /// The shortest deadline of any step.
    pub fn shortest_timeout(&self) -> Option<Duration> {
        self.agents().into_iter().map(|(_, timeout)| timeout).min()
    }
}

/// The `*.toml` files of `dir`, sorted by name.
fn definitions(dir: &str) -> anyhow::Result<Vec<PathBuf>> {
    let listing = std::fs::read_dir(dir)
        .with_context(|| format!("cannot read workflow folder {dir} (scheduler.workflow_dir)"))?;
    let mut paths = Vec::new();
    for item in listing {
        let path = item
            .with_context(|| format!("cannot read workflow folder {dir}"))?
            .path();
        if path.extension().is_some_and(|ext| ext == "toml") && path.is_file() {
            paths.push(path);
        }
    }
    paths.sort();
    anyhow::ensure!(
        !paths.is_empty(),
        "workflow folder {dir} (scheduler.workflow_dir) holds no *.toml definition"
    );
    Ok(paths)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn folder(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (name, text) in files {
            std::fs::write(dir.path().join(name), text).unwrap();
        }
        dir
    }

    const RETURN: &str = r#"
        name = "return"
        version = 3
        [attributes_schema]
        type = "object"
        required = ["refund_cents"]
        [attributes_schema.properties.refund_cents]
        type = "integer"
        minimum = 0
        [[steps]]
        name = "refund"
        agent = "payment"
        action = "credit"
        timeout_ms = 1000
    "#;

    fn order(workflow: Option<&str>, attributes: serde_json::Value) -> SubmitOrder {
        let mut order: SubmitOrder = serde_json::from_value(serde_json::json!({
            "schema_version": 1, "order_id": "o", "customer_id": "c",
            "items": [{"sku": "s", "quantity": 1}], "amount_cents": 1, "currency": "EUR"
        }))
        .unwrap();
        order.workflow = workflow.map(str::to_owned);
        order.attributes = attributes.as_object().cloned();
        order
    }

    #[test]
    fn a_folder_holds_several_workflows_and_an_unknown_one_is_refused_with_the_known_names() {
        let dir = folder(&[
            ("order.toml", super::super::workflow::BUILT_IN),
            ("return.toml", RETURN),
        ]);
        let catalog = Catalog::load("", dir.path().to_str().unwrap()).unwrap();
        let entry = catalog
            .entry_for(&order(None, serde_json::Value::Null))
            .unwrap();
        assert_eq!(entry.plan().name, "order");
        let error = catalog
            .entry_for(&order(Some("exchange"), serde_json::Value::Null))
            .err()
            .unwrap();
        assert!(error.contains("order, return"), "{error}");
        let agents: Vec<String> = catalog.agents().into_iter().map(|(a, _)| a).collect();
        assert_eq!(agents, ["inventory", "payment", "shipping"]);
    }

    #[test]
    fn the_shipped_workflows_folder_loads() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../workflows");
        let catalog = Catalog::load("", dir).unwrap();
        let names: Vec<&str> = catalog
            .entries()
            .map(|e| e.workflow.name.as_str())
            .collect();
        assert_eq!(names, ["large_order", "order", "return"]);
        let refund = &catalog.get("return").unwrap().steps[1];
        let template = refund.kind.calls().unwrap().action.as_ref().unwrap();
        assert_eq!(template.method.as_deref(), Some("PUT"));
    }

    #[test]
    fn attributes_the_schema_refuses_name_the_path_of_the_error() {
        let dir = folder(&[("return.toml", RETURN)]);
        let catalog = Catalog::load("", dir.path().to_str().unwrap()).unwrap();
        let bad = order(Some("return"), serde_json::json!({"refund_cents": "ten"}));
        let error = catalog.entry_for(&bad).err().unwrap();
        assert!(error.contains("at /refund_cents"), "{error}");
        assert!(error.contains("version 3"), "{error}");
        let missing = catalog
            .entry_for(&order(Some("return"), serde_json::Value::Null))
            .err()
            .unwrap();
        assert!(missing.contains("at /:"), "{missing}");
        let good = order(Some("return"), serde_json::json!({"refund_cents": 500}));
        assert_eq!(catalog.entry_for(&good).unwrap().plan().version, 3);
    }

    #[test]
    fn two_files_of_one_name_an_empty_folder_and_both_settings_are_refused() {
        let dir = folder(&[("a.toml", RETURN), ("b.toml", RETURN)]);
        let error = Catalog::load("", dir.path().to_str().unwrap())
            .err()
            .unwrap();
        assert!(error.to_string().contains("defined twice"), "{error}");
        let empty = folder(&[("notes.txt", "x")]);
        let error = Catalog::load("", empty.path().to_str().unwrap())
            .err()
            .unwrap();
        assert!(error.to_string().contains("holds no"), "{error}");
        let error = Catalog::load("a.toml", "dir").err().unwrap();
        assert!(error.to_string().contains("not both"), "{error}");
    }

    /// Why the catalog of `files` is refused, all causes.
    fn refusal(files: &[(&str, &str)]) -> String {
        let dir = folder(files);
        let refused = Catalog::load("", dir.path().to_str().unwrap()).err();
        format!("{:#}", refused.expect("a refusal"))
    }

    /// A workflow named `name` whose steps start the workflows `children`.
    fn starting(name: &str, version: u32, children: &[&str]) -> String {
        let mut text = format!(
            "name = \"{name}\"\nversion = {version}\n[[steps]]\nname = \"call\"\nagent = \"a\"\naction = \"x\"\ntimeout_ms = 1000\n"
        );
        for (i, child) in children.iter().enumerate() {
            text.push_str(&format!(
                "[[steps]]\nname = \"c{i}\"\nkind = \"child\"\nworkflow = \"{child}\"\ntimeout_ms = 5000\n"
            ));
        }
        text
    }

    #[test]
    fn a_child_step_gets_its_workflow_s_version_and_must_name_one_that_is_here() {
        let dir = folder(&[
            ("a.toml", &starting("a", 1, &["b"])),
            ("b.toml", &starting("b", 7, &[])),
        ]);
        let catalog = Catalog::load("", dir.path().to_str().unwrap()).unwrap();
        let kind = &catalog.get("a").unwrap().steps[1].kind;
        assert!(
            matches!(kind, Kind::Child(ChildStep { workflow, version: 7, .. }) if workflow == "b"),
            "{kind:?}"
        );
        let error = refusal(&[("a.toml", &starting("a", 1, &["gone"]))]);
        assert!(
            error.contains("\"gone\" is not one this scheduler runs"),
            "{error}"
        );
    }

    #[test]
    fn a_workflow_that_starts_itself_or_children_too_deep_is_refused() {
        let error = refusal(&[("a.toml", &starting("a", 1, &["a"]))]);
        assert!(error.contains("may not start itself"), "{error}");
        let error = refusal(&[
            ("a.toml", &starting("a", 1, &["b"])),
            ("b.toml", &starting("b", 1, &["a"])),
        ]);
        assert!(
            error.contains("a -> b -> a") || error.contains("b -> a -> b"),
            "{error}"
        );
        // A chain of MAX_DEPTH children is allowed, one more is not.
        let chain = |length: usize| -> Vec<(String, String)> {
            (0..=length)
                .map(|i| {
                    let children: Vec<String> = if i < length {
                        vec![format!("w{}", i + 1)]
                    } else {
                        vec![]
                    };
                    let refs: Vec<&str> = children.iter().map(String::as_str).collect();
                    (format!("w{i}.toml"), starting(&format!("w{i}"), 1, &refs))
                })
                .collect()
        };
        let files = chain(MAX_DEPTH);
        let refs: Vec<(&str, &str)> = files
            .iter()
            .map(|(n, t)| (n.as_str(), t.as_str()))
            .collect();
        assert!(Catalog::load("", folder(&refs).path().to_str().unwrap()).is_ok());
        let files = chain(MAX_DEPTH + 1);
        let refs: Vec<(&str, &str)> = files
            .iter()
            .map(|(n, t)| (n.as_str(), t.as_str()))
            .collect();
        let error = refusal(&refs);
        assert!(error.contains("at most 5 are allowed"), "{error}");
    }

    #[test]
    fn a_child_step_that_calls_an_agent_or_has_no_workflow_is_refused() {
        let text = "name = \"p\"\n[[steps]]\nname = \"c\"\nkind = \"child\"\nagent = \"a\"\nworkflow = \"b\"\ntimeout_ms = 5000\n";
        let error = format!("{:#}", crate::workflow::Workflow::parse(text).unwrap_err());
        assert!(error.contains("a child step calls no agent"), "{error}");
        let text = "name = \"p\"\n[[steps]]\nname = \"c\"\nkind = \"child\"\ntimeout_ms = 5000\n";
        let error = format!("{:#}", crate::workflow::Workflow::parse(text).unwrap_err());
        assert!(
            error.contains("workflow must name the workflow the child follows"),
            "{error}"
        );
        let text = "name = \"p\"\n[[steps]]\nname = \"c\"\nkind = \"child\"\nworkflow = \"b\"\ntimeout_ms = 5000\n[steps.attributes]\nx = \"${/results/later/y}\"\n";
        let error = format!("{:#}", crate::workflow::Workflow::parse(text).unwrap_err());
        assert!(error.contains("attributes:"), "{error}");
    }
}

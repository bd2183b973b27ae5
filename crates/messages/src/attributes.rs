//! An order's attributes checked against its workflow's JSON Schema
//! (`attributes_schema`), with the same refusal wherever an order starts:
//! the scheduler's intake, the gateway, and a parent's child step.

use std::fmt::Display;

/// Why `attributes` do not match the schema of workflow `workflow` at
/// `version`, naming the path of the first error (`/` for the whole), if
/// they do not.
pub fn refusal(
    schema: &jsonschema::Validator,
    workflow: &str,
    version: impl Display,
    attributes: &serde_json::Value,
) -> Option<String> {
    let error = schema.validate(attributes).err()?;
    let path = match error.instance_path().to_string() {
        path if path.is_empty() => "/".to_owned(),
        path => path,
    };
    Some(format!(
        "attributes do not match workflow {workflow:?} (version {version}) at {path}: {error}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_names_the_workflow_and_the_path_of_the_first_error() {
        let schema = jsonschema::validator_for(&serde_json::json!({
            "type": "object",
            "properties": { "refund_cents": { "type": "integer", "maximum": 100 } }
        }))
        .expect("a schema");
        let ok = serde_json::json!({ "refund_cents": 100 });
        assert_eq!(refusal(&schema, "return", 2, &ok), None);
        let over = serde_json::json!({ "refund_cents": 101 });
        let why = refusal(&schema, "return", 2, &over).expect("refused");
        assert!(
            why.starts_with(
                "attributes do not match workflow \"return\" (version 2) at /refund_cents: "
            ),
            "{why}"
        );
        let why = refusal(&schema, "return", 2, &serde_json::json!(3)).expect("refused");
        assert!(why.contains(" at /: "), "{why}");
    }
}

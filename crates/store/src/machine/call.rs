//! A step's call as its workflow shapes it: the method, the path and the
//! body an agent sends, built from the order, its attributes and earlier
//! steps' results. A step without a template sends today's default, a
//! `POST` to `/<action>` with `{order, results}`.
//!
//! A template is JSON in which a string may hold placeholders `${/pointer}`
//! (RFC 6901 JSON pointers into `{order, attributes, results}`):
//! - a string that is one placeholder and nothing else becomes the value it
//!   points at, of any JSON type;
//! - a placeholder inside a longer string is replaced by the value's text
//!   (a string as it is, anything else as compact JSON, nothing for `null`);
//! - in the path, each replaced value is percent-encoded as one segment,
//!   which must not be empty.
//!
//! A placeholder that finds nothing (a missing attribute, a result that
//! never came: the charge id of a charge that timed out), or an empty or
//! `null` value in the path, refuses to render ([`Unrendered`]): a request
//! is never sent with a hole in it (`DELETE /charges/` would be answered
//! 404 and read as "nothing to undo"; `{"charge": null}` is no refund).
//!
//! Each order keeps its steps' templates with its plan (the `steps.request`
//! column), so a changed workflow file never changes an order already
//! running.

use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use sas_messages::StepKind;

/// The methods a step may call with.
pub const METHODS: [&str; 4] = ["POST", "PUT", "PATCH", "DELETE"];

/// What a value placed in a path keeps as it is: RFC 3986's unreserved
/// characters; everything else is percent-encoded, so that a value is one
/// segment whatever it holds (`/`, `..`, `?`).
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// The request one kind of attempt sends, as configured on a workflow step.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CallTemplate {
    /// One of [`METHODS`]; `POST` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    /// The path under the service's base URL, starting with `/`, with
    /// placeholders; `/<operation>` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// The body, with placeholders; `{order, results}` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<Value>,
}

/// The templates of a step: for its action, and for its compensation.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepCalls {
    /// How the action is called, if not by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<CallTemplate>,
    /// How the compensation is called, if not by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compensation: Option<CallTemplate>,
    /// What the step's failure for good does to its order: undo it
    /// (the default), or stop it in `error` for an operator to resume.
    #[serde(default, skip_serializing_if = "OnFailure::is_default")]
    pub on_failure: OnFailure,
    /// How many of its attempts may be in flight at once per key, if the
    /// workflow limits them (see [`super::concurrency`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<super::concurrency::Concurrency>,
    /// How many of its attempts may start a second per key, if the
    /// workflow limits them (see [`super::concurrency::Rate`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<super::concurrency::Rate>,
}

/// What a call step that fails for good (refused, or out of retries) does
/// to its order. A remote that refuses because of something an operator can
/// fix (an expired credential, a merchant account on hold) should not undo
/// an order the customer is waiting for: `stop` leaves it in `error`,
/// nothing undone, and `sasctl resume` (or the console) starts it again
/// from that step once the cause is fixed, or `sasctl cancel` undoes it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnFailure {
    /// Undo the steps done, in reverse order (the pattern's default).
    #[default]
    Compensate,
    /// End the order in `error` with an alert, undoing nothing.
    Stop,
}

impl OnFailure {
    /// True for the default (not written into a registered plan, so plans
    /// registered before this setting existed read as the same plan).
    pub fn is_default(&self) -> bool {
        *self == Self::Compensate
    }
}

impl StepCalls {
    /// The template of an attempt of `kind`, if the step has one.
    pub fn of(&self, kind: StepKind) -> Option<&CallTemplate> {
        match kind {
            StepKind::Action => self.action.as_ref(),
            StepKind::Compensation => self.compensation.as_ref(),
        }
    }
}

/// A call ready to send: what [`CallTemplate::render`] built.
#[derive(Debug, Clone, PartialEq)]
pub struct Rendered {
    /// The request's body.
    pub body: Value,
    /// Its method, when not `POST`'s default.
    pub method: Option<String>,
    /// Its path, when not `/<operation>`.
    pub path: Option<String>,
}

/// Why a template could not render: the placeholder and where it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Unrendered(pub String);

/// One piece of a templated string.
#[derive(Debug, PartialEq)]
enum Piece<'a> {
    Text(&'a str),
    Pointer(&'a str),
}

/// Splits `text` into text and `${/pointer}` placeholders.
///
/// # Errors
/// A `${` without its `}`, or a pointer that does not start with `/`.
fn pieces(text: &str) -> Result<Vec<Piece<'_>>, String> {
    let mut pieces = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find("${") {
        if start > 0 {
            pieces.push(Piece::Text(&rest[..start]));
        }
        let after = &rest[start + 2..];
        let end = after
            .find('}')
            .ok_or_else(|| format!("{text:?} opens a placeholder \"${{\" without its '}}'"))?;
        let pointer = &after[..end];
        if !pointer.starts_with('/') {
            return Err(format!(
                "placeholder ${{{pointer}}} in {text:?} must be a JSON pointer starting with '/', such as ${{/order/customer_id}}"
            ));
        }
        pieces.push(Piece::Pointer(pointer));
        rest = &after[end + 1..];
    }
    if !rest.is_empty() {
        pieces.push(Piece::Text(rest));
    }
    Ok(pieces)
}

/// The text a value leaves inside a longer string.
fn text_of(value: &Value) -> String {
    match value {
        Value::Null => String::new(),
        Value::String(text) => text.clone(),
        other => other.to_string(),
    }
}

/// The value `pointer` finds in `context`, or why there is none.
fn found<'v>(context: &'v Value, pointer: &str, place: &str) -> Result<&'v Value, Unrendered> {
    context.pointer(pointer).ok_or_else(|| {
        Unrendered(format!(
            "placeholder ${{{pointer}}} in the {place} finds no value in the order, its attributes or the results so far"
        ))
    })
}

/// `template` with its placeholders replaced from `context`.
fn render_value(template: &Value, context: &Value) -> Result<Value, Unrendered> {
    Ok(match template {
        Value::String(text) => match pieces(text).as_deref() {
            Ok([Piece::Pointer(pointer)]) => found(context, pointer, "body")?.clone(),
            Ok(pieces) => {
                let mut out = String::new();
                for piece in pieces {
                    match piece {
                        Piece::Text(text) => out.push_str(text),
                        Piece::Pointer(pointer) => {
                            out.push_str(&text_of(found(context, pointer, "body")?));
                        }
                    }
                }
                Value::String(out)
            }
            // Checked when the workflow was loaded; kept as written otherwise.
            Err(_) => template.clone(),
        },
        Value::Array(items) => items
            .iter()
            .map(|v| render_value(v, context))
            .collect::<Result<_, _>>()?,
        Value::Object(fields) => Value::Object(
            fields
                .iter()
                .map(|(name, value)| Ok((name.clone(), render_value(value, context)?)))
                .collect::<Result<_, Unrendered>>()?,
        ),
        other => other.clone(),
    })
}

/// `path` with each placeholder replaced by its value, percent-encoded.
fn render_path(path: &str, context: &Value) -> Result<String, Unrendered> {
    let Ok(pieces) = pieces(path) else {
        return Ok(path.to_owned());
    };
    let mut out = String::new();
    for piece in pieces {
        match piece {
            Piece::Text(text) => out.push_str(text),
            Piece::Pointer(pointer) => {
                let text = text_of(found(context, pointer, "path")?);
                if text.is_empty() {
                    return Err(Unrendered(format!(
                        "placeholder ${{{pointer}}} in the path {path:?} finds an empty value: the path would have an empty segment"
                    )));
                }
                out.push_str(&utf8_percent_encode(&text, SEGMENT).to_string());
            }
        }
    }
    Ok(out)
}

/// Whether `c` may stand in a path as written: RFC 3986's `pchar` and `/`,
/// without `%` (a placeholder's value is encoded; the template's own text
/// needs no escapes).
fn is_path_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || "-._~!$&'()*+,;=:@/".contains(c)
}

/// The context a template reads: the default payload (`{order, results}`)
/// and the order's `attributes` (an empty object when it has none).
pub fn context_of(payload: &Value) -> Value {
    let mut context = payload.clone();
    let attributes = payload
        .pointer("/order/attributes")
        .cloned()
        .unwrap_or_else(|| Value::Object(serde_json::Map::new()));
    if let Value::Object(fields) = &mut context {
        fields.insert("attributes".into(), attributes);
    }
    context
}

/// `template` (any JSON, such as a child step's attributes) with its
/// placeholders replaced from `payload` (`{order, results}`, read as a
/// call's body template reads it).
///
/// # Errors
/// [`Unrendered`] when a placeholder finds no value.
pub fn render_json(template: &Value, payload: &Value) -> Result<Value, Unrendered> {
    render_value(template, &context_of(payload))
}

impl CallTemplate {
    /// The call this template makes for `payload`, the default body
    /// (`{order, results}`) it reads from and sends when it has no body.
    ///
    /// # Errors
    /// [`Unrendered`] when a placeholder finds no value, or an empty one in
    /// the path (see the module docs).
    pub fn render(&self, payload: Value) -> Result<Rendered, Unrendered> {
        let context = context_of(&payload);
        let path = match self.path.as_deref() {
            Some(path) => Some(render_path(path, &context)?),
            None => None,
        };
        Ok(Rendered {
            method: self.method.clone(),
            path,
            body: match &self.body {
                Some(body) => render_value(body, &context)?,
                None => payload,
            },
        })
    }

    /// Every JSON pointer the template reads, for the workflow's checks.
    ///
    /// # Errors
    /// A placeholder that is not well formed, naming it.
    pub fn pointers(&self) -> Result<Vec<String>, String> {
        let mut found = Vec::new();
        let mut strings: Vec<&str> = self.path.as_deref().into_iter().collect();
        let mut stack: Vec<&Value> = self.body.iter().collect();
        while let Some(value) = stack.pop() {
            match value {
                Value::String(text) => strings.push(text),
                Value::Array(items) => stack.extend(items),
                Value::Object(fields) => stack.extend(fields.values()),
                _ => {}
            }
        }
        for text in strings {
            for piece in pieces(text)? {
                if let Piece::Pointer(pointer) = piece {
                    found.push(pointer.to_owned());
                }
            }
        }
        Ok(found)
    }

    /// Checks the method and the path's own text.
    ///
    /// # Errors
    /// What is wrong, and what is allowed.
    pub fn check(&self) -> Result<(), String> {
        if let Some(method) = &self.method {
            if !METHODS.contains(&method.as_str()) {
                return Err(format!(
                    "method {method:?} is not one of {}",
                    METHODS.join(", ")
                ));
            }
        }
        if let Some(path) = &self.path {
            let text: String = pieces(path)?
                .iter()
                .filter_map(|piece| match piece {
                    Piece::Text(text) => Some(*text),
                    Piece::Pointer(_) => None,
                })
                .collect();
            if !path.starts_with('/') || path.len() > 256 || !text.chars().all(is_path_char) {
                return Err(format!(
                    "path {path:?} must start with '/', be at most 256 bytes, and hold only letters, digits, \"-._~!$&'()*+,;=:@/\" besides placeholders"
                ));
            }
            if path
                .split('/')
                .any(|segment| segment == "." || segment == "..")
            {
                return Err(format!("path {path:?} must not hold a '.' or '..' segment"));
            }
        }
        self.pointers().map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn payload() -> Value {
        json!({
            "order": {
                "order_id": "o/1",
                "customer_id": "c-7",
                "amount_cents": 1999,
                "attributes": { "channel": "web", "address": { "zip": "75001" }, "gift": null, "empty": "" }
            },
            "results": { "reserve_stock": { "reservation_id": "r-9" } }
        })
    }

    #[test]
    fn a_whole_placeholder_keeps_its_type_and_a_partial_one_becomes_text() {
        let template = CallTemplate {
            body: Some(json!({
                "amount": "${/order/amount_cents}",
                "address": "${/attributes/address}",
                "note": "order ${/order/order_id} via ${/attributes/channel} (${/attributes/address})",
                "none": "${/attributes/gift}",
                "gone": "x${/attributes/gift}y",
                "list": ["${/results/reserve_stock/reservation_id}", 3, true]
            })),
            ..CallTemplate::default()
        };
        let rendered = template.render(payload()).unwrap();
        assert_eq!(
            rendered.body,
            json!({
                "amount": 1999,
                "address": { "zip": "75001" },
                "note": "order o/1 via web ({\"zip\":\"75001\"})",
                "none": null,
                "gone": "xy",
                "list": ["r-9", 3, true]
            })
        );
        assert_eq!((rendered.method, rendered.path), (None, None));
    }

    #[test]
    fn a_template_without_a_body_sends_the_default_payload() {
        let template = CallTemplate {
            method: Some("PUT".into()),
            ..CallTemplate::default()
        };
        let rendered = template.render(payload()).unwrap();
        assert_eq!(rendered.body, payload());
        assert_eq!(rendered.method.as_deref(), Some("PUT"));
    }

    #[test]
    fn a_value_in_the_path_is_one_encoded_segment() {
        let template = CallTemplate {
            path: Some("/customers/${/order/customer_id}/orders/${/order/order_id}".into()),
            ..CallTemplate::default()
        };
        let rendered = template.render(payload()).unwrap();
        assert_eq!(
            rendered.path.as_deref(),
            Some("/customers/c-7/orders/o%2F1")
        );
    }

    #[test]
    fn a_placeholder_that_finds_nothing_refuses_to_render_never_leaving_a_hole() {
        let refund = |path: &str, body: Value| CallTemplate {
            method: Some("DELETE".into()),
            path: Some(path.into()),
            body: Some(body),
        };
        // The charge's result never came: no id to refund.
        for (template, expected) in [
            (
                refund("/charges/${/results/charge_payment/id}", json!({})),
                "${/results/charge_payment/id} in the path finds no value",
            ),
            (
                refund("/charges/${/attributes/gift}", json!({})),
                "finds an empty value",
            ),
            (
                refund("/charges/${/attributes/empty}", json!({})),
                "empty segment",
            ),
            (
                refund(
                    "/refunds",
                    json!({"charge": "${/results/charge_payment/id}"}),
                ),
                "${/results/charge_payment/id} in the body finds no value",
            ),
            (
                refund("/refunds", json!({"note": ["for ${/attributes/coupon}"]})),
                "${/attributes/coupon} in the body finds no value",
            ),
        ] {
            let error = template.render(payload()).unwrap_err();
            assert!(error.0.contains(expected), "{error}");
        }
    }

    #[test]
    fn bad_methods_paths_and_placeholders_are_refused_with_the_reason() {
        let bad = [
            (Some("GET"), None, None, "method"),
            (None, Some("charge"), None, "start with '/'"),
            (None, Some("/a/../b"), None, "'..'"),
            (None, Some("/a?b=1"), None, "only letters"),
            (None, None, Some(json!("${/order")), "without its"),
            (
                None,
                None,
                Some(json!({"a": "${order}"})),
                "starting with '/'",
            ),
        ];
        for (method, path, body, expected) in bad {
            let template = CallTemplate {
                method: method.map(str::to_owned),
                path: path.map(str::to_owned),
                body,
            };
            let error = template.check().unwrap_err();
            assert!(error.contains(expected), "{error}");
        }
        let good = CallTemplate {
            method: Some("PATCH".into()),
            path: Some("/v2/charges/${/order/order_id}:capture".into()),
            body: Some(json!({"a": ["${/results/x}"]})),
        };
        good.check().unwrap();
        let mut pointers = good.pointers().unwrap();
        pointers.sort();
        assert_eq!(pointers, ["/order/order_id", "/results/x"]);
    }
}

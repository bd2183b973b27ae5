//! Text and JSON as Postgres can store them: `text` and `jsonb` refuse the
//! character U+0000, and one such character from a remote service or a
//! broken client must not fail the statement (or the batch) it arrives in.
//! It becomes U+FFFD, the replacement character, everywhere it is scrubbed:
//! the agent's replies, the store's results and errors, recorded dead
//! letters.

use serde_json::Value;

/// The replacement for U+0000.
pub const REPLACEMENT: char = '\u{FFFD}';

/// `text` without U+0000.
pub fn storable_text(text: &str) -> String {
    if text.contains('\0') {
        text.replace('\0', "\u{FFFD}")
    } else {
        text.to_owned()
    }
}

/// A copy of `value` with U+0000 replaced in every string and key.
pub fn storable(value: &Value) -> Value {
    let mut value = value.clone();
    make_storable(&mut value);
    value
}

/// Replaces U+0000 in every string and key of `value`, in place; true when
/// it replaced any.
pub fn make_storable(value: &mut Value) -> bool {
    match value {
        Value::String(text) if text.contains('\0') => {
            *text = storable_text(text);
            true
        }
        Value::Array(items) => items
            .iter_mut()
            .fold(false, |replaced, item| make_storable(item) | replaced),
        Value::Object(map) => {
            let mut replaced = false;
            if map.keys().any(|key| key.contains('\0')) {
                let old = std::mem::take(map);
                for (key, value) in old {
                    map.insert(storable_text(&key), value);
                }
                replaced = true;
            }
            map.values_mut()
                .fold(replaced, |replaced, item| make_storable(item) | replaced)
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nul_becomes_the_replacement_character_in_strings_and_keys() {
        let mut value = serde_json::json!({"a\u{0}": ["x\u{0}y", 1, {"k": "\u{0}"}], "b": "clean"});
        let copy = storable(&value);
        assert!(make_storable(&mut value));
        assert_eq!(copy, value);
        assert_eq!(
            value,
            serde_json::json!({"a\u{FFFD}": ["x\u{FFFD}y", 1, {"k": "\u{FFFD}"}], "b": "clean"})
        );
        assert!(!make_storable(&mut value), "nothing left to replace");
        assert_eq!(storable_text("plain"), "plain");
        assert_eq!(storable_text("a\u{0}b"), format!("a{REPLACEMENT}b"));
    }
}

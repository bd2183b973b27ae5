//! The documentation points only at what exists: every relative link in
//! README.md, docs/ and deploy/ names a file of the repository (and, with
//! `#anchor`, a heading of it), and every Rust path written in backticks
//! from a workspace crate's root (`sas_store::machine::undo::undo_not_before`)
//! names a module and an item of that crate. A file moved or a function
//! renamed fails here, not in a newcomer's hands. (The Rust sources' own
//! intra-doc links are checked by rustdoc: scripts/test.sh.)

use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};

fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ lives in the repository")
        .to_path_buf()
}

/// The Markdown files the checks read: the README, and everything under
/// docs/ and deploy/.
fn documents() -> Vec<PathBuf> {
    let root = repository();
    let mut found = vec![root.join("README.md")];
    for folder in ["docs", "deploy", "examples", "contract"] {
        collect(&root.join(folder), "md", &mut found);
    }
    found.sort();
    found
}

fn collect(folder: &Path, extension: &str, into: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(folder) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            // Installed packages (the Node client's node_modules, which
            // scripts/client-deps.sh fills) and build output are not ours.
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name == "node_modules" || name == "target" || name.starts_with('.') {
                continue;
            }
            collect(&path, extension, into);
        } else if path.extension().is_some_and(|e| e == extension) {
            into.push(path);
        }
    }
}

/// The document's lines outside fenced code blocks, numbered from 1.
fn prose(text: &str) -> Vec<(usize, &str)> {
    let mut fenced = false;
    let mut lines = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            lines.push((n + 1, line));
        }
    }
    lines
}

/// The targets of the inline links `[text](target)` and of the reference
/// definitions `[name]: target` on a line.
fn link_targets(line: &str) -> Vec<String> {
    let mut targets = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let Some(end) = after.find(')') else { break };
        targets.push(after[..end].trim().to_owned());
        rest = &after[end..];
    }
    let trimmed = line.trim_start();
    if trimmed.starts_with('[') {
        if let Some(at) = trimmed.find("]: ") {
            targets.push(trimmed[at + 3..].trim().to_owned());
        }
    }
    targets
        .into_iter()
        .map(|t| {
            // `[a](path "title")`, `[a](<path>)`
            let t = t.split_whitespace().next().unwrap_or_default();
            t.trim_start_matches('<').trim_end_matches('>').to_owned()
        })
        .filter(|t| {
            !t.is_empty() && !t.contains("://") && !t.starts_with("mailto:") && !t.starts_with("{{")
        })
        .collect()
}

/// GitHub's anchor of a heading: lower case, punctuation dropped but `-`
/// and `_`, spaces as `-`; repeated headings get `-1`, `-2`, ...
fn anchors(text: &str) -> HashSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut anchors = HashSet::new();
    for (_, line) in prose(text) {
        let trimmed = line.trim_start();
        if trimmed.starts_with('#') {
            let title = trimmed.trim_start_matches('#').trim();
            let slug: String = title
                .to_lowercase()
                .chars()
                .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
                .map(|c| if c == ' ' { '-' } else { c })
                .collect();
            let count = seen.entry(slug.clone()).or_insert(0);
            let anchor = if *count == 0 {
                slug.clone()
            } else {
                format!("{slug}-{count}")
            };
            *count += 1;
            anchors.insert(anchor);
        }
        // Explicit anchors: <a id="x"> or <a name="x">.
        for attribute in ["id=\"", "name=\""] {
            let mut rest = line;
            while let Some(at) = rest.find(attribute) {
                let after = &rest[at + attribute.len()..];
                let end = after.find('"').unwrap_or(after.len());
                anchors.insert(after[..end].to_owned());
                rest = &after[end..];
            }
        }
    }
    anchors
}

#[test]
fn every_relative_link_names_a_file_and_heading_that_exist() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for document in documents() {
        let text = fs::read_to_string(&document).expect("read a document");
        let folder = document.parent().expect("a folder");
        for (n, line) in prose(&text) {
            for target in link_targets(line) {
                checked += 1;
                let (path, anchor) = match target.split_once('#') {
                    Some((path, anchor)) => (path, Some(anchor)),
                    None => (target.as_str(), None),
                };
                let file = if path.is_empty() {
                    document.clone()
                } else {
                    folder.join(path)
                };
                let place = format!(
                    "{}:{n}: {target}",
                    document
                        .strip_prefix(repository())
                        .unwrap_or(&document)
                        .display()
                );
                if !file.exists() {
                    broken.push(format!("{place}: no such file"));
                    continue;
                }
                let Some(anchor) = anchor else { continue };
                if file.extension().is_some_and(|e| e == "md") {
                    let target_text = fs::read_to_string(&file).expect("read a linked document");
                    if !anchors(&target_text).contains(anchor) {
                        broken.push(format!("{place}: no heading with this anchor"));
                    }
                }
            }
        }
    }
    assert!(
        checked > 50,
        "only {checked} links found: is the parser broken?"
    );
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// The library crates of the workspace: their names as Rust code writes
/// them, and their `src/` folders.
fn crates() -> BTreeMap<String, PathBuf> {
    let root = repository();
    let manifest = fs::read_to_string(root.join("Cargo.toml")).expect("the workspace manifest");
    let members = manifest
        .split_once("members = [")
        .and_then(|(_, rest)| rest.split_once(']'))
        .expect("the workspace's members")
        .0;
    let mut crates = BTreeMap::new();
    for member in members.split(',') {
        let member = member.trim().trim_matches('"');
        if member.is_empty() {
            continue;
        }
        let folder = root.join(member);
        if !folder.join("src/lib.rs").exists() {
            continue;
        }
        let manifest = fs::read_to_string(folder.join("Cargo.toml")).expect("a member's manifest");
        let name_after = |table: &str| {
            manifest.split_once(table).and_then(|(_, rest)| {
                rest.lines()
                    .take_while(|l| !l.starts_with('['))
                    .find_map(|l| l.strip_prefix("name = "))
                    .map(|name| name.trim().trim_matches('"').replace('-', "_"))
            })
        };
        let name = name_after("[lib]")
            .or_else(|| name_after("[package]"))
            .expect("a crate name");
        crates.insert(name, folder.join("src"));
    }
    crates
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Whether `text` has `word` as a whole identifier right after `prefix`.
fn has_after(text: &str, prefix: &str, word: &str) -> bool {
    let needle = format!("{prefix}{word}");
    text.match_indices(&needle).any(|(at, _)| {
        let before_ok = at == 0 || !text[..at].ends_with(is_ident);
        let after_ok = !text[at + needle.len()..].starts_with(is_ident);
        before_ok && after_ok
    })
}

/// Whether a module's text declares the item `name`, or re-exports it.
fn declares_item(text: &str, name: &str) -> bool {
    const KINDS: [&str; 9] = [
        "fn ",
        "struct ",
        "enum ",
        "trait ",
        "type ",
        "const ",
        "static ",
        "union ",
        "macro_rules! ",
    ];
    if KINDS.iter().any(|kind| has_after(text, kind, name)) {
        return true;
    }
    // `pub use a::b::{c, name};`, `pub use a::name;`, `pub use a::x as name;`
    text.match_indices("pub use ").any(|(at, _)| {
        let statement = &text[at..];
        let statement = &statement[..statement.find(';').unwrap_or(statement.len())];
        has_after(statement, "", name)
    })
}

/// `Some(inline)` when a module's text declares `mod name` (inline: with
/// its body in the same file).
fn declares_module(text: &str, name: &str) -> Option<bool> {
    text.lines().find_map(|line| {
        let line = line.trim_start();
        let line = line
            .strip_prefix("pub(crate) ")
            .or_else(|| line.strip_prefix("pub(super) "))
            .or_else(|| line.strip_prefix("pub "))
            .unwrap_or(line);
        let rest = line.strip_prefix("mod ")?.strip_prefix(name)?;
        match rest.trim_start().chars().next() {
            Some(';') => Some(false),
            Some('{') => Some(true),
            _ => None,
        }
    })
}

/// Every `.rs` file of a crate, joined: for a method or variant named
/// after its type.
fn crate_text(src: &Path) -> String {
    let mut files = Vec::new();
    collect(src, "rs", &mut files);
    files
        .iter()
        .map(|f| fs::read_to_string(f).unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n")
}

/// Walks `segments` from the crate root: modules as declared, then an item
/// of the last module reached, then members of that item (a method, an
/// associated constant, a variant) anywhere in the crate.
fn resolve(src: &Path, segments: &[&str]) -> Result<(), String> {
    let mut file = src.join("lib.rs");
    let mut folder = src.to_path_buf();
    let mut at = 0;
    while at < segments.len() {
        let name = segments[at];
        let text = fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
        match declares_module(&text, name) {
            Some(true) => {
                at += 1;
                continue;
            }
            Some(false) => {
                let candidates = [
                    folder.join(format!("{name}.rs")),
                    folder.join(name).join("mod.rs"),
                ];
                file = candidates
                    .into_iter()
                    .find(|c| c.exists())
                    .ok_or_else(|| format!("module `{name}` has no file"))?;
                folder = folder.join(name);
                at += 1;
                continue;
            }
            None => {}
        }
        if !declares_item(&text, name) {
            return Err(format!(
                "`{name}` is neither a module nor an item of {}",
                file.display()
            ));
        }
        at += 1;
        break;
    }
    let members = &segments[at..];
    if members.is_empty() {
        return Ok(());
    }
    let text = crate_text(src);
    for member in members {
        // An enum variant: a capitalised name opening a line, then its
        // fields or the comma.
        let variant = member.starts_with(char::is_uppercase)
            && text.lines().any(|line| {
                line.trim_start().strip_prefix(member).is_some_and(|rest| {
                    rest.is_empty() || rest.starts_with(['(', '{', ',']) || rest.starts_with(" {")
                })
            });
        if !(variant || declares_item(&text, member)) {
            return Err(format!("no `{member}` in the crate"));
        }
    }
    Ok(())
}

/// The spans in backticks on a line.
fn code_spans(line: &str) -> Vec<&str> {
    line.split('`').skip(1).step_by(2).collect()
}

#[test]
fn every_rust_path_named_in_the_docs_exists() {
    let crates = crates();
    assert!(crates.contains_key("sas_store"), "crates found: {crates:?}");
    let mut broken = Vec::new();
    let mut checked = 0;
    for document in documents() {
        let text = fs::read_to_string(&document).expect("read a document");
        for (n, line) in prose(&text) {
            for span in code_spans(line) {
                let path = span.trim_end_matches("()");
                let segments: Vec<&str> = path.split("::").collect();
                if segments.len() < 2
                    || !segments
                        .iter()
                        .all(|s| !s.is_empty() && s.chars().all(is_ident))
                {
                    continue;
                }
                let Some(src) = crates.get(segments[0]) else {
                    continue;
                };
                checked += 1;
                if let Err(why) = resolve(src, &segments[1..]) {
                    broken.push(format!(
                        "{}:{n}: `{span}`: {why}",
                        document
                            .strip_prefix(repository())
                            .unwrap_or(&document)
                            .display()
                    ));
                }
            }
        }
    }
    assert!(
        checked > 5,
        "only {checked} paths found: is the parser broken?"
    );
    assert!(
        broken.is_empty(),
        "paths that name nothing:\n{}",
        broken.join("\n")
    );
}

/// The checks themselves: a path that does not exist is found, and one
/// that does is not.
#[test]
fn the_resolver_tells_a_real_path_from_a_made_up_one() {
    let crates = crates();
    let store = &crates["sas_store"];
    assert_eq!(
        resolve(store, &["machine", "undo", "undo_not_before"]),
        Ok(())
    );
    assert_eq!(resolve(store, &["Store", "writes"]), Ok(()));
    assert!(resolve(store, &["machine", "undo", "undo_not_after"]).is_err());
    assert!(resolve(store, &["machine", "nowhere", "decide"]).is_err());
    assert!(resolve(store, &["Store", "no_such_method"]).is_err());
    // A method name must be a `fn`: a line merely opening with the word
    // (`let` opens many) is not one; a variant is found.
    assert!(resolve(store, &["Store", "let"]).is_err());
    assert_eq!(resolve(store, &["ProcessState", "Processed"]), Ok(()));
    assert!(link_targets("see [a](../x.md#y) and [b](https://e.org)") == ["../x.md#y"]);
    assert!(anchors("# A `b` c?\n## A `b` c?\n").contains("a-b-c-1"));
}

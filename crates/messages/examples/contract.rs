//! Writes the machine-readable contract under `contract/` at the workspace
//! root: one JSON Schema per message (`contract/schemas/<Type>.json`) and the
//! AsyncAPI document (`contract/asyncapi.yaml`), generated from the types and
//! names of `sas-messages`. Run it after changing a wire type or a name:
//!
//! ```sh
//! cargo run -p sas-messages --example contract
//! ```
//!
//! The test `crates/messages/tests/contract.rs` fails until the files match.

#[path = "../tests/support/files.rs"]
mod files;

fn main() -> std::io::Result<()> {
    for (path, text) in files::generated() {
        if let Some(folder) = path.parent() {
            std::fs::create_dir_all(folder)?;
        }
        std::fs::write(&path, text)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

//! The documentation is checked like code: the flag reference in `docs/configuration.md` and the
//! metric reference in `docs/observability.md` are generated (from clap and from the metric
//! definitions in `src/`) and must equal what is committed; the Helm values table of
//! `docs/deployment.md` names every value of the chart; every page of `docs/` is reachable from the
//! table of contents in `docs/README.md`; every relative link and `#anchor` in `docs/` and
//! `README.md` resolves; `docs/headers.md`'s table names every header of the code; and the module tables of `docs/ARCHITECTURE.md` name exactly the modules
//! of `src/` and `crates/*/src`, whose top-level modules of `src/` import each other without a
//! circle, as do the modules of every crate and the scripts of `e2e/` (`circles.rs`); nothing in
//! the repository reads beside its checkout: the traces it needs are in `data/`, with their
//! licence; and the Python client's proto is `proto/`'s. Reads only files in the repository (and runs `kvpick serve
//! --help`), so a plain `cargo test` from a fresh clone runs it.
//!
//! After adding a flag or a metric: `KVPICK_UPDATE_DOCS=1 cargo test --test docs` rewrites the
//! generated sections; commit the result.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test harness: a panic is a failure report

mod architecture;
mod circles;
mod flags;
mod generated;
mod headers;
mod helm;
mod layering;
mod links;
mod metrics;
mod python_client;
mod self_contained;

use std::path::{Path, PathBuf};

/// The command that regenerates every generated section, printed by each failing check.
pub const REGENERATE: &str = "KVPICK_UPDATE_DOCS=1 cargo test --test docs";

/// The repository root (this package's manifest directory).
pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Reads a repository file, naming it on failure.
pub fn read(rel: impl AsRef<Path>) -> String {
    let path = repo().join(rel.as_ref());
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every `.rs` file below `dir`, recursively.
pub fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    out
}

/// The backticked names in the first cell of each row of the first table after `section`.
pub fn first_cell_names(page: &str, section: &str) -> std::collections::BTreeSet<String> {
    let start = page
        .find(section)
        .unwrap_or_else(|| panic!("a `{section}` section"));
    page[start..]
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .skip(2)
        .flat_map(|row| {
            let first = row.split('|').nth(1).unwrap_or("");
            first
                .split('`')
                .skip(1)
                .step_by(2)
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect()
}

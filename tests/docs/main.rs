//! The documentation is checked like code: the flag reference in `docs/configuration.md` and the
//! metric reference in `docs/observability.md` are generated (from clap and from the metric
//! definitions in `src/`) and must equal what is committed; the Helm values table of
//! `docs/deployment.md` names every value of the chart; every page of `docs/` is reachable from the
//! table of contents in `docs/README.md`; every relative link and `#anchor` in `docs/` and
//! `README.md` resolves; `docs/headers.md`'s table names every header of the code; and the module tables of `docs/ARCHITECTURE.md` name exactly the modules
//! of `src/` and `crates/*/src`, whose top-level modules of `src/` import each other without a
//! circle; and nothing in the repository reads beside its checkout: the traces it needs are in
//! `data/`, with their licence. Reads only files in the repository (and runs `kvpick serve
//! --help`), so a plain `cargo test` from a fresh clone runs it.
//!
//! After adding a flag or a metric: `KVPICK_UPDATE_DOCS=1 cargo test --test docs` rewrites the
//! generated sections; commit the result.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test harness: a panic is a failure report

mod architecture;
mod flags;
mod generated;
mod headers;
mod helm;
mod layering;
mod links;
mod metrics;
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

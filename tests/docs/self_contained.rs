//! The repository needs nothing beside it: no source, script, test, benchmark or page points at a
//! checkout's neighbour (the shared folder the traces once came from); the data they read is
//! in `data/`, every `data/mooncake/…` file they name exists, and the folder carries its
//! provenance and licence.

use std::path::Path;

/// Spelled in pieces so that this file does not match itself.
const OUTSIDE: &[&str] = &[
    concat!("..", "/shared"),
    concat!("shared", "/data"),
    concat!("\"shared\"", " / \"data\""),
];
const DATA: &str = concat!("data/", "mooncake/");

/// Directories that are not the repository's own files: build output, virtual environments, the
/// e2e work dir, fuzzing runs (all ignored by git) and git itself.
fn skipped(rel: &Path) -> bool {
    let name = rel.file_name().and_then(|n| n.to_str()).unwrap_or("");
    name == "target"
        || name == "__pycache__"
        || (name.starts_with('.') && name != ".ci" && name != ".github")
        || ["fuzz/corpus", "fuzz/artifacts", "fuzz/coverage"]
            .iter()
            .any(|d| rel == Path::new(d))
}

/// Every text file of the repository, relative to it, with its contents.
fn text_files() -> Vec<(String, String)> {
    fn walk(rel: &Path, out: &mut Vec<(String, String)>) {
        for entry in std::fs::read_dir(crate::repo().join(rel)).unwrap() {
            let entry = entry.unwrap();
            let rel = rel.join(entry.file_name());
            if entry.file_type().unwrap().is_dir() {
                if !skipped(&rel) {
                    walk(&rel, out);
                }
            } else if let Ok(text) = std::fs::read_to_string(entry.path()) {
                out.push((rel.display().to_string(), text));
            }
        }
    }
    let mut out = Vec::new();
    walk(Path::new(""), &mut out);
    out
}

#[test]
fn nothing_points_outside_the_repository() {
    let files = text_files();
    assert!(
        files.iter().any(|(f, _)| f == "benches/index.rs"),
        "the walk missed the sources"
    );
    let mut bad = Vec::new();
    for (file, text) in &files {
        for (n, line) in text.lines().enumerate() {
            if OUTSIDE.iter().any(|o| line.contains(o)) {
                bad.push(format!("{file}:{}: {}", n + 1, line.trim()));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "these lines read beside the checkout; ship the file under data/ (with its licence) and \
         point at it there:\n{}",
        bad.join("\n")
    );
}

#[test]
fn every_shipped_trace_that_is_named_exists_with_its_licence() {
    let mut named = std::collections::BTreeSet::new();
    for (file, text) in text_files() {
        for (at, _) in text.match_indices(DATA) {
            let rest = &text[at + DATA.len()..];
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || "._-".contains(c)))
                .unwrap_or(rest.len());
            let name = rest[..end].trim_end_matches('.');
            if !name.is_empty() {
                named.insert((name.to_string(), file.clone()));
            }
        }
    }
    assert!(
        named.iter().any(|(n, _)| n == "mooncake_trace_1000.jsonl"),
        "{named:?}"
    );
    for (name, file) in &named {
        let path = crate::repo().join(DATA).join(name);
        assert!(
            path.is_file(),
            "{file} names {DATA}{name}, which is not in the repository"
        );
    }
    for own in ["README.md", "LICENSE"] {
        assert!(crate::repo().join(DATA).join(own).is_file(), "{DATA}{own}");
    }
}

//! `docs/ARCHITECTURE.md` stays true: for every crate (`src/` is `kvpick`, `crates/NAME/src` is
//! `NAME`) the page has a table whose header's first cell is `` `NAME` module ``, and the modules
//! its rows name in their first cell (backticked paths such as `partition::pipeline`, several per
//! row allowed) are exactly the crate's file modules: every `mod x;` reachable from `lib.rs` /
//! `main.rs`, except those under `#[cfg(test)]`. Inline `mod x { ... }` blocks are not files and
//! not listed.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const PAGE: &str = "docs/ARCHITECTURE.md";

/// `mod NAME;` declarations of a file that are not behind `#[cfg(test)]`.
fn declared_modules(text: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let t = line.trim();
        let t = t
            .strip_prefix("pub(crate) ")
            .or_else(|| t.strip_prefix("pub(super) "))
            .or_else(|| t.strip_prefix("pub "))
            .unwrap_or(t);
        let Some(name) = t.strip_prefix("mod ").and_then(|n| n.strip_suffix(';')) else {
            continue;
        };
        // The attributes directly above the declaration.
        let test_only = lines[..i]
            .iter()
            .rev()
            .map(|l| l.trim())
            .take_while(|l| l.starts_with("#[") || l.starts_with("//"))
            .any(|l| l.contains("cfg(test)"));
        if !test_only {
            out.push(name.trim().to_string());
        }
    }
    out
}

/// Every file module of the crate rooted at `src` (`a`, `a::b`, ...).
fn crate_modules(src: &Path) -> BTreeSet<String> {
    fn walk(file: &Path, dir: &Path, prefix: &str, out: &mut BTreeSet<String>) {
        let text = std::fs::read_to_string(file).unwrap();
        for name in declared_modules(&text) {
            let path = if prefix.is_empty() {
                name.clone()
            } else {
                format!("{prefix}::{name}")
            };
            let flat = dir.join(format!("{name}.rs"));
            let nested = dir.join(&name).join("mod.rs");
            let (child, child_dir) = if flat.exists() {
                (flat, dir.join(&name))
            } else if nested.exists() {
                (nested, dir.join(&name))
            } else {
                panic!("{}: `mod {name};` has no file", file.display());
            };
            walk(&child, &child_dir, &path, out);
            out.insert(path);
        }
    }
    let mut out = BTreeSet::new();
    for root in ["lib.rs", "main.rs"] {
        let file = src.join(root);
        if file.exists() {
            walk(&file, src, "", &mut out);
        }
    }
    out
}

/// Every crate of the repository: `kvpick` (`src/`) and each `crates/NAME` with a `src/`.
fn crates() -> BTreeMap<String, PathBuf> {
    let repo = crate::repo();
    let mut out = BTreeMap::from([("kvpick".to_string(), repo.join("src"))]);
    for entry in std::fs::read_dir(repo.join("crates")).unwrap() {
        let path = entry.unwrap().path();
        if path.join("src").is_dir() {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            out.insert(name, path.join("src"));
        }
    }
    out
}

/// The backticked names of a table cell.
fn backticked(cell: &str) -> Vec<String> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .map(|s| s.to_string())
        .collect()
}

/// Per crate, the modules the page's tables name (first cells of the rows).
fn documented() -> BTreeMap<String, BTreeSet<String>> {
    let text = crate::read(PAGE);
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        let Some(row) = line.strip_prefix('|') else {
            current = None;
            continue;
        };
        let first = row.split('|').next().unwrap_or("").trim();
        if let Some(name) = first.strip_suffix(" module") {
            let names = backticked(name);
            assert_eq!(names.len(), 1, "{PAGE}: table header {line:?}");
            current = Some(names[0].clone());
            out.entry(names[0].clone()).or_default();
            continue;
        }
        if first.starts_with("---") {
            continue;
        }
        if let Some(krate) = &current {
            let set = out.get_mut(krate).unwrap();
            for module in backticked(first) {
                assert!(
                    set.insert(module.clone()),
                    "{PAGE}: `{module}` of {krate} is listed twice"
                );
            }
        }
    }
    out
}

#[test]
fn architecture_tables_name_exactly_the_modules_that_exist() {
    let documented = documented();
    let mut problems = Vec::new();
    for (krate, src) in crates() {
        let actual = crate_modules(&src);
        let Some(named) = documented.get(&krate) else {
            problems.push(format!(
                "no table for crate {krate} (a table whose header starts `| \\`{krate}\\` module |`)"
            ));
            continue;
        };
        for m in named.difference(&actual) {
            problems.push(format!(
                "{krate}: the table names `{m}`, which is not a module"
            ));
        }
        for m in actual.difference(named) {
            problems.push(format!("{krate}: module `{m}` is missing from the table"));
        }
    }
    for krate in documented.keys() {
        if !crates().contains_key(krate) {
            problems.push(format!("a table for `{krate}`, which is not a crate"));
        }
    }
    assert!(
        problems.is_empty(),
        "{PAGE} disagrees with the source tree:\n{}",
        problems.join("\n")
    );
}

#[test]
fn modules_are_read_from_declarations() {
    let text = "pub mod a;\nmod b;\n#[cfg(test)]\nmod tests;\n#[cfg(test)]\n#[path = \"x.rs\"]\nmod more;\npub(crate) mod c;\nmod inline {\n}\n";
    assert_eq!(declared_modules(text), ["a", "b", "c"]);
    let core = crate_modules(&crate::repo().join("crates/kvpick-core/src"));
    assert!(core.contains("partition::pipeline"), "{core:?}");
    assert!(!core.iter().any(|m| m.ends_with("tests")), "{core:?}");
}

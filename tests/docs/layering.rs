//! The layering `docs/ARCHITECTURE.md` describes stays true: the top-level modules of `src/`
//! (the role folders `hosts`, `sources`, `observability`, ..., and `selection`, `server`, `clock`) import each other without a circle. A module depends on
//! another when its non-test code names `crate::OTHER` (in a `use`, a path or a
//! `use crate::{OTHER, ...}` group); comments, `*tests.rs` files and the `#[cfg(test)] mod`
//! at the end of a file do not count (tests may reach anywhere).
//!
//! A circle is reported as the modules it passes through, e.g. `selection -> shared ->
//! selection`; break it by moving what both need to a third module or by giving the lower module
//! a trait the upper one implements (`selection::sharing::SharedHooks`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The top-level modules of `src/` and the `.rs` files of each.
fn top_level_modules(src: &Path) -> BTreeMap<String, Vec<PathBuf>> {
    fn files(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                files(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    let mut out: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    for entry in std::fs::read_dir(src).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        if path.is_dir() {
            files(&path, out.entry(name).or_default());
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.entry(name).or_default().push(path);
        }
    }
    out.retain(|name, _| name != "lib" && name != "main");
    out
}

fn is_test_file(path: &Path) -> bool {
    let stem = path.file_stem().unwrap().to_string_lossy();
    stem == "tests" || stem.ends_with("_tests")
}

/// The code of a file without comments and without its trailing `#[cfg(test)] mod ...`.
fn code(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = String::new();
    for (i, line) in lines.iter().enumerate() {
        let t = line.trim();
        let next = lines.get(i + 1).map_or("", |l| l.trim());
        if t == "#[cfg(test)]" && (next.starts_with("mod ") || next.starts_with("#[path")) {
            break;
        }
        if t.starts_with("//") {
            continue;
        }
        out.push_str(line.split(" // ").next().unwrap_or(line));
        out.push('\n');
    }
    out
}

/// The crate modules a piece of code names: `crate::a`, and each first segment of a
/// `crate::{a, b::{c, d}}` group.
fn named_modules(code: &str) -> BTreeSet<String> {
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let mut out = BTreeSet::new();
    for (at, _) in code.match_indices("crate::") {
        if at > 0 && code[..at].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_') {
            continue; // `kvpick_core::...` ends in `core::`, not `crate::`; `foocrate::` is not ours
        }
        let rest = &code[at + "crate::".len()..];
        let Some(group) = rest.strip_prefix('{') else {
            out.insert(ident(rest));
            continue;
        };
        // The first segment of every item at depth 1 of the group.
        let (mut depth, mut item_start) = (1usize, true);
        for (i, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 1 => break,
                '}' => depth -= 1,
                ',' if depth == 1 => item_start = true,
                c if item_start && depth == 1 && !c.is_whitespace() => {
                    out.insert(ident(&group[i..]));
                    item_start = false;
                }
                _ => {}
            }
        }
    }
    out.remove("");
    out
}

/// Who imports whom among the top-level modules (self-references left out).
fn dependencies(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let modules = top_level_modules(src);
    let mut graph = BTreeMap::new();
    for (name, files) in &modules {
        let mut deps = BTreeSet::new();
        for file in files.iter().filter(|f| !is_test_file(f)) {
            let text = std::fs::read_to_string(file).unwrap();
            deps.extend(named_modules(&code(&text)));
        }
        deps.retain(|d| d != name && modules.contains_key(d));
        graph.insert(name.clone(), deps);
    }
    graph
}

/// Every circle of the graph, each once, as the path `a -> b -> ... -> a` (from its smallest
/// module).
fn circles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    fn walk(
        graph: &BTreeMap<String, BTreeSet<String>>,
        start: &str,
        path: &mut Vec<String>,
        out: &mut BTreeSet<String>,
    ) {
        let last = path.last().unwrap().clone();
        for next in graph.get(&last).into_iter().flatten() {
            if next == start {
                out.insert(format!("{} -> {start}", path.join(" -> ")));
            } else if next.as_str() > start && !path.contains(next) {
                path.push(next.clone());
                walk(graph, start, path, out);
                path.pop();
            }
        }
    }
    let mut out = BTreeSet::new();
    for start in graph.keys() {
        walk(graph, start, &mut vec![start.clone()], &mut out);
    }
    out.into_iter().collect()
}

#[test]
fn top_level_modules_import_each_other_without_a_circle() {
    let graph = dependencies(&crate::repo().join("src"));
    assert!(
        graph["sources"].contains("selection"),
        "the scan no longer sees `sources` (shared state) use `selection`: {graph:?}"
    );
    assert!(
        !graph["selection"].contains("sources"),
        "`selection` imports `sources` again (use the `selection::sharing::SharedHooks` seam)"
    );
    let found = circles(&graph);
    assert!(
        found.is_empty(),
        "src/ top-level modules import each other in a circle:\n{}",
        found.join("\n")
    );
}

#[test]
fn imports_are_read_from_paths_and_groups() {
    let text = "//! see crate::docs_only\nuse crate::a::X;\nuse crate::{b, c::{D, E}, d::F};\n\
                fn f() { crate::e::g(); kvpick_core::h(); } // crate::comment\n\
                #[cfg(test)]\nmod tests {\n    use crate::test_only;\n}\n";
    let names: Vec<String> = named_modules(&code(text)).into_iter().collect();
    assert_eq!(names, ["a", "b", "c", "d", "e"]);
}

#[test]
fn a_circle_is_reported_as_its_path() {
    let edge = |a: &str, b: &[&str]| {
        (
            a.to_string(),
            b.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>(),
        )
    };
    let graph = BTreeMap::from([
        edge("selection", &["metrics", "shared"]),
        edge("shared", &["selection"]),
        edge("metrics", &[]),
    ]);
    assert_eq!(circles(&graph), ["selection -> shared -> selection"]);
    let graph = BTreeMap::from([edge("a", &["b"]), edge("b", &["c"]), edge("c", &[])]);
    assert!(circles(&graph).is_empty());
}

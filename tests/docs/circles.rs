//! No module of any crate of the workspace (`src/`, `crates/*/src`) and no script of `e2e/` uses
//! another that uses it back, directly or through others: every crate reads as a tower.
//!
//! **The Rust graph.** The nodes are the modules the crate compiles outside tests, found by
//! following the `mod x;` declarations from `lib.rs` / `main.rs` (a `#[cfg(test)]` item, and so a
//! test module and everything in it, is not read). Module `m` *uses* module `n` when `m`'s code,
//! comments and string literals removed, names a path into `n`: `crate::n::…`, `super::…`,
//! `self::…`, a child's name `x::…`, expanded through `{…}` groups. A path names the module that
//! holds its item, found through re-exports: `crate::a::Item`, where `a` only does
//! `pub use a::b::Item`, is a use of `a::b`, not of `a`; a path that names a module itself
//! (`use super::b;`) is a use of that module. A `mod child;` declaration is not a use: the
//! parent owns the child, it does not read it.
//!
//! A glob import does not hide what it brings in: in a module that does `use super::*` (or any
//! `use m::*`), a bare name that is not the module's own and that `m` defines or imports counts
//! as a path through `m` (`PromptBlocks`, where the parent does `use pipeline::PromptBlocks`, is
//! a use of `pipeline`); a name that is a module counts only as a path's root (`flow::x`, not a
//! parameter named `flow`).
//!
//! **Facades.** An edge between a module and one of its ancestors other than the crate root is
//! the facade relationship and never closes a circle, in either direction: a `mod.rs` that
//! declares its children, re-exports their items and drives them, while they read the state it
//! defines, is how the repository splits one type's impl by phase (`partition` and its stages,
//! `StreamMachine` and `extproc::stream::*`); the parent and its subtree are one unit read from
//! the top. Counting those edges would flag every such split and only push the shared state
//! into one more child for the parent to re-export, no easier to read. Every other edge counts:
//! siblings and cousins (two stages of one parent that use each other are a circle, also when
//! one reaches the other through the parent's re-exports or its glob, which resolve to the
//! sibling), and every edge to or from the crate root. The root is not a facade: a lower module
//! that reads an item `lib.rs` / `main.rs` defines, while the root re-exports or calls that
//! module, is a circle, so the types every module shares live in a leaf module (`kvpick-core`'s
//! `outcome`, re-exported at the root; `kvpick`'s `proto`), never in the root itself.
//!
//! **The Python graph** (`e2e/`, tests included): a script uses another when it imports it
//! anywhere in the file — at the top or inside a function (a late import hides a circle from
//! Python, not from the reader). `from pkg import name` uses `pkg.name` when that is a script,
//! else `pkg`; a name is looked up as its path below `e2e/` and then by its file name, as the
//! scripts put `e2e/`, `e2e/tests` and `e2e/replay` on `sys.path`.
//!
//! A circle is reported as the modules it passes through (`a -> b -> a`), once per set of
//! modules that reach each other.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::{Path, PathBuf};

pub type Graph = BTreeMap<String, BTreeSet<String>>;

/// One shortest circle through each group of nodes that reach each other (strongly connected,
/// more than one node), as `a -> b -> … -> a` starting from the group's smallest node.
pub fn cycles(graph: &Graph) -> Vec<String> {
    let reach = |from: &str| -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.to_string()];
        while let Some(n) = todo.pop() {
            for next in graph.get(&n).into_iter().flatten() {
                if seen.insert(next.clone()) {
                    todo.push(next.clone());
                }
            }
        }
        seen
    };
    let reached: BTreeMap<&String, BTreeSet<String>> =
        graph.keys().map(|n| (n, reach(n))).collect();
    let mut done = BTreeSet::new();
    let mut out = Vec::new();
    for (start, from_start) in &reached {
        if done.contains(*start) || !from_start.contains(*start) {
            continue;
        }
        let group: BTreeSet<&String> = from_start
            .iter()
            .filter(|n| reached.get(n).is_some_and(|r| r.contains(*start)))
            .collect();
        done.extend(group.iter().map(|n| n.to_string()));
        let others: Vec<&str> = group
            .iter()
            .map(|n| n.as_str())
            .filter(|n| !shortest_circle(graph, start).split(" -> ").any(|c| c == *n))
            .collect();
        let mut line = shortest_circle(graph, start);
        if !others.is_empty() {
            line.push_str(&format!(
                " (and, on circles with these, {})",
                others.join(", ")
            ));
        }
        out.push(line);
    }
    out
}

/// The shortest path from `start` back to itself (breadth first).
fn shortest_circle(graph: &Graph, start: &str) -> String {
    let mut came_from: BTreeMap<String, String> = BTreeMap::new();
    let mut queue = VecDeque::from([start.to_string()]);
    while let Some(n) = queue.pop_front() {
        for next in graph.get(&n).into_iter().flatten() {
            if next == start {
                let mut path = vec![n.clone()];
                let mut at = n.clone();
                while let Some(prev) = came_from.get(&at) {
                    path.push(prev.clone());
                    at = prev.clone();
                }
                path.reverse();
                path.push(start.to_string());
                return path.join(" -> ");
            }
            if !came_from.contains_key(next) && next != start {
                came_from.insert(next.clone(), n.clone());
                queue.push_back(next.clone());
            }
        }
    }
    unreachable!("{start} is on a circle")
}

// ---------------------------------------------------------------------------------------------
// Rust source, read just enough.

/// The code of a file without comments and with every string and char literal emptied, so
/// that neither can name a module.
pub fn strip(text: &str) -> String {
    let b: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied().unwrap_or('\0');
        if c == '/' && next == '/' {
            while i < b.len() && b[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == '*' {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push(' ');
        } else if c == 'r' && (next == '"' || next == '#') && !ident_char_before(&b, i) {
            let hashes = b[i + 1..].iter().take_while(|&&h| h == '#').count();
            if b.get(i + 1 + hashes) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            let close: String = std::iter::once('"')
                .chain("#".repeat(hashes).chars())
                .collect();
            let body_start = i + 2 + hashes;
            let rest: String = b[body_start..].iter().collect();
            let len = rest.find(&close).map_or(rest.len(), |e| e + close.len());
            i = body_start + rest[..len].chars().count();
            out.push_str("\"\"");
        } else if c == '"' {
            i += 1;
            while i < b.len() && b[i] != '"' {
                i += if b[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else if c == '\'' && (b.get(i + 2) == Some(&'\'') || next == '\\') {
            // A char literal ('x' or '\n'); a lifetime ('a) has no closing quote after one char.
            i += if next == '\\' { 2 } else { 1 };
            while i < b.len() && b[i] != '\'' {
                i += 1;
            }
            i += 1;
            out.push_str("' '");
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

fn ident_char_before(b: &[char], i: usize) -> bool {
    i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == '_')
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Stripped code without its `#[cfg(test)]` items (a test module, a test-only `use` or fn).
pub fn without_test_items(code: &str) -> String {
    let mut out = String::new();
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        rest = &rest[at + "#[cfg(test)]".len()..];
        // Further attributes, then the item: up to its `;` or its closing brace.
        loop {
            let t = rest.trim_start();
            if let Some(attr) = t.strip_prefix("#[") {
                let end = attr.find(']').map_or(attr.len(), |e| e + 1);
                rest = &attr[end..];
            } else {
                rest = t;
                break;
            }
        }
        let (mut depth, mut end) = (0usize, rest.len());
        for (i, c) in rest.char_indices() {
            match c {
                ';' if depth == 0 => {
                    end = i + 1;
                    break;
                }
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = i + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

/// The identifier at the start of `s`.
fn ident(s: &str) -> &str {
    let end = s.find(|c: char| !is_ident(c)).unwrap_or(s.len());
    &s[..end]
}

/// The paths a `use`-like path text denotes, from its start up to where it ends, each with the
/// name it is bound to (`as` alias, else its last segment; `*` for a glob).
/// `a::{b, c::{d as e, *}}` gives `a::b` (b), `a::c::d` (e), `a::c::*` (*).
/// Also returns the length of text the path spans.
pub fn expand(text: &str) -> (Vec<(Vec<String>, String)>, usize) {
    fn path(s: &str, prefix: &[String], out: &mut Vec<(Vec<String>, String)>) -> usize {
        let mut segs = prefix.to_vec();
        let mut i = 0;
        loop {
            i += s[i..].len() - s[i..].trim_start().len();
            let rest = &s[i..];
            if let Some(group) = rest.strip_prefix('{') {
                i += 1 + items(group, &segs, out);
                return i;
            }
            if rest.starts_with('*') {
                segs.push("*".into());
                out.push((segs, "*".into()));
                return i + 1;
            }
            let name = ident(rest);
            if name.is_empty() {
                if segs.len() > prefix.len() {
                    let last = segs.last().cloned().unwrap_or_default();
                    out.push((segs, last));
                }
                return i;
            }
            i += name.len();
            let after = s[i..].trim_start();
            if let Some(more) = after.strip_prefix("::") {
                if more.trim_start().starts_with('<') {
                    segs.push(name.into());
                    let last = name.to_string();
                    out.push((segs, last));
                    return i;
                }
                i = s.len() - more.len();
                segs.push(name.into());
                continue;
            }
            let bound = match after.strip_prefix("as ") {
                Some(alias) => ident(alias.trim_start()).to_string(),
                None if name == "self" => prefix.last().cloned().unwrap_or_default(),
                None => name.to_string(),
            };
            if name != "self" {
                segs.push(name.into());
            }
            out.push((segs, bound));
            return i;
        }
    }
    /// The items of a `{…}` group up to its closing brace; returns the length read.
    fn items(s: &str, prefix: &[String], out: &mut Vec<(Vec<String>, String)>) -> usize {
        let mut i = 0;
        loop {
            i += path(&s[i..], prefix, out);
            // Past an `as alias` to the `,` or the `}` that ends the item.
            let mut depth = 0usize;
            let mut end = None;
            for (k, c) in s[i..].char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        end = Some((i + k, true));
                        break;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        end = Some((i + k, false));
                        break;
                    }
                    _ => {}
                }
            }
            match end {
                Some((j, true)) => return j + 1,
                Some((j, false)) => i = j + 1,
                None => return s.len(),
            }
        }
    }
    let mut out = Vec::new();
    let len = path(text, &[], &mut out);
    (out, len)
}

/// One module of a crate: its code (stripped, test items removed), its children.
pub struct Module {
    pub code: String,
    pub children: BTreeSet<String>,
}

/// The modules of the crate whose root file is `root`, keyed by path (`""` is the root,
/// `partition::pair`).
pub fn crate_modules(root: &Path) -> BTreeMap<String, Module> {
    let mut out = BTreeMap::new();
    let dir = root.parent().unwrap().to_path_buf();
    add_module(&mut out, String::new(), root.to_path_buf(), dir);
    out
}

fn add_module(out: &mut BTreeMap<String, Module>, name: String, file: PathBuf, dir: PathBuf) {
    let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{file:?}: {e}"));
    let code = without_test_items(&strip(&text));
    let mut children = BTreeSet::new();
    for (at, _) in code.match_indices("mod ") {
        if at > 0 && code[..at].ends_with(is_ident) {
            continue;
        }
        let rest = &code[at + 4..];
        let child = ident(rest.trim_start());
        if child.is_empty()
            || !rest.trim_start()[child.len()..]
                .trim_start()
                .starts_with(';')
        {
            continue; // an inline `mod x { … }` is part of this file's code
        }
        let candidates = [
            dir.join(format!("{child}.rs")),
            dir.join(child).join("mod.rs"),
        ];
        let Some(child_file) = candidates.iter().find(|p| p.is_file()) else {
            panic!("{file:?} declares `mod {child};` and neither {candidates:?} exists")
        };
        children.insert(child.to_string());
        let full = if name.is_empty() {
            child.to_string()
        } else {
            format!("{name}::{child}")
        };
        add_module(out, full, child_file.clone(), dir.join(child));
    }
    out.insert(name, Module { code, children });
}

/// `a::b` as segments (`""` is the root).
fn segments(module: &str) -> Vec<String> {
    if module.is_empty() {
        Vec::new()
    } else {
        module.split("::").map(str::to_string).collect()
    }
}

/// What a module defines and re-exports, for resolving a path to the module holding its item.
struct Surface {
    defined: BTreeSet<String>,
    /// `pub use` by name: the name it is bound to -> the absolute path it points at.
    named: BTreeMap<String, Vec<String>>,
    /// `pub use …::*`: the modules whose items it re-exports.
    globs: Vec<Vec<String>>,
}

/// The crate's module graph: who uses whom (self-uses left out).
pub fn crate_graph(modules: &BTreeMap<String, Module>) -> Graph {
    let surfaces: BTreeMap<&String, Surface> = modules
        .iter()
        .map(|(name, m)| (name, surface(name, m)))
        .collect();
    let mut graph = Graph::new();
    for (name, m) in modules {
        let mut uses = BTreeSet::new();
        let mut add = |target: String| {
            if &target != name && !facade(name, &target) {
                uses.insert(target);
            }
        };
        for (path, _) in paths(name, m) {
            add(resolve(modules, &surfaces, &path));
        }
        // A bare name that is a module (`flow`) is a use only as a path's root (`flow::x`):
        // alone it is a local of the same name.
        for (path, rooted_path) in glob_names(m, &surfaces[name]) {
            let (target, is_module) = locate(modules, &surfaces, &path, 0);
            if rooted_path || !is_module {
                add(target);
            }
        }
        graph.insert(
            name_of(name),
            uses.into_iter().map(|n| name_of(&n)).collect(),
        );
    }
    graph
}

/// Whether `a` and `b` are a module and one of its ancestors other than the crate root: the
/// facade relationship, which never closes a circle (see this file's doc).
fn facade(a: &str, b: &str) -> bool {
    let below = |low: &str, high: &str| !high.is_empty() && low.starts_with(&format!("{high}::"));
    below(a, b) || below(b, a)
}

/// A node's name in a report: the root is `crate`.
fn name_of(module: &str) -> String {
    if module.is_empty() {
        "crate".into()
    } else {
        module.into()
    }
}

fn surface(name: &str, m: &Module) -> Surface {
    let mut defined = BTreeSet::new();
    for kw in [
        "struct ",
        "enum ",
        "trait ",
        "type ",
        "fn ",
        "const ",
        "static ",
        "union ",
        "macro_rules! ",
    ] {
        for (at, _) in m.code.match_indices(kw) {
            if at > 0 && m.code[..at].ends_with(is_ident) {
                continue;
            }
            defined.insert(ident(m.code[at + kw.len()..].trim_start()).to_string());
        }
    }
    let (mut named, mut globs) = (BTreeMap::new(), Vec::new());
    // Every `use` binds names a child can reach through `super::` (a private one too), and a
    // `pub use` re-exports them: both send a path through this module on to its item.
    for (at, _) in m.code.match_indices("use ") {
        if at > 0 && m.code[..at].ends_with(is_ident) {
            continue;
        }
        for (path, bound) in rooted(name, &m.children, &m.code[at + 4..]).0 {
            if bound == "*" {
                globs.push(path[..path.len() - 1].to_vec());
            } else {
                named.insert(bound, path);
            }
        }
    }
    Surface {
        defined,
        named,
        globs,
    }
}

/// The absolute paths of the crate that a path text written in module `name` denotes, when it
/// starts at `crate`, `super`, `self` or a child's name; nothing for other roots (another crate,
/// a local name).
fn rooted(
    name: &str,
    children: &BTreeSet<String>,
    text: &str,
) -> (Vec<(Vec<String>, String)>, usize) {
    let here = segments(name);
    let mut out = Vec::new();
    let (expanded, len) = expand(text);
    for (segs, bound) in expanded {
        let Some(first) = segs.first() else { continue };
        let mut abs = match first.as_str() {
            "crate" => Vec::new(),
            "self" | "super" => here.clone(),
            c if children.contains(c) => here.clone(),
            _ => continue,
        };
        let skip = usize::from(first == "crate" || first == "self");
        for seg in &segs[skip..] {
            if seg == "super" {
                abs.pop();
            } else if seg != "self" {
                abs.push(seg.clone());
            }
        }
        out.push((abs, bound));
    }
    (out, len)
}

/// Every crate path module `name`'s code names, each read once (a group's items are not read
/// again as paths of their own).
fn paths(name: &str, m: &Module) -> Vec<(Vec<String>, String)> {
    let code = &m.code;
    let mut roots: Vec<String> = ["crate::", "super::", "self::"].map(String::from).to_vec();
    roots.extend(m.children.iter().map(|c| format!("{c}::")));
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(at) = roots
        .iter()
        .filter_map(|r| code[i..].find(r.as_str()))
        .min()
    {
        let at = i + at;
        let before = &code[..at];
        if before.ends_with(is_ident) || before.ends_with(':') {
            i = at + 1;
            continue;
        }
        let (found, len) = rooted(name, &m.children, &code[at..]);
        out.extend(found);
        i = at + len.max(1);
    }
    out
}

/// The bare names a module's code takes from its glob imports (`use super::*`): each name
/// that is not the module's own (defined or imported by name), as a path through each globbed
/// module, and whether the name starts a path (`name::…`). A glob does not hide what it brings
/// in: `super::*` of a parent that does `use pipeline::PromptBlocks` makes `PromptBlocks` a use
/// of `pipeline`. (A name the globbed module does not have resolves to that module: the glob's
/// own edge.)
fn glob_names(m: &Module, own: &Surface) -> Vec<(Vec<String>, bool)> {
    let mut out = Vec::new();
    if own.globs.is_empty() {
        return out;
    }
    let code = &m.code;
    let mut seen = BTreeSet::new();
    let mut i = 0;
    while i < code.len() {
        let rest = &code[i..];
        let word = ident(rest);
        if word.is_empty() {
            i += rest.chars().next().map_or(1, char::len_utf8);
            continue;
        }
        let before = code[..i].trim_end();
        let is_path_tail = before.ends_with("::") || before.ends_with('.');
        let starts_path = rest[word.len()..].trim_start().starts_with("::");
        i += word.len();
        if is_path_tail
            || word.starts_with(|c: char| c.is_ascii_digit())
            || own.defined.contains(word)
            || own.named.contains_key(word)
            || !seen.insert((word.to_string(), starts_path))
        {
            continue;
        }
        out.extend(
            own.globs
                .iter()
                .map(|g| ([g.clone(), vec![word.to_string()]].concat(), starts_path)),
        );
    }
    out
}

/// The module holding the item `path` names (following re-exports).
fn resolve(
    modules: &BTreeMap<String, Module>,
    surfaces: &BTreeMap<&String, Surface>,
    path: &[String],
) -> String {
    locate(modules, surfaces, path, 0).0
}

/// [`resolve`], and whether the path names that module itself rather than an item in it.
fn locate(
    modules: &BTreeMap<String, Module>,
    surfaces: &BTreeMap<&String, Surface>,
    path: &[String],
    depth: usize,
) -> (String, bool) {
    let mut k = path.len();
    while k > 0 && !modules.contains_key(&path[..k].join("::")) {
        k -= 1;
    }
    let module = path[..k].join("::");
    let Some(item) = path.get(k) else {
        return (module, true);
    };
    if item == "*" || depth > 16 {
        return (module, false);
    }
    let s = &surfaces[&module];
    if let Some(target) = s.named.get(item) {
        let mut next = target.clone();
        next.extend(path[k + 1..].iter().cloned());
        return locate(modules, surfaces, &next, depth + 1);
    }
    if s.defined.contains(item) {
        return (module, false);
    }
    for glob in &s.globs {
        let g = glob.join("::");
        if let Some(gs) = surfaces.get(&g) {
            if gs.defined.contains(item) || gs.named.contains_key(item) {
                let mut next = glob.clone();
                next.extend(path[k..].iter().cloned());
                return locate(modules, surfaces, &next, depth + 1);
            }
        }
    }
    (module, false)
}

/// The crate roots of the workspace: `lib.rs` and `main.rs` of `src/` and of each `crates/*/src`.
fn crate_roots() -> Vec<PathBuf> {
    let repo = crate::repo();
    let mut dirs = vec![repo.join("src")];
    let mut crates: Vec<PathBuf> = std::fs::read_dir(repo.join("crates"))
        .unwrap()
        .map(|e| e.unwrap().path().join("src"))
        .collect();
    crates.sort();
    dirs.extend(crates);
    dirs.iter()
        .flat_map(|d| [d.join("lib.rs"), d.join("main.rs")])
        .filter(|f| f.is_file())
        .collect()
}

/// Every circle of every crate, named by the crate's root file.
fn rust_circles() -> Vec<String> {
    let repo = crate::repo();
    let mut out = Vec::new();
    for root in crate_roots() {
        let graph = crate_graph(&crate_modules(&root));
        let rel = root.strip_prefix(&repo).unwrap().display().to_string();
        out.extend(cycles(&graph).into_iter().map(|c| format!("{rel}: {c}")));
    }
    out
}

/// The circles there are today, each to be broken; the test fails on any other circle, and on
/// an entry here that is gone (delete it), so this list only shrinks.
const KNOWN: &[&str] = &[];

#[test]
fn no_module_of_any_crate_uses_one_that_uses_it_back() {
    let roots = crate_roots();
    assert!(roots.len() >= 6, "the walk missed crates: {roots:?}");
    let found = rust_circles();
    let gone: Vec<&&str> = KNOWN
        .iter()
        .filter(|k| !found.iter().any(|f| f == *k))
        .collect();
    assert!(
        gone.is_empty(),
        "these circles of KNOWN are no longer found as written (broken or changed): delete or \
         update them:\n{}",
        gone.iter()
            .map(|g| g.to_string())
            .collect::<Vec<_>>()
            .join("\n")
    );
    let found: Vec<String> = found
        .into_iter()
        .filter(|f| !KNOWN.contains(&f.as_str()))
        .collect();
    assert!(
        found.is_empty(),
        "modules use each other in a circle (see this test's doc for the rule; move what both \
         need to a leaf module both read):\n{}",
        found.join("\n")
    );
}

#[test]
#[ignore = "prints the module graphs: cargo test --test docs print_graphs -- --ignored --nocapture"]
fn print_graphs() {
    for root in crate_roots() {
        println!("== {}", root.display());
        for (m, uses) in crate_graph(&crate_modules(&root)) {
            println!("{m} -> {}", uses.into_iter().collect::<Vec<_>>().join(", "));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The e2e scripts.

/// Every `.py` file below `e2e/` (virtual environments and caches left out), relative to `e2e/`.
fn python_files(e2e: &Path) -> Vec<PathBuf> {
    fn walk(dir: &Path, rel: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let entry = entry.unwrap();
            let name = entry.file_name().to_string_lossy().into_owned();
            let rel = rel.join(&name);
            if entry.file_type().unwrap().is_dir() {
                if !name.starts_with('.') && name != "__pycache__" {
                    walk(&entry.path(), &rel, out);
                }
            } else if name.ends_with(".py") {
                out.push(rel);
            }
        }
    }
    let mut out = Vec::new();
    walk(e2e, Path::new(""), &mut out);
    out.sort();
    out
}

/// A script's dotted name below `e2e/`: `soak`, `kv_events.wire`, `kv_events` (its
/// `__init__.py`).
fn dotted(rel: &Path) -> String {
    let s = rel
        .with_extension("")
        .display()
        .to_string()
        .replace('/', ".");
    s.strip_suffix(".__init__").unwrap_or(&s).to_string()
}

/// The modules a Python file imports, as written (`a.b`, and for `from a import b` both `a.b`
/// and `a`, the first that is a script wins), relative imports made absolute within `package`.
/// Triple-quoted strings and comments are not read.
pub fn python_imports(text: &str, package: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut in_doc = false;
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        let t = line.trim();
        if t.matches("\"\"\"").count() % 2 == 1 {
            in_doc = !in_doc;
            continue;
        }
        if in_doc {
            continue;
        }
        let t = t.split(" #").next().unwrap_or(t);
        if let Some(names) = t.strip_prefix("import ") {
            for name in names.split(',') {
                let name = name.split(" as ").next().unwrap_or("").trim();
                out.push(vec![name.to_string()]);
            }
        } else if let Some(rest) = t.strip_prefix("from ") {
            let Some((module, names)) = rest.split_once(" import ") else {
                continue;
            };
            let mut names = names.to_string();
            if names.contains('(') {
                while !names.contains(')') {
                    let Some(more) = lines.next() else { break };
                    names.push_str(more.split('#').next().unwrap_or(""));
                }
            }
            let module = match module.trim().strip_prefix('.') {
                Some("") => package.to_string(),
                Some(rel) => format!("{package}.{rel}"),
                None => module.trim().to_string(),
            };
            for name in names.trim_matches(|c| "() ".contains(c)).split(',') {
                let name = name.split(" as ").next().unwrap_or("").trim();
                if !name.is_empty() {
                    out.push(vec![format!("{module}.{name}"), module.clone()]);
                }
            }
        }
    }
    out
}

/// Who imports whom among the scripts of `e2e/`.
fn python_graph(e2e: &Path) -> Graph {
    let files = python_files(e2e);
    let names: BTreeSet<String> = files.iter().map(|f| dotted(f)).collect();
    // `sys.path` holds `e2e/`, `e2e/tests` and `e2e/replay`: a bare name is also a file there.
    let by_stem: BTreeMap<String, String> = names
        .iter()
        .filter_map(|n| {
            let (dir, stem) = n.rsplit_once('.')?;
            ["tests", "replay"]
                .contains(&dir)
                .then(|| (stem.to_string(), n.clone()))
        })
        .collect();
    let find = |name: &str| -> Option<String> {
        if names.contains(name) {
            return Some(name.to_string());
        }
        let (first, rest) = name.split_once('.').unwrap_or((name, ""));
        let full = by_stem.get(first)?;
        let joined = if rest.is_empty() {
            full.clone()
        } else {
            format!("{full}.{rest}")
        };
        names.contains(&joined).then_some(joined)
    };
    let mut graph = Graph::new();
    for file in &files {
        let me = dotted(file);
        let package = match file.file_name().is_some_and(|n| n == "__init__.py") {
            true => me.clone(),
            false => me.rsplit_once('.').map_or("", |(p, _)| p).to_string(),
        };
        let text = std::fs::read_to_string(e2e.join(file)).unwrap();
        let mut uses = BTreeSet::new();
        for candidates in python_imports(&text, &package) {
            if let Some(found) = candidates.iter().find_map(|c| find(c)) {
                if found != me {
                    uses.insert(found);
                }
            }
        }
        graph.insert(me, uses);
    }
    graph
}

#[test]
fn no_e2e_script_imports_one_that_imports_it_back() {
    let graph = python_graph(&crate::repo().join("e2e"));
    assert!(
        graph
            .get("soak_adversarial")
            .is_some_and(|u| u.contains("harness"))
            && graph
                .get("kv_events.publisher")
                .is_some_and(|u| u.contains("kv_events.wire")),
        "the scan no longer sees the e2e imports: {graph:?}"
    );
    let found = cycles(&graph);
    assert!(
        found.is_empty(),
        "e2e scripts import each other in a circle (move what both need to a script both \
         import, as e2e/soak_load.py is for the two soaks):\n{}",
        found.join("\n")
    );
}

#[test]
fn python_imports_are_read_in_every_form() {
    let text = "\"\"\"Docs.\nimport not_this\n\"\"\"\nimport a, b.c as d  # x\n\
                from e import (f,\n    g)\nfrom . import h\nfrom .i import j\n\
                def late():\n    import k\n";
    let got: Vec<Vec<String>> = python_imports(text, "pkg");
    let want: Vec<Vec<&str>> = vec![
        vec!["a"],
        vec!["b.c"],
        vec!["e.f", "e"],
        vec!["e.g", "e"],
        vec!["pkg.h", "pkg"],
        vec!["pkg.i.j", "pkg.i"],
        vec!["k"],
    ];
    assert_eq!(got, want);
}

/// A crate written to a temporary directory, `(path, text)` per file; returns its cycles.
fn cycles_of(files: &[(&str, &str)]) -> Vec<String> {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("kvpick-circles-{}-{n}", std::process::id()));
    for (path, text) in files {
        let path = dir.join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }
    let found = cycles(&crate_graph(&crate_modules(&dir.join("lib.rs"))));
    std::fs::remove_dir_all(&dir).unwrap();
    found
}

#[test]
fn the_rule_for_parents_children_and_re_exports() {
    // A child reads its parent's own type; the parent re-exports the child and calls into it:
    // the facade, no circle. The same between a grandparent and a grandchild.
    let base = [
        ("lib.rs", "mod p;\n"),
        (
            "p/mod.rs",
            "mod c;\npub struct S;\npub use c::T;\nfn f() { let _ = self::c::{T}; }\n",
        ),
        ("p/c.rs", "use super::S;\npub struct T(S);\n"),
    ];
    assert!(cycles_of(&base).is_empty());
    let deep = [
        ("lib.rs", "mod p;\n"),
        ("p/mod.rs", "mod q;\npub struct S;\npub use q::r::T;\n"),
        ("p/q/mod.rs", "pub mod r;\n"),
        ("p/q/r.rs", "use crate::p::S;\npub struct T(S);\n"),
    ];
    assert!(cycles_of(&deep).is_empty());
    // Two children of one parent that use each other are a circle, also when one reaches the
    // other through the parent's re-export; a mention in a test, a comment or a string is not.
    let siblings = [
        ("lib.rs", "mod p;\n"),
        ("p/mod.rs", "mod a;\nmod b;\npub use b::B;\n"),
        ("p/a.rs", "pub struct A(super::B);\n"),
        ("p/b.rs", "pub struct B;\nfn f() { let _ = super::a::A; }\n"),
    ];
    assert_eq!(cycles_of(&siblings), ["p::a -> p::b -> p::a"]);
    let mut test_only = siblings;
    test_only[3].1 = "pub struct B;\n#[cfg(test)]\nmod tests { use super::super::a::A; }\n\
                      // super::a::A in a comment\nconst X: &str = \"super::a::A\";\n";
    assert!(cycles_of(&test_only).is_empty());
    // A glob import of the parent brings the sibling's item in by its bare name.
    let mut glob = siblings;
    glob[2].1 = "use super::*;\npub struct A(B);\n";
    assert_eq!(cycles_of(&glob), ["p::a -> p::b -> p::a"]);
    // A name the globbing module defines itself is its own, not the sibling's.
    glob[2].1 = "use super::*;\npub struct B;\npub struct A(B);\n";
    assert!(cycles_of(&glob).is_empty());
    // A sibling module's bare name is a use only as a path's root, not as a local's name.
    glob[2].1 = "use super::*;\nfn f() { let b = 1; let _ = b; }\n";
    assert!(cycles_of(&glob).is_empty());
    glob[2].1 = "use super::*;\nfn f() { let _ = b::B; }\n";
    assert_eq!(cycles_of(&glob), ["p::a -> p::b -> p::a"]);
}

#[test]
fn a_path_through_a_facade_names_the_module_that_holds_the_item() {
    // `crate::Thing` is `b::Thing` re-exported by the root: `a` uses `b`, not the root.
    let facade = [
        (
            "lib.rs",
            "mod a;\nmod b;\npub use b::Thing;\npub use a::run;\n",
        ),
        ("a.rs", "use crate::Thing;\npub fn run(_: Thing) {}\n"),
        ("b.rs", "pub struct Thing;\n"),
    ];
    assert!(cycles_of(&facade).is_empty());
    // Defined in the root, read by a module the root re-exports: the two arrows up.
    let mut own = facade;
    own[0].1 = "mod a;\npub struct Thing;\npub use a::run;\n";
    own[2] = ("unused.rs", "");
    assert_eq!(cycles_of(&own), ["a -> crate -> a"]);
}

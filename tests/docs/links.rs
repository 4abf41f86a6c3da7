//! The book holds together: every page under `docs/` is linked from the table of contents
//! (`docs/README.md`), every page of `docs/` opens with a sentence saying what it is for, and
//! every relative link in `docs/` and `README.md` reaches a file, or a heading of it when it
//! names an `#anchor` (GitHub's anchor rules). External links are not fetched.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};

const CONTENTS: &str = "docs/README.md";

/// Every Markdown file the book is made of, relative to the repository: `README.md` and `docs/**`.
fn pages() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(crate::repo().join(dir)).unwrap() {
            let entry = entry.unwrap();
            let rel = dir.join(entry.file_name());
            if entry.path().is_dir() {
                walk(&rel, out);
            } else if rel.extension().is_some_and(|e| e == "md") {
                out.push(rel);
            }
        }
    }
    let mut out = vec![PathBuf::from("README.md")];
    walk(Path::new("docs"), &mut out);
    out.sort();
    out
}

/// The page's lines outside fenced code blocks (```` ``` ```` or `~~~`), numbered from 1.
fn outside_fences(text: &str) -> Vec<(usize, &str)> {
    let mut fence: Option<&str> = None;
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        if let Some(f) = fence {
            if trimmed.starts_with(f) {
                fence = None;
            }
            continue;
        }
        if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
            fence = Some(&trimmed[..3]);
            continue;
        }
        out.push((n + 1, line));
    }
    out
}

/// The page's lines outside fenced code blocks, with inline code spans blanked out, numbered.
fn prose(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line) in outside_fences(text) {
        let mut kept = String::new();
        let mut in_code = false;
        for c in line.chars() {
            if c == '`' {
                in_code = !in_code;
                kept.push('`');
            } else if !in_code {
                kept.push(c);
            }
        }
        out.push((n, kept));
    }
    out
}

/// GitHub's anchor for a heading: inline markup dropped, lower case, spaces to hyphens, every
/// character other than a letter, digit, `-` or `_` removed.
fn slug(heading: &str) -> String {
    // Links keep their text: `[text](url)` -> `text`.
    let mut text = String::new();
    let mut rest = heading;
    while let Some(open) = rest.find('[') {
        match rest[open..]
            .find("](")
            .and_then(|m| rest[open + m..].find(')').map(|c| (open + m, open + m + c)))
        {
            Some((mid, close)) => {
                text.push_str(&rest[..open]);
                text.push_str(&rest[open + 1..mid]);
                rest = &rest[close + 1..];
            }
            None => break,
        }
    }
    text.push_str(rest);
    text.trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// Every anchor a page defines: its headings (with `-1`, `-2` for repeats) and HTML ids.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    for (_, line) in outside_fences(text) {
        if let Some(h) = line.strip_prefix('#') {
            let h = h.trim_start_matches('#');
            if h.starts_with(' ') {
                let base = slug(h);
                let n = seen.entry(base.clone()).or_insert(0);
                out.insert(if *n == 0 {
                    base.clone()
                } else {
                    format!("{base}-{n}")
                });
                *n += 1;
            }
        }
        for attr in ["id=\"", "name=\""] {
            for (i, _) in line.match_indices(attr) {
                if let Some(end) = line[i + attr.len()..].find('"') {
                    out.insert(line[i + attr.len()..i + attr.len() + end].to_string());
                }
            }
        }
    }
    out
}

/// `(line, target)` of every inline link `[text](target)` in the page's prose.
fn links(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line) in prose(text) {
        let mut rest = line.as_str();
        while let Some(i) = rest.find("](") {
            let after = &rest[i + 2..];
            let Some(end) = after.find(')') else { break };
            let target = after[..end].split_whitespace().next().unwrap_or("");
            out.push((n, target.to_string()));
            rest = &after[end..];
        }
    }
    out
}

/// `dir/rel` with `.` and `..` resolved, still relative to the repository.
fn join(dir: &Path, rel: &str) -> PathBuf {
    let mut out = PathBuf::new();
    for part in dir.join(rel).components() {
        match part {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

#[test]
fn every_relative_link_and_anchor_resolves() {
    let mut broken = Vec::new();
    for page in pages() {
        let text = crate::read(&page);
        let dir = page.parent().unwrap_or(Path::new(""));
        for (line, target) in links(&text) {
            if target.contains("://") || target.starts_with("mailto:") || target.is_empty() {
                continue;
            }
            let (path, anchor) = match target.split_once('#') {
                Some((p, a)) => (p, Some(a)),
                None => (target.as_str(), None),
            };
            let file = if path.is_empty() {
                page.clone()
            } else {
                join(dir, path)
            };
            let at = format!("{}:{line}: ({target})", page.display());
            if !crate::repo().join(&file).exists() {
                broken.push(format!("{at}: no file {}", file.display()));
                continue;
            }
            if let Some(anchor) = anchor {
                if file.extension().is_none_or(|e| e != "md") {
                    broken.push(format!("{at}: an anchor into a file that is not Markdown"));
                } else if !anchors(&crate::read(&file)).contains(anchor) {
                    broken.push(format!("{at}: no heading #{anchor} in {}", file.display()));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn every_page_is_in_the_table_of_contents() {
    let contents = crate::read(CONTENTS);
    let linked: BTreeSet<PathBuf> = links(&contents)
        .into_iter()
        .map(|(_, t)| join(Path::new("docs"), t.split('#').next().unwrap_or("")))
        .collect();
    let missing: Vec<String> = pages()
        .into_iter()
        .filter(|p| p.starts_with("docs") && p != Path::new(CONTENTS) && !linked.contains(p))
        .map(|p| p.display().to_string())
        .collect();
    assert!(
        missing.is_empty(),
        "pages not linked from {CONTENTS}: {missing:?}"
    );
}

#[test]
fn every_page_opens_with_what_it_is_for() {
    let mut bad = Vec::new();
    for page in pages().into_iter().filter(|p| p.starts_with("docs")) {
        let text = crate::read(&page);
        let mut lines = text.lines().filter(|l| !l.trim().is_empty());
        let title = lines.next().unwrap_or("");
        let first = lines.next().unwrap_or("");
        let opens_with_prose =
            !first.starts_with(['#', '|', '-', '*', '<', '>', '!']) && !first.starts_with("```");
        if !title.starts_with("# ") || !opens_with_prose {
            bad.push(format!("{}: {title:?} / {first:?}", page.display()));
        }
    }
    assert!(
        bad.is_empty(),
        "pages that do not open with a `# Title` and a sentence saying what they are for:\n{}",
        bad.join("\n")
    );
}

#[test]
fn slugs_follow_github() {
    assert_eq!(
        slug("Flags (`kvpick serve --help`)"),
        "flags-kvpick-serve---help"
    );
    assert_eq!(
        slug("Prefill/decode disaggregation"),
        "prefilldecode-disaggregation"
    );
    assert_eq!(
        slug("Deploy on Kubernetes in five minutes"),
        "deploy-on-kubernetes-in-five-minutes"
    );
    assert_eq!(slug("A [link](x.md) in a heading"), "a-link-in-a-heading");
    let a = anchors("# A\n## A\n```\n# not a heading\n```\n<a id=\"x\"></a>\n");
    assert_eq!(a, ["a", "a-1", "x"].iter().map(|s| s.to_string()).collect());
}

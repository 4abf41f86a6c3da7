//! The header table of `docs/headers.md` names every header kvpick reads or writes: each
//! `x-...` header name written as a string literal in `src/` or `crates/kvpick-core/src/` (test
//! files and inline test modules left out), and each value of a constant named for a header
//! (`*HEADER*`, `TRACEPARENT`, `TRACESTATE`), must appear backticked in the first cell of a row;
//! and every `x-...` name in the table must still be in the code, so the table cannot keep a
//! header kvpick no longer speaks.

use std::collections::BTreeSet;

const PAGE: &str = "docs/headers.md";
const SOURCES: &[&str] = &["src", "crates/kvpick-core/src"];
/// Header-like names in the code that are not HTTP headers: the page must still say what they
/// are (outside the table).
const NOT_HTTP: &[&str] = &["x-anthropic-billing-header"];

/// The code before its inline test module, if any.
fn without_tests(text: &str) -> &str {
    text.find("#[cfg(test)]\nmod tests {")
        .map_or(text, |i| &text[..i])
}

/// Every plain string literal of `text` (byte strings and raw strings left out) with the name of
/// the `const` it initialises, when it is in one.
fn literals(text: &str) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    for line in text.lines() {
        let constant = line
            .trim_start()
            .strip_prefix("pub ")
            .unwrap_or(line.trim_start())
            .strip_prefix("const ")
            .and_then(|rest| rest.split(':').next())
            .map(str::to_string);
        let bytes = line.as_bytes();
        let mut i = 0;
        while let Some(start) = line[i..].find('"').map(|s| s + i) {
            let Some(end) = line[start + 1..].find('"').map(|e| e + start + 1) else {
                break;
            };
            let prefixed = start > 0 && matches!(bytes[start - 1], b'b' | b'r' | b'#' | b'\\');
            if !prefixed {
                out.push((line[start + 1..end].to_string(), constant.clone()));
            }
            i = end + 1;
        }
    }
    out
}

fn is_header_name(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.ends_with('-')
        && s.starts_with(|c: char| c.is_ascii_lowercase())
}

/// The header names the code speaks.
fn code_headers() -> BTreeSet<String> {
    // Test files are left out: they send headers the code does not speak.
    let files = SOURCES
        .iter()
        .flat_map(|dir| crate::rust_files(&crate::repo().join(dir)))
        .filter(|p| !p.to_string_lossy().ends_with("tests.rs"));
    let mut names = BTreeSet::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        for (value, constant) in literals(without_tests(&text)) {
            let named = constant
                .as_deref()
                .is_some_and(|c| c.contains("HEADER") || c == "TRACEPARENT" || c == "TRACESTATE");
            // Flag defaults pair headers (`SESSION=PARENT`) or list them (`A,B`).
            for part in value.split([',', '=']) {
                if is_header_name(part) && (part.starts_with("x-") || named) {
                    names.insert(part.to_string());
                }
            }
        }
    }
    names
}

#[test]
fn the_header_table_names_every_header_of_the_code() {
    let page = crate::read(PAGE);
    let table = crate::first_cell_names(&page, "## The table");
    let code = code_headers();
    assert!(
        code.contains("x-llm-d-inference-fairness-id") && code.contains("traceparent"),
        "the scan finds the code's headers: {code:?}"
    );
    let missing: Vec<&String> = code
        .iter()
        .filter(|h| !table.contains(*h) && !NOT_HTTP.contains(&h.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "{PAGE}: headers of the code missing from the table: {missing:?}"
    );
    for name in NOT_HTTP {
        assert!(
            page.contains(&format!("`{name}`")),
            "{PAGE} must say what {name} is"
        );
    }
    let stale: Vec<&String> = table
        .iter()
        .filter(|h| h.starts_with("x-") && !code.contains(*h))
        .collect();
    assert!(
        stale.is_empty(),
        "{PAGE}: table rows no code reads or writes: {stale:?}"
    );
}

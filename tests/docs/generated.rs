//! Generated sections of a documentation page: the text between
//! `<!-- BEGIN GENERATED: NAME -->` and `<!-- END GENERATED: NAME -->` must equal what the
//! generator renders; with `KVPICK_UPDATE_DOCS=1` the section is rewritten instead.

use crate::{read, repo, REGENERATE};

fn markers(name: &str) -> (String, String) {
    (
        format!("<!-- BEGIN GENERATED: {name} (edit the source, then run `{REGENERATE}`) -->\n"),
        format!("<!-- END GENERATED: {name} -->"),
    )
}

/// Byte range of the section `name` inside `text` (the page `rel`), markers excluded.
fn span(rel: &str, text: &str, name: &str) -> (usize, usize) {
    let (begin, end) = markers(name);
    let start = text
        .find(&begin)
        .unwrap_or_else(|| panic!("{rel}: no line `{}`", begin.trim_end()))
        + begin.len();
    let stop = start
        + text[start..]
            .find(&end)
            .unwrap_or_else(|| panic!("{rel}: no line `{end}` after the BEGIN marker"));
    (start, stop)
}

/// The committed text of the section `name` of the page `rel`.
pub fn section(rel: &str, name: &str) -> String {
    let text = read(rel);
    let (start, stop) = span(rel, &text, name);
    text[start..stop].to_string()
}

/// Checks (or, with `KVPICK_UPDATE_DOCS=1`, rewrites) the section `name` of the page `rel`.
pub fn check(rel: &str, name: &str, rendered: &str) {
    let text = read(rel);
    let (start, stop) = span(rel, &text, name);
    let current = &text[start..stop];
    if current == rendered {
        return;
    }
    if std::env::var_os("KVPICK_UPDATE_DOCS").is_some_and(|v| v == "1") {
        let updated = format!("{}{rendered}{}", &text[..start], &text[stop..]);
        std::fs::write(repo().join(rel), updated).unwrap();
        eprintln!("{rel}: rewrote the generated section `{name}`");
        return;
    }
    let first_difference = current
        .lines()
        .zip(rendered.lines())
        .position(|(a, b)| a != b)
        .unwrap_or(current.lines().count().min(rendered.lines().count()));
    let page_line = current
        .lines()
        .nth(first_difference)
        .unwrap_or("(end of section)");
    let want_line = rendered
        .lines()
        .nth(first_difference)
        .unwrap_or("(end of section)");
    panic!(
        "{rel}: the generated section `{name}` is out of date (first difference at its line {}):\n  \
         page:      {page_line}\n  generated: {want_line}\nRegenerate it with:\n  {REGENERATE}",
        first_difference + 1
    );
}

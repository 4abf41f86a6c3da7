//! The metric reference of `docs/observability.md`, generated from the metric definitions in
//! `src/` and `crates/kvpick-tokenize/src/`: every `prometheus` constructor call whose first argument is a `"kvpick_..."` literal
//! (or one of the EPP contract's prefixes, [`PREFIXES`])
//! (`IntCounterVec::new(Opts::new(NAME, HELP), &[LABELS])`, `IntGauge::new(NAME, HELP)`,
//! `HistogramVec::new(HistogramOpts::new(NAME, HELP)..., &[LABELS])`, ...) gives one row: name,
//! type, labels and help. A gauge whose help is `"unexported"` is a stand-in nobody registers
//! (`extproc::budget`'s unmetered budget) and is left out. Reading the source rather than a live
//! registry lists labelled metrics before any label value exists, and the ones registered only
//! with a flag (`--shared-state`, `--tokenizer-config`).

use std::collections::BTreeMap;

const PAGE: &str = "docs/observability.md";
/// Names of the families kvpick exports (`--metrics-families`): its own and the EPP contract's.
const PREFIXES: &[&str] = &[
    "kvpick_",
    "llm_d_epp_",
    "inference_objective_",
    "inference_pool_",
    "inference_extension_",
];
const SECTION: &str = "metrics";

/// Constructors, longest first so `IntCounterVec` is not read as `IntCounter`.
const CONSTRUCTORS: &[(&str, &str)] = &[
    // src/observability/epp_metrics/series.rs's helpers (one registered metric each).
    ("epp_histogram_vec(", "histogram"),
    ("epp_histogram(", "histogram"),
    ("epp_counter(", "counter"),
    ("epp_fgauge(", "gauge"),
    ("epp_gauge(", "gauge"),
    ("IntCounterVec::new", "counter"),
    ("IntGaugeVec::new", "gauge"),
    ("HistogramVec::new", "histogram"),
    ("CounterVec::new", "counter"),
    ("GaugeVec::new", "gauge"),
    ("IntCounter::with_opts", "counter"),
    ("IntGauge::with_opts", "gauge"),
    ("Histogram::with_opts", "histogram"),
    ("IntCounter::new", "counter"),
    ("IntGauge::new", "gauge"),
    ("Counter::new", "counter"),
    ("Gauge::new", "gauge"),
];

#[derive(Debug)]
struct Metric {
    kind: &'static str,
    labels: Vec<String>,
    help: String,
    file: String,
}

/// A Rust string literal starting at `s[0] == '"'`: its value and the bytes it spans.
fn string_literal(s: &str) -> (String, usize) {
    assert!(
        s.starts_with('"'),
        "not a string literal: {}",
        &s[..s.len().min(40)]
    );
    let mut value = String::new();
    let mut chars = s.char_indices().skip(1).peekable();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return (value, i + 1),
            '\\' => match chars.next() {
                // A line continuation drops the newline and the next line's indentation.
                Some((_, '\n')) => {
                    while chars.peek().is_some_and(|(_, c)| c.is_whitespace()) {
                        chars.next();
                    }
                }
                Some((_, 'n')) => value.push('\n'),
                Some((_, other)) => value.push(other),
                None => break,
            },
            c => value.push(c),
        }
    }
    panic!("unterminated string literal");
}

/// The constructor call ending just before `at` in `text`, if one is within 200 bytes.
fn constructor_before(text: &str, at: usize) -> Option<(usize, &'static str, &'static str)> {
    let from = at.saturating_sub(200);
    let window = &text[from..at];
    CONSTRUCTORS
        .iter()
        .filter_map(|(call, kind)| {
            window
                .rmatch_indices(call)
                // `IntCounter::new` must not match inside `IntCounterVec::new`'s tail.
                .find(|(i, _)| {
                    !window[..*i].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_')
                })
                .map(|(i, _)| (from + i, *call, *kind))
        })
        .max_by_key(|(i, _, _)| *i)
}

/// The labels of the constructor call starting at `call[0]`: the `&["a", "b"]` among its own
/// arguments (not inside a nested call such as `Opts::new(..)` or `.buckets(..)`).
fn labels_of(call: &str, name: &str) -> Vec<String> {
    let open = call.find('(').unwrap();
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    let bytes = call.as_bytes();
    for i in open..call.len() {
        let c = bytes[i];
        if in_string {
            match c {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            b'"' => in_string = true,
            b'(' | b'[' => depth += 1,
            b')' | b']' => {
                depth -= 1;
                if depth == 0 {
                    return Vec::new();
                }
            }
            b'&' if depth == 1 && call[i..].starts_with("&[") => {
                let list = &call[i + 2..];
                let close = list.find(']').unwrap();
                return list[..close]
                    .split(',')
                    .map(|l| l.trim().trim_matches('"').to_string())
                    .filter(|l| !l.is_empty())
                    .collect();
            }
            _ => {}
        }
    }
    panic!("{name}: unbalanced constructor call");
}

fn metrics() -> BTreeMap<String, Metric> {
    // The host and the tokenizer crate (its metrics register on the host's registry).
    let mut files = crate::rust_files(&crate::repo().join("src"));
    files.extend(crate::rust_files(
        &crate::repo().join("crates/kvpick-tokenize/src"),
    ));
    files.sort();
    let mut out = BTreeMap::new();
    for path in files {
        let text = std::fs::read_to_string(&path).unwrap();
        let file = path
            .strip_prefix(crate::repo())
            .unwrap()
            .display()
            .to_string();
        let starts = PREFIXES
            .iter()
            .flat_map(|p| {
                let quoted = format!("\"{p}");
                text.match_indices(&quoted)
                    .map(|(at, _)| at)
                    .collect::<Vec<_>>()
            })
            .collect::<Vec<_>>();
        for at in starts {
            let Some((call_at, call, kind)) = constructor_before(&text, at) else {
                continue;
            };
            let (name, len) = string_literal(&text[at..]);
            let rest = &text[at + len..];
            let help_at = rest
                .find('"')
                .unwrap_or_else(|| panic!("{file}: {name} has no help text"));
            let (help, _) = string_literal(&rest[help_at..]);
            if help == "unexported" {
                continue;
            }
            let labels = labels_of(&text[call_at..], &name);
            let labelled =
                call.contains("Vec") || (call.starts_with("epp_") && call != "epp_histogram(");
            assert!(
                !(labelled && labels.is_empty()),
                "{file}: cannot read the labels of {name}: write them as a literal `&[\"a\", \"b\"]`"
            );
            let previous = out.insert(
                name.clone(),
                Metric {
                    kind,
                    labels,
                    help,
                    file: file.clone(),
                },
            );
            if let Some(p) = previous {
                panic!("{name} is defined twice: {} and {file}", p.file);
            }
        }
    }
    out
}

fn render() -> String {
    let mut out =
        String::from("\n| metric | type | labels | help | defined in |\n|---|---|---|---|---|\n");
    for (name, m) in metrics() {
        let labels = if m.labels.is_empty() {
            "—".to_string()
        } else {
            m.labels
                .iter()
                .map(|l| format!("`{l}`"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let help = m
            .help
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
            .replace('|', "\\|");
        out.push_str(&format!(
            "| `{name}` | {} | {labels} | {help} | `{}` |\n",
            m.kind, m.file
        ));
    }
    out.push('\n');
    out
}

#[test]
fn the_metric_reference_lists_every_metric_defined_in_src() {
    let all = metrics();
    assert!(all.len() >= 40, "found only {} metrics: {all:?}", all.len());
    assert_eq!(
        all["kvpick_queue_wait_seconds"].labels,
        ["priority", "fairness"]
    );
    assert_eq!(all["kvpick_inflight_total"].kind, "gauge");
    assert_eq!(
        all["llm_d_epp_request_total"].labels,
        ["model_name", "target_model_name", "fairness_id", "priority"]
    );
    assert_eq!(all["inference_pool_ready_pods"].labels, ["name"]);
    crate::generated::check(PAGE, SECTION, &render());
}

//! The `--flow-config` file: objectives and model rewrite rules in YAML, for running without
//! Kubernetes (or on top of it). Parsed strictly (unknown fields, bad weights, duplicate names fail
//! with the entry named); re-read when its content changes, like the static catalog: a valid edit is
//! published, an invalid one is logged and the last good version stays in force.
//!
//! ```yaml
//! objectives:
//!   - name: interactive
//!     priority: 100
//!   - name: batch
//!     priority: -10          # negative = sheddable
//! rewrites:
//!   - matches: [llama-3]     # requested model names; empty or absent = every model no rule names
//!     targets:
//!       - model: llama-3-v1
//!         weight: 90
//!       - model: llama-3-v2
//!         weight: 10         # weights: all or none (none = equal shares), 1..=1000000
//! ```

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use serde::Deserialize;
use tokio::sync::watch;

use super::{
    Objective, Origin, RewriteRule, WeightedModel, MAX_OBJECTIVES, MAX_OBJECTIVE_LEN,
    MAX_REWRITE_RULES,
};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FlowFile {
    #[serde(default)]
    objectives: Vec<FileObjective>,
    #[serde(default)]
    rewrites: Vec<FileRule>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileObjective {
    name: String,
    #[serde(default)]
    priority: i32,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileRule {
    #[serde(default)]
    matches: Vec<String>,
    targets: Vec<FileTarget>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileTarget {
    model: String,
    #[serde(default)]
    weight: Option<u32>,
}

/// The file's content: objectives and rules, validated.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FlowFileContent {
    pub objectives: Vec<Objective>,
    pub rules: Vec<RewriteRule>,
}

/// Turns GIE-style weights (all set or none set) into explicit ones.
pub(crate) fn weights(
    targets: impl IntoIterator<Item = (String, Option<u32>)>,
) -> Result<Vec<WeightedModel>, String> {
    let targets: Vec<(String, Option<u32>)> = targets.into_iter().collect();
    let set = targets.iter().filter(|(_, w)| w.is_some()).count();
    if set != 0 && set != targets.len() {
        return Err("weights must be set for all targets of a rule, or for none".into());
    }
    Ok(targets
        .into_iter()
        .map(|(model, weight)| WeightedModel {
            model,
            weight: weight.unwrap_or(1),
        })
        .collect())
}

/// Parses and validates the flow-config YAML.
pub fn parse_flow_config(text: &str) -> anyhow::Result<FlowFileContent> {
    let file: FlowFile = serde_yaml::from_str(text).context("invalid flow-config YAML")?;
    if file.objectives.len() > MAX_OBJECTIVES {
        bail!("at most {MAX_OBJECTIVES} objectives");
    }
    if file.rewrites.len() > MAX_REWRITE_RULES {
        bail!("at most {MAX_REWRITE_RULES} rewrite rules");
    }
    let mut names = BTreeSet::new();
    let mut objectives = Vec::with_capacity(file.objectives.len());
    for (i, o) in file.objectives.into_iter().enumerate() {
        let label = || format!("objectives[{i}] ({})", o.name);
        if o.name.is_empty() || o.name.len() > MAX_OBJECTIVE_LEN {
            bail!("{}: `name` must be 1..={MAX_OBJECTIVE_LEN} bytes", label());
        }
        if !o.name.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
            bail!(
                "{}: `name` must be printable ASCII without spaces (it is sent in a header)",
                label()
            );
        }
        if !names.insert(o.name.clone()) {
            bail!("{}: duplicate objective name", label());
        }
        objectives.push(Objective {
            name: o.name,
            priority: o.priority,
            pool: None,
            origin: Origin::File,
        });
    }
    let mut rules = Vec::with_capacity(file.rewrites.len());
    for (i, r) in file.rewrites.into_iter().enumerate() {
        let label = format!("rewrites[{i}]");
        let targets = weights(r.targets.into_iter().map(|t| (t.model, t.weight)))
            .map_err(anyhow::Error::msg)
            .with_context(|| label.clone())?;
        let rule = RewriteRule {
            source: format!("file#{i}"),
            matches: r.matches,
            targets,
        };
        rule.validate()
            .map_err(anyhow::Error::msg)
            .with_context(|| label.clone())?;
        rules.push(rule);
    }
    Ok(FlowFileContent { objectives, rules })
}

/// Reads and parses the file once (start-up: an error here fails `kvpick serve`).
pub fn load_flow_config(path: &Path) -> anyhow::Result<(String, FlowFileContent)> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read flow-config file {}", path.display()))?;
    let content = parse_flow_config(&text)
        .with_context(|| format!("in flow-config file {}", path.display()))?;
    Ok((text, content))
}

/// Polls the file every `interval` and publishes each new valid version into `tx` (a missing file
/// mid-swap, or an invalid edit, keeps the last good version; `on_invalid` counts the latter).
/// Returns when every receiver is gone.
pub async fn watch_flow_config(
    path: PathBuf,
    initial: String,
    interval: Duration,
    tx: watch::Sender<FlowFileContent>,
    on_invalid: impl Fn(&anyhow::Error) + Send + 'static,
) {
    let mut last_text = initial;
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = tx.closed() => return,
        }
        let text = match tokio::fs::read_to_string(&path).await {
            Ok(text) => text,
            Err(err) => {
                tracing::debug!(path = %path.display(), %err, "flow-config file unreadable, keeping the last policy");
                continue;
            }
        };
        if text == last_text {
            continue;
        }
        match parse_flow_config(&text) {
            Ok(content) => {
                tracing::info!(
                    path = %path.display(),
                    objectives = content.objectives.len(),
                    rewrites = content.rules.len(),
                    "flow-config file changed"
                );
                if tx.send(content).is_err() {
                    return;
                }
            }
            Err(err) => {
                tracing::error!(path = %path.display(), error = format!("{err:#}"), "flow-config file invalid, keeping the last good policy");
                on_invalid(&err);
            }
        }
        last_text = text;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_objectives_and_weighted_rewrites() {
        let c = parse_flow_config(
            r#"
objectives:
  - {name: interactive, priority: 100}
  - {name: batch, priority: -10}
  - {name: plain}
rewrites:
  - matches: [llama-3]
    targets: [{model: v1, weight: 90}, {model: v2, weight: 10}]
  - targets: [{model: fallback-a}, {model: fallback-b}]
"#,
        )
        .unwrap();
        let prio: Vec<(&str, i32)> = c
            .objectives
            .iter()
            .map(|o| (o.name.as_str(), o.priority))
            .collect();
        assert_eq!(prio, [("interactive", 100), ("batch", -10), ("plain", 0)]);
        assert_eq!(c.rules[0].matches, ["llama-3"]);
        assert_eq!(c.rules[0].targets[1].weight, 10);
        assert!(c.rules[1].matches.is_empty());
        assert_eq!(
            c.rules[1]
                .targets
                .iter()
                .map(|t| t.weight)
                .collect::<Vec<_>>(),
            [1, 1],
            "no weights = equal shares"
        );
        assert_eq!(parse_flow_config("{}").unwrap(), FlowFileContent::default());
    }

    #[test]
    fn errors_name_the_entry() {
        let cases = [
            (
                "objectives: [{name: a}, {name: a}]",
                "objectives[1] (a): duplicate",
            ),
            ("objectives: [{name: ''}]", "objectives[0]"),
            ("objectives: [{name: 'a b'}]", "printable ASCII"),
            (
                "objectives: [{name: a, priority: 1.5}]",
                "invalid flow-config YAML",
            ),
            (
                "objectives: [{name: a, priority: 3000000000}]",
                "invalid flow-config YAML",
            ),
            ("objectives: [{name: a, colour: red}]", "unknown field"),
            (
                "rewrites: [{matches: [m], targets: [{model: x, weight: 1}, {model: y}]}]",
                "rewrites[0]: weights must be set for all",
            ),
            (
                "rewrites: [{matches: [m], targets: []}]",
                "rewrites[0]: a rewrite rule needs",
            ),
            (
                "rewrites: [{matches: [m], targets: [{model: x, weight: 0}]}]",
                "weight must be 1..=1000000",
            ),
            (
                "rewrites: [{matches: [m], targets: [{model: x, weight: 1000001}]}]",
                "weight must be",
            ),
            (
                "rewrites: [{matches: [''], targets: [{model: x}]}]",
                "must not be empty",
            ),
        ];
        for (yaml, want) in cases {
            let err = format!("{:#}", parse_flow_config(yaml).unwrap_err());
            assert!(err.contains(want), "{yaml}: {err}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn reload_publishes_valid_edits_and_keeps_the_last_good_one() {
        let dir = std::env::temp_dir().join(format!("kvpick-flow-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("flow.yaml");
        let v1 = "objectives: [{name: a, priority: 1}]";
        std::fs::write(&path, v1).unwrap();
        let (text, initial) = load_flow_config(&path).unwrap();
        let (tx, mut rx) = watch::channel(initial);
        let (bad_tx, mut bad_rx) = tokio::sync::mpsc::unbounded_channel();
        let task = tokio::spawn(watch_flow_config(
            path.clone(),
            text,
            Duration::from_secs(1),
            tx,
            move |err| {
                let _ = bad_tx.send(format!("{err:#}"));
            },
        ));
        std::fs::write(&path, "objectives: [{name: a, priority: 2}]").unwrap();
        rx.changed().await.unwrap();
        assert_eq!(rx.borrow_and_update().objectives[0].priority, 2);
        std::fs::write(&path, "objectives: [{name: a, priority: x}]").unwrap();
        let err = bad_rx.recv().await.unwrap();
        assert!(err.contains("invalid flow-config YAML"), "{err}");
        assert!(!rx.has_changed().unwrap(), "the bad edit is not published");
        assert_eq!(rx.borrow().objectives[0].priority, 2, "last good kept");
        std::fs::write(&path, "objectives: [{name: b, priority: 3}]").unwrap();
        rx.changed().await.unwrap();
        assert_eq!(rx.borrow().objectives[0].name, "b");
        drop(rx);
        task.await.unwrap();
        std::fs::remove_dir_all(dir).unwrap();
        assert!(
            load_flow_config(&path).is_err(),
            "missing file fails start-up"
        );
    }
}

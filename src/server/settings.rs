//! `kvpick serve --settings FILE`: a YAML file holding any `serve` flag by its long name, for
//! GitOps. It owns reading the file, turning its keys into command-line arguments, the
//! precedence (flag > environment > file > default), and the reload loop that swaps the live
//! settings into the core. Clap stays the single source of truth: every file value is parsed by
//! clap as if it were given on the command line (before the user's own arguments, and only for
//! flags whose value is still the default), and checked by `server::core_config` like a flag.
//! It must not duplicate flag definitions or their validation, and touches the core only through
//! [`kvpick_core::Core::update_live_config`].

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use clap::parser::ValueSource;
use clap::{ArgAction, ArgMatches, Args, FromArgMatches};
use prometheus::{Gauge, IntCounterVec, Opts, Registry};

use crate::selection::SelectionCore;
use crate::server::{core_config, ServeArgs};

/// Flags whose change in the file takes effect without a restart (the core's
/// [`kvpick_core::LiveConfig`]); any other changed key is logged as needing a restart.
pub const LIVE_KEYS: &[&str] = &[
    "overlap-score-credit",
    "prefill-load-scale",
    "decode-block-weight",
    "decode-active-request-weight",
    "router-temperature",
    "stall-weight",
    "ttft-slack",
    "engine-waiting-weight",
    "engine-kv-usage-weight",
    "adapter-load-weight",
    "adapter-full-weight",
    "active-decode-blocks-threshold",
    "active-prefill-tokens-threshold",
    "sheddable-threshold-fraction",
    "queue-timeout",
    "saturation-wait",
    "saturation-max-requests",
    "saturation-engine-waiting",
    "saturation-kv-usage",
    "session-soft-margin",
];

/// Largest settings file read (a settings file is a few hundred bytes).
pub const MAX_SETTINGS_BYTES: usize = 1 << 20;

/// Keys that are not settings.
const NOT_SETTINGS: &[&str] = &["settings", "help", "version"];

/// What a settings file contributed: kept to compare the next version against.
#[derive(Debug, Clone)]
pub struct Loaded {
    pub path: PathBuf,
    /// The user's `serve` arguments (after `serve`), parsed again with every reload.
    user_args: Vec<OsString>,
    /// Keys taken from the file (not overridden by a flag or the environment) -> arguments.
    injected: BTreeMap<String, Vec<String>>,
    /// The file's text at the last load (invalid versions included: each is reported once).
    text: String,
}

/// One top-level key of the file, as written.
struct Raw {
    key: String,
    line: Option<usize>,
    value: serde_yaml::Value,
}

/// One key of the file turned into arguments.
struct Entry {
    key: String,
    /// The flag's long name (`key` may be an alias).
    long: String,
    line: Option<usize>,
    argv: Vec<String>,
}

/// The `kvpick serve` command alone, as clap sees it.
fn serve_command() -> clap::Command {
    ServeArgs::augment_args(clap::Command::new("kvpick-serve").no_binary_name(true))
}

/// The `serve` arguments of this process: everything after the first `serve`.
pub fn serve_argv() -> Vec<OsString> {
    let mut args = std::env::args_os().skip(1);
    args.by_ref().find(|a| a == "serve");
    args.collect()
}

/// `args` with `--settings` applied (unchanged without it): the file's keys parsed by clap as
/// flags, below the command line and the environment. Errors name the file, line and key.
pub fn apply(args: ServeArgs, user_args: Vec<OsString>) -> anyhow::Result<ServeArgs> {
    let Some(path) = args.settings.clone() else {
        return Ok(args);
    };
    let text = read(&path)?;
    let (mut resolved, injected) = resolve(&path, &text, &user_args)?;
    resolved.settings_loaded = Some(Arc::new(Loaded {
        path,
        user_args,
        injected,
        text,
    }));
    Ok(resolved)
}

/// At most one byte more than [`MAX_SETTINGS_BYTES`] of the file (so an oversized file is seen
/// as one without reading it all).
fn read_bounded(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(path)?
        .take(MAX_SETTINGS_BYTES as u64 + 1)
        .read_to_end(&mut bytes)?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// The file at start-up, refused past [`MAX_SETTINGS_BYTES`].
fn read(path: &Path) -> anyhow::Result<String> {
    let text = read_bounded(path)
        .with_context(|| format!("cannot read settings file {}", path.display()))?;
    if text.len() > MAX_SETTINGS_BYTES {
        bail!(
            "settings file {} is over the {MAX_SETTINGS_BYTES}-byte limit",
            path.display()
        );
    }
    Ok(text)
}

/// Where a key is written, for messages.
fn at(path: &Path, key: &str, line: Option<usize>) -> String {
    match line {
        Some(n) => format!("settings file {} line {n}: `{key}`", path.display()),
        None => format!("settings file {}: `{key}`", path.display()),
    }
}

/// Parses the user's arguments with the file's keys injected where the value is still the
/// default, and checks the result like `serve` does. Returns the arguments and what was taken.
fn resolve(
    path: &Path,
    text: &str,
    user_args: &[OsString],
) -> anyhow::Result<(ServeArgs, BTreeMap<String, Vec<String>>)> {
    let entries =
        parse_entries(text).map_err(|e| anyhow!("settings file {}: {e}", path.display()))?;
    let user = serve_command()
        .try_get_matches_from(user_args)
        .map_err(|e| anyhow!("{}", first_line(&e.to_string())))?;
    let taken = take(path, entries, &user)?;
    let argv = |only: Option<&Entry>| -> Vec<OsString> {
        let injected = taken.iter().filter(|e| only.is_none_or(|o| o.key == e.key));
        injected
            .flat_map(|e| e.argv.iter().map(OsString::from))
            .chain(user_args.iter().cloned())
            .collect()
    };
    let matches = match serve_command().try_get_matches_from(argv(None)) {
        Ok(m) => m,
        Err(err) => {
            // Name the key: the first one clap refuses on its own.
            let culprit = taken
                .iter()
                .find(|e| serve_command().try_get_matches_from(argv(Some(e))).is_err());
            let message = first_line(&err.to_string());
            return Err(match culprit {
                Some(e) => anyhow!("{}: {message}", at(path, &e.key, e.line)),
                None => anyhow!("settings file {}: {message}", path.display()),
            });
        }
    };
    let args = ServeArgs::from_arg_matches(&matches).map_err(|e| anyhow!("{e}"))?;
    if let Err(err) = core_config(&args) {
        let message = format!("{err:#}");
        let culprit = taken.iter().find(|e| names_flag(&message, &e.long));
        return Err(match culprit {
            Some(e) => anyhow!("{}: {message}", at(path, &e.key, e.line)),
            None => err,
        });
    }
    let injected = taken.into_iter().map(|e| (e.key, e.argv)).collect();
    Ok((args, injected))
}

/// The file's keys as arguments, leaving out those the command line or environment set.
fn take(path: &Path, entries: Vec<Raw>, user: &ArgMatches) -> anyhow::Result<Vec<Entry>> {
    let command = serve_command();
    let mut taken = Vec::new();
    for raw in entries {
        let arg = command.get_arguments().find(|a| {
            !NOT_SETTINGS.contains(&raw.key.as_str())
                && a.get_long_and_visible_aliases()
                    .is_some_and(|names| names.contains(&raw.key.as_str()))
        });
        let (Some(arg), Some(long)) = (arg, arg.and_then(|a| a.get_long())) else {
            bail!(
                "{}: unknown setting (keys are `kvpick serve` flag names)",
                at(path, &raw.key, raw.line)
            );
        };
        if is_default(user, arg.get_id().as_str()) {
            let argv = to_argv(arg, long, &raw.value)
                .map_err(|e| anyhow!("{}: {e}", at(path, &raw.key, raw.line)))?;
            taken.push(Entry {
                key: raw.key,
                long: long.to_string(),
                line: raw.line,
                argv,
            });
        }
    }
    Ok(taken)
}

/// Whether `message` names `--long` (not a longer flag that starts with it).
fn names_flag(message: &str, long: &str) -> bool {
    let flag = format!("--{long}");
    message.match_indices(&flag).any(|(i, _)| {
        message[i + flag.len()..]
            .chars()
            .next()
            .is_none_or(|c| !(c.is_alphanumeric() || c == '-'))
    })
}

/// Whether `id`'s value in `user` came from its default (not a flag, not the environment).
fn is_default(user: &ArgMatches, id: &str) -> bool {
    matches!(
        user.value_source(id),
        None | Some(ValueSource::DefaultValue)
    )
}

/// clap's message without the `error: ` prefix and the usage lines.
fn first_line(message: &str) -> String {
    let line = message.lines().next().unwrap_or_default();
    line.strip_prefix("error: ").unwrap_or(line).to_string()
}

/// The file's top-level keys in order, with their lines when cheap to find.
fn parse_entries(text: &str) -> anyhow::Result<Vec<Raw>> {
    let value: serde_yaml::Value = serde_yaml::from_str(text).context("invalid YAML")?;
    let map = match value {
        serde_yaml::Value::Null => serde_yaml::Mapping::new(),
        serde_yaml::Value::Mapping(map) => map,
        _ => bail!("must be a mapping of flag names to values"),
    };
    map.into_iter()
        .map(|(k, value)| match k {
            serde_yaml::Value::String(key) => Ok(Raw {
                line: line_of(text, &key),
                key,
                value,
            }),
            other => bail!("keys must be flag names, got {other:?}"),
        })
        .collect()
}

/// The 1-based line where top-level `key:` is written in block style (None: not found cheaply).
fn line_of(text: &str, key: &str) -> Option<usize> {
    let prefix = format!("{key}:");
    text.lines()
        .position(|l| l.starts_with(&prefix) || l.starts_with(&format!("\"{key}\":")))
        .map(|i| i + 1)
}

/// One YAML scalar as a flag value.
fn scalar(value: &serde_yaml::Value) -> anyhow::Result<String> {
    match value {
        serde_yaml::Value::Bool(b) => Ok(b.to_string()),
        serde_yaml::Value::Number(n) => Ok(n.to_string()),
        serde_yaml::Value::String(s) => Ok(s.clone()),
        serde_yaml::Value::Null => bail!("has no value"),
        _ => bail!("must be a string, number, boolean or a list of them"),
    }
}

/// The arguments that give `arg` the file's `value`, as a user would type them.
fn to_argv(arg: &clap::Arg, key: &str, value: &serde_yaml::Value) -> anyhow::Result<Vec<String>> {
    let flag = format!("--{key}");
    match arg.get_action() {
        ArgAction::SetTrue | ArgAction::SetFalse => {
            let serde_yaml::Value::Bool(b) = value else {
                bail!("must be true or false");
            };
            let on = matches!(arg.get_action(), ArgAction::SetTrue) == *b;
            return Ok(if on { vec![flag] } else { Vec::new() });
        }
        ArgAction::Set | ArgAction::Append => {}
        other => bail!("cannot be set from a file ({other:?})"),
    }
    let serde_yaml::Value::Sequence(items) = value else {
        return Ok(vec![format!("{flag}={}", scalar(value)?)]);
    };
    let items = items
        .iter()
        .map(scalar)
        .collect::<anyhow::Result<Vec<_>>>()?;
    if items.is_empty() {
        bail!("an empty list is the same as leaving the key out; leave it out");
    }
    if let Some(delimiter) = arg.get_value_delimiter() {
        if items.iter().any(|i| i.contains(delimiter)) {
            bail!("list items must not contain {delimiter:?}");
        }
        return Ok(vec![format!(
            "{flag}={}",
            items.join(&delimiter.to_string())
        )]);
    }
    if matches!(arg.get_action(), ArgAction::Append) {
        return Ok(items.iter().map(|i| format!("{flag}={i}")).collect());
    }
    bail!("takes one value, not a list")
}

/// What one reload did.
#[derive(Debug)]
pub enum Reload {
    /// The file's text is as last read.
    Unchanged,
    /// Valid: the live settings are in force; `restart` lists changed keys that are not live
    /// (they take effect at the next start).
    Applied { restart: Vec<String> },
    /// Refused: the previous settings stay in force.
    Invalid(anyhow::Error),
}

impl Loaded {
    /// Applies a new version of the file to `core`, or refuses it whole.
    pub fn reload(&mut self, text: String, core: &kvpick_core::Core) -> Reload {
        if text == self.text {
            return Reload::Unchanged;
        }
        let outcome = self.apply_text(&text, core);
        self.text = text;
        match outcome {
            Ok(restart) => Reload::Applied { restart },
            Err(err) => Reload::Invalid(err),
        }
    }

    fn apply_text(&mut self, text: &str, core: &kvpick_core::Core) -> anyhow::Result<Vec<String>> {
        if text.len() > MAX_SETTINGS_BYTES {
            bail!("settings file is over the {MAX_SETTINGS_BYTES}-byte limit");
        }
        let (args, injected) = resolve(&self.path, text, &self.user_args)?;
        let live = kvpick_core::LiveConfig::of(&core_config(&args)?);
        core.update_live_config(live)
            .map_err(|e| anyhow!("settings file {}: {e}", self.path.display()))?;
        let keys: std::collections::BTreeSet<&String> =
            injected.keys().chain(self.injected.keys()).collect();
        let restart = keys
            .into_iter()
            .filter(|k| injected.get(*k) != self.injected.get(*k))
            .filter(|k| !LIVE_KEYS.contains(&k.as_str()))
            .cloned()
            .collect();
        self.injected = injected;
        Ok(restart)
    }
}

/// `kvpick_settings_*`: reloads by result and the time of the last accepted one.
#[derive(Clone)]
pub struct SettingsMetrics {
    pub reloads: IntCounterVec,
    pub last_success: Gauge,
}

impl SettingsMetrics {
    pub fn register(registry: &Registry) -> anyhow::Result<Self> {
        let reloads = IntCounterVec::new(
            Opts::new(
                "kvpick_settings_reloads_total",
                "Settings-file reloads by result (ok, invalid, restart_needed)",
            ),
            &["result"],
        )?;
        let last_success = Gauge::new(
            "kvpick_settings_last_reload_success_timestamp_seconds",
            "Unix time of the last settings-file version put in force (start-up included)",
        )?;
        registry.register(Box::new(reloads.clone()))?;
        registry.register(Box::new(last_success.clone()))?;
        for result in ["ok", "invalid", "restart_needed"] {
            reloads.with_label_values(&[result]);
        }
        Ok(SettingsMetrics {
            reloads,
            last_success,
        })
    }

    fn mark_success(&self) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        self.last_success.set(now.as_secs_f64());
    }

    /// Logs and counts one reload.
    pub fn record(&self, path: &Path, reload: &Reload) {
        let path = path.display();
        match reload {
            Reload::Unchanged => {}
            Reload::Applied { restart } if restart.is_empty() => {
                tracing::info!(%path, "settings file changed: live settings applied");
                self.reloads.with_label_values(&["ok"]).inc();
                self.mark_success();
            }
            Reload::Applied { restart } => {
                tracing::warn!(%path, keys = restart.join(", "), "settings file changed: these settings need a restart (live settings applied)");
                self.reloads.with_label_values(&["restart_needed"]).inc();
                self.mark_success();
            }
            Reload::Invalid(err) => {
                tracing::error!(%path, error = format!("{err:#}"), "settings file invalid, keeping the last good settings");
                self.reloads.with_label_values(&["invalid"]).inc();
            }
        }
    }
}

/// With `--settings`: registers the metrics and polls the file every `--catalog-poll-ms`,
/// applying each new version to `core` until the core is dropped.
pub fn start(args: &ServeArgs, core: &Arc<SelectionCore>) -> anyhow::Result<()> {
    let Some(loaded) = args.settings_loaded.as_deref() else {
        return Ok(());
    };
    let metrics = SettingsMetrics::register(&core.metrics().registry)?;
    metrics.mark_success();
    let poll = Duration::from_millis(args.catalog_poll_ms.max(1));
    tokio::spawn(watch(loaded.clone(), Arc::downgrade(core), poll, metrics));
    Ok(())
}

async fn watch(
    mut loaded: Loaded,
    core: std::sync::Weak<SelectionCore>,
    poll: Duration,
    metrics: SettingsMetrics,
) {
    let mut tick = tokio::time::interval(poll);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(core) = core.upgrade() else {
            return;
        };
        let path = loaded.path.clone();
        let text = match tokio::task::spawn_blocking(move || read_bounded(&path)).await {
            Ok(Ok(text)) => text,
            Ok(Err(err)) => {
                // A missing file mid-swap is normal for atomic renames (ConfigMaps).
                tracing::debug!(path = %loaded.path.display(), %err, "settings file unreadable, keeping the last settings");
                continue;
            }
            Err(err) => {
                tracing::error!(%err, "settings file read task failed");
                continue;
            }
        };
        let reload = loaded.reload(text, core.inner());
        metrics.record(&loaded.path, &reload);
    }
}

#[cfg(test)]
#[path = "settings_tests.rs"]
mod tests;

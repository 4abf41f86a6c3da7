//! The scale benchmark's numbers: what the run observed turned into the JSON report (written
//! under `target/`) and a short table for stdout, with the targets checked.
//!
//! Pure values, apart from writing the file.

use std::path::Path;
use std::time::Instant;

use serde_json::{json, Value};

use crate::args::ScaleArgs;
use crate::churn::ChurnTally;
use crate::picks::PickTally;
use crate::prom::{self, Sample};

/// The targets.
pub const READY_WITHIN_S: f64 = 5.0;
pub const PICK_P99_US: f64 = 1_000.0;
pub const EVENT_LAG_P99_MS: f64 = 50.0;

/// One look at kvpick: its metrics page, CPU time and RSS, and ours.
pub struct Scrape {
    pub at: Instant,
    pub kvpick_cpu_s: f64,
    pub bench_cpu_s: f64,
    pub rss_bytes: u64,
    pub samples: Vec<Sample>,
}

/// What the measured window saw.
pub struct Observed {
    pub before: Scrape,
    pub after: Scrape,
    pub picks: PickTally,
    pub picks_started: u64,
    pub churn: ChurnTally,
    pub peak_rss_bytes: u64,
}

/// Start-up, in seconds.
pub struct Startup {
    pub bind_publishers_s: f64,
    pub spawn_to_first_list_s: f64,
    pub first_list_to_ready_s: f64,
    pub subscriptions_connected: u64,
    pub first_list_to_subscribed_s: Option<f64>,
}

/// The report: its JSON, from which the table is printed.
#[derive(Debug, Clone)]
pub struct Report {
    pub json: Value,
}

/// The `q` quantile of sorted values (nearest rank).
pub fn nearest_rank(sorted: &[u64], q: f64) -> Option<u64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// A counter's (or gauge sum's) growth over the window.
fn grew(o: &Observed, name: &str, filter: &[(&str, &str)]) -> f64 {
    prom::sum(&o.after.samples, name, filter) - prom::sum(&o.before.samples, name, filter)
}

/// A histogram's quantile over the window, scaled by `unit` (1e3: milliseconds).
fn window_quantile(o: &Observed, name: &str, q: f64, unit: f64) -> Option<f64> {
    let before = prom::buckets(&o.before.samples, name);
    let after = prom::buckets(&o.after.samples, name);
    prom::quantile(&prom::delta(&before, &after), q).map(|v| v * unit)
}

fn mib(bytes: u64) -> f64 {
    (bytes as f64 / (1024.0 * 1024.0) * 10.0).round() / 10.0
}

fn picks_json(o: &Observed, args: &ScaleArgs, window_s: f64) -> Value {
    // Abandoned picks count at the timeout: open-loop percentiles must not drop the slowest.
    let mut latencies = o.picks.latencies_us.clone();
    let routed = latencies.len();
    let timeout_us = args.pick_timeout_ms.saturating_mul(1_000);
    latencies.extend(std::iter::repeat_n(timeout_us, o.picks.timed_out as usize));
    latencies.sort_unstable();
    let q = |q: f64| nearest_rank(&latencies, q);
    json!({
        "offered_per_s": args.picks_per_second,
        "started": o.picks_started,
        "routed": routed,
        "routed_per_s": routed as f64 / window_s,
        "unrouted": o.picks.unrouted,
        "failed": o.picks.failed,
        "timed_out": o.picks.timed_out,
        "first_error": o.picks.first_error,
        "timeout_ms": args.pick_timeout_ms,
        "late_starts": o.picks.late_starts,
        "p50_us": q(0.5), "p90_us": q(0.9), "p99_us": q(0.99), "p999_us": q(0.999),
        "max_us": latencies.last(),
        "server_p50_us": window_quantile(o, "kvpick_pick_latency_seconds", 0.5, 1e6),
        "server_p99_us": window_quantile(o, "kvpick_pick_latency_seconds", 0.99, 1e6),
    })
}

fn events_json(o: &Observed, sent_total: u64, window_s: f64, wanted: u64) -> Value {
    let lag = "kvpick_kv_event_lag_seconds";
    let applied = grew(o, "kvpick_kv_events_total", &[("result", "applied")]);
    json!({
        "publishers": wanted,
        "batches_sent_total": sent_total,
        "batches_in_window": grew(o, &format!("{lag}_count"), &[]),
        "events_applied": applied,
        "events_applied_per_s": applied / window_s,
        "events_dropped": grew(o, "kvpick_kv_events_total", &[("result", "dropped")]),
        "decode_errors": grew(o, "kvpick_kv_events_total", &[("result", "decode_error")]),
        "gaps": grew(o, "kvpick_kv_event_gaps_total", &[]),
        "lag_p50_ms": window_quantile(o, lag, 0.5, 1e3),
        "lag_p99_ms": window_quantile(o, lag, 0.99, 1e3),
        "index_blocks": prom::sum(&o.after.samples, "kvpick_index_blocks", &[]),
    })
}

impl Report {
    pub fn new(args: &ScaleArgs, startup: Startup, o: Observed, sent_total: u64) -> Report {
        let window_s = o
            .after
            .at
            .saturating_duration_since(o.before.at)
            .as_secs_f64()
            .max(1e-9);
        let wanted = u64::from(args.pods) * u64::from(args.ranks);
        let picks = picks_json(&o, args, window_s);
        let events = events_json(&o, sent_total, window_s, wanted);
        let targets = json!({
            "ready_within_5s": startup.first_list_to_ready_s <= READY_WITHIN_S,
            "pick_p99_within_1ms": picks["p99_us"].as_f64().is_some_and(|p| p <= PICK_P99_US),
            "event_lag_p99_within_50ms": events["lag_p99_ms"].as_f64().is_some_and(|p| p <= EVENT_LAG_P99_MS),
        });
        let json = json!({
            "benchmark": "scale",
            "parameters": {
                "pods": args.pods, "ranks_per_pod": args.ranks, "ranks": wanted,
                "pod_changes_per_second": args.pod_changes_per_second,
                "no_restarts": args.no_restarts,
                "picks_per_second": args.picks_per_second,
                "events_per_rank_second": args.events_per_rank_second,
                "blocks_per_event": args.blocks_per_event,
                "families": args.families, "family_blocks": args.family_blocks,
                "block_size": args.block_size, "prompt_tokens": args.prompt_tokens,
                "warmup_s": args.warmup_secs, "duration_s": args.duration_secs,
                "connections": args.connections, "quick": args.quick,
                "kvpick_args": args.kvpick_args,
                "kvpick_bin": args.kvpick_bin.as_ref().map(|p| p.display().to_string()),
            },
            "startup": {
                "bind_publishers_s": startup.bind_publishers_s,
                "spawn_to_first_list_s": startup.spawn_to_first_list_s,
                "first_list_to_ready_s": startup.first_list_to_ready_s,
                "subscriptions_connected": startup.subscriptions_connected,
                "subscriptions_wanted": wanted,
                "first_list_to_subscribed_s": startup.first_list_to_subscribed_s,
            },
            "memory": {
                "rss_mib_start": mib(o.before.rss_bytes),
                "rss_mib_end": mib(o.after.rss_bytes),
                "peak_rss_mib": mib(o.peak_rss_bytes.max(o.after.rss_bytes)),
            },
            "picks": picks,
            "events": events,
            "churn": {
                "changes": o.churn.changes, "restarts": o.churn.restarts,
                "readiness_flips": o.churn.readiness_flips, "late": o.churn.late,
                "catalog_applied_in_window": grew(&o, "kvpick_catalog_reloads_total", &[("result", "applied")]),
            },
            "cpu": {
                "window_s": window_s,
                "kvpick_cores": (o.after.kvpick_cpu_s - o.before.kvpick_cpu_s) / window_s,
                "bench_cores": (o.after.bench_cpu_s - o.before.bench_cpu_s) / window_s,
            },
            "targets": targets,
        });
        Report { json }
    }

    /// Writes the JSON (pretty) to `path`, creating its directory.
    pub fn write(&self, path: &Path) -> anyhow::Result<()> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(path, serde_json::to_string_pretty(&self.json)?)?;
        Ok(())
    }

    /// The short stdout table.
    pub fn table(&self) -> String {
        let j = &self.json;
        let p = &j["parameters"];
        let mut out = format!(
            "scale: {} pods x {} ranks, {} pod changes/s, {} picks/s, {} event batches/rank/s, {} s\n",
            p["pods"], p["ranks_per_pod"], p["pod_changes_per_second"], p["picks_per_second"],
            p["events_per_rank_second"], p["duration_s"]
        );
        out.push_str("| measure | value | note |\n|---|---|---|\n");
        for (name, value, note) in self.rows() {
            out.push_str(&format!("| {name} | {value} | {note} |\n"));
        }
        out
    }

    fn rows(&self) -> Vec<(&'static str, String, String)> {
        let j = &self.json;
        let met = |key: &str| {
            if j["targets"][key] == true {
                "met"
            } else {
                "MISSED"
            }
        };
        let (s, k, e) = (&j["startup"], &j["picks"], &j["events"]);
        vec![
            (
                "start-up: first LIST -> ready",
                format!("{} s", num(&s["first_list_to_ready_s"], 3)),
                format!("<= 5 s: {}", met("ready_within_5s")),
            ),
            (
                "start-up: first LIST -> all subscribed",
                format!("{} s", num(&s["first_list_to_subscribed_s"], 2)),
                format!(
                    "{} of {}",
                    s["subscriptions_connected"], s["subscriptions_wanted"]
                ),
            ),
            (
                "pick p50 / p99 (client)",
                format!("{} / {} µs", num(&k["p50_us"], 0), num(&k["p99_us"], 0)),
                format!("p99 <= 1 ms: {}", met("pick_p99_within_1ms")),
            ),
            (
                "pick p50 / p99 (kvpick histogram)",
                format!(
                    "{} / {} µs",
                    num(&k["server_p50_us"], 0),
                    num(&k["server_p99_us"], 0)
                ),
                format!(
                    "{} routed/s, {} unrouted, {} failed, {} timed out",
                    num(&k["routed_per_s"], 0),
                    k["unrouted"],
                    k["failed"],
                    k["timed_out"]
                ),
            ),
            (
                "event lag p50 / p99",
                format!(
                    "{} / {} ms",
                    num(&e["lag_p50_ms"], 2),
                    num(&e["lag_p99_ms"], 2)
                ),
                format!("p99 <= 50 ms: {}", met("event_lag_p99_within_50ms")),
            ),
            (
                "kvpick RSS end / peak",
                format!(
                    "{} / {} MiB",
                    num(&j["memory"]["rss_mib_end"], 1),
                    num(&j["memory"]["peak_rss_mib"], 1)
                ),
                String::new(),
            ),
            (
                "CPU cores: kvpick / bench",
                format!(
                    "{} / {}",
                    num(&j["cpu"]["kvpick_cores"], 2),
                    num(&j["cpu"]["bench_cores"], 2)
                ),
                format!(
                    "{} events applied/s, {} pod changes",
                    num(&e["events_applied_per_s"], 0),
                    j["churn"]["changes"]
                ),
            ),
        ]
    }
}

/// A number with `digits` decimals, or `-` when absent.
fn num(v: &Value, digits: usize) -> String {
    match v.as_f64() {
        Some(x) => format!("{x:.digits$}"),
        None => "-".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_quantiles() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(nearest_rank(&v, 0.5), Some(50));
        assert_eq!(nearest_rank(&v, 0.99), Some(99));
        assert_eq!(nearest_rank(&v, 0.999), Some(100));
        assert_eq!(nearest_rank(&v, 0.0), Some(1));
        assert_eq!(nearest_rank(&[], 0.5), None);
    }
}

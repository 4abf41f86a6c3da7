//! What a generated (or any Mooncake) trace looks like, in the terms the workload families are
//! specified in: lengths, reuse fraction, reuse gap, group sizes, request rate, and the offered
//! load on a reference fleet. Owns the arithmetic only; reads no files.

use std::collections::HashMap;

use serde::Serialize;

use crate::replay::trace::TraceRecord;
use crate::sim::engine::EngineConfig;

/// Mean, median and 90th percentile (nearest rank).
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Summary {
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub max: f64,
}

pub fn summary(values: &mut [f64]) -> Summary {
    if values.is_empty() {
        return Summary {
            mean: 0.0,
            p50: 0.0,
            p90: 0.0,
            max: 0.0,
        };
    }
    values.sort_by(f64::total_cmp);
    let pct =
        |p: f64| values[((p * values.len() as f64).ceil() as usize).clamp(1, values.len()) - 1];
    Summary {
        mean: values.iter().sum::<f64>() / values.len() as f64,
        p50: pct(0.5),
        p90: pct(0.9),
        max: values[values.len() - 1],
    }
}

/// The reference fleet [`Stats::offered_load_8_ranks`] is computed for.
pub const REFERENCE_RANKS: usize = 8;

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Stats {
    pub family: String,
    pub requests: usize,
    pub duration_s: f64,
    pub request_rate: f64,
    pub input_tokens: Summary,
    pub output_tokens: Summary,
    /// Hash ids already seen earlier in the trace / all hash ids.
    pub reuse_fraction: f64,
    /// Per reused hash id: seconds since that id was last used.
    pub reuse_gap_s: Summary,
    /// Sessions, documents or prefix families with at least one request in the trace.
    pub groups: usize,
    /// Requests per group.
    pub group_size: Summary,
    /// [`crate::replay::offered_load`] on 8 default engines at the trace's own timestamps.
    pub offered_load_8_ranks: f64,
}

/// Statistics of `records`; `groups[i]` is the group of `records[i]`.
pub fn compute(family: &str, records: &[TraceRecord], groups: &[u64]) -> Stats {
    let first = records.iter().map(|r| r.timestamp).min().unwrap_or(0);
    let last = records.iter().map(|r| r.timestamp).max().unwrap_or(0);
    let duration_s = (last - first) as f64 / 1e3;
    let mut inputs: Vec<f64> = records.iter().map(|r| r.input_length as f64).collect();
    let mut outputs: Vec<f64> = records.iter().map(|r| r.output_length as f64).collect();
    let mut last_use: HashMap<u64, u64> = HashMap::new();
    let (mut seen, mut total) = (0u64, 0u64);
    let mut gaps = Vec::new();
    for r in records {
        for id in &r.hash_ids {
            total += 1;
            if let Some(prev) = last_use.insert(*id, r.timestamp) {
                seen += 1;
                gaps.push(r.timestamp.saturating_sub(prev) as f64 / 1e3);
            }
        }
    }
    let mut sizes: HashMap<u64, u64> = HashMap::new();
    for g in groups {
        *sizes.entry(*g).or_default() += 1;
    }
    let mut group_sizes: Vec<f64> = sizes.values().map(|&n| n as f64).collect();
    let config = EngineConfig::default();
    let demand_ns: f64 = records
        .iter()
        .map(|r| crate::replay::no_cache_prefill_ns(&config, r.input_length) as f64)
        .sum();
    Stats {
        family: family.to_string(),
        requests: records.len(),
        duration_s,
        request_rate: if duration_s > 0.0 {
            records.len() as f64 / duration_s
        } else {
            0.0
        },
        input_tokens: summary(&mut inputs),
        output_tokens: summary(&mut outputs),
        reuse_fraction: if total == 0 {
            0.0
        } else {
            seen as f64 / total as f64
        },
        reuse_gap_s: summary(&mut gaps),
        groups: sizes.len(),
        group_size: summary(&mut group_sizes),
        offered_load_8_ranks: if duration_s > 0.0 {
            demand_ns / (REFERENCE_RANKS as f64 * duration_s * 1e9)
        } else {
            0.0
        },
    }
}

/// The human-readable form `kvpick workload` prints.
pub fn text(s: &Stats) -> String {
    let row = |name: &str, v: &Summary, unit: &str| {
        format!(
            "  {name:<14} mean {:>9.1}{unit}  p50 {:>9.1}{unit}  p90 {:>9.1}{unit}  max {:>9.1}{unit}\n",
            v.mean, v.p50, v.p90, v.max
        )
    };
    let mut out = format!(
        "{}: {} requests over {:.0} s ({:.2} requests/s), {} groups; reuse fraction {:.1}%; \
         offered load on {REFERENCE_RANKS} default ranks {:.2}\n",
        s.family,
        s.requests,
        s.duration_s,
        s.request_rate,
        s.groups,
        s.reuse_fraction * 100.0,
        s.offered_load_8_ranks
    );
    out.push_str(&row("input tokens", &s.input_tokens, ""));
    out.push_str(&row("output tokens", &s.output_tokens, ""));
    out.push_str(&row("reuse gap", &s.reuse_gap_s, "s"));
    out.push_str(&row("group size", &s.group_size, ""));
    out
}

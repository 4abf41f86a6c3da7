//! Results people can look at: the chart data of a run (TTFT and E2E CDFs, KV hit rate and
//! requests per rank per policy, load per rank and router queue length over time) and its
//! rendering into one self-contained HTML page with inline SVG ([`svg`]): no script, no external
//! style sheet, no font or CDN fetch, so the file opens offline and can be attached to an issue.
//!
//! One renderer for every producer: `kvpick replay --report-html` builds a [`ChartData`] from its
//! own run, and `kvpick report-html --input FILE` renders one written by someone else (the
//! benchmark matrix and the demo, `e2e/matrix.py` / `e2e/demo.py`, through `e2e/report.py`).
//!
//! This module owns the data model, the CDF and time-series computations and the `report-html`
//! subcommand. It must not influence a replay: the replay only hands it values it already
//! computed or recorded ([`StepRecorder`] is write-only from the loop's side).

pub mod svg;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Points kept per CDF (quantiles), enough for a smooth curve in a 640-pixel chart.
pub const CDF_POINTS: usize = 200;
/// Samples per time series.
pub const SERIES_SAMPLES: usize = 240;
/// Most sections, policies per section and points per curve `kvpick report-html` accepts: a
/// bound on the page it writes for any input.
pub const MAX_SECTIONS: usize = 200;
pub const MAX_POLICIES: usize = 32;
pub const MAX_POINTS: usize = 10_000;
pub const MAX_RANKS: usize = 256;
/// Largest input file `kvpick report-html` reads.
pub const MAX_INPUT_BYTES: u64 = 64 << 20;

/// Everything one report page shows: a title and one or more sections (a run, a matrix cell).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ChartData {
    pub title: String,
    pub sections: Vec<Section>,
}

/// One run: its policies side by side.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Section {
    pub title: String,
    /// A line of context under the title (trace, load, seed).
    #[serde(default)]
    pub note: String,
    pub policies: Vec<PolicyCharts>,
}

/// One policy's charted results.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PolicyCharts {
    pub name: String,
    /// `(milliseconds, fraction of requests at or below)`, ascending (see [`cdf`]).
    #[serde(default)]
    pub ttft_cdf: Vec<(f64, f64)>,
    #[serde(default)]
    pub e2e_cdf: Vec<(f64, f64)>,
    /// Cached prompt tokens / prompt tokens, 0..=1.
    pub kv_hit_rate: f64,
    #[serde(default)]
    pub requests_per_rank: Vec<u64>,
    /// In-flight requests per rank over time (`values[rank][sample]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load: Option<Series>,
    /// Requests waiting in the router's own queue over time (`values[0][sample]`); only for a
    /// policy with a queue (kvpick's flow control).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<Series>,
}

/// Channels sampled at common instants.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Series {
    /// Seconds since the first arrival.
    pub t_s: Vec<f64>,
    pub values: Vec<Vec<f64>>,
}

/// The empirical CDF of `values`, at most `max_points` points `(x, F(x))`: every sample when
/// there are few, else evenly spaced quantiles (the first and the last sample always kept).
/// Non-finite values are ignored; an empty input gives no points.
pub fn cdf(values: &[f64], max_points: usize) -> Vec<(f64, f64)> {
    let mut sorted: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
    if sorted.is_empty() || max_points == 0 {
        return Vec::new();
    }
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    let indices: Vec<usize> = if n <= max_points {
        (0..n).collect()
    } else if max_points == 1 {
        vec![n - 1]
    } else {
        (0..max_points)
            .map(|k| (k * (n - 1) + (max_points - 1) / 2) / (max_points - 1))
            .collect()
    };
    let mut out: Vec<(f64, f64)> = Vec::with_capacity(indices.len());
    for i in indices {
        let point = (sorted[i], (i + 1) as f64 / n as f64);
        match out.last_mut() {
            // Ties: keep the highest fraction at that value.
            Some(last) if last.0 == point.0 => *last = point,
            _ => out.push(point),
        }
    }
    out
}

/// A step function of several channels over virtual time, recorded at its changes only (the
/// replay calls [`StepRecorder::record`] after each instant it processes).
#[derive(Debug, Clone, Default)]
pub struct StepRecorder {
    changes: Vec<(u64, Vec<u32>)>,
}

impl StepRecorder {
    /// The channels' values from `now_ns` on; a repeat of the current values is not stored, a
    /// second record at the same instant replaces the first.
    pub fn record(&mut self, now_ns: u64, values: &[u32]) {
        match self.changes.last_mut() {
            Some((_, last)) if last.as_slice() == values => {}
            Some((t, last)) if *t == now_ns => last.copy_from_slice(values),
            _ => self.changes.push((now_ns, values.to_vec())),
        }
    }

    /// The values at `samples` evenly spaced instants of `[start_ns, end_ns]` (each sample is the
    /// state in force at that instant; before the first record every channel is 0).
    pub fn sample(&self, channels: usize, start_ns: u64, end_ns: u64, samples: usize) -> Series {
        let samples = samples.max(2);
        let span = end_ns.saturating_sub(start_ns);
        let mut t_s = Vec::with_capacity(samples);
        let mut values = vec![Vec::with_capacity(samples); channels];
        let mut next = 0usize;
        let mut current: Option<&Vec<u32>> = None;
        for k in 0..samples {
            let at = start_ns + (span as u128 * k as u128 / (samples - 1) as u128) as u64;
            while let Some((t, v)) = self.changes.get(next).filter(|(t, _)| *t <= at) {
                debug_assert!(*t <= at);
                current = Some(v);
                next += 1;
            }
            t_s.push((at - start_ns) as f64 / 1e9);
            for (c, channel) in values.iter_mut().enumerate() {
                channel.push(
                    current
                        .and_then(|v| v.get(c))
                        .map_or(0.0, |&x| f64::from(x)),
                );
            }
        }
        Series { t_s, values }
    }
}

/// `kvpick report-html` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct ReportHtmlArgs {
    /// Chart data (JSON, as `kvpick replay --chart-data` writes it; e2e/report.py documents it).
    #[arg(long)]
    pub input: PathBuf,
    /// Write the HTML report here.
    #[arg(long)]
    pub out: PathBuf,
}

impl ChartData {
    /// Rejects input no page should be built from: too many sections, policies or points,
    /// non-finite numbers.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.sections.len() <= MAX_SECTIONS,
            "{} sections: at most {MAX_SECTIONS}",
            self.sections.len()
        );
        for s in &self.sections {
            anyhow::ensure!(
                s.policies.len() <= MAX_POLICIES,
                "section {:?}: {} policies, at most {MAX_POLICIES}",
                s.title,
                s.policies.len()
            );
            for p in &s.policies {
                p.validate().map_err(|e| {
                    anyhow::anyhow!("section {:?}, policy {:?}: {e}", s.title, p.name)
                })?;
            }
        }
        Ok(())
    }
}

impl PolicyCharts {
    fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.kv_hit_rate.is_finite(), "kv_hit_rate must be a number");
        anyhow::ensure!(
            self.requests_per_rank.len() <= MAX_RANKS,
            "{} ranks, at most {MAX_RANKS}",
            self.requests_per_rank.len()
        );
        for (what, points) in [("ttft_cdf", &self.ttft_cdf), ("e2e_cdf", &self.e2e_cdf)] {
            anyhow::ensure!(
                points.len() <= MAX_POINTS,
                "{what}: {} points, at most {MAX_POINTS}",
                points.len()
            );
            anyhow::ensure!(
                points.iter().all(|(x, y)| x.is_finite() && y.is_finite()),
                "{what}: every point must be finite"
            );
        }
        for (what, series) in [("load", &self.load), ("queue", &self.queue)] {
            let Some(series) = series else { continue };
            anyhow::ensure!(
                series.t_s.len() <= MAX_POINTS,
                "{what}: {} samples, at most {MAX_POINTS}",
                series.t_s.len()
            );
            anyhow::ensure!(
                series.values.len() <= MAX_RANKS,
                "{what}: {} channels, at most {MAX_RANKS}",
                series.values.len()
            );
            anyhow::ensure!(
                series.values.iter().all(|c| c.len() == series.t_s.len()),
                "{what}: every channel needs one value per t_s"
            );
            anyhow::ensure!(
                series
                    .t_s
                    .iter()
                    .chain(series.values.iter().flatten())
                    .all(|v| v.is_finite()),
                "{what}: every value must be finite"
            );
        }
        Ok(())
    }
}

/// Writes `data` as an HTML report to `path`.
pub fn write_html(data: &ChartData, path: &std::path::Path) -> anyhow::Result<()> {
    data.validate()?;
    std::fs::write(path, svg::page(data))
        .map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))
}

/// `kvpick report-html`.
pub fn run(args: ReportHtmlArgs) -> anyhow::Result<()> {
    let size = std::fs::metadata(&args.input)
        .map_err(|e| anyhow::anyhow!("reading {}: {e}", args.input.display()))?
        .len();
    anyhow::ensure!(
        size <= MAX_INPUT_BYTES,
        "{}: {size} bytes, larger than the {MAX_INPUT_BYTES}-byte limit",
        args.input.display()
    );
    let text = std::fs::read_to_string(&args.input)
        .map_err(|e| anyhow::anyhow!("reading {}: {e}", args.input.display()))?;
    let data: ChartData = serde_json::from_str(&text)
        .map_err(|e| anyhow::anyhow!("{}: not chart data: {e}", args.input.display()))?;
    write_html(&data, &args.out)
}

#[cfg(test)]
mod tests;

//! Engine metrics (the GIE model-server protocol): scrapes each rank's `/metrics` on a short,
//! jittered interval with bounded concurrency and a per-scrape timeout, reads queue depth,
//! running requests, KV-cache usage and LoRA adapters (names per model-server type), and hands
//! each reading to the selection core (`Core::record_engine_metrics`). A rank whose scrapes fail
//! is counted as stale once its last reading is older than the core's bound; the core then
//! ignores the old reading by itself.
//!
//! Which URL per rank: `http://<rank endpoint><path>`. Ranks that share one endpoint
//! (data-parallel ranks multiplexed behind one port) are scraped once, and each rank takes the
//! series whose rank label (vLLM: `engine`) equals its DP rank; a page without that label gives
//! its totals to every rank of the endpoint.
//!
//! The scraper also judges whether the engines of ranks without a KV-event subscription (no
//! `kv_events` endpoint, or `--kv-events=off`) are reachable: a scrape whose connection fails
//! reports them unreachable (no picks), the next good scrape reachable again, with their index
//! entries cleared (a process that refused connections and answers again is a new one). Ranks
//! with a subscription are judged by it (`events::ingest`), which sees a lost engine at once.
//!
//! Owns HTTP scraping, its schedule and its metrics; it never decides anything (the cost of a
//! reading is `kvpick_core::decide::engine_metrics_cost`).

pub mod parse;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use kvpick_core::{EngineMetrics, RankKey, WorkerRecord};
use rand::Rng;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinHandle;

use crate::observability::metrics::EngineScrapeMetrics;
use crate::selection::SelectionCore;

/// Metric and label names of one model-server type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricNames {
    pub waiting: String,
    pub running: String,
    pub kv_usage: String,
    /// vLLM's `lora_requests_info` (labels `running_lora_adapters`, `waiting_lora_adapters`,
    /// `max_lora`; the value is a timestamp, the latest series wins). `None`: no LoRA metric.
    pub lora_info: Option<String>,
    /// Label telling data-parallel ranks apart on one page. `None`: one rank per page.
    pub rank_label: Option<String>,
}

impl MetricNames {
    pub fn vllm() -> Self {
        MetricNames {
            waiting: "vllm:num_requests_waiting".into(),
            running: "vllm:num_requests_running".into(),
            kv_usage: "vllm:kv_cache_usage_perc".into(),
            lora_info: Some("vllm:lora_requests_info".into()),
            rank_label: Some("engine".into()),
        }
    }

    /// SGLang's equivalents (`--enable-metrics`); SGLang exports no LoRA metric.
    pub fn sglang() -> Self {
        MetricNames {
            waiting: "sglang:num_queue_reqs".into(),
            running: "sglang:num_running_reqs".into(),
            kv_usage: "sglang:token_usage".into(),
            lora_info: None,
            rank_label: Some("dp_rank".into()),
        }
    }

    /// Applies `key=value,...` overrides (`waiting`, `running`, `kv_usage`, `lora_info`,
    /// `rank_label`; an empty value for the last two means none).
    pub fn with_overrides(mut self, overrides: &str) -> anyhow::Result<Self> {
        for pair in overrides
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
        {
            let (key, value) = pair
                .split_once('=')
                .ok_or_else(|| anyhow::anyhow!("expected key=value, got {pair:?}"))?;
            let value = value.trim().to_string();
            let optional = || (!value.is_empty()).then(|| value.clone());
            match key.trim() {
                "waiting" => self.waiting = value,
                "running" => self.running = value,
                "kv_usage" => self.kv_usage = value,
                "lora_info" => self.lora_info = optional(),
                "rank_label" => self.rank_label = optional(),
                other => anyhow::bail!(
                    "unknown metric key {other:?} (waiting, running, kv_usage, lora_info, rank_label)"
                ),
            }
        }
        for (key, value) in [
            ("waiting", &self.waiting),
            ("running", &self.running),
            ("kv_usage", &self.kv_usage),
        ] {
            if value.is_empty() {
                anyhow::bail!("metric name {key} must not be empty");
            }
        }
        Ok(self)
    }
}

/// How the scraper runs.
#[derive(Debug, Clone)]
pub struct ScrapeConfig {
    pub names: MetricNames,
    pub path: String,
    /// Mean time between two scrapes of one endpoint; each wait is jittered by ±`jitter`.
    pub interval: Duration,
    pub jitter: f64,
    pub timeout: Duration,
    /// Scrapes in flight at once, over all endpoints.
    pub concurrency: usize,
    /// Largest page read; a bigger one is refused (counted as invalid).
    pub max_body_bytes: usize,
    /// The core's staleness bound: past it without a good scrape, a rank counts as stale.
    pub stale_after: Duration,
}

/// Why a scrape gave no reading (the `outcome` label; "ok" otherwise).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    Unreachable,
    Timeout,
    HttpStatus,
    Invalid,
}

impl Failure {
    pub fn label(self) -> &'static str {
        match self {
            Failure::Unreachable => "unreachable",
            Failure::Timeout => "timeout",
            Failure::HttpStatus => "http_error",
            Failure::Invalid => "invalid",
        }
    }
}

/// The readings of one page for the ranks `dp_ranks` sharing it, in that order.
#[derive(Debug, Default, Clone)]
struct Partial {
    waiting: Option<f64>,
    running: Option<f64>,
    kv_usage: Option<f64>,
    /// (timestamp value, adapters, max_lora) of the latest `lora_requests_info` series.
    lora: Option<(f64, Vec<String>, Option<u32>)>,
}

impl Partial {
    fn merge(&mut self, other: &Partial) {
        let add = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(x), Some(y)) => Some(x + y),
            (x, y) => x.or(y),
        };
        self.waiting = add(self.waiting, other.waiting);
        self.running = add(self.running, other.running);
        self.kv_usage = match (self.kv_usage, other.kv_usage) {
            (Some(x), Some(y)) => Some(x.max(y)),
            (x, y) => x.or(y),
        };
        if let Some(l) = &other.lora {
            if self.lora.as_ref().is_none_or(|mine| l.0 > mine.0) {
                self.lora = Some(l.clone());
            }
        }
    }
}

fn count(value: f64) -> Option<u64> {
    (value.is_finite() && value >= 0.0).then_some(value.round() as u64)
}

fn adapter_list(labels: Option<&str>) -> impl Iterator<Item = String> + '_ {
    labels
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .map(str::to_string)
}

/// Reads one page into a reading per rank of `dp_ranks` (`None` for a rank the page has no
/// complete reading of). `multiplexed`: the ranks share the page and are told apart by the rank
/// label.
pub fn readings(
    text: &str,
    names: &MetricNames,
    dp_ranks: &[u32],
    at: std::time::Instant,
) -> Result<Vec<Option<EngineMetrics>>, parse::ParseError> {
    let mut wanted: Vec<&str> = vec![&names.waiting, &names.running, &names.kv_usage];
    if let Some(lora) = &names.lora_info {
        wanted.push(lora);
    }
    let mut by_rank: HashMap<Option<String>, Partial> = HashMap::new();
    parse::samples(text, &wanted, |s| {
        let rank = names
            .rank_label
            .as_deref()
            .and_then(|l| s.label(l))
            .map(str::to_string);
        let p = by_rank.entry(rank).or_default();
        let add = |slot: &mut Option<f64>, v: f64| *slot = Some(slot.unwrap_or(0.0) + v);
        if s.name == names.waiting {
            add(&mut p.waiting, s.value);
        } else if s.name == names.running {
            add(&mut p.running, s.value);
        } else if s.name == names.kv_usage {
            p.kv_usage = Some(p.kv_usage.map_or(s.value, |k| k.max(s.value)));
        } else if s.value.is_finite() {
            let adapters: Vec<String> = adapter_list(s.label("running_lora_adapters"))
                .chain(adapter_list(s.label("waiting_lora_adapters")))
                .collect();
            let max = s
                .label("max_lora")
                .and_then(|m| m.trim().parse::<u32>().ok());
            let newer = p.lora.as_ref().is_none_or(|(ts, _, _)| s.value > *ts);
            if newer {
                p.lora = Some((s.value, adapters, max));
            }
        }
    })?;
    let total = by_rank.values().fold(Partial::default(), |mut acc, p| {
        acc.merge(p);
        acc
    });
    let per_rank = dp_ranks.len() > 1 && by_rank.keys().any(Option::is_some);
    Ok(dp_ranks
        .iter()
        .map(|rank| {
            let p = if per_rank {
                by_rank.get(&Some(rank.to_string()))?
            } else {
                &total
            };
            let (adapters, max_adapters) = match &p.lora {
                Some((_, adapters, max)) => {
                    let mut adapters = adapters.clone();
                    adapters.sort();
                    adapters.dedup();
                    (adapters, *max)
                }
                None => (Vec::new(), None),
            };
            Some(EngineMetrics {
                waiting: count(p.waiting?)?,
                running: count(p.running?)?,
                kv_usage: p.kv_usage.filter(|k| k.is_finite())?.clamp(0.0, 1.0),
                adapters: adapters.into(),
                max_adapters,
                at,
            })
        })
        .collect())
}

/// One endpoint to scrape and the ranks its page describes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub endpoint: SocketAddr,
    pub ranks: Vec<RankKey>,
    /// Of `ranks`, those whose reachability this scraper judges: no KV-event subscription
    /// watches their engine.
    pub judged: Vec<RankKey>,
    /// The worker name of each rank (its per-rank gauges' `worker` label).
    pub workers: Vec<Arc<str>>,
}

/// The endpoints of the catalog's ranks, each with the ranks behind it. `kv_events`: whether
/// ranks with a `kv_events` endpoint are subscribed to (`--kv-events`).
pub fn targets(records: &[WorkerRecord], kv_events: bool) -> Vec<Target> {
    type Ranks = (Vec<(RankKey, Arc<str>)>, Vec<RankKey>);
    let mut by_endpoint: HashMap<SocketAddr, Ranks> = HashMap::new();
    for record in records {
        let subscribed = kv_events && record.spec.kv_events.is_some();
        let name: Arc<str> = Arc::from(record.spec.name.as_str());
        for rank in &record.ranks {
            let key = RankKey {
                worker_id: record.id,
                dp_rank: rank.dp_rank,
            };
            let (ranks, judged) = by_endpoint.entry(rank.endpoint).or_default();
            ranks.push((key, Arc::clone(&name)));
            if !subscribed {
                judged.push(key);
            }
        }
    }
    let mut out: Vec<Target> = by_endpoint
        .into_iter()
        .map(|(endpoint, (mut ranks, mut judged))| {
            ranks.sort_by_key(|(key, _)| *key);
            judged.sort();
            let (ranks, workers) = ranks.into_iter().unzip();
            Target {
                endpoint,
                ranks,
                judged,
                workers,
            }
        })
        .collect();
    out.sort_by_key(|t| t.endpoint);
    out
}

/// The scraper's judgement of its target's unsubscribed ranks: reported unreachable when a
/// scrape cannot connect, reachable (and cleared: a new process) at the next good scrape. A task
/// that ends (its target changed) withdraws it.
struct Judged {
    core: Arc<SelectionCore>,
    ranks: Vec<RankKey>,
    held: bool,
}

impl Judged {
    fn scraped(&mut self, outcome: Result<(), Failure>) {
        if self.ranks.is_empty() {
            return;
        }
        match outcome {
            Err(Failure::Unreachable) => {
                self.held = true;
                for rank in &self.ranks {
                    self.core.set_rank_reachable(*rank, false);
                }
            }
            Ok(()) if self.held => {
                self.held = false;
                for rank in &self.ranks {
                    self.core.clear_rank(*rank);
                    self.core.set_rank_reachable(*rank, true);
                }
            }
            // A slow or bad page is no verdict on whether the engine runs.
            _ => {}
        }
    }
}

impl Drop for Judged {
    fn drop(&mut self) {
        if self.held {
            for rank in &self.ranks {
                self.core.set_rank_reachable(*rank, true);
            }
        }
    }
}

type HttpClient = Client<HttpConnector, Empty<Bytes>>;

fn client(timeout: Duration) -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(timeout));
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(1)
        .build(connector)
}

/// One GET of the page (within the caller's timeout).
async fn fetch(client: &HttpClient, url: &hyper::Uri, limit: usize) -> Result<Bytes, Failure> {
    let response = client
        .get(url.clone())
        .await
        .map_err(|_| Failure::Unreachable)?;
    if !response.status().is_success() {
        return Err(Failure::HttpStatus);
    }
    Limited::new(response.into_body(), limit)
        .collect()
        .await
        .map(|b| b.to_bytes())
        .map_err(|_| Failure::Invalid)
}

/// Counts a target's ranks in the stale gauge while they are stale, and takes them out when the
/// target goes away.
struct StaleMark {
    gauge: prometheus::IntGauge,
    ranks: i64,
    stale: bool,
}

impl StaleMark {
    fn set(&mut self, stale: bool) {
        if stale != self.stale {
            self.gauge.add(if stale { self.ranks } else { -self.ranks });
            self.stale = stale;
        }
    }
}

impl Drop for StaleMark {
    fn drop(&mut self) {
        self.set(false);
    }
}

struct Scraper {
    core: Arc<SelectionCore>,
    config: Arc<ScrapeConfig>,
    metrics: EngineScrapeMetrics,
    client: HttpClient,
    permits: Arc<Semaphore>,
}

impl Scraper {
    /// Scrapes one target forever (the manager aborts it when the target changes).
    async fn run(self: Arc<Self>, target: Target) {
        let url: hyper::Uri = match format!("http://{}{}", target.endpoint, self.config.path)
            .parse()
        {
            Ok(u) => u,
            Err(err) => {
                tracing::error!(endpoint = %target.endpoint, %err, "engine metrics URL is invalid");
                return;
            }
        };
        let dp_ranks: Vec<u32> = target.ranks.iter().map(|k| k.dp_rank).collect();
        let mut stale = StaleMark {
            gauge: self.metrics.stale_ranks.clone(),
            ranks: target.ranks.len() as i64,
            stale: false,
        };
        // Never scraped counts as stale until the first good reading.
        stale.set(true);
        let mut judged = Judged {
            core: Arc::clone(&self.core),
            ranks: target.judged.clone(),
            held: false,
        };
        let mut last_ok: Option<tokio::time::Instant> = None;
        let mut failing = false;
        // The first scrape of every target at a random point of the first interval, so a large
        // catalog does not scrape in lockstep.
        let first = self.config.interval.mul_f64(rand::rng().random::<f64>());
        tokio::time::sleep(first).await;
        loop {
            let outcome = self.scrape_once(&url, &target, &dp_ranks).await;
            judged.scraped(outcome);
            let now = tokio::time::Instant::now();
            match outcome {
                Ok(()) => {
                    last_ok = Some(now);
                    if failing {
                        tracing::info!(endpoint = %target.endpoint, "engine metrics answer again");
                        failing = false;
                    }
                }
                Err(failure) => {
                    if !failing {
                        tracing::warn!(
                            endpoint = %target.endpoint,
                            outcome = failure.label(),
                            "engine metrics scrape failed; the rank's reading goes stale"
                        );
                        failing = true;
                    }
                }
            }
            stale.set(last_ok.is_none_or(|t| now - t > self.config.stale_after));
            let jitter = 1.0 + self.config.jitter * (2.0 * rand::rng().random::<f64>() - 1.0);
            tokio::time::sleep(self.config.interval.mul_f64(jitter.max(0.0))).await;
        }
    }

    async fn scrape_once(
        &self,
        url: &hyper::Uri,
        target: &Target,
        dp_ranks: &[u32],
    ) -> Result<(), Failure> {
        let Ok(_permit) = self.permits.acquire().await else {
            return Err(Failure::Unreachable);
        };
        let started = tokio::time::Instant::now();
        let fetched = tokio::time::timeout(
            self.config.timeout,
            fetch(&self.client, url, self.config.max_body_bytes),
        )
        .await
        .unwrap_or(Err(Failure::Timeout));
        let result = fetched.and_then(|body| {
            let text = std::str::from_utf8(&body).map_err(|_| Failure::Invalid)?;
            let at = crate::selection::now();
            let readings =
                readings(text, &self.config.names, dp_ranks, at).map_err(|_| Failure::Invalid)?;
            let mut any = false;
            let named = target.ranks.iter().zip(&target.workers);
            for ((key, worker), reading) in named.zip(readings) {
                if let Some(reading) = reading {
                    let pool = &self.core.metrics().pool;
                    pool.engine_reading(*key, worker, &reading);
                    any |= self.core.record_engine_metrics(*key, reading);
                }
            }
            if any {
                Ok(())
            } else {
                Err(Failure::Invalid)
            }
        });
        self.metrics
            .scrape_duration
            .observe(started.elapsed().as_secs_f64());
        let label = match &result {
            Ok(()) => "ok",
            Err(f) => f.label(),
        };
        self.metrics.scrapes.with_label_values(&[label]).inc();
        result
    }
}

/// Keeps one scrape loop per catalog endpoint, following catalog changes, until the channel
/// closes.
pub async fn manage(
    core: Arc<SelectionCore>,
    config: ScrapeConfig,
    mut catalog_changes: watch::Receiver<u64>,
) {
    let metrics = core.metrics().engine.clone();
    let scraper = Arc::new(Scraper {
        client: client(config.timeout),
        permits: Arc::new(Semaphore::new(config.concurrency.max(1))),
        config: Arc::new(config),
        metrics,
        core,
    });
    let mut running: HashMap<SocketAddr, (Target, JoinHandle<()>)> = HashMap::new();
    loop {
        let kv_events = scraper.core.config().kv_events;
        let desired = targets(&scraper.core.inner().records(), kv_events);
        let wanted: HashMap<SocketAddr, &Target> =
            desired.iter().map(|t| (t.endpoint, t)).collect();
        running.retain(|endpoint, (target, task)| {
            let keep = wanted.get(endpoint).is_some_and(|t| *t == target);
            if !keep {
                task.abort();
            }
            keep
        });
        for target in desired {
            if running.contains_key(&target.endpoint) {
                continue;
            }
            let endpoint = target.endpoint;
            let task = tokio::spawn(Arc::clone(&scraper).run(target.clone()));
            running.insert(endpoint, (target, task));
        }
        if catalog_changes.changed().await.is_err() {
            for (_, (_, task)) in running {
                task.abort();
            }
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    const PAGE: &str = "\
vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 4\n\
vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 1\n\
vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 2\n\
vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 3\n\
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.5\n\
vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.25\n\
vllm:lora_requests_info{engine=\"0\",max_lora=\"2\",running_lora_adapters=\"a\",waiting_lora_adapters=\"b\"} 100\n\
vllm:lora_requests_info{engine=\"0\",max_lora=\"2\",running_lora_adapters=\"old\",waiting_lora_adapters=\"\"} 50\n";

    #[test]
    fn multiplexed_ranks_take_their_own_series_and_one_rank_takes_the_totals() {
        let at = std::time::Instant::now();
        let r = readings(PAGE, &MetricNames::vllm(), &[0, 1], at).unwrap();
        let r0 = r[0].as_ref().unwrap();
        assert_eq!((r0.waiting, r0.running, r0.kv_usage), (4, 2, 0.5));
        // The latest lora_requests_info series wins; running and waiting adapters are loaded.
        assert_eq!(&*r0.adapters, &["a".to_string(), "b".to_string()]);
        assert_eq!(r0.max_adapters, Some(2));
        let r1 = r[1].as_ref().unwrap();
        assert_eq!((r1.waiting, r1.running, r1.kv_usage), (1, 3, 0.25));
        assert!(r1.adapters.is_empty());
        // One rank on the page: totals (KV usage: the fullest engine).
        let one = readings(PAGE, &MetricNames::vllm(), &[0], at).unwrap();
        let t = one[0].as_ref().unwrap();
        assert_eq!((t.waiting, t.running, t.kv_usage), (5, 5, 0.5));
    }

    #[test]
    fn a_page_missing_a_metric_or_a_rank_gives_no_reading() {
        let at = std::time::Instant::now();
        let text = "vllm:num_requests_waiting 1\nvllm:num_requests_running 1\n";
        assert!(readings(text, &MetricNames::vllm(), &[0], at).unwrap()[0].is_none());
        let r = readings(PAGE, &MetricNames::vllm(), &[0, 7], at).unwrap();
        assert!(r[0].is_some() && r[1].is_none());
        // Negative or NaN counts are not readings.
        let text = "vllm:num_requests_waiting -1\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0\n";
        assert!(readings(text, &MetricNames::vllm(), &[0], at).unwrap()[0].is_none());
    }

    #[test]
    fn sglang_names_and_overrides() {
        let at = std::time::Instant::now();
        let text = "sglang:num_queue_reqs{model_name=\"m\"} 7\nsglang:num_running_reqs{model_name=\"m\"} 1\nsglang:token_usage{model_name=\"m\"} 0.9\n";
        let r = readings(text, &MetricNames::sglang(), &[0], at).unwrap();
        assert_eq!(r[0].as_ref().unwrap().waiting, 7);
        let names = MetricNames::vllm()
            .with_overrides("waiting=q, lora_info=, rank_label=dp")
            .unwrap();
        assert_eq!(names.waiting, "q");
        assert_eq!(names.lora_info, None);
        assert_eq!(names.rank_label.as_deref(), Some("dp"));
        assert!(MetricNames::vllm().with_overrides("bogus=x").is_err());
        assert!(MetricNames::vllm().with_overrides("waiting=").is_err());
        assert!(MetricNames::vllm().with_overrides("waiting").is_err());
    }
}

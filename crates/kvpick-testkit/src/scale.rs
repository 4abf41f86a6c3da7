//! The scale benchmark (issue 27 item 5): a fleet of pods × data-parallel ranks served by the
//! fake Kubernetes API server on loopback, one simulated KV-event publisher per rank, the real
//! `kvpick serve` binary following the InferencePool through its real kube client and
//! subscribing to every rank over real ZeroMQ, pods changing at a fixed rate, and open-loop
//! picks through the real ext_proc port. It measures start-up to ready (from the first pod LIST
//! answered to readiness SERVING), kvpick's memory (RSS), pick latency, KV-event lag (kvpick's
//! `kvpick_kv_event_lag_seconds`) and where kvpick's CPU went, and writes a JSON report.
//!
//! Owns the scenario and its phases; the parts are [`crate::apiserver`], [`crate::publishers`],
//! [`crate::churn`], [`crate::picks`], [`crate::process`]; the numbers are [`crate::report`]'s.

use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use parking_lot::Mutex;
use serde_json::json;

use crate::apiserver::{pod, pool_object, Fake, NAMESPACE, POOL};
use crate::picks::PickConfig;
use crate::process::{is_ready, Kvpick};
use crate::prom;
use crate::publishers::{bind_pod, PublishConfig, Publishers};
use crate::report::{Observed, Report, Scrape};
use crate::workload::Workload;

pub use crate::args::{ScaleArgs, MAX_PODS};

/// Pod `i`'s address: its own loopback IP, so every pod's ranks bind the same ports.
pub fn pod_ip(i: u32) -> IpAddr {
    let j = i + 1;
    IpAddr::V4(Ipv4Addr::new(
        127,
        64 + (j >> 16) as u8,
        (j >> 8) as u8,
        j as u8,
    ))
}

fn pod_name(i: u32) -> String {
    format!("vllm-{i:05}")
}

fn pod_object(args: &ScaleArgs, i: u32) -> serde_json::Value {
    let mut p = pod(&pod_name(i), &pod_ip(i).to_string())
        .annotation("kvpick.io/kv-events-port", &args.kv_port.to_string())
        .annotation("kvpick.io/block-size", &args.block_size.to_string());
    if args.ranks > 1 {
        p = p.annotation("kvpick.io/data-parallel-size", &args.ranks.to_string());
    }
    p.build()
}

/// The simulated fleet: every rank's publisher bound and sending, the pool and its pods served.
async fn start_fleet(args: &ScaleArgs) -> anyhow::Result<(Publishers, Fake, f64)> {
    let bind_start = Instant::now();
    let mut sockets = Vec::with_capacity(args.pods as usize);
    for i in 0..args.pods {
        sockets.push(bind_pod(i, pod_ip(i), args.kv_port, args.ranks).await?);
    }
    let bind_seconds = bind_start.elapsed().as_secs_f64();
    let publishers = Publishers::start(
        sockets,
        PublishConfig {
            workload: args.workload(),
            blocks_per_batch: args.blocks_per_event,
            batches_per_pod_second: args.events_per_rank_second * f64::from(args.ranks),
            pods: args.pods,
        },
    );
    let fake = Fake::start(false).await?;
    fake.put_pool(pool_object(json!({"app": "vllm"}), &[8000]));
    for i in 0..args.pods {
        fake.put_pod(pod_object(args, i));
    }
    Ok((publishers, fake, bind_seconds))
}

/// `kvpick serve`'s flags: the fake's pool through its API, then the caller's extras.
fn serve_flags(args: &ScaleArgs, fake: &Fake) -> Vec<String> {
    let mut flags: Vec<String> = [
        "--secure-serving=false",
        "--flow-watch-crds=false",
        "--pool-name",
        POOL,
        "--pool-namespace",
        NAMESPACE,
        "--kube-api-url",
        &fake.url,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    flags.extend(args.kvpick_args.iter().cloned());
    flags
}

/// Runs the benchmark against `binary` (`kvpick`), writes the JSON report and returns it.
pub async fn run(binary: &Path, args: ScaleArgs) -> anyhow::Result<Report> {
    let args = args.resolved();
    let binary = args.kvpick_bin.as_deref().unwrap_or(binary);
    args.validate()?;
    let (publishers, fake, bind_seconds) = start_fleet(&args).await?;
    let spawned = Instant::now();
    let mut kvpick = Kvpick::start(binary, &serve_flags(&args, &fake)).await?;
    let ready = wait_ready(&mut kvpick, Duration::from_secs(120)).await?;
    let first_list = fake
        .first_pod_list()
        .context("kvpick became ready without listing pods")?;
    let subscriptions = wait_subscriptions(&kvpick, &args).await?;

    let observed = measure(&kvpick, &fake, &args, args.workload()).await?;
    let since_list = |t: Instant| t.saturating_duration_since(first_list).as_secs_f64();
    let startup = crate::report::Startup {
        bind_publishers_s: bind_seconds,
        spawn_to_first_list_s: first_list.saturating_duration_since(spawned).as_secs_f64(),
        first_list_to_ready_s: since_list(ready),
        subscriptions_connected: subscriptions.0,
        first_list_to_subscribed_s: subscriptions.1.map(since_list),
    };
    let report = Report::new(&args, startup, observed, publishers.sent());
    drop(publishers);
    let log = args
        .kvpick_log
        .clone()
        .unwrap_or_else(|| args.out.with_extension("kvpick.log"));
    if let Some(dir) = log.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    kvpick.copy_log(&log)?;
    if !kvpick.running() {
        bail!("kvpick exited during the run:\n{}", kvpick.log_tail(40));
    }
    report.write(&args.out)?;
    Ok(report)
}

/// Polls readiness every 2 ms until SERVING; the instant it was seen.
async fn wait_ready(kvpick: &mut Kvpick, limit: Duration) -> anyhow::Result<Instant> {
    let deadline = Instant::now() + limit;
    let mut client = loop {
        match kvpick.health_client().await {
            Ok(c) => break c,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(2)).await
            }
            Err(e) => return Err(e),
        }
    };
    loop {
        if is_ready(&mut client).await {
            return Ok(Instant::now());
        }
        if !kvpick.running() || Instant::now() > deadline {
            bail!("kvpick never became ready:\n{}", kvpick.log_tail(40));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Waits (bounded) until every rank's KV-event subscription is connected; the count reached and
/// when all were, if they were.
async fn wait_subscriptions(
    kvpick: &Kvpick,
    args: &ScaleArgs,
) -> anyhow::Result<(u64, Option<Instant>)> {
    let want = u64::from(args.pods) * u64::from(args.ranks);
    let deadline = Instant::now() + Duration::from_secs_f64(args.subscribe_timeout_secs.max(0.0));
    loop {
        let samples = prom::parse(&kvpick.metrics_text().await?);
        let connected = prom::sum(&samples, "kvpick_kv_subscriptions", &[]) as u64;
        if connected >= want {
            return Ok((connected, Some(Instant::now())));
        }
        if Instant::now() > deadline {
            eprintln!("scale: only {connected} of {want} KV-event subscriptions connected; measuring anyway");
            return Ok((connected, None));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Churn and picks for warm-up + duration; scrapes, CPU and memory at the window's edges.
async fn measure(
    kvpick: &Kvpick,
    fake: &Fake,
    args: &ScaleArgs,
    workload: Workload,
) -> anyhow::Result<Observed> {
    let warmup = Duration::from_secs_f64(args.warmup_secs.max(0.0));
    let duration = Duration::from_secs_f64(args.duration_secs);
    let names: Vec<String> = (0..args.pods).map(pod_name).collect();
    let churn = tokio::spawn(crate::churn::run(
        fake.clone(),
        names,
        args.pod_changes_per_second,
        warmup + duration,
        crate::churn::Plan::new(args.no_restarts),
    ));
    let picks = tokio::spawn(crate::picks::run(
        format!("http://127.0.0.1:{}", kvpick.grpc),
        PickConfig {
            rate: args.picks_per_second,
            connections: args.connections,
            model: "m".into(),
            workload,
            timeout: Duration::from_millis(args.pick_timeout_ms.max(1)),
        },
        warmup,
        duration,
    ));
    let peak_rss = Arc::new(Mutex::new(0u64));
    let sampler = {
        let (pid, peak) = (kvpick.pid(), Arc::clone(&peak_rss));
        tokio::spawn(async move {
            loop {
                if let Some(rss) = crate::process::rss_of(pid) {
                    let mut peak = peak.lock();
                    *peak = (*peak).max(rss);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    tokio::time::sleep(warmup).await;
    let before = scrape(kvpick).await?;
    tokio::time::sleep(duration).await;
    let after = scrape(kvpick).await?;
    let (tally, started) = picks.await??;
    let churn = churn.await?;
    sampler.abort();
    let peak = *peak_rss.lock();
    Ok(Observed {
        before,
        after,
        picks: tally,
        picks_started: started,
        churn,
        peak_rss_bytes: peak,
    })
}

async fn scrape(kvpick: &Kvpick) -> anyhow::Result<Scrape> {
    let at = Instant::now();
    let kvpick_cpu_s = kvpick.cpu_seconds().unwrap_or(0.0);
    let bench_cpu_s = crate::process::cpu_seconds_of(std::process::id()).unwrap_or(0.0);
    let rss_bytes = kvpick.memory().map_or(0, |(rss, _)| rss);
    let samples = prom::parse(&kvpick.metrics_text().await?);
    Ok(Scrape {
        at,
        kvpick_cpu_s,
        bench_cpu_s,
        rss_bytes,
        samples,
    })
}

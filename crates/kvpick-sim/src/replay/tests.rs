use super::*;

fn small_trace() -> Vec<TraceRecord> {
    // Three families of shared prefixes, arriving close together.
    (0..24u64)
        .map(|i| TraceRecord {
            timestamp: i * 40,
            input_length: 800 + (i as usize % 3) * 100,
            output_length: 4 + (i % 5) as u32,
            hash_ids: vec![i % 3, 100 + i],
            class: Default::default(),
            session: Default::default(),
        })
        .collect()
}

fn engine() -> EngineConfig {
    EngineConfig {
        num_gpu_blocks: 2_000,
        ..EngineConfig::default()
    }
}

fn args(report: PathBuf, trace: PathBuf) -> ReplayArgs {
    use clap::Parser;
    #[derive(clap::Parser)]
    struct Wrap {
        #[command(flatten)]
        args: ReplayArgs,
    }
    Wrap::parse_from([
        "replay",
        "--trace",
        trace.to_str().unwrap(),
        "--workers",
        "3",
        "--seed",
        "5",
        "--report",
        report.to_str().unwrap(),
    ])
    .args
}

#[test]
fn same_seed_gives_identical_json() {
    let dir = std::env::temp_dir().join(format!("kvpick-replay-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace_path = dir.join("t.jsonl");
    let text: String = small_trace()
        .iter()
        .map(|r| {
            format!(
                "{{\"timestamp\":{},\"input_length\":{},\"output_length\":{},\"hash_ids\":{:?}}}\n",
                r.timestamp, r.input_length, r.output_length, r.hash_ids
            )
        })
        .collect();
    std::fs::write(&trace_path, text).unwrap();
    let (a, b) = (dir.join("a.json"), dir.join("b.json"));
    run(args(a.clone(), trace_path.clone())).unwrap();
    run(args(b.clone(), trace_path)).unwrap();
    let (ja, jb) = (std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    assert_eq!(ja, jb);
    let report: serde_json::Value = serde_json::from_slice(&ja).unwrap();
    assert_eq!(
        report["policies"].as_array().unwrap().len(),
        policy::ALL.len()
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn every_request_completes_and_hits_never_exceed_the_bound() {
    let requests = prepare(&small_trace(), 1.0);
    let names: Vec<String> = policy::ALL.iter().map(|s| s.to_string()).collect();
    let bound = infinite_cache_hit_rate(&requests, 16);
    assert!(bound > 0.3, "{bound}");
    for p in run_policies(
        &requests,
        &names,
        3,
        &engine(),
        &policy::PolicyOptions::new(16, 1),
    )
    .unwrap()
    {
        assert_eq!(p.completed, 24, "{}", p.policy);
        assert_eq!(p.per_rank_requests.iter().sum::<u64>(), 24);
        assert!(
            p.kv_hit_rate <= bound + 1e-12,
            "{}: {}",
            p.policy,
            p.kv_hit_rate
        );
    }
}

#[test]
fn kvpick_follows_the_kv_events_to_the_rank_holding_the_prefix() {
    // Requests of one family spaced far apart: once the first is done and its blocks announced,
    // kvpick sends every later one to the same rank and they hit.
    let records: Vec<TraceRecord> = (0..6u64)
        .map(|i| TraceRecord {
            timestamp: i * 10_000,
            input_length: 1000,
            output_length: 2,
            hash_ids: vec![7, 200 + i],
            class: Default::default(),
            session: Default::default(),
        })
        .collect();
    let requests = prepare(&records, 1.0);
    let reports = run_policies(
        &requests,
        &["kvpick".to_string(), "round-robin".to_string()],
        4,
        &engine(),
        &policy::PolicyOptions::new(16, 3),
    )
    .unwrap();
    let kv = &reports[0];
    assert_eq!(kv.per_rank_requests.iter().filter(|&&n| n > 0).count(), 1);
    // 5 of 6 requests find the 512-token family prefix (32 blocks of 16) cached.
    assert_eq!(kv.kv_hit_rate, (5.0 * 512.0) / 6000.0);
    assert!(reports[1].kv_hit_rate < kv.kv_hit_rate);
}

#[test]
fn infinite_bound_counts_prefixes_seen_before() {
    let r = |id, ids: Vec<u64>| Prepared {
        id,
        arrival_ns: id,
        tokens: trace::synthesize(&TraceRecord {
            timestamp: 0,
            input_length: 512 * ids.len(),
            output_length: 1,
            hash_ids: ids,
            class: Default::default(),
            session: Default::default(),
        }),
        output: 1,
        class: Default::default(),
        session: Default::default(),
    };
    let reqs = vec![r(0, vec![1, 2]), r(1, vec![1, 3]), r(2, vec![1, 2])];
    // second: 512 of 1024; third: all but the last block (1024 - 16).
    let expect = (512.0 + 1008.0) / 3072.0;
    assert_eq!(infinite_cache_hit_rate(&reqs, 16), expect);
}

#[test]
fn offered_load_flag_rescales_arrivals_to_that_load() {
    let records = small_trace();
    let config = engine();
    for target in [0.5, 0.95] {
        let speedup = speedup_for_load(&records, &config, 3, target).unwrap();
        let load = offered_load(&prepare(&records, speedup), &config, 3);
        assert!((load - target).abs() < 1e-9, "{target}: {load}");
    }
    assert!(speedup_for_load(&records, &config, 3, 0.0).is_err());
    assert!(speedup_for_load(&records[..1], &config, 3, 0.5).is_err());
}

#[test]
fn offered_load_conflicts_with_arrival_speedup_and_lands_in_the_report() {
    use clap::Parser;
    #[derive(clap::Parser)]
    struct Wrap {
        #[command(flatten)]
        args: ReplayArgs,
    }
    let both = Wrap::try_parse_from([
        "replay",
        "--trace",
        "t",
        "--offered-load",
        "0.9",
        "--arrival-speedup",
        "2",
    ]);
    assert!(both.is_err());
    let dir = std::env::temp_dir().join(format!("kvpick-replay-load-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace_path = dir.join("t.jsonl");
    let text: String = small_trace()
        .iter()
        .map(|r| serde_json::to_string(r).unwrap() + "\n")
        .collect();
    std::fs::write(&trace_path, text).unwrap();
    let args = Wrap::parse_from([
        "replay",
        "--trace",
        trace_path.to_str().unwrap(),
        "--workers",
        "3",
        "--policy",
        "round-robin",
        "--offered-load",
        "0.75",
    ])
    .args;
    let report = build_report(&args).unwrap();
    assert!(
        (report.offered_load - 0.75).abs() < 1e-9,
        "{}",
        report.offered_load
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn the_table_rounds_the_arrival_speedup_to_three_digits() {
    assert_eq!(three_digits(0.6562185358190088), 0.656);
    assert_eq!(three_digits(2.3), 2.3);
    assert_eq!(three_digits(12_345.6), 12_300.0);
    assert_eq!(three_digits(0.0), 0.0);
    use clap::Parser;
    #[derive(clap::Parser)]
    struct Wrap {
        #[command(flatten)]
        args: ReplayArgs,
    }
    let trace = tiny_trace();
    let args = Wrap::parse_from([
        "replay",
        "--trace",
        trace.to_str().unwrap(),
        "--workers",
        "2",
        "--policy",
        "round-robin",
        "--arrival-speedup",
        "0.6562185358190088",
    ])
    .args;
    let report = build_report(&args).unwrap();
    assert_eq!(
        report.arrival_speedup, 0.6562185358190088,
        "the JSON keeps it"
    );
    let table = markdown(&report);
    assert!(
        table.starts_with("2 requests, 2 workers, arrival speedup 0.656, "),
        "{table}"
    );
}

/// The two-request trace shipped in the repository (`data/mooncake/mooncake_trace_tiny.jsonl`).
fn tiny_trace() -> PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../data/mooncake/mooncake_trace_tiny.jsonl")
}

#[test]
fn report_html_is_self_contained_with_one_svg_per_chart() {
    use clap::Parser;
    #[derive(clap::Parser)]
    struct Wrap {
        #[command(flatten)]
        args: ReplayArgs,
    }
    let dir = std::env::temp_dir().join(format!("kvpick-replay-html-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (html, data) = (dir.join("r.html"), dir.join("r.json"));
    let trace = tiny_trace();
    let args = Wrap::parse_from([
        "replay",
        "--trace",
        trace.to_str().unwrap(),
        "--workers",
        "2",
        "--report-html",
        html.to_str().unwrap(),
        "--chart-data",
        data.to_str().unwrap(),
    ])
    .args;
    run(args).unwrap();
    let page = std::fs::read_to_string(&html).unwrap();
    assert!(page.starts_with("<!DOCTYPE html>"));
    assert!(
        !page.contains("http://") && !page.contains("https://"),
        "external reference"
    );
    assert!(!page.contains("<script") && !page.contains("<link"));
    let charts: crate::charts::ChartData =
        serde_json::from_str(&std::fs::read_to_string(&data).unwrap()).unwrap();
    assert_eq!(charts.sections.len(), 1);
    let section = &charts.sections[0];
    // TTFT, E2E, hit rate, per rank, a load chart per policy, kvpick's queue.
    assert_eq!(section.policies.len(), policy::ALL.len());
    let expected = 4 + policy::ALL.len() + 1;
    assert_eq!(crate::charts::svg::section_charts(section).len(), expected);
    assert_eq!(page.matches("<svg ").count(), expected);
    for name in policy::ALL {
        assert!(page.contains(&format!(">{name}<")), "{name} not named");
    }
    // Both requests completed: each CDF ends at 1, and the per-rank bars add up.
    for p in &section.policies {
        assert_eq!(p.ttft_cdf.last().unwrap().1, 1.0, "{}", p.name);
        assert_eq!(p.requests_per_rank.iter().sum::<u64>(), 2, "{}", p.name);
        let load = p.load.as_ref().unwrap();
        assert_eq!(load.values.len(), 2);
        assert_eq!(p.queue.is_some(), p.name == "kvpick");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn report_html_is_refused_in_pd_mode() {
    use clap::Parser;
    #[derive(clap::Parser)]
    struct Wrap {
        #[command(flatten)]
        args: ReplayArgs,
    }
    let args = Wrap::parse_from([
        "replay",
        "--trace",
        "/nonexistent.jsonl",
        "--pd-prefill-ranks",
        "1",
        "--report-html",
        "/nonexistent/r.html",
    ])
    .args;
    let err = run(args).unwrap_err().to_string();
    assert!(err.contains("--pd-prefill-ranks"), "{err}");
}

#[test]
fn a_shared_store_serves_round_robin_its_prefixes_and_kvpick_sees_it() {
    // One family, spaced apart: round robin lands each on another rank, which loads the
    // family's prefix from the store instead of recomputing it.
    let records: Vec<TraceRecord> = (0..6u64)
        .map(|i| TraceRecord {
            timestamp: i * 10_000,
            input_length: 1000,
            output_length: 2,
            hash_ids: vec![7, 200 + i],
            class: Default::default(),
            session: Default::default(),
        })
        .collect();
    let requests = prepare(&records, 1.0);
    let names = ["kvpick".to_string(), "round-robin".to_string()];
    let plain = policy::PolicyOptions::new(16, 3);
    let off = run_policies(&requests, &names, 4, &engine(), &plain).unwrap();
    assert!(
        off.iter().all(|p| p.tiers.is_none()),
        "no store, no tier report"
    );
    let store = policy::PolicyOptions {
        // A load as good as a local hit: every rank ties with the holder.
        shared_cache_multiplier: 1.0,
        tiers: tiers::TierOptions {
            store_ns_per_block: Some(200_000),
            p2p_ns_per_block: None,
        },
        ..plain
    };
    let on = run_policies(&requests, &names, 4, &engine(), &store).unwrap();
    let rr = on[1].tiers.as_ref().unwrap();
    // Requests 2..=6 each load the 32 blocks of the family prefix their rank lacks (requests
    // 5 and 6 land on ranks that served it and hold it).
    assert_eq!(rr.store_blocks_loaded, 3 * 32, "{rr:?}");
    assert!(
        on[1].kv_hit_rate > off[1].kv_hit_rate,
        "loaded blocks are hits"
    );
    let kv = on[0].tiers.as_ref().unwrap();
    assert!(
        kv.shared_changed_picks > 0,
        "kvpick saw the store's blocks: {kv:?}"
    );
    assert!(kv.store_blocks_loaded > 0, "{kv:?}");
    let used = |p: &PolicyReport| p.per_rank_requests.iter().filter(|&&n| n > 0).count();
    assert_eq!(
        used(&off[0]),
        1,
        "without the store kvpick keeps the holder"
    );
    assert!(
        used(&on[0]) > 1,
        "with it, ties spread: {:?}",
        on[0].per_rank_requests
    );
    assert_eq!(on[0].completed, 6);
}

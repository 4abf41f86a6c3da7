use super::pool::{PoolConfig, PoolTracker};
use super::*;
use crate::observability::metrics::Metrics;
use kvpick_core::{EngineMetrics, RankKey, RankLoad, SaturationLimits};
use std::time::Duration;

fn llm_d(m: &Metrics) -> &Series {
    m.epp
        .series()
        .iter()
        .find(|s| s.generation == Generation::LlmD)
        .unwrap()
}

fn igw(m: &Metrics) -> &Series {
    m.epp
        .series()
        .iter()
        .find(|s| s.generation == Generation::Igw)
        .unwrap()
}

fn all() -> Families {
    Families {
        kvpick: true,
        epp: true,
        igw: true,
    }
}

const L: [&str; 4] = ["m", "m", "default", "0"];

#[test]
fn families_parse_and_choose_what_is_exported() {
    assert_eq!(
        "kvpick,epp".parse::<Families>().unwrap(),
        Families::default()
    );
    let igw: Families = " igw ".parse().unwrap();
    assert!(igw.exports("inference_pool_ready_pods"));
    assert!(igw.exports("inference_objective_request_total"));
    assert!(igw.exports("inference_extension_info"));
    assert!(!igw.exports("llm_d_epp_request_total"));
    assert!(!igw.exports("kvpick_requests_total"));
    let err = "kvpick,prom".parse::<Families>().unwrap_err();
    assert!(err.contains("\"prom\""), "{err}");
    assert!("".parse::<Families>().is_err());
    assert!(",".parse::<Families>().is_err());
}

#[test]
fn render_exports_only_the_chosen_families() {
    let only_kvpick = Metrics::with_families(Families {
        kvpick: true,
        epp: false,
        igw: false,
    });
    only_kvpick
        .extproc
        .requests
        .with_label_values(&["200"])
        .inc();
    let text = only_kvpick.render();
    assert!(text.contains("kvpick_requests_total"));
    assert!(!text.contains("llm_d_epp_"), "{text}");
    let only_epp = Metrics::with_families(Families {
        kvpick: false,
        epp: true,
        igw: false,
    });
    only_epp.extproc.requests.with_label_values(&["200"]).inc();
    let text = only_epp.render();
    assert!(text.contains("llm_d_epp_info"), "{text}");
    assert!(text.contains("llm_d_epp_ready_endpoints"), "{text}");
    assert!(!text.lines().any(|l| l.starts_with("kvpick_")), "{text}");
    assert!(!text.contains("# TYPE kvpick_"), "{text}");
    assert!(!text.contains("inference_pool_"), "{text}");
    let text = Metrics::with_families(all()).render();
    assert!(text.contains("inference_extension_info"), "{text}");
    assert!(text.contains("inference_pool_ready_pods"), "{text}");
}

#[test]
fn a_routed_request_is_counted_runs_and_completes_in_both_generations() {
    let m = Metrics::with_families(all());
    let mut r = m.epp.request();
    r.classified(0, "");
    r.body(Some("m"), 120);
    r.routed();
    let s = llm_d(&m);
    assert_eq!(s.req.request_total.with_label_values(&L).get(), 1);
    assert_eq!(s.req.running.with_label_values(&L).get(), 1);
    let g = igw(&m);
    assert_eq!(
        g.req
            .request_total
            .with_label_values(&["m", "m", "0"])
            .get(),
        1
    );
    assert_eq!(g.req.running.with_label_values(&["m"]).get(), 1);
    r.streaming(true);
    r.response_chunk(10);
    r.response_chunk(30);
    r.completed(Some(Usage {
        prompt_tokens: 100,
        completion_tokens: 4,
        cached_tokens: 64,
        cached_reported: true,
    }));
    assert_eq!(s.req.running.with_label_values(&L).get(), 0);
    assert_eq!(g.req.running.with_label_values(&["m"]).get(), 0);
    let size = s.req.response_size.with_label_values(&L);
    assert_eq!((size.get_sample_count(), size.get_sample_sum()), (1, 40.0));
    let req = s.req.request_size.with_label_values(&L);
    assert_eq!(req.get_sample_sum(), 120.0);
    for (h, want) in [
        (&s.req.tokens.input, 100.0),
        (&s.req.tokens.output, 4.0),
        (&s.req.tokens.cached, 64.0),
    ] {
        assert_eq!(h.with_label_values(&L).get_sample_sum(), want);
    }
    let duration = s.req.duration.with_label_values(&L).get_sample_sum();
    let ntpot = s.req.tokens.ntpot.with_label_values(&L).get_sample_sum();
    assert!(
        (ntpot - duration / 4.0).abs() < 1e-9,
        "{ntpot} vs {duration}"
    );
    let ttft = s.req.ttft.as_ref().unwrap();
    assert_eq!(
        ttft.with_label_values(&["m", "m", "default", "0", "true"])
            .get_sample_count(),
        1
    );
    // Completing twice (trailers after the end) records nothing more.
    r.completed(None);
    assert_eq!(s.req.duration.with_label_values(&L).get_sample_count(), 1);
}

#[test]
fn a_dropped_stream_leaves_the_running_gauge() {
    let m = Metrics::new();
    let mut r = m.epp.request();
    r.body(Some("m"), 1);
    r.routed();
    assert_eq!(llm_d(&m).req.running.with_label_values(&L).get(), 1);
    drop(r);
    assert_eq!(llm_d(&m).req.running.with_label_values(&L).get(), 0);
    assert_eq!(
        llm_d(&m)
            .req
            .duration
            .with_label_values(&L)
            .get_sample_count(),
        0
    );
}

#[test]
fn refusals_and_model_server_errors_count_as_errors_with_upstream_codes() {
    let m = Metrics::new();
    let s = llm_d(&m);
    let mut r = m.epp.request();
    r.body(Some("m"), 1);
    r.routed();
    r.response_status(503);
    let mut e = L.to_vec();
    e.push("ModelServerError");
    assert_eq!(s.req.request_errors.with_label_values(&e).get(), 1);
    // A model never routed is `other` (a client chooses it).
    let mut r = m.epp.request();
    r.body(Some("never-served"), 1);
    r.rejected(429);
    let labels = [
        "other",
        "other",
        "default",
        "0",
        "InferencePoolResourceExhausted",
    ];
    assert_eq!(s.req.request_errors.with_label_values(&labels).get(), 1);
    assert_eq!(
        s.req
            .request_total
            .with_label_values(&["other", "other", "default", "0"])
            .get(),
        1
    );
    // "m" was routed before: its refusal keeps its name.
    let mut r = m.epp.request();
    r.body(Some("m"), 1);
    r.rejected(400);
    let mut e = L.to_vec();
    e.push("BadRequest");
    assert_eq!(s.req.request_errors.with_label_values(&e).get(), 1);
    assert_eq!(error_code(503), "ServiceUnavailable");
    assert_eq!(error_code(404), "BadConfiguration");
    assert_eq!(error_code(500), "Internal");
}

#[test]
fn model_labels_stop_at_the_limit_and_the_rest_are_other() {
    let m = Metrics::new();
    let s = llm_d(&m);
    for i in 0..MAX_MODELS {
        let mut r = m.epp.request();
        r.body(Some(&format!("m{i}")), 1);
        r.routed();
    }
    let mut r = m.epp.request();
    r.body(Some("one-too-many"), 1);
    r.routed();
    assert_eq!(
        s.req
            .request_total
            .with_label_values(&["other", "other", "default", "0"])
            .get(),
        1
    );
    // A name labelled before still is.
    let mut r = m.epp.request();
    r.body(Some("m0"), 1);
    r.routed();
    assert_eq!(
        s.req
            .request_total
            .with_label_values(&["m0", "m0", "default", "0"])
            .get(),
        2
    );
}

#[test]
fn fairness_ids_are_bounded() {
    let m = Metrics::new();
    let s = llm_d(&m);
    for i in 0..=MAX_FAIRNESS_IDS {
        let mut r = m.epp.request();
        r.classified(0, &format!("tenant-{i}"));
        r.body(Some("m"), 1);
        r.routed();
    }
    assert_eq!(
        s.req
            .request_total
            .with_label_values(&["m", "m", "other", "0"])
            .get(),
        1
    );
}

#[test]
fn priorities_are_bounded() {
    let m = Metrics::new();
    let s = llm_d(&m);
    for p in 0..=MAX_PRIORITIES as i32 {
        let mut r = m.epp.request();
        r.classified(p, "");
        r.body(Some("m"), 1);
        r.routed();
    }
    let last = (MAX_PRIORITIES - 1).to_string();
    let labels = ["m", "m", "default", last.as_str()];
    assert_eq!(s.req.request_total.with_label_values(&labels).get(), 1);
    assert_eq!(
        s.req
            .request_total
            .with_label_values(&["m", "m", "default", "other"])
            .get(),
        1
    );
}

#[test]
fn a_rewrite_labels_the_source_model_and_its_target() {
    let m = Metrics::new();
    let mut r = m.epp.request();
    r.rewritten("alias", "base");
    // The rewritten body names the target; the source stays the request's model.
    r.body(Some("base"), 1);
    r.routed();
    assert_eq!(
        llm_d(&m)
            .req
            .request_total
            .with_label_values(&["alias", "base", "default", "0"])
            .get(),
        1
    );
}

#[test]
fn the_queue_gauge_holds_a_queued_request_until_it_is_routed_or_gone() {
    let m = Metrics::new();
    m.epp.set_pool_name("pool-a");
    let q = &llm_d(&m).pool.queue_size;
    let labels = ["default", "0", "pool-a", "m", "m"];
    let mut r = m.epp.request();
    r.body(Some("m"), 1);
    r.queued();
    assert_eq!(q.with_label_values(&labels).get(), 1);
    r.routed();
    assert_eq!(q.with_label_values(&labels).get(), 0);
    let mut gone = m.epp.request();
    gone.body(Some("m"), 1);
    gone.queued();
    assert_eq!(q.with_label_values(&labels).get(), 1);
    drop(gone);
    assert_eq!(q.with_label_values(&labels).get(), 0);
}

#[test]
fn stages_and_the_scheduler_time_are_observed() {
    let m = Metrics::with_families(all());
    m.epp.stage(Stage::Pick, 0.001);
    m.epp.scheduled(0.002);
    for s in m.epp.series() {
        let h = s
            .pool
            .plugin_duration
            .with_label_values(&Stage::Pick.labels());
        assert_eq!(h.get_sample_count(), 1);
        assert_eq!(s.pool.scheduler_e2e.get_sample_sum(), 0.002);
    }
}

fn reading(waiting: u64, running: u64, kv: f64, at: Instant) -> EngineMetrics {
    EngineMetrics {
        waiting,
        running,
        kv_usage: kv,
        adapters: Arc::from(Vec::<String>::new()),
        max_adapters: None,
        at,
    }
}

fn key(worker_id: u64) -> RankKey {
    RankKey {
        worker_id,
        dp_rank: 0,
    }
}

fn tracker(limits: SaturationLimits) -> PoolTracker {
    let p = PoolTracker::register(&Registry::new());
    p.configure(PoolConfig {
        limits,
        stale_after: Duration::from_secs(5),
    });
    p
}

const ENGINE_LIMITS: SaturationLimits = SaturationLimits {
    max_wait_seconds: None,
    max_active_requests: None,
    engine_waiting: Some(8),
    engine_kv_usage: Some(0.8),
};

#[test]
fn pool_averages_and_saturation_come_from_fresh_readings() {
    let p = tracker(ENGINE_LIMITS);
    let now = Instant::now();
    p.engine_reading(key(1), &"w1".into(), &reading(4, 10, 0.4, now));
    p.engine_reading(key(2), &"w2".into(), &reading(8, 20, 0.2, now));
    let f = p.figures(now);
    assert_eq!(f.reporting, 2);
    assert!((f.average_kv - 0.3).abs() < 1e-9);
    assert!((f.average_queue - 6.0).abs() < 1e-9);
    assert!((f.average_running - 15.0).abs() < 1e-9);
    // Rank 1: max(4/8, 0.4/0.8) = 0.5; rank 2: max(8/8, 0.25) = 1 (saturated).
    assert!((f.saturation - 0.75).abs() < 1e-9, "{f:?}");
    assert!((f.saturated_ratio - 0.5).abs() < 1e-9, "{f:?}");
    // Past the staleness bound the readings no longer count.
    let f = p.figures(now + Duration::from_secs(6));
    assert_eq!((f.reporting, f.saturation, f.average_kv), (0, 0.0, 0.0));
}

#[test]
fn active_requests_count_against_max_requests() {
    let p = tracker(SaturationLimits {
        max_active_requests: Some(4),
        ..ENGINE_LIMITS
    });
    let load = |n| RankLoad {
        active_requests: n,
        ..Default::default()
    };
    let a: Arc<str> = Arc::from("a");
    let b: Arc<str> = Arc::from("b");
    p.load(&a, 0, &load(4));
    p.load(&b, 0, &load(2));
    let f = p.figures(Instant::now());
    assert!((f.saturation - 0.75).abs() < 1e-9, "{f:?}");
    assert!((f.saturated_ratio - 0.5).abs() < 1e-9, "{f:?}");
    p.rank_gone(&a, 0);
    let f = p.figures(Instant::now());
    assert!((f.saturation - 0.5).abs() < 1e-9, "{f:?}");
    assert_eq!(f.saturated_ratio, 0.0);
}

#[test]
fn queue_length_and_oldest_age_follow_the_waiters() {
    let p = tracker(ENGINE_LIMITS);
    let t0 = Instant::now();
    p.enqueued(1, t0);
    p.enqueued(2, t0 + Duration::from_secs(2));
    let f = p.figures(t0 + Duration::from_secs(3));
    assert_eq!(f.queue_length, 2);
    assert!((f.queue_oldest_age_seconds - 3.0).abs() < 1e-9);
    p.dequeued(1);
    let f = p.figures(t0 + Duration::from_secs(3));
    assert_eq!(f.queue_length, 1);
    assert!((f.queue_oldest_age_seconds - 1.0).abs() < 1e-9);
    p.dequeued(2);
    assert_eq!(p.figures(t0).queue_oldest_age_seconds, 0.0);
}

#[test]
fn refresh_sets_the_epp_pool_gauges_and_drops_averages_without_readings() {
    let m = Metrics::new();
    m.epp.set_pool_name("p");
    m.pool.configure(PoolConfig {
        limits: ENGINE_LIMITS,
        stale_after: Duration::from_secs(5),
    });
    m.pool.schedulable(3);
    let text = m.render();
    assert!(
        text.contains("llm_d_epp_ready_endpoints{name=\"p\"} 3"),
        "{text}"
    );
    assert!(
        !text.contains("llm_d_epp_average_kv_cache_utilization{"),
        "{text}"
    );
    m.pool.engine_reading(
        key(1),
        &"w1".into(),
        &reading(2, 1, 0.5, crate::selection::now()),
    );
    let text = m.render();
    assert!(
        text.contains("llm_d_epp_average_kv_cache_utilization{name=\"p\"} 0.5"),
        "{text}"
    );
    assert!(
        text.contains("llm_d_epp_average_queue_size{name=\"p\"} 2"),
        "{text}"
    );
    assert!(text.contains("kvpick_pool_saturation 0.625"), "{text}");
    assert!(
        text.contains("llm_d_epp_flow_control_pool_saturation{inference_pool=\"p\"} 0.625"),
        "{text}"
    );
}

/// Each rank's scraped reading is exported as it was scraped (not only as pool averages), until
/// it goes stale or the rank leaves; at most `MAX_ENGINE_RANK_SERIES` ranks, first by name.
#[test]
fn per_rank_engine_readings_are_exported_while_fresh() {
    use crate::observability::epp_metrics::pool::MAX_ENGINE_RANK_SERIES;
    let m = Metrics::new();
    m.pool.configure(PoolConfig {
        limits: ENGINE_LIMITS,
        stale_after: Duration::from_secs(5),
    });
    let now = crate::selection::now();
    m.pool
        .engine_reading(key(1), &"w1".into(), &reading(3, 7, 0.25, now));
    m.pool
        .engine_reading(key(2), &"w2".into(), &reading(1, 2, 0.5, now));
    let text = m.render();
    for line in [
        "kvpick_engine_requests_waiting{rank=\"0\",worker=\"w1\"} 3",
        "kvpick_engine_requests_running{rank=\"0\",worker=\"w1\"} 7",
        "kvpick_engine_kv_cache_usage_ratio{rank=\"0\",worker=\"w1\"} 0.25",
        "kvpick_engine_requests_waiting{rank=\"0\",worker=\"w2\"} 1",
    ] {
        assert!(text.contains(line), "{line} in {text}");
    }
    // w2 leaves the catalog; w1's reading goes stale: neither is exported any more.
    m.pool.rank_gone(&"w2".into(), 0);
    let text = m.render();
    assert!(!text.contains("worker=\"w2\""), "{text}");
    let stale = now + Duration::from_secs(6);
    m.pool.refresh(&m.epp, stale);
    let text = m.render();
    assert!(!text.contains("kvpick_engine_requests_waiting{"), "{text}");
    // Bounded: one rank more than the bound, the last by name is left out.
    for i in 0..=MAX_ENGINE_RANK_SERIES as u64 {
        m.pool.engine_reading(
            key(100 + i),
            &format!("w{i:05}").into(),
            &reading(0, 0, 0.0, now),
        );
    }
    let text = m.render();
    let exported = text
        .lines()
        .filter(|l| l.starts_with("kvpick_engine_requests_waiting{"))
        .count();
    assert_eq!(exported, MAX_ENGINE_RANK_SERIES);
    let last = format!("w{:05}", MAX_ENGINE_RANK_SERIES);
    assert!(!text.contains(&format!("worker=\"{last}\"")));
}

#[path = "stream_tests.rs"]
mod stream_tests;

//! The scale benchmark keeps working: `--quick` (4 pods × 2 ranks, 2 s) against the real binary,
//! and its JSON report has every section with sane values. Timings are not asserted here: speed
//! targets live in the benchmark itself (`cargo bench --bench scale`, docs/benchmarks.md).

use clap::Parser;
use kvpick_testkit::scale::{run, ScaleArgs};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quick_scale_benchmark_writes_a_sane_report() {
    let dir = std::env::temp_dir().join(format!("kvpick-scale-{}", uuid::Uuid::new_v4()));
    let out = dir.join("bench-scale.json");
    // Its own events port range: other tests' simulated engines use the default ones.
    let args = ScaleArgs::parse_from([
        "scale",
        "--quick",
        "--kv-port",
        "26557",
        "--out",
        out.to_str().unwrap(),
    ]);
    let report = run(std::path::Path::new(env!("CARGO_BIN_EXE_kvpick")), args)
        .await
        .unwrap();
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let j = &report.json;
    assert_eq!(
        written["picks"]["routed"], j["picks"]["routed"],
        "the file is the report"
    );
    assert_eq!(j["parameters"]["ranks"], 8, "4 pods x 2 ranks");
    assert_eq!(j["startup"]["subscriptions_connected"], 8);
    assert!(j["startup"]["first_list_to_ready_s"].as_f64().unwrap() >= 0.0);
    let routed = j["picks"]["routed"].as_u64().unwrap();
    assert!(routed > 0, "{j:#}");
    let other = ["unrouted", "failed", "timed_out"].map(|k| j["picks"][k].as_u64().unwrap());
    assert_eq!(
        routed + other.iter().sum::<u64>(),
        j["picks"]["started"].as_u64().unwrap(),
        "every measured pick is accounted for"
    );
    assert_eq!(j["picks"]["failed"], 0, "{j:#}");
    assert!(j["picks"]["p99_us"].as_u64().unwrap() >= j["picks"]["p50_us"].as_u64().unwrap());
    assert!(
        j["events"]["events_applied"].as_f64().unwrap() > 0.0,
        "{j:#}"
    );
    assert!(
        j["events"]["lag_p99_ms"].as_f64().is_some(),
        "the lag histogram counted batches"
    );
    assert!(j["churn"]["changes"].as_u64().unwrap() > 0);
    assert!(
        j["churn"]["catalog_applied_in_window"].as_f64().unwrap() > 0.0,
        "restarts and readiness flips reach the catalog: {j:#}"
    );
    assert!(j["memory"]["rss_mib_end"].as_f64().unwrap() > 1.0);
    assert!(j["cpu"]["kvpick_cores"].as_f64().unwrap() > 0.0);
    for target in [
        "ready_within_5s",
        "pick_p99_within_1ms",
        "event_lag_p99_within_50ms",
    ] {
        assert!(j["targets"][target].is_boolean(), "{target}");
    }
    assert!(report.table().contains("| pick p50 / p99 (client) |"));
    let log = std::fs::read_to_string(dir.join("bench-scale.kvpick.log")).unwrap();
    assert!(
        log.contains("catalog applied"),
        "kvpick's log is kept beside the report"
    );
    assert!(
        !log.contains("watch failed"),
        "every churned pod parses:\n{log}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

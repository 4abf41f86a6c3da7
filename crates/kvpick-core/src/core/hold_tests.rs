//! `--hold-when-no-endpoints` through [`Core`]: requests for a model without a ready rank wait
//! in the queue (scale from zero) instead of being refused, within a bound on how many models
//! may wait; without the setting nothing changes.
use super::*;
use crate::catalog::RankLayout;
use crate::flow::FlowConfig;
use crate::request::PromptInput;
use std::time::Duration;

fn core(hold: bool, workers: &[(&str, &str)]) -> Core {
    let core = Core::new(CoreConfig {
        seed: Some(1),
        flow: FlowConfig {
            hold_when_no_endpoints: hold,
            ..FlowConfig::default()
        },
        ..CoreConfig::default()
    });
    core.apply_source_snapshot("catalog", specs(workers), Instant::now())
        .unwrap();
    core
}

fn specs(workers: &[(&str, &str)]) -> Vec<WorkerSpec> {
    workers
        .iter()
        .enumerate()
        .map(|(i, (name, model))| {
            WorkerSpec::for_test(name, model, RankLayout::PerPort(vec![8000 + i as u16]))
        })
        .collect()
}

fn request(id: &str, model: &str) -> SelectionRequest {
    SelectionRequest {
        request_id: id.into(),
        model: Some(model.into()),
        prompt: PromptInput::Tokens(vec![7; 64]),
        ..Default::default()
    }
}

fn queued(core: &Core, r: &SelectionRequest, now: Instant) -> u64 {
    match core.admit(r, now).0 {
        Ok(Admission::Queued { ticket, .. }) => ticket,
        other => panic!("expected to queue, got {other:?}"),
    }
}

fn released(facts: &Facts) -> Vec<(u64, Result<Selection, SelectError>)> {
    facts
        .iter()
        .filter_map(|f| match f {
            Fact::Dequeued { ticket, result } => Some((*ticket, result.clone().map(|s| *s))),
            _ => None,
        })
        .collect()
}

#[test]
fn a_pool_at_zero_holds_requests_until_a_worker_joins() {
    let core = core(true, &[]);
    let now = Instant::now();
    let t = queued(&core, &request("r", "m"), now);
    assert_eq!(core.waiting_requests(), 1);
    // A release pass with still no rank keeps it waiting.
    assert!(released(&core.pump(now)).is_empty());
    let (_, facts) = core
        .apply_source_snapshot("catalog", specs(&[("a", "m")]), now)
        .unwrap();
    let out = released(&facts);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].0, t);
    assert_eq!(out[0].1.as_ref().unwrap().primary.worker_name, "a");
    assert_eq!(core.waiting_requests(), 0);
}

#[test]
fn without_the_setting_a_pool_at_zero_refuses_at_once() {
    let core = core(false, &[]);
    let (result, _) = core.admit(&request("r", "m"), Instant::now());
    assert_eq!(result.unwrap_err().label(), "unavailable");
    assert_eq!(core.waiting_requests(), 0);
}

#[test]
fn a_partition_losing_every_rank_keeps_its_waiting_requests() {
    let core = core(true, &[("a", "m")]);
    let now = Instant::now();
    // The rank goes; a new request waits, and the timer ends it with a 503 at its deadline.
    core.apply_source_snapshot("catalog", vec![], now).unwrap();
    let t = queued(&core, &request("w", "m"), now);
    let (error, _) = core.expire_waiting(t, now + Duration::from_secs(30));
    assert_eq!(error.unwrap().label(), "unavailable");
    assert_eq!(core.waiting_requests(), 0);
}

#[test]
fn at_most_the_bound_of_models_wait_and_one_more_is_refused_at_once() {
    let core = core(true, &[]);
    let now = Instant::now();
    for i in 0..MAX_HELD_PARTITIONS {
        queued(
            &core,
            &request(&format!("r{i}"), &format!("model-{i}")),
            now,
        );
    }
    let (result, _) = core.admit(&request("over", "model-x"), now);
    let error = result.unwrap_err();
    assert_eq!(error.label(), "unavailable");
    assert!(error.to_string().contains("already wait"), "{error}");
    // A model already waiting still takes more requests.
    queued(&core, &request("again", "model-0"), now);
    assert_eq!(core.waiting_requests(), MAX_HELD_PARTITIONS + 1);
}

#[test]
fn a_request_without_a_model_waits_in_the_pools_only_partition() {
    let core = core(true, &[("a", "m")]);
    let now = Instant::now();
    core.apply_source_snapshot("catalog", vec![], now).unwrap();
    let anonymous = SelectionRequest {
        model: None,
        ..request("anon", "m")
    };
    let t = queued(&core, &anonymous, now);
    let (_, facts) = core
        .apply_source_snapshot("catalog", specs(&[("b", "m")]), now)
        .unwrap();
    let out = released(&facts);
    assert_eq!(out[0].0, t);
    assert_eq!(out[0].1.as_ref().unwrap().primary.worker_name, "b");
}

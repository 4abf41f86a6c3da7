//! A remote index's overlap as the decision's input (`SelectionRequest::remote_overlap`,
//! `--kv-index-remote`): a replica with no KV events of its own picks what the indexer would,
//! from the indexer's scores for the block hashes the replica computed; its own predictions
//! count where deeper; without the scores it is the approximate picker it always was.

use std::sync::Arc;
use std::time::Instant;

use super::*;
use crate::catalog::RankLayout;
use crate::event::KvEvent;
use crate::request::{PromptInput, RemoteOverlap};
use crate::types::TierDepths;

const BS: u32 = 16;

fn specs() -> Vec<WorkerSpec> {
    (1..=4u16)
        .map(|p| WorkerSpec {
            block_size: Some(BS),
            kv_events: Some(format!("tcp://127.0.0.1:{}", 5557 + p)),
            ..WorkerSpec::for_test(&format!("w{p}"), "m", RankLayout::PerPort(vec![p]))
        })
        .collect()
}

fn core(kv_events: bool, t0: Instant) -> Core {
    let core = Core::new(CoreConfig {
        kv_events,
        seed: Some(7),
        ..CoreConfig::default()
    });
    core.apply_source_snapshot("catalog", specs(), t0).unwrap();
    core
}

fn request(id: &str, tokens: Vec<u32>) -> SelectionRequest {
    fixtures::token_request(id, tokens)
}

fn stored(tokens: &[u32]) -> KvEvent {
    fixtures::gpu_store(tokens, BS, 500)
}

/// What the indexer answers the replica's query (the `OverlapScores` RPC's content).
fn indexer_answer(indexer: &Core, replica: &Core, req: &SelectionRequest) -> RemoteOverlap {
    let q = replica
        .remote_query(req)
        .expect("a prompt with complete blocks");
    let asked = SelectionRequest {
        model: Some(q.model),
        routing_group: q.routing_group,
        prompt: PromptInput::BlockHashes {
            seq_hashes: q.seq_hashes,
            prompt_tokens: q.prompt_tokens,
        },
        ..Default::default()
    };
    let (_, scores) = indexer.overlap_scores(&asked, Instant::now()).unwrap();
    RemoteOverlap::new(scores.into_iter().map(|(r, d)| (r.key, d)).collect())
}

#[test]
fn the_remote_scores_pick_the_rank_holding_the_prefix_as_the_indexer_would() {
    let t0 = Instant::now();
    let indexer = core(true, t0);
    let replica = core(false, t0);
    let tokens: Vec<u32> = (0..8 * BS + 1).collect();
    let holder = RankKey {
        worker_id: specs()[2].worker_id(),
        dp_rank: 0,
    };
    indexer.apply_kv_events(holder, &[stored(&tokens)], None, t0);
    let req = request("r1", tokens.clone());
    let remote = indexer_answer(&indexer, &replica, &req);
    assert_eq!(
        remote
            .ranks()
            .iter()
            .find(|r| r.0 == holder)
            .map(|r| r.1.gpu),
        Some(8)
    );
    let (own, _) = indexer.select(&req, t0).unwrap();
    assert_eq!(own.primary.key, holder);
    let with_remote = SelectionRequest {
        remote_overlap: Some(Arc::new(remote)),
        ..req.clone()
    };
    let (picked, _) = replica.select_and_reserve(&with_remote, t0).unwrap();
    assert_eq!(
        picked.primary.key, holder,
        "the replica picks what the indexer holds"
    );
    assert_eq!(picked.overlap_blocks, own.overlap_blocks);
    assert_eq!(picked.cost, own.cost);
}

#[test]
fn the_replicas_own_predictions_count_where_deeper_than_the_remotes() {
    let t0 = Instant::now();
    let replica = core(false, t0);
    let tokens: Vec<u32> = (0..6 * BS + 1).collect();
    // The replica's first pick predicts the prompt on its rank (approximate mode).
    let (first, _) = replica
        .select_and_reserve(&request("a", tokens.clone()), t0)
        .unwrap();
    // Its load gone (an approximate rank's predictions outlive the request).
    assert!(replica.free("a", crate::request::Claim::Any, t0).0);
    // The remote has not heard of it yet (the engine's events are still on their way): an
    // empty answer does not hide the replica's own prediction.
    let again = SelectionRequest {
        remote_overlap: Some(Arc::new(RemoteOverlap::new(Vec::new()))),
        ..request("b", tokens)
    };
    let (second, _) = replica.select(&again, t0).unwrap();
    assert_eq!(second.primary.key, first.primary.key);
    assert_eq!(second.overlap_blocks, 6);
}

#[test]
fn a_rank_named_twice_keeps_its_deepest_tiers_and_the_answer_is_sorted() {
    let r = |w: u64| RankKey {
        worker_id: w,
        dp_rank: 0,
    };
    let d = |gpu, host, disk| TierDepths { gpu, host, disk };
    let remote = RemoteOverlap::new(vec![
        (r(9), d(1, 5, 5)),
        (r(2), d(3, 3, 3)),
        (r(9), d(4, 4, 6)),
    ]);
    assert_eq!(remote.ranks(), &[(r(2), d(3, 3, 3)), (r(9), d(4, 5, 6))]);
    let merged = remote.merged_with(&[(r(5), d(1, 1, 1)), (r(2), d(7, 7, 7))]);
    assert_eq!(
        merged,
        vec![(r(2), d(7, 7, 7)), (r(5), d(1, 1, 1)), (r(9), d(4, 5, 6))]
    );
}

#[test]
fn a_prompt_cut_at_max_prompt_blocks_asks_with_a_length_the_remote_accepts() {
    let t0 = Instant::now();
    let replica = Core::new(CoreConfig {
        max_prompt_blocks: 4,
        ..CoreConfig::default()
    });
    replica
        .apply_source_snapshot("catalog", specs(), t0)
        .unwrap();
    let q = replica
        .remote_query(&request("long", (0..40 * BS).collect()))
        .unwrap();
    assert_eq!(q.seq_hashes.len(), 4);
    assert_eq!(q.prompt_tokens, u64::from(4 * BS + 1));
    let check = PromptInput::BlockHashes {
        seq_hashes: q.seq_hashes,
        prompt_tokens: q.prompt_tokens,
    };
    crate::request::check_block_hashes(&check, BS).unwrap();
    // No complete block: nothing to ask.
    assert!(replica
        .remote_query(&request("short", (0..BS - 1).collect()))
        .is_none());
}

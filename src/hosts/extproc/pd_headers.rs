//! The headers that tell the serving side about a prefill/decode pair ([`kvpick_core::Selection::
//! prefill`]), in the protocol `--pd-protocol` names. It owns only the header names and values;
//! the stream machine adds them to its header mutation and must not emit them itself.
//!
//! - **llm-d** (default): the destination is the decode rank; `x-prefiller-host-port` is the
//!   prefill rank's `ip:port` for llm-d's routing sidecar on the decode pod. A DP worker with a
//!   port per rank names the rank by its port; a multiplexed one (one port for every rank) gets
//!   `x-prefiller-data-parallel-rank` as well (kvpick's own: llm-d's sidecar picks the prefill
//!   rank of a single-port DP engine itself, by request-id hash).
//! - **Dynamo**: `x-dynamo-prefill-instance-id` (decimal worker id), `x-dynamo-prefill-dp-rank`
//!   and `x-dynamo-routing-mode` (`disaggregated`, or `aggregated` when the decode rank prefills).
//!
//! Every one of these names a client sent is removed unless kvpick sets it: a client must not
//! steer a sidecar's prefill request (SSRF).

use std::str::FromStr;

use kvpick_core::Selection;

pub const PREFILLER_HOST_PORT: &str = "x-prefiller-host-port";
pub const PREFILLER_DP_RANK: &str = "x-prefiller-data-parallel-rank";
pub const DYNAMO_PREFILL_INSTANCE_ID: &str = "x-dynamo-prefill-instance-id";
pub const DYNAMO_PREFILL_DP_RANK: &str = "x-dynamo-prefill-dp-rank";
pub const DYNAMO_ROUTING_MODE: &str = "x-dynamo-routing-mode";

/// Every header this module may set, lower-case.
pub const ALL: [&str; 5] = [
    PREFILLER_HOST_PORT,
    PREFILLER_DP_RANK,
    DYNAMO_PREFILL_INSTANCE_ID,
    DYNAMO_PREFILL_DP_RANK,
    DYNAMO_ROUTING_MODE,
];

/// Which serving stack reads the pair (`--pd-protocol`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PdProtocol {
    #[default]
    LlmD,
    Dynamo,
}

impl FromStr for PdProtocol {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "llm-d" | "llmd" => Ok(PdProtocol::LlmD),
            "dynamo" => Ok(PdProtocol::Dynamo),
            other => Err(format!(
                "--pd-protocol must be llm-d or dynamo, got {:?}",
                other.chars().take(32).collect::<String>()
            )),
        }
    }
}

/// The pair headers for `selection` (name, value), lower-case names.
pub fn headers(selection: &Selection, protocol: PdProtocol) -> Vec<(&'static str, String)> {
    let prefill = selection.prefill.as_ref();
    match protocol {
        PdProtocol::LlmD => match prefill {
            None => Vec::new(),
            Some(p) => {
                let mut out = vec![(PREFILLER_HOST_PORT, p.endpoint.to_string())];
                if p.multiplexed {
                    out.push((PREFILLER_DP_RANK, p.key.dp_rank.to_string()));
                }
                out
            }
        },
        PdProtocol::Dynamo => match prefill {
            None => vec![(DYNAMO_ROUTING_MODE, "aggregated".to_string())],
            Some(p) => vec![
                (DYNAMO_PREFILL_INSTANCE_ID, p.key.worker_id.to_string()),
                (DYNAMO_PREFILL_DP_RANK, p.key.dp_rank.to_string()),
                (DYNAMO_ROUTING_MODE, "disaggregated".to_string()),
            ],
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpick_core::{PartitionKey, PickedRank, RankKey};

    fn rank(worker_id: u64, dp_rank: u32, endpoint: &str, multiplexed: bool) -> PickedRank {
        PickedRank {
            key: RankKey { worker_id, dp_rank },
            worker_name: format!("w{worker_id}"),
            endpoint: endpoint.parse().unwrap(),
            multiplexed,
        }
    }

    fn selection(prefill: Option<PickedRank>) -> Selection {
        Selection {
            booking_id: "r".into(),
            generation: 1,
            partition: PartitionKey {
                model: "m".into(),
                routing_group: String::new(),
            },
            primary: rank(1, 0, "10.0.0.1:8000", false),
            fallbacks: vec![],
            prefill,
            overlap_blocks: 0,
            predicted_cached_tokens: 0,
            prompt_blocks: 0,
            prompt_tokens: 0,
            cost: 0.0,
            session: None,
            candidates: 1,
            predicted_ttft_seconds: 0.0,
            scores: vec![],
            shared_blocks: 0,
            transfer: None,
        }
    }

    #[test]
    fn llm_d_names_the_prefill_endpoint_and_a_multiplexed_rank() {
        let split = selection(Some(rank(2, 1, "10.0.0.2:8001", false)));
        assert_eq!(
            headers(&split, PdProtocol::LlmD),
            vec![(PREFILLER_HOST_PORT, "10.0.0.2:8001".to_string())]
        );
        let mux = selection(Some(rank(2, 3, "10.0.0.2:8000", true)));
        assert_eq!(
            headers(&mux, PdProtocol::LlmD),
            vec![
                (PREFILLER_HOST_PORT, "10.0.0.2:8000".to_string()),
                (PREFILLER_DP_RANK, "3".to_string())
            ]
        );
        assert!(headers(&selection(None), PdProtocol::LlmD).is_empty());
    }

    #[test]
    fn dynamo_names_the_prefill_instance_rank_and_mode() {
        let split = selection(Some(rank(2, 1, "10.0.0.2:8001", false)));
        assert_eq!(
            headers(&split, PdProtocol::Dynamo),
            vec![
                (DYNAMO_PREFILL_INSTANCE_ID, "2".to_string()),
                (DYNAMO_PREFILL_DP_RANK, "1".to_string()),
                (DYNAMO_ROUTING_MODE, "disaggregated".to_string())
            ]
        );
        assert_eq!(
            headers(&selection(None), PdProtocol::Dynamo),
            vec![(DYNAMO_ROUTING_MODE, "aggregated".to_string())]
        );
        assert_eq!("dynamo".parse(), Ok(PdProtocol::Dynamo));
        assert!("sglang".parse::<PdProtocol>().is_err());
    }
}

//! Mooncake JSONL traces (ARCHITECTURE.md §10): parsing, and the deterministic synthesis of token ids from
//! `hash_ids` (each id is one 512-token block; equal leading ids are a shared prefix). The same
//! synthesis is implemented in `e2e/replay/trace.py`, so online and offline replays send identical
//! prompts. Owns nothing else.

use serde::{Deserialize, Serialize};

/// Tokens per Mooncake hash id.
pub const MOONCAKE_BLOCK: usize = 512;

/// Vocabulary the synthetic token ids are drawn from (Llama-3 sized).
pub const VOCAB: u64 = 128_000;

/// One trace line (fields in Mooncake's order, which is also the order it is written in).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
pub struct TraceRecord {
    /// Arrival, milliseconds since the trace start.
    pub timestamp: u64,
    pub input_length: usize,
    pub output_length: u32,
    pub hash_ids: Vec<u64>,
    /// Flow-control columns (absent in Mooncake's traces): priority, tenant, TTFT SLO.
    #[serde(flatten)]
    pub class: FlowClass,
    /// Session columns (absent in Mooncake's traces): the request's session and its parent.
    #[serde(flatten)]
    pub session: SessionColumns,
}

/// A request's session, optional trace columns: `session_id` (kvpick binds it as it binds a
/// session header) and `parent_session_id` (a sub-agent's parent session; docs/sessions.md).
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct SessionColumns {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_session_id: Option<String>,
}

/// A request's flow-control class, optional trace columns: `priority` (integer, negative =
/// sheddable; default 0), `tenant` (the fairness key) and `slo_ttft_ms`.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct FlowClass {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slo_ttft_ms: Option<u64>,
}

/// SplitMix64 finaliser.
pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The 512 token ids of one Mooncake hash id: a 64-bit LCG seeded by `splitmix64(id)`, each token
/// `(state >> 33) % VOCAB`.
pub fn block_tokens(hash_id: u64, out: &mut Vec<u32>, take: usize) {
    let mut x = splitmix64(hash_id);
    for _ in 0..take.min(MOONCAKE_BLOCK) {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        out.push(((x >> 33) % VOCAB) as u32);
    }
}

/// The prompt of a record: its hash ids' blocks, the last one truncated to `input_length`.
pub fn synthesize(record: &TraceRecord) -> Vec<u32> {
    let mut out = Vec::with_capacity(record.input_length);
    for id in &record.hash_ids {
        let left = record.input_length - out.len();
        if left == 0 {
            break;
        }
        block_tokens(*id, &mut out, left);
    }
    out
}

/// Parses a JSONL trace (blank lines skipped).
pub fn parse(text: &str) -> anyhow::Result<Vec<TraceRecord>> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let rec: TraceRecord =
            serde_json::from_str(line).map_err(|e| anyhow::anyhow!("trace line {}: {e}", n + 1))?;
        if rec.input_length == 0 || rec.input_length > rec.hash_ids.len() * MOONCAKE_BLOCK {
            anyhow::bail!(
                "trace line {}: input_length {} does not fit {} hash ids",
                n + 1,
                rec.input_length,
                rec.hash_ids.len()
            );
        }
        out.push(rec);
    }
    Ok(out)
}

pub fn load(path: &std::path::Path) -> anyhow::Result<Vec<TraceRecord>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("reading trace {}: {e}", path.display()))?;
    parse(&text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthesis_is_deterministic_prefix_shared_and_truncated() {
        let a = TraceRecord {
            timestamp: 0,
            input_length: 700,
            output_length: 1,
            hash_ids: vec![0, 1],
            class: FlowClass::default(),
            session: Default::default(),
        };
        let b = TraceRecord {
            hash_ids: vec![0, 2],
            ..a.clone()
        };
        let (ta, tb) = (synthesize(&a), synthesize(&b));
        assert_eq!(ta.len(), 700);
        assert_eq!(ta[..512], tb[..512]);
        assert_ne!(ta[512..], tb[512..]);
        assert_eq!(ta, synthesize(&a));
        assert!(ta.iter().all(|&t| (t as u64) < VOCAB));
    }

    #[test]
    fn known_vector_shared_with_the_python_client() {
        // e2e/replay/trace.py asserts the same numbers.
        let mut out = Vec::new();
        block_tokens(0, &mut out, 4);
        block_tokens(12345, &mut out, 2);
        assert_eq!(out, KNOWN_VECTOR);
    }

    pub(super) const KNOWN_VECTOR: [u32; 6] = [61292, 1891, 23524, 50541, 66863, 74704];

    #[test]
    fn parse_rejects_inconsistent_lines() {
        assert!(parse(
            "{\"timestamp\":0,\"input_length\":600,\"output_length\":1,\"hash_ids\":[1]}"
        )
        .is_err());
        let ok =
            parse("\n{\"timestamp\":3,\"input_length\":8,\"output_length\":2,\"hash_ids\":[1]}\n")
                .unwrap();
        assert_eq!(ok[0].timestamp, 3);
        assert_eq!(ok[0].class, FlowClass::default());
    }

    #[test]
    fn flow_columns_are_optional_and_round_trip() {
        let line = r#"{"timestamp":0,"input_length":8,"output_length":2,"hash_ids":[1],"priority":-1,"tenant":"t1","slo_ttft_ms":500}"#;
        let rec = &parse(line).unwrap()[0];
        assert_eq!(rec.class.priority, Some(-1));
        assert_eq!(rec.class.tenant.as_deref(), Some("t1"));
        assert_eq!(rec.class.slo_ttft_ms, Some(500));
        assert_eq!(serde_json::to_string(rec).unwrap(), line);
    }
}

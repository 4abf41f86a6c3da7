//! What a host knows about a request that matters for the pick ([`SelectionRequest`]), and the
//! one place its fields are validated, for every host. Bounds here are on values that come from
//! the network, so all arithmetic on them is checked.

#![warn(clippy::arithmetic_side_effects)]

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};

use crate::error::SelectError;
use crate::types::{RankKey, TierDepths};

/// Longest accepted session id, in bytes.
pub const MAX_SESSION_ID_BYTES: usize = 256;
/// Longest accepted request (booking) id, in characters.
pub const MAX_REQUEST_ID_CHARS: usize = 256;
/// What a session id of [`MAX_SESSION_ID_BYTES`] raw bytes can become once a host has made it a
/// string (lossy UTF-8 turns one invalid byte into the 3-byte U+FFFD).
const MAX_SESSION_ID_STRING_BYTES: usize = 3 * MAX_SESSION_ID_BYTES;
/// Longest accepted fairness key, in bytes.
pub const MAX_FAIRNESS_KEY_BYTES: usize = 256;
/// Largest accepted SLO (one hour), in milliseconds.
pub const MAX_SLO_MS: u64 = 3_600_000;
/// Most fallback endpoints one request may ask for.
pub const MAX_FALLBACKS: usize = 16;
/// Most candidate ranks whose scores one answer carries ([`SelectionRequest::scores`]).
pub const MAX_ENDPOINT_SCORES: usize = 1_024;
/// Largest prompt a request may declare (tokens). Far above any context window; it only keeps
/// load arithmetic (tokens summed over bookings) far from overflow.
pub const MAX_PROMPT_TOKENS: u64 = 1 << 32;

/// Restricts candidates to a set of endpoints (`ip:port` exact, or bare `ip` for any port).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EndpointFilter {
    exact: HashSet<SocketAddr>,
    any_port: HashSet<IpAddr>,
}

impl EndpointFilter {
    /// Parses entries; unparsable entries are ignored (they match nothing).
    pub fn parse<'a>(entries: impl IntoIterator<Item = &'a str>) -> Self {
        let mut filter = EndpointFilter::default();
        for raw in entries {
            let entry = raw.trim();
            if let Ok(addr) = entry.parse::<SocketAddr>() {
                filter.exact.insert(addr);
            } else if let Ok(ip) = entry.trim_matches(['[', ']']).parse::<IpAddr>() {
                filter.any_port.insert(ip);
            }
        }
        filter
    }

    pub fn matches(&self, endpoint: &SocketAddr) -> bool {
        self.exact.contains(endpoint) || self.any_port.contains(&endpoint.ip())
    }

    pub fn is_empty(&self) -> bool {
        self.exact.is_empty() && self.any_port.is_empty()
    }
}

/// What to do when a live booking already has the request id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DuplicateId {
    /// ext_proc: suffix the id so two streams never share a booking.
    #[default]
    Suffix,
    /// gRPC API: refuse (a [`SelectError::Conflict`]).
    Reject,
}

/// Who holds a booking, and so who may end it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Holder {
    /// A live ext_proc stream. Its guard frees the booking when the stream ends, however long the
    /// response runs, so the booking never expires.
    #[default]
    Stream,
    /// A gRPC API caller: freed by that caller's `Free`, or expired after `booking_ttl`. API
    /// calls can end only bookings an API call made.
    Api,
}

/// Which booking of an id an operation means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// Exactly this booking (the holder's own guard).
    Generation(u64),
    /// The id's current booking if this kind of holder made it (the API's `Free`).
    HeldBy(Holder),
    /// The id's current booking, whoever holds it (tests and the replay, which hold every id).
    Any,
}

/// The prompt as far as the host knows it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum PromptInput {
    /// No prompt (e.g. `GET /v1/models`): load-only routing.
    #[default]
    None,
    /// Engine token ids: exact block hashes.
    Tokens(Vec<u32>),
    /// Engine token ids of a multimodal prompt (placeholder tokens expanded) and the items they
    /// hold: each block a span overlaps has the item's key folded in (`hash::media_prompt_hashes`),
    /// as vLLM's `extra_keys` do for the same block.
    MediaTokens {
        tokens: Vec<u32>,
        media: Vec<crate::hash::MediaSpan>,
    },
    /// Precomputed chained block hashes (gRPC callers that hash themselves).
    BlockHashes {
        seq_hashes: Vec<u64>,
        prompt_tokens: u64,
    },
    /// Prompt text without a tokenizer: hashed in 4-byte pseudo-tokens. Prefix-stable, so our own
    /// routing decisions still find shared prefixes, but never comparable with engine KV events.
    Text(Vec<u8>),
}

/// An explicit pin to a worker (and optionally one of its ranks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pin {
    pub worker_id: u64,
    pub dp_rank: Option<u32>,
}

/// Everything a host knows about a request that matters for the pick.
#[derive(Debug, Clone, Default)]
pub struct SelectionRequest {
    pub request_id: String,
    /// `None` for requests without a model (e.g. `GET /v1/models`): any partition.
    pub model: Option<String>,
    pub routing_group: String,
    pub prompt: PromptInput,
    pub cache_salt: Option<String>,
    /// Subset hint / allowed set; `None` means the whole pool.
    pub subset: Option<EndpointFilter>,
    pub pin: Option<Pin>,
    pub fallbacks: usize,
    /// Per-request override of `router_temperature`.
    pub temperature: Option<f64>,
    /// Negative = sheddable.
    pub priority: i32,
    /// Flow control: the fairness key within the request's priority band (tenant, user);
    /// `None` shares one default key.
    pub fairness_key: Option<String>,
    /// Flow control: time-to-first-token objective in milliseconds (`x-llm-d-slo-ttft-ms`).
    pub slo_ttft_ms: Option<u64>,
    /// Time-per-output-token objective in milliseconds (`x-llm-d-slo-tpot-ms`); reported, not
    /// yet scheduled on.
    pub slo_tpot_ms: Option<u64>,
    /// Session for affinity (at most [`MAX_SESSION_ID_BYTES`]).
    pub session_id: Option<String>,
    /// The parent session of a child session (a subagent): its first pick prefers the parent's
    /// bound rank when that costs no more than a soft binding would allow (docs/sessions.md).
    pub parent_session_id: Option<String>,
    /// The session's last request (`x-dynamo-session-final: true`): routed on the binding, which
    /// is then released.
    pub session_final: bool,
    pub on_duplicate: DuplicateId,
    pub holder: Holder,
    /// Most endpoints whose scores the answer carries ([`crate::Selection::scores`]: the
    /// destinations, then the best-scored other candidates); 0 = none, and nothing is allocated
    /// for them. At most [`MAX_ENDPOINT_SCORES`].
    pub scores: usize,
    /// The prompt's overlap as a remote index answered it (`--kv-index-remote`): when set, the
    /// decision reads each rank's depths from it (and from this process's own predictions,
    /// whichever is deeper) instead of the local index. A host input like the prompt, never
    /// from a client; `None` = the local index alone.
    pub remote_overlap: Option<std::sync::Arc<RemoteOverlap>>,
}

/// Per-rank matched depths of one prompt, read from another process's index (the indexer a
/// replica queries instead of subscribing to the engines' KV events). Sorted by rank, one
/// entry per rank; a rank not listed matches nothing there.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RemoteOverlap {
    ranks: Vec<(RankKey, TierDepths)>,
}

impl RemoteOverlap {
    /// The remote's answer in any order; a rank named twice keeps its deepest tiers.
    pub fn new(mut ranks: Vec<(RankKey, TierDepths)>) -> Self {
        ranks.sort_unstable_by_key(|r| r.0);
        ranks.dedup_by(|later, kept| {
            let same = later.0 == kept.0;
            if same {
                kept.1 = deeper(kept.1, later.1);
            }
            same
        });
        RemoteOverlap { ranks }
    }

    pub fn ranks(&self) -> &[(RankKey, TierDepths)] {
        &self.ranks
    }

    /// The remote's depths merged with `local` (this process's own predictions, any order):
    /// per rank and tier the deeper, sorted by rank. A pick this replica made moments ago is
    /// in its own index before the engine's events reach the remote one.
    pub fn merged_with(&self, local: &[(RankKey, TierDepths)]) -> Vec<(RankKey, TierDepths)> {
        let mut all: Vec<(RankKey, TierDepths)> = self.ranks.clone();
        all.extend_from_slice(local);
        RemoteOverlap::new(all).ranks
    }
}

/// Per tier the deeper of two depths.
fn deeper(a: TierDepths, b: TierDepths) -> TierDepths {
    TierDepths {
        gpu: a.gpu.max(b.gpu),
        host: a.host.max(b.host),
        disk: a.disk.max(b.disk),
    }
}

/// Precomputed block hashes must describe the prompt they claim: `prompt_tokens` within one
/// block of `hashes × block_size` (the hashes cover the complete blocks, or every block with the
/// last one partial). A caller cannot declare a huge prompt (load) with a few hashes.
pub fn check_block_hashes(prompt: &PromptInput, block_size: u32) -> Result<(), SelectError> {
    let PromptInput::BlockHashes {
        seq_hashes,
        prompt_tokens,
    } = prompt
    else {
        return Ok(());
    };
    let block = u64::from(block_size.max(1));
    let covered = (seq_hashes.len() as u64).saturating_mul(block);
    if prompt_tokens.abs_diff(covered) >= block {
        return Err(SelectError::BadRequest(format!(
            "prompt_tokens {prompt_tokens} does not match {} block hashes of {block} tokens",
            seq_hashes.len()
        )));
    }
    Ok(())
}

/// The session-id rule, on the bytes the client sent: a host applies it to the raw value before
/// any lossy conversion to a string; [`SelectionRequest::validate`] bounds the string it got.
pub fn check_session_id_len(len: usize, what: &str) -> Result<(), SelectError> {
    if len > MAX_SESSION_ID_BYTES {
        return Err(SelectError::BadRequest(format!(
            "{what} longer than {MAX_SESSION_ID_BYTES} bytes"
        )));
    }
    Ok(())
}

impl SelectionRequest {
    /// A copy without the prompt (which may be megabytes of text): what a queued request keeps
    /// once its block hashes are computed.
    pub fn without_prompt(&self) -> SelectionRequest {
        SelectionRequest {
            request_id: self.request_id.clone(),
            model: self.model.clone(),
            routing_group: self.routing_group.clone(),
            prompt: PromptInput::None,
            cache_salt: self.cache_salt.clone(),
            subset: self.subset.clone(),
            pin: self.pin,
            fallbacks: self.fallbacks,
            temperature: self.temperature,
            priority: self.priority,
            fairness_key: self.fairness_key.clone(),
            slo_ttft_ms: self.slo_ttft_ms,
            slo_tpot_ms: self.slo_tpot_ms,
            session_id: self.session_id.clone(),
            parent_session_id: self.parent_session_id.clone(),
            session_final: self.session_final,
            on_duplicate: self.on_duplicate,
            holder: self.holder,
            scores: self.scores,
            remote_overlap: self.remote_overlap.clone(),
        }
    }

    /// Checks every field that comes from a client. The core calls it before any pick, so both
    /// hosts refuse the same requests with the same messages.
    pub fn validate(&self) -> Result<(), SelectError> {
        for (sid, what) in [
            (&self.session_id, "session id"),
            (&self.parent_session_id, "parent session id"),
        ] {
            if let Some(sid) = sid
                .as_ref()
                .filter(|s| s.len() > MAX_SESSION_ID_STRING_BYTES)
            {
                check_session_id_len(sid.len(), what)?;
            }
        }
        if self.request_id.len() > MAX_REQUEST_ID_CHARS
            && self.request_id.chars().count() > MAX_REQUEST_ID_CHARS
        {
            return Err(SelectError::BadRequest(format!(
                "request id longer than {MAX_REQUEST_ID_CHARS} characters"
            )));
        }
        if self
            .fairness_key
            .as_ref()
            .is_some_and(|k| k.len() > MAX_FAIRNESS_KEY_BYTES)
        {
            return Err(SelectError::BadRequest(format!(
                "fairness id longer than {MAX_FAIRNESS_KEY_BYTES} bytes"
            )));
        }
        for (name, slo) in [("TTFT", self.slo_ttft_ms), ("TPOT", self.slo_tpot_ms)] {
            if slo.is_some_and(|ms| ms == 0 || ms > MAX_SLO_MS) {
                return Err(SelectError::BadRequest(format!(
                    "{name} SLO must be 1..={MAX_SLO_MS} ms"
                )));
            }
        }
        if self.fallbacks > MAX_FALLBACKS {
            return Err(SelectError::BadRequest(format!(
                "at most {MAX_FALLBACKS} fallbacks, got {}",
                self.fallbacks
            )));
        }
        if self.scores > MAX_ENDPOINT_SCORES {
            return Err(SelectError::BadRequest(format!(
                "at most {MAX_ENDPOINT_SCORES} endpoint scores, got {}",
                self.scores
            )));
        }
        if let Some(t) = self.temperature {
            if !(t.is_finite() && t >= 0.0) {
                return Err(SelectError::BadRequest(
                    "temperature must be a finite number >= 0".into(),
                ));
            }
        }
        let tokens = match &self.prompt {
            PromptInput::None => 0,
            PromptInput::Tokens(t) | PromptInput::MediaTokens { tokens: t, .. } => t.len() as u64,
            PromptInput::BlockHashes { prompt_tokens, .. } => *prompt_tokens,
            PromptInput::Text(bytes) => (bytes.len() as u64).div_ceil(4),
        };
        if tokens > MAX_PROMPT_TOKENS {
            return Err(SelectError::BadRequest(format!(
                "prompt of {tokens} tokens is over the {MAX_PROMPT_TOKENS}-token limit"
            )));
        }
        Ok(())
    }
}

/// Keeps client input in messages short (never more than 128 bytes echoed).
pub fn clip(s: &str) -> String {
    const MAX: usize = 128;
    if s.len() <= MAX {
        return s.to_string();
    }
    format!("{}...", crate::event::truncate(s, MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> SelectionRequest {
        SelectionRequest {
            request_id: "r".into(),
            ..Default::default()
        }
    }

    #[test]
    fn every_bounded_field_is_checked() {
        assert_eq!(request().validate(), Ok(()));
        let err = check_session_id_len(MAX_SESSION_ID_BYTES + 1, "session id").unwrap_err();
        assert_eq!(err.label(), "bad_request");
        assert!(err.to_string().contains("longer than 256 bytes"), "{err}");
        assert_eq!(
            check_session_id_len(MAX_SESSION_ID_BYTES, "session id"),
            Ok(())
        );
        let long_session = SelectionRequest {
            session_id: Some("s".repeat(MAX_SESSION_ID_STRING_BYTES + 1)),
            ..request()
        };
        assert!(long_session.validate().is_err());
        let at_limit = SelectionRequest {
            // 256 invalid bytes made lossy: 768 bytes of U+FFFD.
            session_id: Some("\u{fffd}".repeat(MAX_SESSION_ID_BYTES)),
            request_id: "é".repeat(MAX_REQUEST_ID_CHARS),
            fallbacks: MAX_FALLBACKS,
            ..request()
        };
        assert_eq!(at_limit.validate(), Ok(()));
        for bad in [
            SelectionRequest {
                request_id: "r".repeat(MAX_REQUEST_ID_CHARS + 1),
                ..request()
            },
            SelectionRequest {
                fallbacks: MAX_FALLBACKS + 1,
                ..request()
            },
            SelectionRequest {
                fairness_key: Some("k".repeat(MAX_FAIRNESS_KEY_BYTES + 1)),
                ..request()
            },
            SelectionRequest {
                slo_ttft_ms: Some(0),
                ..request()
            },
            SelectionRequest {
                slo_tpot_ms: Some(MAX_SLO_MS + 1),
                ..request()
            },
            SelectionRequest {
                temperature: Some(f64::NAN),
                ..request()
            },
            SelectionRequest {
                temperature: Some(-1.0),
                ..request()
            },
            SelectionRequest {
                prompt: PromptInput::BlockHashes {
                    seq_hashes: vec![1],
                    prompt_tokens: u64::MAX,
                },
                ..request()
            },
        ] {
            assert!(
                matches!(bad.validate(), Err(SelectError::BadRequest(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn clip_keeps_messages_short() {
        assert_eq!(clip("short"), "short");
        let long = "é".repeat(100);
        let clipped = clip(&long);
        assert!(clipped.len() <= 131 && clipped.ends_with("..."));
    }
}

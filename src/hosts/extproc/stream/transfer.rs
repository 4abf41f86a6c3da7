//! KV transfer hints on the wire (ARCHITECTURE.md §4, "Transfer hints"): a booked pick's
//! `Selection::transfer` as llm-d's `x-kv-cache-source-host-port` header (the holder's
//! `host:port`; llm-d's routing sidecar turns it into a P2P pull) and, with
//! `--kv-transfer-p2p-port`, vLLM's `kv_transfer_params.remote_kv_source` in the echoed body (for
//! engines whose P2P connector reads it directly). Client-sent copies of the header never pass.
//! It must not book or decide: it only renders the core's hint, which the core never gives a
//! query-only selection.

use kvpick_core::{Selection, TransferHint};
use serde_json::Value;

use super::{BodyTail, StreamMachine};

/// llm-d's header naming the holder a pick may pull the prompt's prefix from.
pub const KV_CACHE_SOURCE_HEADER: &str = "x-kv-cache-source-host-port";
/// Its names a client might send (llm-d's current alias too): removed unless kvpick sets it.
pub const KV_CACHE_SOURCE_HEADERS: [&str; 2] =
    [KV_CACHE_SOURCE_HEADER, "x-llm-d-kv-cache-source-host-port"];

/// The hint's header, when the pick carries one.
pub(super) fn header(selection: &Selection) -> Option<(&'static str, String)> {
    let hint = selection.transfer.as_ref()?;
    Some((KV_CACHE_SOURCE_HEADER, hint.source.endpoint.to_string()))
}

/// vLLM's `remote_kv_source` for the hint: the holder's host, its P2P connector's port (the
/// base port offset by its data-parallel rank, as vLLM offsets its side channel), and the
/// request's id.
fn remote_kv_source(hint: &TransferHint, request_id: &str, p2p_port: u16) -> Value {
    let port = u32::from(p2p_port).saturating_add(hint.source.key.dp_rank);
    serde_json::json!({
        "kv_request_id": request_id,
        "remote_host": hint.source.endpoint.ip().to_string(),
        "remote_port": port,
    })
}

/// The body with `kv_transfer_params.remote_kv_source` set: inserted as the first member when
/// the body has no `kv_transfer_params` (the rest stays byte for byte), merged into an object
/// one otherwise. `None` (the body passes as sent) when it is not a JSON object or its
/// `kv_transfer_params` is not an object.
pub(super) fn with_remote_kv_source(body: &[u8], source: Value) -> Option<Vec<u8>> {
    let mut value: Value = serde_json::from_slice(body).ok()?;
    let object = value.as_object_mut()?;
    match object.get_mut("kv_transfer_params") {
        None => {
            let open = body.iter().position(|b| !b.is_ascii_whitespace())?;
            let rest = body.get(open + 1..)?;
            let empty = rest.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'}');
            let member = serde_json::json!({ "remote_kv_source": source });
            let mut out = Vec::with_capacity(body.len() + 160);
            out.extend_from_slice(body.get(..=open)?);
            out.extend_from_slice(b"\"kv_transfer_params\":");
            serde_json::to_writer(&mut out, &member).ok()?;
            if !empty {
                out.push(b',');
            }
            out.extend_from_slice(rest);
            Some(out)
        }
        Some(Value::Object(params)) => {
            params.insert("remote_kv_source".into(), source);
            serde_json::to_vec(&value).ok()
        }
        Some(_) => None,
    }
}

impl StreamMachine {
    /// The held body with the pick's `remote_kv_source`, when the pick carries a hint and
    /// `--kv-transfer-p2p-port` is set; as held otherwise, or when the body budget cannot take
    /// the few bytes it grows by (the header still names the holder).
    pub(super) fn transfer_body(&self, mut tail: BodyTail) -> BodyTail {
        let (Some(port), Some(reservation)) = (
            self.settings.kv_transfer_p2p_port,
            self.reservation.as_ref(),
        ) else {
            return tail;
        };
        let Some(hint) = reservation.selection().transfer.as_ref() else {
            return tail;
        };
        let held: Vec<u8> = tail.body.iter().flat_map(|b| b.iter().copied()).collect();
        let source = remote_kv_source(hint, reservation.booking_id(), port);
        let Some(body) = with_remote_kv_source(&held, source) else {
            return tail;
        };
        if !tail.lease.try_grow(body.len().saturating_sub(held.len())) {
            return tail;
        }
        tail.body = vec![body.into()];
        tail
    }
}

#[cfg(test)]
#[path = "transfer_tests.rs"]
mod tests;

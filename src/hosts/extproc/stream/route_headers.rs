//! The routing headers of a pick: the destination (primary, then fallbacks), kvpick's picker
//! headers, the upstream's trace context, a prefill/decode pair's headers; and the client-sent
//! headers that must not pass (spoofable routing headers, a stale DP rank, prefill headers).
//!
//! It must not book or change the phase: it only builds the header mutation of a pick.

use envoy_types::pb::envoy::config::core::v3::HeaderValueOption;

use super::super::pd_headers;
use super::wire::set_header;
use super::{StreamMachine, DESTINATION_HEADER};

/// Request headers a client must not be able to set: they steer routing.
const SPOOFABLE_PREFIXES: [&str; 3] = [
    "x-gateway-destination-endpoint",
    "x-gateway-inference-",
    "x-gateway-model-name-rewrite",
];

impl StreamMachine {
    /// The routing headers of a pick: the destination (primary, then fallbacks), kvpick's
    /// picker headers, the upstream's trace context when tracing, a pair's prefill headers; and
    /// the client-sent headers that must not pass (spoofable routing headers, a stale DP rank,
    /// prefill headers the pair did not set).
    pub(super) fn route_headers(
        &mut self,
        selection: &kvpick_core::Selection,
        request_id: &str,
    ) -> (String, Vec<HeaderValueOption>, Vec<String>) {
        let mut destination = selection.primary.endpoint.to_string();
        for f in &selection.fallbacks {
            destination.push(',');
            destination.push_str(&f.endpoint.to_string());
        }
        let primary = &selection.primary;
        let mut set = vec![
            set_header(DESTINATION_HEADER, &destination),
            set_header(
                "x-dynamo-worker-instance-id",
                &primary.key.worker_id.to_string(),
            ),
            set_header("x-dynamo-dp-rank", &primary.key.dp_rank.to_string()),
        ];
        if self.request_id.is_none() {
            set.push(set_header("x-request-id", request_id));
        }
        let mut remove: Vec<String> = self
            .header_names
            .iter()
            .filter(|n| {
                SPOOFABLE_PREFIXES.iter().any(|p| n.starts_with(p)) && *n != DESTINATION_HEADER
            })
            .cloned()
            .collect();
        if primary.multiplexed {
            set.push(set_header(
                "x-data-parallel-rank",
                &primary.key.dp_rank.to_string(),
            ));
        } else if self
            .header_names
            .iter()
            .any(|n| n == "x-data-parallel-rank")
        {
            remove.push("x-data-parallel-rank".into());
        }
        // Tracing on: the upstream's trace context names the pick span.
        if let Some(t) = &mut self.trace {
            for (name, value) in t.picked(selection, self.pin.is_some()) {
                set.push(set_header(name, &value));
            }
        }
        // The prefill/decode pair, in `--pd-protocol`'s headers; client-sent ones never pass.
        let pair = pd_headers::headers(selection, self.settings.pd_protocol);
        for (name, value) in &pair {
            set.push(set_header(name, value));
        }
        remove.extend(
            self.header_names
                .iter()
                .filter(|n| {
                    pd_headers::ALL.contains(&n.as_str()) && pair.iter().all(|(set, _)| set != n)
                })
                .cloned(),
        );
        // A KV transfer hint (`--kv-transfer-hints`); client-sent ones never pass.
        let hint = super::transfer::header(selection);
        if let Some((name, value)) = &hint {
            set.push(set_header(name, value));
        }
        remove.extend(
            self.header_names
                .iter()
                .filter(|n| {
                    super::transfer::KV_CACHE_SOURCE_HEADERS.contains(&n.as_str())
                        && hint.as_ref().is_none_or(|(set, _)| set != n)
                })
                .cloned(),
        );
        remove.sort();
        remove.dedup();
        (destination, set, remove)
    }
}

#[cfg(test)]
#[path = "route_headers_tests.rs"]
mod tests;

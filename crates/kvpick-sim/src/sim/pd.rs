//! The decode side of prefill/decode disaggregation in `kvpick sim` (what llm-d's routing
//! sidecar does in front of a vLLM decode pod): read which prefill rank the picker chose from the
//! request's headers (llm-d's `x-prefiller-host-port`, or Dynamo's
//! `x-dynamo-prefill-instance-id` + `x-dynamo-prefill-dp-rank` resolved through `--prefill-peer`),
//! have that rank run the prefill (a `max_tokens: 1` completion over HTTP; it caches the prompt
//! and publishes its KV events), and report what came back. The transfer wait and the decode are
//! the server's ([`super::server`]); this module owns only the header reading and the HTTP call.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use axum::http::HeaderMap;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Where a request's prefill runs, as its headers say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillTarget {
    pub addr: SocketAddr,
    /// The prefill worker's DP rank when it multiplexes ranks on one port.
    pub dp_rank: Option<u32>,
}

/// What the prefill rank answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillDone {
    pub worker: String,
    pub rank: String,
    pub cached_tokens: u64,
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty())
}

/// The prefill target named by the request, `Ok(None)` when it names none (aggregated), an error
/// for a header that names nothing usable.
pub fn target(
    headers: &HeaderMap,
    peers: &HashMap<u64, SocketAddr>,
) -> Result<Option<PrefillTarget>, String> {
    let rank = |name: &str| -> Result<Option<u32>, String> {
        header(headers, name)
            .map(|v| {
                v.parse::<u32>()
                    .map_err(|_| format!("{name} must be a rank number"))
            })
            .transpose()
    };
    if let Some(hp) = header(headers, "x-prefiller-host-port") {
        let addr = hp
            .parse::<SocketAddr>()
            .map_err(|_| "x-prefiller-host-port must be ip:port".to_string())?;
        return Ok(Some(PrefillTarget {
            addr,
            dp_rank: rank("x-prefiller-data-parallel-rank")?,
        }));
    }
    let disaggregated = header(headers, "x-dynamo-routing-mode") == Some("disaggregated");
    match header(headers, "x-dynamo-prefill-instance-id") {
        Some(id) if disaggregated => {
            let id: u64 = id
                .parse()
                .map_err(|_| "x-dynamo-prefill-instance-id must be a number".to_string())?;
            let addr = *peers.get(&id).ok_or_else(|| {
                format!("x-dynamo-prefill-instance-id {id} is not a --prefill-peer")
            })?;
            Ok(Some(PrefillTarget {
                addr,
                dp_rank: rank("x-dynamo-prefill-dp-rank")?,
            }))
        }
        _ => Ok(None),
    }
}

/// Runs the prompt's prefill on `target`: `POST /v1/completions` with the token ids and
/// `max_tokens: 1`, as the sidecar sends it (bounded by `timeout`).
pub async fn prefill(
    target: PrefillTarget,
    model: &str,
    prompt: &[u32],
    timeout: Duration,
) -> Result<PrefillDone, String> {
    let body =
        serde_json::json!({"model": model, "prompt": prompt, "max_tokens": 1, "stream": false})
            .to_string();
    let mut request = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n",
        target.addr,
        body.len()
    );
    if let Some(rank) = target.dp_rank {
        request.push_str(&format!("x-data-parallel-rank: {rank}\r\n"));
    }
    request.push_str("\r\n");
    request.push_str(&body);
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(target.addr)
            .await
            .map_err(|e| format!("prefill rank {}: {e}", target.addr))?;
        stream
            .write_all(request.as_bytes())
            .await
            .map_err(|e| format!("prefill rank {}: {e}", target.addr))?;
        let mut response = Vec::new();
        stream
            .read_to_end(&mut response)
            .await
            .map_err(|e| format!("prefill rank {}: {e}", target.addr))?;
        Ok::<Vec<u8>, String>(response)
    };
    let response = tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| format!("prefill rank {} timed out", target.addr))??;
    parse_response(&response).map_err(|e| format!("prefill rank {}: {e}", target.addr))
}

/// Reads the prefill rank's HTTP/1.1 answer: status 200, its `x-sim-*` headers, `usage`.
fn parse_response(raw: &[u8]) -> Result<PrefillDone, String> {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("truncated response")?;
    let head = std::str::from_utf8(&raw[..split]).map_err(|_| "response head is not UTF-8")?;
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .ok_or("no status line")?;
    let body = &raw[split + 4..];
    if status != "200" {
        return Err(format!(
            "status {status}: {}",
            String::from_utf8_lossy(&body[..body.len().min(200)])
        ));
    }
    let headers: HashMap<String, String> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let cached_tokens = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| {
            v.pointer("/usage/prompt_tokens_details/cached_tokens")?
                .as_u64()
        })
        .unwrap_or(0);
    Ok(PrefillDone {
        worker: headers.get("x-sim-worker").cloned().unwrap_or_default(),
        rank: headers.get("x-sim-rank").cloned().unwrap_or_default(),
        cached_tokens,
    })
}

/// `--prefill-peer NAME=IP:PORT`: the worker id kvpick gives a static worker `NAME` (its
/// Dynamo instance id) -> where it serves.
pub fn parse_peer(value: &str) -> Result<(u64, SocketAddr), String> {
    let (name, addr) = value
        .split_once('=')
        .ok_or_else(|| format!("--prefill-peer wants NAME=IP:PORT, got {value:?}"))?;
    let addr: SocketAddr = addr
        .parse()
        .map_err(|_| format!("--prefill-peer {name}: {addr:?} is not IP:PORT"))?;
    Ok((kvpick_core::catalog::worker_id("static", name), addr))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn llm_d_and_dynamo_headers_name_the_prefill_rank() {
        let (id, addr) = parse_peer("p=127.0.0.1:8100").unwrap();
        let peers = HashMap::from([(id, addr)]);
        let llm_d = headers(&[("x-prefiller-host-port", "127.0.0.1:8100")]);
        assert_eq!(
            target(&llm_d, &peers),
            Ok(Some(PrefillTarget {
                addr,
                dp_rank: None
            }))
        );
        let dynamo = headers(&[
            ("x-dynamo-prefill-instance-id", &id.to_string()),
            ("x-dynamo-prefill-dp-rank", "1"),
            ("x-dynamo-routing-mode", "disaggregated"),
        ]);
        assert_eq!(
            target(&dynamo, &peers),
            Ok(Some(PrefillTarget {
                addr,
                dp_rank: Some(1)
            }))
        );
        let aggregated = headers(&[("x-dynamo-routing-mode", "aggregated")]);
        assert_eq!(target(&aggregated, &peers), Ok(None));
        let unknown = headers(&[
            ("x-dynamo-prefill-instance-id", "7"),
            ("x-dynamo-routing-mode", "disaggregated"),
        ]);
        assert!(target(&unknown, &peers)
            .unwrap_err()
            .contains("--prefill-peer"));
        let bad = headers(&[("x-prefiller-host-port", "nowhere")]);
        assert!(target(&bad, &peers).is_err());
        assert!(parse_peer("p").is_err() && parse_peer("p=host:1").is_err());
    }

    #[test]
    fn the_prefill_answer_is_read_from_status_headers_and_usage() {
        let ok = b"HTTP/1.1 200 OK\r\nx-sim-worker: 2\r\nX-Sim-Rank: 0\r\n\r\n{\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":32}}}";
        assert_eq!(
            parse_response(ok),
            Ok(PrefillDone {
                worker: "2".into(),
                rank: "0".into(),
                cached_tokens: 32
            })
        );
        let err = parse_response(b"HTTP/1.1 400 Bad Request\r\n\r\nno").unwrap_err();
        assert!(err.contains("400"), "{err}");
        assert!(parse_response(b"HTTP/1.1 200").is_err());
    }
}

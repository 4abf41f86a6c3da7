//! The ext_proc messages of a stream as values: header values read as Envoy sent them, header
//! mutations and load-balancing metadata built, the request body buffered ([`BodyBuf`], the
//! received chunks themselves) and echoed in chunks, immediate responses. No state of the stream
//! machine lives here.

use bytes::{Bytes, BytesMut};
use envoy_types::pb::envoy::config::core::v3::{
    header_value_option::HeaderAppendAction, HeaderValue, HeaderValueOption,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_response, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse,
    ProcessingResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};
use tonic::Status;

use crate::tokenize::body::BodyError;

use super::super::budget::BodyLease;
use super::super::codec::{BodySide, Outbound};
use super::{Step, DESTINATION_HEADER, LB_NAMESPACE, MAX_BODY_CHUNK, SCORES_KEY};

pub(super) fn check_protocol(
    config: &envoy_types::pb::envoy::service::ext_proc::v3::ProtocolConfiguration,
) -> Result<(), Status> {
    use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
    let full_duplex = BodySendMode::FullDuplexStreamed as i32;
    if config.request_body_mode != full_duplex || config.response_body_mode != full_duplex {
        return Err(Status::failed_precondition(format!(
            "kvpick needs request_body_mode and response_body_mode FULL_DUPLEX_STREAMED \
             (got request {}, response {}); see docs/deployment.md, \"Wiring Envoy\"",
            mode_name(config.request_body_mode),
            mode_name(config.response_body_mode)
        )));
    }
    Ok(())
}

pub(super) fn mode_name(mode: i32) -> String {
    use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
    BodySendMode::try_from(mode)
        .map(|m| m.as_str_name().to_string())
        .unwrap_or_else(|_| mode.to_string())
}

pub(super) fn body_error_message(err: &BodyError) -> String {
    err.to_string()
}

/// The length in bytes of the value as Envoy sent it.
pub(super) fn header_len(h: &HeaderValue) -> usize {
    if h.raw_value.is_empty() {
        h.value.len()
    } else {
        h.raw_value.len()
    }
}

/// A session id as the table keys it: the header as sent when it is UTF-8; otherwise U+FFFD
/// followed by the bytes in hex, so distinct invalid ids stay distinct (a lossy conversion would
/// make every one of them the same run of U+FFFD).
pub(super) fn session_key(h: &HeaderValue) -> String {
    if h.raw_value.is_empty() {
        return h.value.clone();
    }
    match std::str::from_utf8(&h.raw_value) {
        Ok(s) => s.to_string(),
        Err(_) => {
            let mut key = String::with_capacity(3 + 2 * h.raw_value.len());
            key.push('\u{fffd}');
            for b in &h.raw_value {
                key.push_str(&format!("{b:02x}"));
            }
            key
        }
    }
}

/// The value's bytes as Envoy sent them.
pub(super) fn header_bytes(h: &HeaderValue) -> &[u8] {
    if h.raw_value.is_empty() {
        h.value.as_bytes()
    } else {
        &h.raw_value
    }
}

pub(super) fn header_value(h: &HeaderValue) -> std::borrow::Cow<'_, str> {
    if h.raw_value.is_empty() {
        std::borrow::Cow::Borrowed(h.value.as_str())
    } else {
        String::from_utf8_lossy(&h.raw_value)
    }
}

/// A metadata value as a list of strings: a list of strings, or one comma-separated string.
pub(super) fn string_entries(value: &Value) -> Vec<String> {
    match &value.kind {
        Some(Kind::StringValue(s)) => s
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(str::to_string)
            .collect(),
        Some(Kind::ListValue(ListValue { values })) => {
            values.iter().flat_map(string_entries).collect()
        }
        _ => Vec::new(),
    }
}

pub(super) fn set_header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_string(),
            value: String::new(),
            raw_value: value.as_bytes().to_vec(),
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

/// The request-headers answer of a routed request: the header mutation, the `envoy.lb` metadata
/// naming the same destination (and the candidates' scores, when the pick carries them), and a
/// cleared route cache so Envoy routes on the new headers.
pub(super) fn headers_response(
    destination: &str,
    scores: &[kvpick_core::EndpointScore],
    set_headers: Vec<HeaderValueOption>,
    remove_headers: Vec<String>,
) -> ProcessingResponse {
    ProcessingResponse {
        dynamic_metadata: Some(lb_metadata(destination, scores)),
        response: Some(processing_response::Response::RequestHeaders(
            HeadersResponse {
                response: Some(CommonResponse {
                    header_mutation: Some(HeaderMutation {
                        set_headers,
                        remove_headers,
                    }),
                    clear_route_cache: true,
                    ..Default::default()
                }),
            },
        )),
        ..Default::default()
    }
}

/// `envoy.lb`: the destination and, when `scores` is not empty, the scores struct (llm-d-router's
/// shape: `"ip:port"` -> number; docs/headers.md says what the number means).
pub(super) fn lb_metadata(destination: &str, scores: &[kvpick_core::EndpointScore]) -> Struct {
    let mut inner = Struct {
        fields: [(
            DESTINATION_HEADER.to_string(),
            Value {
                kind: Some(Kind::StringValue(destination.to_string())),
            },
        )]
        .into(),
    };
    if !scores.is_empty() {
        let by_endpoint = scores
            .iter()
            .map(|s| {
                let score = Value {
                    kind: Some(Kind::NumberValue(s.score())),
                };
                (s.endpoint.to_string(), score)
            })
            .collect();
        inner.fields.insert(
            SCORES_KEY.to_string(),
            Value {
                kind: Some(Kind::StructValue(Struct {
                    fields: by_endpoint,
                })),
            },
        );
    }
    Struct {
        fields: [(
            LB_NAMESPACE.to_string(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]
        .into(),
    }
}

/// Below this size a body chunk is appended to the previous one instead of kept alone, so a
/// peer sending many tiny chunks costs a copy of a few bytes, not an allocation and an echoed
/// message each.
pub(super) const COALESCE_BELOW: usize = 1024;

/// A piece of the buffered body: a chunk as received (a slice of the gRPC message it came in),
/// or small chunks copied together.
#[derive(Debug)]
pub(super) enum Piece {
    Received(Bytes),
    Coalesced(BytesMut),
}

impl AsRef<[u8]> for Piece {
    fn as_ref(&self) -> &[u8] {
        match self {
            Piece::Received(b) => b,
            Piece::Coalesced(b) => b,
        }
    }
}

impl Piece {
    fn into_bytes(self) -> Bytes {
        match self {
            Piece::Received(b) => b,
            Piece::Coalesced(b) => b.freeze(),
        }
    }
}

/// The request body as Envoy sent it, chunk by chunk. Echoing the received chunks themselves
/// (moved, not copied) saves a copy of the body; the lease holds its bytes in the global budget.
#[derive(Debug)]
pub(super) struct BodyBuf {
    pub(super) chunks: Vec<Piece>,
    pub(super) len: usize,
    pub(super) lease: BodyLease,
}

impl BodyBuf {
    pub(super) fn new(lease: BodyLease) -> Self {
        BodyBuf {
            chunks: Vec::new(),
            len: 0,
            lease,
        }
    }

    /// Keeps a chunk. A small one is copied onto the previous piece (a run of them costs one
    /// copy of that piece, then amortised appends) or into a piece of its own, so it neither
    /// becomes an echoed message of its own nor holds the buffer it was received in.
    pub(super) fn push(&mut self, chunk: Bytes) {
        if chunk.is_empty() {
            return;
        }
        self.len += chunk.len();
        if chunk.len() >= COALESCE_BELOW {
            self.chunks.push(Piece::Received(chunk));
            return;
        }
        if let Some(last) = self.chunks.last_mut() {
            if last.as_ref().len() + chunk.len() <= MAX_BODY_CHUNK {
                match last {
                    Piece::Coalesced(owned) => owned.extend_from_slice(&chunk),
                    Piece::Received(received) => {
                        let mut owned = BytesMut::with_capacity(received.len() + COALESCE_BELOW);
                        owned.extend_from_slice(received);
                        owned.extend_from_slice(&chunk);
                        *last = Piece::Coalesced(owned);
                    }
                }
                return;
            }
        }
        self.chunks
            .push(Piece::Coalesced(BytesMut::from(&chunk[..])));
    }

    /// The whole body in one slice: borrowed when it is one piece (the usual case for small
    /// requests), else one copy for the parser.
    pub(super) fn contiguous(&self) -> std::borrow::Cow<'_, [u8]> {
        match self.chunks.as_slice() {
            [] => std::borrow::Cow::Borrowed(&[]),
            [one] => std::borrow::Cow::Borrowed(one.as_ref()),
            many => {
                let mut whole = Vec::with_capacity(self.len);
                for piece in many {
                    whole.extend_from_slice(piece.as_ref());
                }
                std::borrow::Cow::Owned(whole)
            }
        }
    }

    /// Replaces the body with `body` (a rewritten one).
    pub(super) fn replace(&mut self, body: Vec<u8>) {
        self.len = body.len();
        self.chunks = vec![Piece::Received(Bytes::from(body))];
    }

    /// The chunks and the lease covering them; leaves an empty buffer with a fresh lease.
    pub(super) fn take(&mut self) -> (Vec<Bytes>, BodyLease) {
        self.len = 0;
        let fresh = self.lease.fresh();
        let chunks = std::mem::take(&mut self.chunks)
            .into_iter()
            .map(Piece::into_bytes)
            .collect();
        (chunks, std::mem::replace(&mut self.lease, fresh))
    }
}

/// The request body echoed back in chunks of at most [`MAX_BODY_CHUNK`] bytes, the received
/// chunks moved as they are (a chunk over the limit is cut into slices of itself); an empty body
/// is still answered (Envoy needs a body response to continue).
pub(super) fn body_chunks(chunks: Vec<Bytes>, end_of_stream: bool) -> Vec<Outbound> {
    let mut pieces: Vec<Bytes> = Vec::with_capacity(chunks.len());
    for chunk in chunks {
        let mut chunk = chunk;
        while chunk.len() > MAX_BODY_CHUNK {
            pieces.push(chunk.split_to(MAX_BODY_CHUNK));
        }
        pieces.push(chunk);
    }
    if pieces.is_empty() {
        pieces.push(Bytes::new());
    }
    let n = pieces.len();
    pieces
        .into_iter()
        .enumerate()
        .map(|(i, piece)| {
            Outbound::streamed_body(BodySide::Request, piece, end_of_stream && i + 1 == n)
        })
        .collect()
}

pub(super) fn one(response: processing_response::Response) -> Step {
    Step {
        responses: vec![ProcessingResponse {
            response: Some(response),
            ..Default::default()
        }
        .into()],
        ..Step::default()
    }
}

/// `kvpick: <code>: <message>` with a text content type.
pub fn immediate(status: u16, message: &str) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::ImmediateResponse(
            ImmediateResponse {
                status: Some(HttpStatus {
                    code: status as i32,
                }),
                headers: Some(HeaderMutation {
                    set_headers: vec![set_header("content-type", "text/plain; charset=utf-8")],
                    remove_headers: vec![],
                }),
                body: format!("kvpick: {status}: {message}\n").into_bytes(),
                details: format!("kvpick_{status}"),
                ..Default::default()
            },
        )),
        ..Default::default()
    }
}

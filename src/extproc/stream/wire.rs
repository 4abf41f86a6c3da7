//! The ext_proc messages of a stream as values: header values read as Envoy sent them, header
//! mutations and load-balancing metadata built, the request body buffered ([`BodyBuf`]) and
//! echoed in chunks, immediate responses. No state of the stream machine lives here.

use envoy_types::pb::envoy::config::core::v3::{
    header_value_option::HeaderAppendAction, HeaderValue, HeaderValueOption,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_response, BodyMutation, BodyResponse, CommonResponse, HeaderMutation,
    HeadersResponse, ImmediateResponse, ProcessingResponse, StreamedBodyResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};
use tonic::Status;

use crate::request::BodyError;

use super::super::budget::BodyLease;
use super::{Step, DESTINATION_HEADER, LB_NAMESPACE, MAX_BODY_CHUNK};

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
/// naming the same destination, and a cleared route cache so Envoy routes on the new headers.
pub(super) fn headers_response(
    destination: &str,
    set_headers: Vec<HeaderValueOption>,
    remove_headers: Vec<String>,
) -> ProcessingResponse {
    ProcessingResponse {
        dynamic_metadata: Some(lb_metadata(destination)),
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

pub(super) fn lb_metadata(destination: &str) -> Struct {
    let inner = Struct {
        fields: [(
            DESTINATION_HEADER.to_string(),
            Value {
                kind: Some(Kind::StringValue(destination.to_string())),
            },
        )]
        .into(),
    };
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

pub(super) fn streamed_body(body: Vec<u8>, end_of_stream: bool) -> BodyResponse {
    BodyResponse {
        response: Some(CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(
                    StreamedBodyResponse {
                        body,
                        end_of_stream,
                        ..Default::default()
                    },
                )),
            }),
            ..Default::default()
        }),
    }
}

/// Below this size a body chunk is appended to the previous one instead of kept alone, so a
/// peer sending many tiny chunks costs a copy of a few bytes, not an allocation and an echoed
/// message each.
pub(super) const COALESCE_BELOW: usize = 1024;

/// The request body as Envoy sent it, chunk by chunk. Echoing the received chunks themselves
/// (moved, not copied) saves a copy of the body; the lease holds its bytes in the global budget.
#[derive(Debug)]
pub(super) struct BodyBuf {
    pub(super) chunks: Vec<Vec<u8>>,
    pub(super) len: usize,
    pub(super) lease: BodyLease,
}

impl BodyBuf {
    pub(super) fn push(&mut self, chunk: Vec<u8>) {
        if chunk.is_empty() {
            return;
        }
        self.len += chunk.len();
        if chunk.len() < COALESCE_BELOW {
            if let Some(last) = self.chunks.last_mut() {
                if last.len() + chunk.len() <= MAX_BODY_CHUNK {
                    last.extend_from_slice(&chunk);
                    return;
                }
            }
        }
        self.chunks.push(chunk);
    }

    /// The whole body in one slice: borrowed when Envoy sent it in one chunk (the usual case
    /// for small requests), else one copy for the parser.
    pub(super) fn contiguous(&self) -> std::borrow::Cow<'_, [u8]> {
        match self.chunks.as_slice() {
            [] => std::borrow::Cow::Borrowed(&[]),
            [one] => std::borrow::Cow::Borrowed(one),
            many => std::borrow::Cow::Owned(many.concat()),
        }
    }

    /// The chunks and the lease covering them; leaves an empty buffer with a fresh lease.
    pub(super) fn take(&mut self) -> (Vec<Vec<u8>>, BodyLease) {
        self.len = 0;
        let fresh = self.lease.fresh();
        (
            std::mem::take(&mut self.chunks),
            std::mem::replace(&mut self.lease, fresh),
        )
    }
}

/// The request body echoed back in chunks of at most [`MAX_BODY_CHUNK`] bytes, the received
/// chunks moved as they are (only a chunk over the limit is split, which copies it); an empty
/// body is still answered (Envoy needs a body response to continue).
pub(super) fn body_chunks(chunks: Vec<Vec<u8>>, end_of_stream: bool) -> Vec<ProcessingResponse> {
    let mut pieces: Vec<Vec<u8>> = Vec::with_capacity(chunks.len());
    for chunk in chunks {
        if chunk.len() <= MAX_BODY_CHUNK {
            pieces.push(chunk);
        } else {
            pieces.extend(chunk.chunks(MAX_BODY_CHUNK).map(<[u8]>::to_vec));
        }
    }
    if pieces.is_empty() {
        pieces.push(Vec::new());
    }
    let n = pieces.len();
    pieces
        .into_iter()
        .enumerate()
        .map(|(i, piece)| ProcessingResponse {
            response: Some(processing_response::Response::RequestBody(streamed_body(
                piece,
                end_of_stream && i + 1 == n,
            ))),
            ..Default::default()
        })
        .collect()
}

pub(super) fn one(response: processing_response::Response) -> Step {
    Step {
        responses: vec![ProcessingResponse {
            response: Some(response),
            ..Default::default()
        }],
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

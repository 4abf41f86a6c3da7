//! The ext_proc stream's gRPC codec: `ProcessingRequest` / `ProcessingResponse` on the wire,
//! with body chunks as [`Bytes`] instead of the `Vec<u8>` of `envoy-types`' generated messages.
//! A received body chunk is a slice of the buffer tonic decoded the message from (no copy) when
//! it is nearly the whole message, as Envoy sends it; a chunk much smaller than its message (a
//! client padding it with unknown fields) is copied out, so keeping the chunk never keeps the
//! message around it. An echoed chunk is written once, into the frame sent back. Every other field goes through prost
//! as before, so the bytes on the wire are the same as `tonic_prost::ProstCodec`'s both ways
//! (`codec_tests.rs` compares them).
//!
//! It owns only the encoding; it never looks at what a message means (the stream machine does).

use std::ops::Deref;

use bytes::{BufMut, Bytes};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_request, processing_response, BodyMutation, BodyResponse,
    CommonResponse, HttpBody, ProcessingRequest, ProcessingResponse, StreamedBodyResponse,
};
use prost::Message;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::Status;

/// One message from Envoy; the chunk of a request or response body is `body` (the message's own
/// `HttpBody.body` is left empty).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Inbound {
    pub message: ProcessingRequest,
    pub body: Bytes,
}

impl From<ProcessingRequest> for Inbound {
    /// Moves the body chunk out of the message (no copy).
    fn from(mut message: ProcessingRequest) -> Self {
        use processing_request::Request;
        let body = match &mut message.request {
            Some(Request::RequestBody(b) | Request::ResponseBody(b)) => {
                Bytes::from(std::mem::take(&mut b.body))
            }
            _ => Bytes::new(),
        };
        Inbound { message, body }
    }
}

/// Which body a streamed chunk belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodySide {
    Request,
    Response,
}

/// One message to Envoy. A streamed body chunk keeps its bytes apart ([`Outbound::streamed_body`])
/// and is written straight into the frame; the message itself ([`Deref`]) then carries the
/// `StreamedBodyResponse` with an empty body.
#[derive(Debug, Clone, PartialEq)]
pub struct Outbound {
    message: ProcessingResponse,
    chunk: Option<StreamedChunk>,
}

#[derive(Debug, Clone, PartialEq)]
struct StreamedChunk {
    side: BodySide,
    body: Bytes,
    end_of_stream: bool,
}

impl From<ProcessingResponse> for Outbound {
    fn from(message: ProcessingResponse) -> Self {
        Outbound {
            message,
            chunk: None,
        }
    }
}

impl Deref for Outbound {
    type Target = ProcessingResponse;

    fn deref(&self) -> &ProcessingResponse {
        &self.message
    }
}

impl Outbound {
    /// A `StreamedBodyResponse` of `body` on the request or response path.
    pub fn streamed_body(side: BodySide, body: Bytes, end_of_stream: bool) -> Self {
        let common = CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(
                    StreamedBodyResponse {
                        end_of_stream,
                        ..Default::default()
                    },
                )),
            }),
            ..Default::default()
        };
        let response = BodyResponse {
            response: Some(common),
        };
        let response = match side {
            BodySide::Request => processing_response::Response::RequestBody(response),
            BodySide::Response => processing_response::Response::ResponseBody(response),
        };
        Outbound {
            message: ProcessingResponse {
                response: Some(response),
                ..Default::default()
            },
            chunk: Some(StreamedChunk {
                side,
                body,
                end_of_stream,
            }),
        }
    }

    /// The chunk and its end-of-stream flag, for a streamed body chunk.
    pub fn streamed_chunk(&self) -> Option<(&[u8], bool)> {
        self.chunk
            .as_ref()
            .map(|c| (c.body.as_ref(), c.end_of_stream))
    }

    /// The message as `envoy-types` has it, the chunk copied in (tests, and whoever needs the
    /// generated type).
    pub fn into_message(self) -> ProcessingResponse {
        let mut message = self.message;
        if let (Some(chunk), Some(body)) = (self.chunk, streamed_mut(&mut message)) {
            body.body = chunk.body.to_vec();
        }
        message
    }

    /// The size of the message on the wire (without gRPC's 5-byte prefix).
    pub fn encoded_len(&self) -> usize {
        match &self.chunk {
            None => self.message.encoded_len(),
            Some(chunk) => chunk.encoded_len(),
        }
    }

    /// Writes the message as prost would write [`Outbound::into_message`]'s.
    pub fn encode(&self, buf: &mut impl BufMut) -> Result<(), NoRoom> {
        self.encode_sized(buf, self.encoded_len())
    }

    /// [`Outbound::encode`] with the size already known (`needed` = [`Outbound::encoded_len`]).
    fn encode_sized(&self, buf: &mut impl BufMut, needed: usize) -> Result<(), NoRoom> {
        if buf.remaining_mut() < needed {
            return Err(NoRoom {
                needed,
                remaining: buf.remaining_mut(),
            });
        }
        match &self.chunk {
            // The room was checked: prost's only error is the lack of it.
            None => {
                let _ = self.message.encode(buf);
            }
            Some(chunk) => chunk.encode(buf),
        }
        Ok(())
    }
}

/// The buffer had too little room for the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("no room to encode a ProcessingResponse: {needed} bytes needed, {remaining} left")]
pub struct NoRoom {
    pub needed: usize,
    pub remaining: usize,
}

fn streamed_mut(message: &mut ProcessingResponse) -> Option<&mut StreamedBodyResponse> {
    use processing_response::Response;
    match &mut message.response {
        Some(Response::RequestBody(b) | Response::ResponseBody(b)) => {
            match b
                .response
                .as_mut()?
                .body_mutation
                .as_mut()?
                .mutation
                .as_mut()?
            {
                body_mutation::Mutation::StreamedResponse(s) => Some(s),
                _ => None,
            }
        }
        _ => None,
    }
}

/// Protobuf keys of the fields a streamed chunk nests in (each field number is below 16, so a key
/// is one byte): `ProcessingResponse.request_body` (3) / `response_body` (4) → `BodyResponse.
/// response` (1) → `CommonResponse.body_mutation` (3) → `BodyMutation.streamed_response` (3) →
/// `StreamedBodyResponse.body` (1), `.end_of_stream` (2).
const LEN: u8 = 2;
const fn key(field: u8, wire_type: u8) -> u8 {
    (field << 3) | wire_type
}

/// A length-delimited field's size: key, length, contents.
fn field_len(len: usize) -> usize {
    1 + prost::length_delimiter_len(len) + len
}

impl StreamedChunk {
    /// `StreamedBodyResponse`'s size, then each enclosing message's.
    fn lengths(&self) -> [usize; 4] {
        let streamed = if self.body.is_empty() {
            0
        } else {
            field_len(self.body.len())
        } + if self.end_of_stream { 2 } else { 0 };
        let mutation = field_len(streamed);
        let common = field_len(mutation);
        let response = field_len(common);
        [streamed, mutation, common, response]
    }

    fn encoded_len(&self) -> usize {
        field_len(self.lengths()[3])
    }

    /// Proto3 as prost writes it: fields at their default are left out, a set message field is
    /// written even when empty.
    fn encode(&self, buf: &mut impl BufMut) {
        let [streamed, mutation, common, response] = self.lengths();
        let outer = match self.side {
            BodySide::Request => 3,
            BodySide::Response => 4,
        };
        for (field, len) in [(outer, response), (1, common), (3, mutation), (3, streamed)] {
            buf.put_u8(key(field, LEN));
            // The caller checked the room: no error.
            let _ = prost::encode_length_delimiter(len, buf);
        }
        if !self.body.is_empty() {
            buf.put_u8(key(1, LEN));
            let _ = prost::encode_length_delimiter(self.body.len(), buf);
            buf.put_slice(&self.body);
        }
        if self.end_of_stream {
            buf.put_u8(key(2, 0));
            buf.put_u8(1);
        }
    }
}

/// A varint at `*pos` of `b`, or `None` if it is cut short or longer than ten bytes.
fn varint(b: &[u8], pos: &mut usize) -> Option<u64> {
    let mut value = 0u64;
    for shift in (0..70).step_by(7) {
        let byte = *b.get(*pos)?;
        *pos += 1;
        value |= u64::from(byte & 0x7f).checked_shl(shift)?;
        if byte & 0x80 == 0 {
            return Some(value);
        }
    }
    None
}

/// The field at `*pos` of a protobuf message: `(field number, wire type, value's range)`, `pos`
/// moved past it; `None` for anything this reader leaves to prost (cut short, groups).
fn next_field(b: &[u8], pos: &mut usize) -> Option<(u64, u64, std::ops::Range<usize>)> {
    let key = varint(b, pos)?;
    let (field, wire_type) = (key >> 3, key & 7);
    let start = *pos;
    match wire_type {
        0 => {
            varint(b, pos)?;
        }
        1 => *pos = pos.checked_add(8)?,
        2 => {
            let len = usize::try_from(varint(b, pos)?).ok()?;
            *pos = pos.checked_add(len)?;
            return (*pos <= b.len()).then_some((field, wire_type, *pos - len..*pos));
        }
        5 => *pos = pos.checked_add(4)?,
        _ => return None,
    }
    (*pos <= b.len()).then_some((field, wire_type, start..*pos))
}

/// A chunk stays a slice of its message when the rest of the message is at most this many bytes
/// or an eighth of it (Envoy's framing and metadata: tens of bytes); otherwise it is copied.
const SLICE_SLACK_BYTES: usize = 256;

/// The chunk at `range` of `message`: a slice when it is nearly all of it, else its own copy, so
/// what a kept chunk holds is about its own size.
fn chunk_of(message: &Bytes, range: std::ops::Range<usize>) -> Bytes {
    let rest = message.len() - range.len();
    if rest <= SLICE_SLACK_BYTES.max(message.len() / 8) {
        message.slice(range)
    } else {
        Bytes::copy_from_slice(&message[range])
    }
}

/// A `ProcessingRequest` whose one `request` is a body (field 4 or 5) read with its chunk as a
/// slice of `message`; every other field decoded by prost from a copy of its own bytes. `None`
/// for any other message, and whatever this reader is unsure of (prost decodes those whole).
fn split_body(message: &Bytes) -> Option<Inbound> {
    let mut others = Vec::new();
    let mut body = None;
    let mut pos = 0;
    while pos < message.len() {
        let start = pos;
        let (field, wire_type, value) = next_field(message, &mut pos)?;
        match (field, wire_type) {
            (4 | 5, 2) if body.is_none() => body = Some((field, value)),
            // Another member of the `request` oneof (or a second body): prost's merge rules.
            (2..=7, _) => return None,
            _ => others.extend_from_slice(&message[start..pos]),
        }
    }
    let (field, value) = body?;
    let http = &message[value.clone()];
    let mut chunk = Bytes::new();
    let mut http_others = Vec::new();
    let mut pos = 0;
    while pos < http.len() {
        let start = pos;
        match next_field(http, &mut pos)? {
            // `bytes` is a scalar: the last occurrence wins, as in prost.
            (1, 2, range) => {
                chunk = chunk_of(message, value.start + range.start..value.start + range.end)
            }
            _ => http_others.extend_from_slice(&http[start..pos]),
        }
    }
    let http = HttpBody::decode(http_others.as_slice()).ok()?;
    let mut request = ProcessingRequest::decode(others.as_slice()).ok()?;
    request.request = Some(if field == 4 {
        processing_request::Request::RequestBody(http)
    } else {
        processing_request::Request::ResponseBody(http)
    });
    Some(Inbound {
        message: request,
        body: chunk,
    })
}

/// Decodes one `ProcessingRequest`; its body chunk, if any, stays a slice of `message`.
pub fn decode_inbound(message: Bytes) -> Result<Inbound, prost::DecodeError> {
    match split_body(&message) {
        Some(inbound) => Ok(inbound),
        None => ProcessingRequest::decode(message).map(Inbound::from),
    }
}

/// The ext_proc service's codec (in place of `tonic_prost::ProstCodec`).
#[derive(Debug, Clone, Copy, Default)]
pub struct ExtProcCodec;

#[derive(Debug, Clone, Copy, Default)]
pub struct OutboundEncoder;

#[derive(Debug, Clone, Copy, Default)]
pub struct InboundDecoder;

impl Codec for ExtProcCodec {
    type Encode = Outbound;
    type Decode = Inbound;
    type Encoder = OutboundEncoder;
    type Decoder = InboundDecoder;

    fn encoder(&mut self) -> OutboundEncoder {
        OutboundEncoder
    }

    fn decoder(&mut self) -> InboundDecoder {
        InboundDecoder
    }
}

impl Encoder for OutboundEncoder {
    type Item = Outbound;
    type Error = Status;

    fn encode(&mut self, item: Outbound, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        // One reservation for the whole message, instead of doubling tonic's buffer (8 KiB to
        // start) step by step while an echoed chunk is written into it, each step copying the
        // whole buffer. The buffer keeps tonic's size to start with: most streams' messages are
        // small, and a bigger start would cost every stream its allocation.
        let needed = item.encoded_len();
        dst.reserve(needed);
        item.encode_sized(dst, needed)
            .map_err(|e| Status::internal(format!("encoding a ProcessingResponse: {e}")))
    }
}

impl Decoder for InboundDecoder {
    type Item = Inbound;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Inbound>, Status> {
        use bytes::Buf;
        // `DecodeBuf` hands out its message as a slice of tonic's buffer: no copy.
        let message = src.copy_to_bytes(src.remaining());
        decode_inbound(message)
            .map(Some)
            // As tonic_prost maps a decode error (gRPC's status codes: INTERNAL).
            .map_err(|e| Status::internal(e.to_string()))
    }
}

#[cfg(test)]
#[path = "codec_tests.rs"]
mod tests;

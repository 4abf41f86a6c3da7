//! The codec against prost: the same bytes written, the same messages read (or the same refusal),
//! and a received body chunk that is a slice of the received message, not a copy.

use std::collections::HashMap;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpHeaders, HttpTrailers, ImmediateResponse, ProtocolConfiguration,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use rand::{Rng, SeedableRng};

use super::*;

fn prost_bytes(message: &impl Message) -> Vec<u8> {
    message.encode_to_vec()
}

fn ours(outbound: &Outbound) -> Vec<u8> {
    let mut buf = Vec::new();
    outbound.encode(&mut buf).unwrap();
    buf
}

#[test]
fn streamed_chunks_are_written_as_prost_writes_them() {
    for len in [0usize, 1, 127, 128, 16_383, 16_384, 62_000, 2_097_152] {
        for end_of_stream in [false, true] {
            for side in [BodySide::Request, BodySide::Response] {
                let body = Bytes::from((0..len).map(|i| (i * 31) as u8).collect::<Vec<u8>>());
                let outbound = Outbound::streamed_body(side, body.clone(), end_of_stream);
                let message = outbound.clone().into_message();
                assert_eq!(
                    ours(&outbound),
                    prost_bytes(&message),
                    "{len} {end_of_stream} {side:?}"
                );
                assert_eq!(outbound.streamed_chunk(), Some((&body[..], end_of_stream)));
                // What the stream machine inspects through `Deref`: everything but the chunk.
                let mut emptied = message.clone();
                if let Some(s) = streamed_mut(&mut emptied) {
                    s.body.clear();
                }
                assert_eq!(*outbound, emptied);
            }
        }
    }
}

#[test]
fn the_size_reserved_for_a_message_is_the_size_written() {
    for len in [0usize, 1, 127, 128, 16_383, 16_384, 62_000] {
        let body = Bytes::from(vec![7u8; len]);
        for side in [BodySide::Request, BodySide::Response] {
            let outbound = Outbound::streamed_body(side, body.clone(), len % 2 == 0);
            assert_eq!(
                outbound.encoded_len(),
                ours(&outbound).len(),
                "{len} {side:?}"
            );
        }
    }
    let message = Outbound::from(ProcessingResponse::default());
    assert_eq!(message.encoded_len(), ours(&message).len());
}

#[test]
fn other_responses_are_prost_messages() {
    let responses = [
        ProcessingResponse::default(),
        ProcessingResponse {
            response: Some(processing_response::Response::ImmediateResponse(
                ImmediateResponse {
                    body: b"kvpick: 400: bad\n".to_vec(),
                    details: "kvpick_400".into(),
                    ..Default::default()
                },
            )),
            ..Default::default()
        },
    ];
    for message in responses {
        let outbound = Outbound::from(message.clone());
        assert_eq!(ours(&outbound), prost_bytes(&message));
        assert_eq!(outbound.streamed_chunk(), None);
        assert_eq!(outbound.into_message(), message);
    }
}

#[test]
fn a_full_buffer_is_an_error_not_a_panic() {
    let outbound = Outbound::streamed_body(BodySide::Request, Bytes::from_static(b"abc"), true);
    let mut small = [0u8; 4];
    let err = outbound.encode(&mut &mut small[..]).unwrap_err();
    assert_eq!(err.remaining, 4);
    assert!(err.needed > 4);
    let mut small = [0u8; 2];
    let message = Outbound::from(ProcessingResponse {
        dynamic_metadata: Some(Struct {
            fields: [("k".to_string(), Value::default())].into(),
        }),
        ..Default::default()
    });
    assert!(message.encode(&mut &mut small[..]).is_err());
}

fn header_map(pairs: &[(&str, &str)]) -> HeaderMap {
    HeaderMap {
        headers: pairs
            .iter()
            .map(|(k, v)| HeaderValue {
                key: k.to_string(),
                raw_value: v.as_bytes().to_vec(),
                ..Default::default()
            })
            .collect(),
    }
}

/// Requests of every kind, with the fields Envoy sets around them.
fn requests() -> Vec<ProcessingRequest> {
    use processing_request::Request;
    let metadata = Metadata {
        filter_metadata: HashMap::from([(
            "envoy.lb".to_string(),
            Struct {
                fields: [(
                    "k".to_string(),
                    Value {
                        kind: Some(Kind::StringValue("v".into())),
                    },
                )]
                .into(),
            },
        )]),
        ..Default::default()
    };
    let body = |b: &[u8], eos| HttpBody {
        body: b.to_vec(),
        end_of_stream: eos,
        ..Default::default()
    };
    vec![
        ProcessingRequest::default(),
        ProcessingRequest {
            request: Some(Request::RequestHeaders(HttpHeaders {
                headers: Some(header_map(&[(":path", "/v1/completions"), ("x", "y")])),
                end_of_stream: false,
                ..Default::default()
            })),
            metadata_context: Some(metadata.clone()),
            protocol_config: Some(ProtocolConfiguration {
                request_body_mode: 4,
                response_body_mode: 4,
                ..Default::default()
            }),
            ..Default::default()
        },
        ProcessingRequest {
            request: Some(Request::RequestBody(body(br#"{"model":"m"}"#, true))),
            ..Default::default()
        },
        ProcessingRequest {
            request: Some(Request::RequestBody(body(&[7; 70_000], false))),
            metadata_context: Some(metadata),
            observability_mode: true,
            ..Default::default()
        },
        ProcessingRequest {
            request: Some(Request::ResponseBody(HttpBody {
                body: b"data: {}\n\n".to_vec(),
                end_of_stream: true,
                end_of_stream_without_message: true,
                grpc_message_compressed: true,
                drain_complete: true,
            })),
            ..Default::default()
        },
        ProcessingRequest {
            request: Some(Request::RequestBody(body(b"", true))),
            ..Default::default()
        },
        ProcessingRequest {
            request: Some(Request::RequestTrailers(HttpTrailers {
                trailers: Some(header_map(&[("t", "1")])),
            })),
            ..Default::default()
        },
    ]
}

#[test]
fn requests_read_as_prost_reads_them_with_the_chunk_a_slice_of_the_message() {
    for message in requests() {
        let wire = Bytes::from(prost_bytes(&message));
        let inbound = decode_inbound(wire.clone()).unwrap();
        assert_eq!(inbound, Inbound::from(message.clone()));
        if !inbound.body.is_empty() {
            let within = wire.as_ptr_range();
            assert!(
                within.contains(&inbound.body.as_ptr()),
                "the chunk is not a copy"
            );
        }
    }
}

/// Bytes prost reads, or refuses, and this decoder must read or refuse alike: the request
/// messages above bent (a body next to headers, two bodies, a body with the wrong wire type,
/// varints cut short, random bytes changed).
#[test]
fn any_bytes_read_as_prost_reads_them() {
    let same = |wire: &[u8]| {
        let want = ProcessingRequest::decode(wire).map(Inbound::from);
        let got = decode_inbound(Bytes::copy_from_slice(wire));
        match (&got, &want) {
            (Ok(a), Ok(b)) => assert_eq!(a, b, "{wire:?}"),
            (Err(_), Err(_)) => {}
            _ => panic!("{wire:?}: ours {got:?}, prost {want:?}"),
        }
    };
    let wires: Vec<Vec<u8>> = requests().iter().map(prost_bytes).collect();
    // Two messages back to back are one message to protobuf (fields merge, last wins).
    for a in &wires {
        for b in &wires {
            same(&[a.as_slice(), b.as_slice()].concat());
        }
    }
    // Field 4 (request_body) as a varint, a body's field 1 as a varint, a group, a cut length.
    for odd in [
        &[0x20, 0x01][..],
        &[0x22, 0x02, 0x08, 0x01],
        &[0x22, 0x03, 0x0a, 0x05, 0x61],
        &[0x23, 0x24],
        &[0x22, 0x80],
        &[0x22, 0x01],
        &[0x22, 0x00, 0x22, 0x00],
        &[0x2a, 0x02, 0x10, 0x01, 0x22, 0x00],
    ] {
        same(odd);
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(4);
    for round in 0..20_000 {
        let mut wire = wires[round % wires.len()].clone();
        if wire.len() > 100_000 {
            continue;
        }
        for _ in 0..rng.random_range(1..4) {
            match rng.random_range(0..3) {
                0 if !wire.is_empty() => {
                    let at = rng.random_range(0..wire.len());
                    wire[at] = rng.random();
                }
                1 => wire.truncate(rng.random_range(0..=wire.len())),
                _ => {
                    let at = rng.random_range(0..=wire.len());
                    wire.insert(at, rng.random());
                }
            }
        }
        same(&wire);
    }
}

/// A small chunk padded with unknown fields (a client inflating what a kept chunk holds) is
/// copied out: what it keeps is its own bytes, not the megabyte around them. A chunk that is
/// nearly its whole message stays a slice of it.
#[test]
fn a_padded_chunk_is_copied_out_and_a_nearly_whole_one_stays_a_slice() {
    let body = |chunk: &[u8]| ProcessingRequest {
        request: Some(processing_request::Request::RequestBody(HttpBody {
            body: chunk.to_vec(),
            ..Default::default()
        })),
        ..Default::default()
    };
    let mut padded = prost_bytes(&body(&[7; 1024]));
    // Unknown field 999 (wire type 2) of 1 MB: prost skips it, so does the reader.
    let pad = vec![0u8; 1 << 20];
    prost::encoding::encode_key(999, prost::encoding::WireType::LengthDelimited, &mut padded);
    prost::encoding::encode_varint(pad.len() as u64, &mut padded);
    padded.extend_from_slice(&pad);
    let wire = Bytes::from(padded);
    let inbound = decode_inbound(wire.clone()).unwrap();
    assert_eq!(inbound.body.len(), 1024);
    assert!(
        !wire.as_ptr_range().contains(&inbound.body.as_ptr()),
        "the chunk holds its own 1 KiB, not the 1 MB message"
    );
    drop(wire);
    let kept = inbound.body;
    assert!(
        kept.try_into_mut().is_ok(),
        "nothing else shares its buffer"
    );

    // The rest of the message at the slack (256 bytes, or an eighth of a large message): still a
    // slice; one byte over: copied.
    for (chunk, extra, rest, sliced) in [
        (1024, 246, 256, true),
        (1024, 247, 257, false),
        (70_000, 8000, 8012, true),
        (70_000, 11_000, 11_012, false),
    ] {
        let mut wire = prost_bytes(&body(&vec![1; chunk]));
        prost::encoding::encode_key(999, prost::encoding::WireType::LengthDelimited, &mut wire);
        prost::encoding::encode_varint(extra as u64, &mut wire);
        wire.extend(vec![0u8; extra]);
        let wire = Bytes::from(wire);
        assert_eq!(wire.len() - chunk, rest);
        let inbound = decode_inbound(wire.clone()).unwrap();
        assert_eq!(
            wire.as_ptr_range().contains(&inbound.body.as_ptr()),
            sliced,
            "chunk {chunk}, {extra} bytes of padding"
        );
    }
}

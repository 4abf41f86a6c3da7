//! Fuzzes the ext_proc host's per-stream state machine (`src/hosts/extproc/stream/mod.rs`): header and
//! metadata handling (session ids, pins, priority, request ids, subset hints of any shape, binary
//! and oversized values), bodies, trailers and response messages in any order and any number.
//! It may answer with errors or immediate responses, but it must never panic, and once the stream
//! is gone no booking and no body-budget bytes may remain.
//!
//! Input: a sequence of messages, each `[op][flags][len][bytes...]` (see `next_message`).

#![no_main]

use std::sync::{Arc, OnceLock};

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request, HttpBody, HttpHeaders, HttpTrailers, ProcessingRequest,
};
use kvpick::sources::catalog::{RankLayout, WorkerSpec};
use kvpick::hosts::extproc::{ExtProcSettings, StreamMachine};
use kvpick::observability::metrics::Metrics;
use kvpick::selection::{CoreConfig, SelectionCore};
use libfuzzer_sys::fuzz_target;
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};

/// Header names the machine reads or strips, so mutations reach their handling often.
const NAMES: [&str; 16] = [
    ":path",
    ":method",
    "content-type",
    "x-request-id",
    "x-dynamo-session-id",
    "x-session-id",
    "x-dynamo-worker-instance-id",
    "x-dynamo-dp-rank",
    "x-dynamo-request-priority",
    "x-gateway-destination-endpoint",
    "x-gateway-inference-objective",
    "x-data-parallel-rank",
    "x-gateway-destination-endpoint-subset",
    "x-conformance-test-served-endpoint",
    "content-length",
    "X-Request-ID",
];

fn core() -> &'static (Arc<SelectionCore>, Arc<ExtProcSettings>) {
    static CORE: OnceLock<(Arc<SelectionCore>, Arc<ExtProcSettings>)> = OnceLock::new();
    CORE.get_or_init(|| {
        let core = SelectionCore::new(
            CoreConfig {
                seed: Some(1),
                allow_pins: true,
                ..Default::default()
            },
            Metrics::new(),
        );
        let spec = |name: &str, ip: &str, ranks| WorkerSpec {
            namespace: "fuzz".into(),
            name: name.into(),
            model: "m".into(),
            routing_group: String::new(),
            address: ip.parse().unwrap(),
            ranks,
            block_size: Some(16),
            kv_events: None,
            kv_replay: None,
            lora_adapters: vec![],
            draining: false,
            incarnation: 0,
            roles: Vec::new(),
        };
        core.apply_snapshot(vec![
            spec("a", "10.0.0.1", RankLayout::PerPort(vec![8000, 8001])),
            spec("b", "10.0.0.2", RankLayout::Multiplexed { port: 8000, size: 2 }),
        ])
        .unwrap();
        let settings = ExtProcSettings {
            max_body_bytes: 1 << 16,
            ..Default::default()
        };
        (core, Arc::new(settings))
    })
}

struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn byte(&mut self) -> Option<u8> {
        let (b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(*b)
    }
    fn bytes(&mut self) -> Option<&'a [u8]> {
        let len = self.byte()? as usize;
        // A length byte of 255 takes the rest: long values and bodies stay reachable.
        let len = if len == 255 { self.0.len() } else { len.min(self.0.len()) };
        let (b, rest) = self.0.split_at(len);
        self.0 = rest;
        Some(b)
    }
    fn text(&mut self) -> Option<String> {
        Some(String::from_utf8_lossy(self.bytes()?).into_owned())
    }
}

fn value(c: &mut Cursor, depth: u8) -> Option<Value> {
    let kind = match c.byte()? % 6 {
        0 => Kind::StringValue(c.text()?),
        1 => Kind::NumberValue(c.byte()? as f64 - 1.5),
        2 => Kind::BoolValue(c.byte()? & 1 == 1),
        3 if depth < 4 => {
            let n = c.byte()? % 4;
            let mut values = Vec::new();
            for _ in 0..n {
                values.push(value(c, depth + 1)?);
            }
            Kind::ListValue(ListValue { values })
        }
        4 if depth < 4 => Kind::StructValue(Struct {
            fields: [(c.text()?, value(c, depth + 1)?)].into_iter().collect(),
        }),
        _ => Kind::NullValue(0),
    };
    Some(Value { kind: Some(kind) })
}

fn metadata(c: &mut Cursor) -> Option<Metadata> {
    let namespace = ["envoy.lb.subset_hint", "envoy.lb", "other"][c.byte()? as usize % 3];
    let key = match c.byte()? % 3 {
        0 => "x-gateway-destination-endpoint-subset".to_string(),
        1 => "x-gateway-destination-endpoint-served".to_string(),
        _ => c.text()?,
    };
    let mut md = Metadata::default();
    md.filter_metadata.insert(
        namespace.to_string(),
        Struct {
            fields: [(key, value(c, 0)?)].into_iter().collect(),
        },
    );
    Some(md)
}

fn headers(c: &mut Cursor, end_of_stream: bool) -> Option<HttpHeaders> {
    let n = c.byte()? % 8;
    let mut list = Vec::new();
    for _ in 0..n {
        let pick = c.byte()?;
        let key = if pick < 200 {
            NAMES[pick as usize % NAMES.len()].to_string()
        } else {
            c.text()?
        };
        let raw = c.bytes()?.to_vec();
        // Envoy sends `raw_value`; older peers send `value`. Both must be handled.
        list.push(if pick & 1 == 0 {
            HeaderValue {
                key,
                raw_value: raw,
                ..Default::default()
            }
        } else {
            HeaderValue {
                key,
                value: String::from_utf8_lossy(&raw).into_owned(),
                ..Default::default()
            }
        });
    }
    Some(HttpHeaders {
        headers: Some(HeaderMap { headers: list }),
        end_of_stream,
        ..Default::default()
    })
}

fn next_message(c: &mut Cursor) -> Option<ProcessingRequest> {
    let op = c.byte()?;
    let flags = c.byte()?;
    let eos = flags & 1 == 1;
    let request = match op % 7 {
        0 => Some(Request::RequestHeaders(headers(c, eos)?)),
        1 => Some(Request::RequestBody(HttpBody {
            body: c.bytes()?.to_vec(),
            end_of_stream: eos,
            ..Default::default()
        })),
        2 => Some(Request::RequestTrailers(HttpTrailers::default())),
        3 => Some(Request::ResponseHeaders(headers(c, eos)?)),
        4 => Some(Request::ResponseBody(HttpBody {
            body: c.bytes()?.to_vec(),
            end_of_stream: eos,
            ..Default::default()
        })),
        5 => Some(Request::ResponseTrailers(HttpTrailers::default())),
        _ => None,
    };
    let metadata_context = if flags & 2 == 2 { metadata(c) } else { None };
    Some(ProcessingRequest {
        request,
        metadata_context,
        ..Default::default()
    })
}

fuzz_target!(|data: &[u8]| {
    let (core, settings) = core();
    let mut machine = StreamMachine::new(Arc::clone(core), Arc::clone(settings));
    let mut cursor = Cursor(data);
    for _ in 0..24 {
        let Some(message) = next_message(&mut cursor) else {
            break;
        };
        let Ok(step) = machine.handle(message) else {
            break;
        };
        if step.finished {
            break;
        }
    }
    drop(machine);
    assert_eq!(core.live_bookings(), 0, "a booking outlived its stream");
    assert_eq!(settings.body_budget.in_use(), 0, "body bytes outlived their stream");
});

//! Test support: a tracer provider whose spans end up in memory, exported synchronously as each
//! span ends, so tests read them without waiting.

use std::sync::{Arc, Mutex};

use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider, SpanData, SpanExporter};

use super::Telemetry;

/// The spans exported so far.
#[derive(Clone, Debug, Default)]
pub struct Finished(Arc<Mutex<Vec<SpanData>>>);

impl Finished {
    pub fn spans(&self) -> Vec<SpanData> {
        self.0.lock().map(|s| s.clone()).unwrap_or_default()
    }

    pub fn named(&self, name: &str) -> Option<SpanData> {
        self.spans().into_iter().find(|s| s.name == name)
    }
}

#[derive(Debug)]
struct Memory(Finished);

impl SpanExporter for Memory {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        if let Ok(mut spans) = self.0 .0.lock() {
            spans.extend(batch);
        }
        Ok(())
    }
}

/// Tracing on with `sampler`, spans kept in memory.
pub fn in_memory(sampler: Sampler) -> (Telemetry, Finished) {
    let finished = Finished::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(Memory(finished.clone()))
        .with_sampler(sampler)
        .build();
    (Telemetry::from_provider(provider), finished)
}

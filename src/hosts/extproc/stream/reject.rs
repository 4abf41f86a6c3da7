//! The stream's refusals: an immediate response (413 too large, 503 body budget, the selection's
//! own status, 400 for bad input) that ends the stream for kvpick, with what it buffered or
//! queued dropped and the refusal counted and traced.
//!
//! It must not book: a refused request holds nothing.

use crate::selection::{SelectError, ToHttpStatus};

use super::wire::immediate;
use super::{Phase, Step, StreamMachine};

impl StreamMachine {
    pub(super) fn reject_too_large(&mut self) -> Step {
        let message = format!(
            "request body exceeds max_body_bytes ({} bytes)",
            self.settings.max_body_bytes
        );
        self.reject(413, &message)
    }

    pub(super) fn reject_select(&mut self, err: &SelectError) -> Step {
        self.reject(err.http_status(), &err.to_string())
    }

    /// 503 for a body the global budget cannot hold: memory is shared by every stream, so a
    /// retry (elsewhere or later) can succeed where buffering more could starve the process.
    pub(super) fn reject_budget(&mut self) -> Step {
        self.core.metrics().extproc.body_budget_rejected.inc();
        tracing::debug!(
            limit = self.settings.body_budget.limit(),
            "request body budget exhausted"
        );
        self.reject(503, "request body budget exhausted, retry later")
    }

    pub(super) fn reject(&mut self, status: u16, message: &str) -> Step {
        self.epp.rejected(status);
        if let Some(t) = &mut self.trace {
            t.refused(status, message);
        }
        self.phase = Phase::Finished;
        drop(self.body.take());
        self.scanner = None;
        self.pending = None;
        self.queued = None;
        self.core
            .metrics()
            .extproc
            .requests
            .with_label_values(&[&status.to_string()])
            .inc();
        Step {
            responses: vec![immediate(status, message).into()],
            finished: true,
            ..Step::default()
        }
    }
}

#[cfg(test)]
#[path = "reject_tests.rs"]
mod tests;

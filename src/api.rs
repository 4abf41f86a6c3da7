//! The gRPC selection API host (`kvpick.v1.Selection`): the selection core for callers that are
//! not Envoy. Like the ext_proc host it only translates; bookings made here live until `Free` or
//! expiry because the caller, not a stream, owns them.

use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::proto::selection_server::{Selection, SelectionServer};
use crate::proto::{
    BookingAck, BookingRef, Endpoint, ListWorkersRequest, ListWorkersResponse, SelectRequest,
    SelectResponse, Worker, WorkerRank,
};
use crate::selection::{
    DuplicateId, EndpointFilter, PickedRank, SelectError, SelectionCore, SelectionRequest,
};

#[derive(Clone)]
pub struct SelectionApi {
    core: Arc<SelectionCore>,
}

impl SelectionApi {
    pub fn new(core: Arc<SelectionCore>) -> Self {
        SelectionApi { core }
    }

    pub fn into_server(self) -> SelectionServer<Self> {
        SelectionServer::new(self)
    }
}

fn endpoint(p: &PickedRank) -> Endpoint {
    Endpoint {
        worker_id: p.key.worker_id,
        dp_rank: p.key.dp_rank,
        address: p.endpoint.to_string(),
        multiplexed_rank: p.multiplexed,
        worker_name: p.worker_name.clone(),
    }
}

/// The gRPC status for a selection error (same meaning as the HTTP status on ext_proc).
pub fn status_of(err: &SelectError) -> Status {
    let msg = err.to_string();
    match err {
        SelectError::BadRequest(_) => Status::invalid_argument(msg),
        SelectError::Conflict(_) => Status::already_exists(msg),
        SelectError::Overloaded(_) => Status::resource_exhausted(msg),
        SelectError::Unavailable(_) => Status::unavailable(msg),
    }
}

#[tonic::async_trait]
impl Selection for SelectionApi {
    async fn select_and_reserve(
        &self,
        request: Request<SelectRequest>,
    ) -> Result<Response<SelectResponse>, Status> {
        let req = request.into_inner();
        if req.request_id.is_empty() {
            return Err(Status::invalid_argument("request_id is required"));
        }
        if req.model.is_empty() {
            return Err(Status::invalid_argument("model is required"));
        }
        let selection_request = SelectionRequest {
            request_id: req.request_id,
            model: Some(req.model),
            subset: (!req.subset.is_empty())
                .then(|| EndpointFilter::parse(req.subset.iter().map(String::as_str))),
            fallbacks: req.fallbacks as usize,
            on_duplicate: DuplicateId::Reject,
        };
        let reservation = self
            .core
            .select_and_reserve(&selection_request)
            .map_err(|e| status_of(&e))?;
        let selection = reservation.detach();
        Ok(Response::new(SelectResponse {
            primary: Some(endpoint(&selection.primary)),
            fallbacks: selection.fallbacks.iter().map(endpoint).collect(),
            request_id: selection.booking_id,
            overlap_blocks: 0,
        }))
    }

    async fn mark_prefill_complete(
        &self,
        request: Request<BookingRef>,
    ) -> Result<Response<BookingAck>, Status> {
        let found = self
            .core
            .mark_prefill_complete(&request.into_inner().request_id);
        Ok(Response::new(BookingAck { found }))
    }

    async fn free(&self, request: Request<BookingRef>) -> Result<Response<BookingAck>, Status> {
        let found = self.core.free(&request.into_inner().request_id);
        Ok(Response::new(BookingAck { found }))
    }

    async fn list_workers(
        &self,
        request: Request<ListWorkersRequest>,
    ) -> Result<Response<ListWorkersResponse>, Status> {
        let model = request.into_inner().model;
        let workers = self
            .core
            .list_workers((!model.is_empty()).then_some(model.as_str()))
            .into_iter()
            .map(|v| Worker {
                worker_id: v.record.id,
                name: v.record.spec.name.clone(),
                model: v.record.spec.model.clone(),
                routing_group: v.record.spec.routing_group.clone(),
                lifecycle: v.record.lifecycle.as_str().to_string(),
                reason: v.record.reason.clone(),
                ranks: v
                    .record
                    .ranks
                    .iter()
                    .zip(&v.active_requests)
                    .map(|(r, active)| WorkerRank {
                        dp_rank: r.dp_rank,
                        address: r.endpoint.to_string(),
                        active_requests: *active,
                    })
                    .collect(),
                block_size: v.record.spec.block_size.unwrap_or(0),
                lora_adapters: v.record.spec.lora_adapters.clone(),
                kv_events: v.record.spec.kv_events.clone().unwrap_or_default(),
            })
            .collect();
        Ok(Response::new(ListWorkersResponse { workers }))
    }
}

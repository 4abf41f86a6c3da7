//! The gRPC selection API host (`kvpick.v1.Selection`): the selection core for callers that are
//! not Envoy. Like the ext_proc host it only translates; bookings made here live until `Free` or
//! expiry because the caller, not a stream, owns them. Workers upserted here form the "api"
//! catalog source, merged with the file/Kubernetes source.

#![warn(clippy::arithmetic_side_effects)]

use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::proto::selection_server::{Selection, SelectionServer};
use crate::proto::{
    BookingAck, BookingRef, CatalogAck, DeleteWorkerRequest, Endpoint, ListWorkersRequest,
    ListWorkersResponse, LoadsRequest, LoadsResponse, OverlapScore, OverlapScoresResponse,
    RankLoad, SelectRequest, SelectResponse, Worker, WorkerSpec,
};
use crate::selection::{
    self, CatalogError, Claim, DuplicateId, EndpointFilter, Holder, PickedRank, Pin, PromptInput,
    SelectError, SelectionCore, SelectionRequest, WorkerView,
};
use crate::sources::catalog::static_file::{to_spec, StaticWorker};
use kvpick_core::request::check_session_id_len;

/// Catalog source name of workers managed through this API.
pub const API_SOURCE: &str = "api";

#[derive(Clone)]
pub struct SelectionApi {
    core: Arc<SelectionCore>,
    worker_writes: bool,
    reservations: bool,
}

impl SelectionApi {
    /// An API that answers every RPC, including catalog writes (in-process hosts and tests).
    pub fn new(core: Arc<SelectionCore>) -> Self {
        SelectionApi {
            core,
            worker_writes: true,
            reservations: true,
        }
    }

    /// Whether `SelectAndReserve` / `Free` / `PrefillComplete` are accepted (`--selection-api`);
    /// refused with `PERMISSION_DENIED` otherwise. Bookings are load: whoever may make them can
    /// saturate the pool for every Envoy request.
    pub fn with_reservations(mut self, allowed: bool) -> Self {
        self.reservations = allowed;
        self
    }

    fn check_reservations(&self) -> Result<(), Status> {
        if self.reservations {
            Ok(())
        } else {
            Err(Status::permission_denied(
                "bookings through the API are disabled; start kvpick with --selection-api to allow SelectAndReserve, Free and PrefillComplete",
            ))
        }
    }

    /// Whether `UpsertWorker` / `DeleteWorker` are accepted (`--worker-api`); refused with
    /// `PERMISSION_DENIED` otherwise.
    pub fn with_worker_writes(mut self, allowed: bool) -> Self {
        self.worker_writes = allowed;
        self
    }

    fn check_worker_writes(&self) -> Result<(), Status> {
        if self.worker_writes {
            Ok(())
        } else {
            Err(Status::permission_denied(
                "catalog writes are disabled; start kvpick with --worker-api to allow them",
            ))
        }
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

/// The gRPC status for a refused catalog change.
pub fn catalog_status(err: &CatalogError) -> Status {
    match err {
        CatalogError::DuplicateWorker { .. } => Status::already_exists(err.to_string()),
    }
}

/// Translates an API request into the core's request (shared by Select, SelectAndReserve and
/// OverlapScores).
pub fn selection_request(req: SelectRequest) -> Result<SelectionRequest, Status> {
    if req.model.is_empty() {
        return Err(Status::invalid_argument("model is required"));
    }
    check_session_id_len(req.session_id.len(), "session_id").map_err(|e| status_of(&e))?;
    check_session_id_len(req.parent_session_id.len(), "parent_session_id")
        .map_err(|e| status_of(&e))?;
    if req.pin_dp_rank.is_some() && req.pin_worker_id.is_none() {
        return Err(Status::invalid_argument("pin_dp_rank needs pin_worker_id"));
    }
    if !req.token_ids.is_empty() && !req.block_hashes.is_empty() {
        return Err(Status::invalid_argument(
            "send token_ids or block_hashes, not both",
        ));
    }
    let prompt = if !req.token_ids.is_empty() {
        PromptInput::Tokens(req.token_ids)
    } else if !req.block_hashes.is_empty() {
        PromptInput::BlockHashes {
            seq_hashes: req.block_hashes,
            prompt_tokens: req.prompt_tokens,
        }
    } else {
        PromptInput::None
    };
    Ok(SelectionRequest {
        request_id: req.request_id,
        model: Some(req.model),
        routing_group: req.routing_group,
        prompt,
        cache_salt: (!req.cache_salt.is_empty()).then_some(req.cache_salt),
        subset: (!req.subset.is_empty())
            .then(|| EndpointFilter::parse(req.subset.iter().map(String::as_str))),
        pin: req.pin_worker_id.map(|worker_id| Pin {
            worker_id,
            dp_rank: req.pin_dp_rank,
        }),
        fallbacks: req.fallbacks as usize,
        temperature: req.temperature,
        priority: req.priority,
        fairness_key: None,
        slo_ttft_ms: None,
        slo_tpot_ms: None,
        session_id: (!req.session_id.is_empty()).then_some(req.session_id),
        parent_session_id: (!req.parent_session_id.is_empty()).then_some(req.parent_session_id),
        session_final: req.session_final,
        on_duplicate: DuplicateId::Reject,
        holder: crate::selection::Holder::Stream,
        // The gRPC answer carries the pick's own cost; per-candidate scores are the gateway's.
        scores: 0,
        remote_overlap: None,
    })
}

fn response(selection: selection::Selection) -> SelectResponse {
    SelectResponse {
        primary: Some(endpoint(&selection.primary)),
        fallbacks: selection.fallbacks.iter().map(endpoint).collect(),
        request_id: selection.booking_id,
        overlap_blocks: selection.overlap_blocks as u64,
        cost: selection.cost,
        prompt_blocks: selection.prompt_blocks,
        prefill: selection.prefill.as_ref().map(endpoint),
    }
}

fn worker_message(v: WorkerView) -> Worker {
    let spec = &v.record.spec;
    Worker {
        worker_id: v.record.id,
        name: spec.name.clone(),
        namespace: spec.namespace.clone(),
        model: spec.model.clone(),
        routing_group: spec.routing_group.clone(),
        lifecycle: v.record.lifecycle.as_str().to_string(),
        reason: v.record.reason.clone(),
        ranks: v
            .record
            .ranks
            .iter()
            .zip(v.loads.iter().zip(&v.status))
            .map(|(r, (load, status))| RankLoad {
                dp_rank: r.dp_rank,
                address: r.endpoint.to_string(),
                active_requests: load.active_requests,
                active_prefill_tokens: load.active_prefill_tokens,
                active_decode_blocks: load.active_decode_blocks,
                unreachable: !status.reachable,
                kv_events_block_size: status.mismatched_block_size.unwrap_or(0),
            })
            .collect(),
        block_size: v.block_size.unwrap_or(0),
        lora_adapters: spec.lora_adapters.clone(),
        kv_events: spec.kv_events.clone().unwrap_or_default(),
    }
}

fn port(p: u32) -> Result<u16, Status> {
    u16::try_from(p).map_err(|_| Status::invalid_argument(format!("port {p} is out of range")))
}

#[tonic::async_trait]
impl Selection for SelectionApi {
    async fn select(
        &self,
        request: Request<SelectRequest>,
    ) -> Result<Response<SelectResponse>, Status> {
        let mut req = selection_request(request.into_inner())?;
        self.core.attach_remote_overlap(&mut req).await;
        let selection = self.core.select(&req).map_err(|e| status_of(&e))?;
        Ok(Response::new(response(selection)))
    }

    async fn select_and_reserve(
        &self,
        request: Request<SelectRequest>,
    ) -> Result<Response<SelectResponse>, Status> {
        self.check_reservations()?;
        let req = request.into_inner();
        if req.request_id.is_empty() {
            return Err(Status::invalid_argument("request_id is required"));
        }
        let mut req = SelectionRequest {
            holder: Holder::Api,
            ..selection_request(req)?
        };
        let lookup = self.core.session_tree_lookup(
            req.model.as_deref(),
            &req.routing_group,
            req.session_id.as_deref(),
            req.parent_session_id.as_deref(),
        );
        // Both before the pick, at once: the wait stays the longer one's.
        let remote = self.core.remote_query(&req);
        let (_, overlap) = futures::join!(
            async {
                if let Some(job) = lookup {
                    self.core.prefetch_session(job).await;
                }
            },
            async {
                match remote {
                    Some(query) => self.core.fetch_remote_overlap(query).await,
                    None => None,
                }
            }
        );
        req.remote_overlap = overlap;
        let reservation = self
            .core
            .select_and_reserve(&req)
            .map_err(|e| status_of(&e))?;
        Ok(Response::new(response(reservation.detach())))
    }

    async fn prefill_complete(
        &self,
        request: Request<BookingRef>,
    ) -> Result<Response<BookingAck>, Status> {
        self.check_reservations()?;
        // The API can only touch bookings an API call made, never an ext_proc stream's.
        let found = self.core.mark_prefill_complete_claimed(
            &request.into_inner().request_id,
            Claim::HeldBy(Holder::Api),
        );
        Ok(Response::new(BookingAck { found }))
    }

    async fn free(&self, request: Request<BookingRef>) -> Result<Response<BookingAck>, Status> {
        self.check_reservations()?;
        let found = self
            .core
            .free_claimed(&request.into_inner().request_id, Claim::HeldBy(Holder::Api));
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
            .map(worker_message)
            .collect();
        Ok(Response::new(ListWorkersResponse { workers }))
    }

    async fn upsert_worker(
        &self,
        request: Request<WorkerSpec>,
    ) -> Result<Response<CatalogAck>, Status> {
        self.check_worker_writes()?;
        let w = request.into_inner();
        let ports = if w.ports.is_empty() {
            None
        } else {
            Some(
                w.ports
                    .iter()
                    .map(|p| port(*p))
                    .collect::<Result<Vec<_>, _>>()?,
            )
        };
        let entry = StaticWorker {
            name: w.name,
            model: w.model,
            routing_group: w.routing_group,
            address: w.address,
            ports,
            port: if w.port == 0 {
                None
            } else {
                Some(port(w.port)?)
            },
            data_parallel_size: (w.data_parallel_size != 0).then_some(w.data_parallel_size),
            block_size: (w.block_size != 0).then_some(w.block_size),
            kv_events: (!w.kv_events.is_empty()).then_some(w.kv_events),
            kv_replay: None,
            lora_adapters: w.lora_adapters,
            role: match w.roles.len() {
                0 => None,
                _ => Some(crate::sources::catalog::static_file::RoleField::PerRank(
                    w.roles,
                )),
            },
        };
        let spec =
            to_spec(entry, API_SOURCE).map_err(|e| Status::invalid_argument(format!("{e:#}")))?;
        let worker_id = spec.worker_id();
        self.core
            .upsert_source_worker(API_SOURCE, spec)
            .map_err(|e| catalog_status(&e))?;
        Ok(Response::new(CatalogAck {
            worker_id,
            found: true,
        }))
    }

    async fn delete_worker(
        &self,
        request: Request<DeleteWorkerRequest>,
    ) -> Result<Response<CatalogAck>, Status> {
        self.check_worker_writes()?;
        let name = request.into_inner().name;
        let found = self
            .core
            .delete_source_worker(API_SOURCE, &name)
            .map_err(|e| catalog_status(&e))?;
        Ok(Response::new(CatalogAck {
            worker_id: crate::sources::catalog::worker_id(API_SOURCE, &name),
            found,
        }))
    }

    async fn loads(
        &self,
        request: Request<LoadsRequest>,
    ) -> Result<Response<LoadsResponse>, Status> {
        let req = request.into_inner();
        let workers = self
            .core
            .list_workers((!req.model.is_empty()).then_some(req.model.as_str()))
            .into_iter()
            .filter(|v| {
                req.routing_group.is_empty() || v.record.spec.routing_group == req.routing_group
            })
            .map(worker_message)
            .collect();
        Ok(Response::new(LoadsResponse { workers }))
    }

    async fn overlap_scores(
        &self,
        request: Request<SelectRequest>,
    ) -> Result<Response<OverlapScoresResponse>, Status> {
        let req = selection_request(request.into_inner())?;
        let (prompt_blocks, scores) = self.core.overlap_scores(&req).map_err(|e| status_of(&e))?;
        Ok(Response::new(OverlapScoresResponse {
            prompt_blocks,
            scores: scores
                .into_iter()
                .map(|(rank, d)| OverlapScore {
                    rank: Some(endpoint(&rank)),
                    gpu_blocks: d.gpu,
                    host_blocks: d.host,
                    disk_blocks: d.disk,
                })
                .collect(),
        }))
    }
}

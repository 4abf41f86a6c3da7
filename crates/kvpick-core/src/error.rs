//! The core's typed errors. Hosts alone map them to their protocol (HTTP status on ext_proc, gRPC
//! code on the API); the core never names a status code. Messages are short and never echo more
//! than 128 bytes of client input ([`crate::request::clip`]).

/// Why a pick failed. The variant is the kind (what a host maps to a status); the message says
/// which rule refused the request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectError {
    /// The request itself is invalid (bad session id, pin, token count, ...).
    #[error("{0}")]
    BadRequest(String),
    /// The request id already has a live booking (the API refuses duplicates).
    #[error("{0}")]
    Conflict(String),
    /// Every eligible rank is over a busy threshold, or a sheddable request was shed.
    #[error("{0}")]
    Overloaded(String),
    /// Nothing can serve the request now (no worker, catalog not synced, pin gone, ...).
    #[error("{0}")]
    Unavailable(String),
}

impl SelectError {
    /// A bounded label for metrics and logs.
    pub fn label(&self) -> &'static str {
        match self {
            SelectError::BadRequest(_) => "bad_request",
            SelectError::Conflict(_) => "conflict",
            SelectError::Overloaded(_) => "overloaded",
            SelectError::Unavailable(_) => "unavailable",
        }
    }
}

/// A worker declaration or a setting the core refuses; the message names what to change.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error(
        "worker {worker} declares {roles} roles for {ranks} ranks (give one role, or one per rank)"
    )]
    RolesPerRank {
        worker: String,
        roles: usize,
        ranks: usize,
    },
    #[error("block_size {declared} conflicts with block size {current} of partition {model}")]
    BlockSizeConflict {
        declared: u32,
        current: u32,
        model: String,
    },
    #[error("expected hard or soft, got {0:?}")]
    AffinityMode(String),
    #[error("--session-ttl must be between 1 and 31536000 seconds, got {0}")]
    SessionTtl(f64),
    #[error("--session-max-entries must be at least 1")]
    SessionMaxEntries,
}

/// Why a catalog change was refused. A refused change leaves the catalog as it was.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CatalogError {
    /// Two workers of the union of all sources share one id (namespace/name).
    #[error("duplicate worker {namespace}/{name} in snapshot (source {source_name})")]
    DuplicateWorker {
        namespace: String,
        name: String,
        source_name: &'static str,
    },
}

impl CatalogError {
    /// A bounded label for metrics and logs.
    pub fn label(&self) -> &'static str {
        match self {
            CatalogError::DuplicateWorker { .. } => "duplicate_worker",
        }
    }
}

//! Worker catalog records and the sources that produce them (static YAML file, Kubernetes
//! InferencePool/pod reflector). A source only ever produces *complete desired snapshots*; applying them is the
//! selection core's job (`kvpick_core::catalog`, where the worker records are defined), so this module never touches bookings, load or scheduling state.

pub mod kube;
pub mod static_file;

pub use kvpick_core::catalog::{worker_id, RankEndpoint, RankLayout, WorkerSpec, MAX_DP_RANKS};

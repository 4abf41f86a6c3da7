//! `--kv-index-remote` as the selection core sees it: the [`RemoteIndex`] a remote-index client
//! implements (the `kv_remote` module, over the gRPC `OverlapScores` RPC of another kvpick) and
//! the one step of a pick that uses it: the prompt's block hashes asked for before the pick, the
//! answer handed to the core as the request's `remote_overlap` (an input like the prompt; the
//! decision stays the core's pure function of it).
//!
//! This module owns the seam so that `selection` never imports `kv_remote`. It must not talk
//! to the network, count fallbacks (the client does) or decide a pick.

use std::sync::Arc;

use futures::future::BoxFuture;
use kvpick_core::core::RemoteQuery;
use kvpick_core::RemoteOverlap;

use super::{PromptInput, SelectionCore, SelectionRequest};

/// Where this replica reads its KV view from instead of the engines' events.
pub trait RemoteIndex: Send + Sync {
    /// The remote's per-rank overlap for the query, within the client's deadline; `None` when
    /// it is slow, down or refuses (the client counts why): the pick is then approximate.
    fn overlap(&self, query: RemoteQuery) -> BoxFuture<'_, Option<RemoteOverlap>>;
}

impl SelectionCore {
    /// Takes the KV view from a remote index from now on (once; `--kv-index-remote`).
    pub fn attach_remote_index(&self, remote: Arc<dyn RemoteIndex>) {
        let _ = self.remote.set(remote);
    }

    /// Whether picks read a remote index (`--kv-index-remote`).
    pub fn has_remote_index(&self) -> bool {
        self.remote.get().is_some()
    }

    /// The query a request needs before its pick: `None` without a remote index, or for a
    /// prompt whose blocks no engine's events can name (text hashed without a tokenizer, none).
    pub fn remote_query(&self, request: &SelectionRequest) -> Option<RemoteQuery> {
        self.remote.get()?;
        match request.prompt {
            PromptInput::Tokens(_)
            | PromptInput::MediaTokens { .. }
            | PromptInput::BlockHashes { .. } => self.core.remote_query(request),
            PromptInput::None | PromptInput::Text(_) => None,
        }
    }

    /// Runs a [`SelectionCore::remote_query`]: the remote's answer, or `None` (approximate).
    pub async fn fetch_remote_overlap(&self, query: RemoteQuery) -> Option<Arc<RemoteOverlap>> {
        let remote = self.remote.get()?;
        remote.overlap(query).await.map(Arc::new)
    }

    /// Both steps for a host holding the whole request (the gRPC API).
    pub async fn attach_remote_overlap(&self, request: &mut SelectionRequest) {
        if let Some(query) = self.remote_query(request) {
            request.remote_overlap = self.fetch_remote_overlap(query).await;
        }
    }
}

//! `--shared-state` as the selection core sees it: the [`SharedHooks`] a replica-sharing backend
//! implements (the `shared` module, on Redis) and the steps of a pick that use it: the session's
//! local binding before the pick, the one bounded lookup of a session this replica has no
//! binding for, and publishing the pick's binding after it (the same step on every path: booked
//! now, released from the queue, released before its waiter listened).
//!
//! This module owns the seam so that `selection` never imports `shared` (`shared` imports
//! `selection`, never the other way; `tests/docs/layering.rs` keeps it so). It must not talk to
//! Redis, decide a pick, or block one on anything but [`SelectionCore::prefetch_session`].

use std::sync::Arc;

use futures::future::BoxFuture;

use super::{now, PartitionKey, RankKey, Selection, SelectionCore, SelectionRequest};

/// What the selection core needs from the state shared with the other replicas.
pub trait SharedHooks: Send + Sync {
    /// Whether the shared state answers (a lookup is skipped while it does not).
    fn is_up(&self) -> bool;
    /// A lookup was skipped because the shared state is down (counted).
    fn lookup_skipped_down(&self);
    /// The binding another replica made for the session, if the shared state answers in time.
    fn lookup<'a>(&'a self, job: &'a SessionLookupJob) -> BoxFuture<'a, Option<RankKey>>;
    /// Publishes a pick's session binding; `before` is the session's local binding before the
    /// pick. Never blocks.
    fn after_pick(&self, selection: &Selection, session_id: &str, before: Option<RankKey>);
}

/// A session this replica has no binding for, to look up before its pick.
#[derive(Debug, Clone)]
pub struct SessionLookupJob {
    pub partition: PartitionKey,
    pub session_id: String,
    /// A child session's parent, looked up too when it has no binding here either, so the
    /// child's first pick can prefer the parent's rank bound by another replica.
    pub parent_session_id: Option<String>,
}

/// `--shared-state`: a session's local binding before its pick, so the pick can be published
/// to the other replicas once it is made (now, or when the request is released).
#[derive(Debug, Clone)]
pub(super) struct SessionBefore {
    session_id: String,
    before: Option<RankKey>,
}

impl SelectionCore {
    /// Shares sessions and load with the other replicas from now on (once; `--shared-state`).
    pub fn attach_shared<S: SharedHooks + 'static>(&self, shared: Arc<S>) {
        let _ = self.shared.set(shared);
    }

    pub fn shared(&self) -> Option<&Arc<dyn SharedHooks>> {
        self.shared.get()
    }

    /// With shared state: the session's partition and its local binding before a pick (`None`
    /// inside when it has none here). `None` without shared state or a partition for the model.
    fn local_binding(
        &self,
        model: Option<&str>,
        group: &str,
        sid: &str,
    ) -> Option<(PartitionKey, Option<RankKey>)> {
        self.shared.get()?;
        let (partition, bound, facts) = self.core.session_binding(model, group, sid, now())?;
        self.record(facts);
        Some((partition, bound))
    }

    /// With shared state: the lookup a request of a session this replica has no binding for
    /// needs before its pick (none while the shared state is down: the pick goes on local state).
    pub fn session_lookup(
        &self,
        model: Option<&str>,
        routing_group: &str,
        session_id: Option<&str>,
    ) -> Option<SessionLookupJob> {
        let sid = session_id?;
        let (partition, bound) = self.local_binding(model, routing_group, sid)?;
        if bound.is_some() {
            return None;
        }
        let shared = self.shared.get()?;
        if !shared.is_up() {
            shared.lookup_skipped_down();
            return None;
        }
        Some(SessionLookupJob {
            partition,
            session_id: sid.to_string(),
            parent_session_id: None,
        })
    }

    /// [`SelectionCore::session_lookup`] for a child session: its parent is looked up too when
    /// this replica has no binding for it either.
    pub fn session_tree_lookup(
        &self,
        model: Option<&str>,
        routing_group: &str,
        session_id: Option<&str>,
        parent_session_id: Option<&str>,
    ) -> Option<SessionLookupJob> {
        let mut job = self.session_lookup(model, routing_group, session_id)?;
        if let Some(parent) = parent_session_id.filter(|p| *p != job.session_id) {
            let unbound = self
                .local_binding(model, routing_group, parent)
                .is_some_and(|(_, bound)| bound.is_none());
            job.parent_session_id = unbound.then(|| parent.to_string());
        }
        Some(job)
    }

    /// Runs a [`SelectionCore::session_lookup`] job: a binding another replica made is installed
    /// here, so the pick follows it. Bounded by `--shared-state-timeout-ms`; never fails.
    pub async fn prefetch_session(&self, job: SessionLookupJob) {
        let Some(shared) = self.shared.get() else {
            return;
        };
        let parent = job
            .parent_session_id
            .as_ref()
            .map(|parent| SessionLookupJob {
                partition: job.partition.clone(),
                session_id: parent.clone(),
                parent_session_id: None,
            });
        let parent_lookup = async {
            match &parent {
                Some(p) => shared.lookup(p).await.map(|rank| (p, rank)),
                None => None,
            }
        };
        // Both at once: the wait stays one lookup's.
        let (own, parent) = futures::join!(shared.lookup(&job), parent_lookup);
        if let Some(rank) = own {
            self.install_session_binding(&job.partition, &job.session_id, rank);
        } else if let Some((p, rank)) = parent {
            self.install_session_binding(&p.partition, &p.session_id, rank);
        }
    }

    /// The request's session binding before the pick; `None` without shared state, a session
    /// id or a partition for the model.
    pub(super) fn session_before(&self, request: &SelectionRequest) -> Option<SessionBefore> {
        let sid = request.session_id.as_deref()?;
        let (_, before) =
            self.local_binding(request.model.as_deref(), &request.routing_group, sid)?;
        Some(SessionBefore {
            session_id: sid.to_string(),
            before,
        })
    }

    /// Publishes a pick's session binding to the other replicas: the one after-pick step of
    /// every path (booked now, released from the queue, released before its waiter listened).
    pub(super) fn after_pick(&self, selection: &Selection, session: Option<&SessionBefore>) {
        if let (Some(shared), Some(s)) = (self.shared.get(), session) {
            shared.after_pick(selection, &s.session_id, s.before);
        }
    }
}

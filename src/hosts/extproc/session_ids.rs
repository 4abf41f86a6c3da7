//! Which request headers name a request's session, its parent session and its end
//! (docs/sessions.md, "Session headers"): the agents' own headers in a documented precedence,
//! resolved to the session id, parent session id and final flag the core keys on. Pure: it
//! reads header values the stream collected and decides nothing about routing.
//!
//! Dynamo's canonical headers come first; then, as Dynamo's frontend maps them
//! (`lib/llm/src/protocols/agents.rs`), each agent's own: Claude Code's session id with its
//! agent id (a subagent) and parent agent id, Codex's `session-id` (and `thread-id` with
//! `x-codex-parent-thread-id`), OpenCode's `x-session-id` with `x-parent-session-id`.

/// One header naming a session, with the headers that qualify it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionSource {
    /// The session id header (lower-case).
    pub session: String,
    /// A header naming an agent inside the session (Claude Code's `x-claude-code-agent-id`):
    /// present, the request belongs to the child session `<session>/<agent>`.
    pub agent: Option<String>,
    /// The parent session's header. With `agent`, it names the parent *agent* inside the same
    /// session (`<session>/<parent>`), and a child without it has the session itself as parent.
    pub parent: Option<String>,
}

/// The session headers kvpick reads, in precedence order (`--session-headers`,
/// `--session-parent-headers`, `--session-agent-headers`, `--session-final-headers`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionHeaders {
    pub sources: Vec<SessionSource>,
    /// Headers whose value `true` (also `1`, `yes`, `on`) marks the session's last request.
    pub final_headers: Vec<String>,
}

/// Session ids in precedence order: Dynamo, Claude Code, Codex (`session-id`, then
/// `thread-id`), OpenCode.
pub const DEFAULT_SESSION_HEADERS: [&str; 5] = [
    "x-dynamo-session-id",
    "x-claude-code-session-id",
    "session-id",
    "thread-id",
    "x-session-id",
];

/// `SESSION=PARENT`: the parent session header of each session header.
pub const DEFAULT_PARENT_HEADERS: [&str; 4] = [
    "x-dynamo-session-id=x-dynamo-parent-session-id",
    "x-claude-code-session-id=x-claude-code-parent-agent-id",
    "thread-id=x-codex-parent-thread-id",
    "x-session-id=x-parent-session-id",
];

/// `SESSION=AGENT`: the header naming an agent (a child session) inside a session.
pub const DEFAULT_AGENT_HEADERS: [&str; 1] = ["x-claude-code-session-id=x-claude-code-agent-id"];

pub const DEFAULT_FINAL_HEADERS: [&str; 1] = ["x-dynamo-session-final"];

/// What a request's headers say of its session.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SessionIds {
    pub session: Option<String>,
    pub parent: Option<String>,
    pub last: bool,
}

impl Default for SessionHeaders {
    fn default() -> Self {
        SessionHeaders::from_lists(
            &DEFAULT_SESSION_HEADERS.map(String::from),
            &DEFAULT_PARENT_HEADERS.map(String::from),
            &DEFAULT_AGENT_HEADERS.map(String::from),
            &DEFAULT_FINAL_HEADERS.map(String::from),
        )
        .unwrap_or_else(|_| SessionHeaders {
            sources: Vec::new(),
            final_headers: Vec::new(),
        })
    }
}

fn normalize(h: &str) -> String {
    h.trim().to_ascii_lowercase()
}

/// `SESSION=OTHER` pairs, each naming a header of `sessions`.
fn pairs(
    flag: &str,
    entries: &[String],
    sessions: &[String],
) -> Result<Vec<(String, String)>, String> {
    let mut out: Vec<(String, String)> = Vec::new();
    for entry in entries.iter().map(|e| e.trim()).filter(|e| !e.is_empty()) {
        let Some((session, other)) = entry.split_once('=') else {
            return Err(format!("{flag}: `{entry}` is not SESSION_HEADER=HEADER"));
        };
        let (session, other) = (normalize(session), normalize(other));
        if other.is_empty() || !sessions.contains(&session) {
            return Err(format!(
                "{flag}: `{entry}` must pair a header of --session-headers with another header"
            ));
        }
        if out.iter().any(|(s, _)| *s == session) {
            return Err(format!("{flag}: `{session}` is paired twice"));
        }
        out.push((session, other));
    }
    Ok(out)
}

impl SessionHeaders {
    /// From the flags' lists; an entry naming no session header, or a malformed pair, is an
    /// error naming the flag.
    pub fn from_lists(
        sessions: &[String],
        parents: &[String],
        agents: &[String],
        finals: &[String],
    ) -> Result<SessionHeaders, String> {
        let mut names: Vec<String> = Vec::new();
        for h in sessions
            .iter()
            .map(|h| normalize(h))
            .filter(|h| !h.is_empty())
        {
            if !names.contains(&h) {
                names.push(h);
            }
        }
        let parents = pairs("--session-parent-headers", parents, &names)?;
        let agents = pairs("--session-agent-headers", agents, &names)?;
        let find = |list: &[(String, String)], s: &str| {
            list.iter().find(|(k, _)| k == s).map(|(_, v)| v.clone())
        };
        let sources = names
            .iter()
            .map(|s| SessionSource {
                session: s.clone(),
                agent: find(&agents, s),
                parent: find(&parents, s),
            })
            .collect();
        let final_headers = finals
            .iter()
            .map(|h| normalize(h))
            .filter(|h| !h.is_empty())
            .collect();
        Ok(SessionHeaders {
            sources,
            final_headers,
        })
    }

    /// Whether the stream must keep this header's value for [`SessionHeaders::resolve`] (and
    /// bound its length like a session id's).
    pub fn names_session(&self, name: &str) -> bool {
        self.sources.iter().any(|s| {
            s.session == name
                || s.agent.as_deref() == Some(name)
                || s.parent.as_deref() == Some(name)
        })
    }

    pub fn is_final_header(&self, name: &str) -> bool {
        self.final_headers.iter().any(|h| h == name)
    }

    /// The session, parent and final flag from the collected `(name, value)` headers (names
    /// lower-case; the first value of a repeated header counts; blank values are absent). The
    /// first session header present decides: its agent header makes it a child session, its
    /// parent header names the parent (a parent equal to the session itself is none).
    pub fn resolve(&self, headers: &[(String, String)]) -> SessionIds {
        let get = |name: &str| {
            headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.trim())
                .filter(|v| !v.is_empty())
        };
        let last = self.final_headers.iter().any(|h| {
            get(h).is_some_and(|v| {
                ["true", "1", "yes", "on"]
                    .iter()
                    .any(|t| v.eq_ignore_ascii_case(t))
            })
        });
        let Some((source, root)) = self
            .sources
            .iter()
            .find_map(|s| get(&s.session).map(|v| (s, v)))
        else {
            return SessionIds {
                last,
                ..SessionIds::default()
            };
        };
        let parent = source.parent.as_deref().and_then(get);
        let agent = source.agent.as_deref().and_then(get);
        let (session, parent) = match agent {
            // A subagent: keyed inside its session; its parent is the parent agent, else the
            // session's main thread.
            Some(agent) => (
                format!("{root}/{agent}"),
                Some(parent.map_or_else(|| root.to_string(), |p| format!("{root}/{p}"))),
            ),
            // Without an agent id, a parent *agent* header means nothing (Claude Code sends it
            // only with an agent id): only a plain parent session header counts.
            None if source.agent.is_some() => (root.to_string(), None),
            None => (root.to_string(), parent.map(str::to_string)),
        };
        let parent = parent.filter(|p| *p != session);
        SessionIds {
            session: Some(session),
            parent,
            last,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(pairs: &[(&str, &str)]) -> SessionIds {
        let headers: Vec<(String, String)> = pairs
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect();
        SessionHeaders::default().resolve(&headers)
    }

    fn ids(session: &str, parent: Option<&str>, last: bool) -> SessionIds {
        SessionIds {
            session: Some(session.into()),
            parent: parent.map(Into::into),
            last,
        }
    }

    /// The precedence table of docs/sessions.md, row by row.
    #[test]
    fn agent_headers_resolve_in_the_documented_precedence() {
        let all = [
            ("x-session-id", "oc"),
            ("thread-id", "th"),
            ("session-id", "cx"),
            ("x-claude-code-session-id", "cc"),
            ("x-dynamo-session-id", "dyn"),
        ];
        // Each header wins over every one after it in the table.
        for (i, expected) in ["dyn", "cc", "cx", "th", "oc"].iter().enumerate() {
            let present = &all[..all.len() - i];
            assert_eq!(resolve(present).session.as_deref(), Some(*expected), "{i}");
        }
        assert_eq!(resolve(&[]), SessionIds::default());
        // Blank values are absent.
        assert_eq!(
            resolve(&[("x-dynamo-session-id", "  "), ("x-session-id", "oc")]),
            ids("oc", None, false)
        );
    }

    #[test]
    fn parents_follow_the_header_that_named_the_session() {
        assert_eq!(
            resolve(&[
                ("x-dynamo-session-id", "child"),
                ("x-dynamo-parent-session-id", "root"),
                ("x-parent-session-id", "ignored"),
            ]),
            ids("child", Some("root"), false)
        );
        // OpenCode's parent pairs with OpenCode's session only.
        assert_eq!(
            resolve(&[("x-session-id", "ses_b"), ("x-parent-session-id", "ses_a")]),
            ids("ses_b", Some("ses_a"), false)
        );
        assert_eq!(
            resolve(&[("session-id", "cx"), ("x-parent-session-id", "ses_a")]),
            ids("cx", None, false)
        );
        assert_eq!(
            resolve(&[("thread-id", "t2"), ("x-codex-parent-thread-id", "t1")]),
            ids("t2", Some("t1"), false)
        );
        // A parent naming the session itself is none.
        assert_eq!(
            resolve(&[
                ("x-dynamo-session-id", "s"),
                ("x-dynamo-parent-session-id", "s")
            ]),
            ids("s", None, false)
        );
    }

    #[test]
    fn claude_code_agents_are_child_sessions_of_their_session() {
        // The main thread: the session itself.
        assert_eq!(
            resolve(&[("x-claude-code-session-id", "S")]),
            ids("S", None, false)
        );
        // A subagent of the main thread.
        assert_eq!(
            resolve(&[
                ("x-claude-code-session-id", "S"),
                ("x-claude-code-agent-id", "a1"),
            ]),
            ids("S/a1", Some("S"), false)
        );
        // A subagent of a subagent.
        assert_eq!(
            resolve(&[
                ("x-claude-code-session-id", "S"),
                ("x-claude-code-agent-id", "a2"),
                ("x-claude-code-parent-agent-id", "a1"),
            ]),
            ids("S/a2", Some("S/a1"), false)
        );
        // A parent agent id alone says nothing.
        assert_eq!(
            resolve(&[
                ("x-claude-code-session-id", "S"),
                ("x-claude-code-parent-agent-id", "a1"),
            ]),
            ids("S", None, false)
        );
    }

    #[test]
    fn final_is_true_only_for_true_like_values_whatever_named_the_session() {
        for (value, last) in [
            ("true", true),
            ("TRUE", true),
            ("1", true),
            ("false", false),
            ("", false),
            ("nope", false),
        ] {
            assert_eq!(
                resolve(&[("x-session-id", "s"), ("x-dynamo-session-final", value)]).last,
                last,
                "{value:?}"
            );
        }
    }

    #[test]
    fn flags_are_checked_and_configure_the_lists() {
        let l = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let h =
            SessionHeaders::from_lists(&l(&["X-A", "x-b"]), &l(&["x-b=x-pb"]), &[], &l(&["x-end"]))
                .unwrap();
        assert_eq!(
            h.resolve(&[
                ("x-b".into(), "b".into()),
                ("x-pb".into(), "p".into()),
                ("x-end".into(), "yes".into()),
                ("x-dynamo-session-id".into(), "not listed".into()),
            ]),
            ids("b", Some("p"), true)
        );
        assert!(h.names_session("x-pb") && h.names_session("x-a") && !h.names_session("x-end"));
        for bad in [
            &["x-c=x-pc"][..],
            &["x-a"],
            &["x-a=x-p", "x-a=x-q"],
            &["x-a="],
        ] {
            let err = SessionHeaders::from_lists(&l(&["x-a"]), &l(bad), &[], &[]).unwrap_err();
            assert!(err.contains("--session-parent-headers"), "{err}");
        }
        // Empty lists switch parents, agents and finals off.
        let plain = SessionHeaders::from_lists(&l(&["x-a"]), &[], &[], &[]).unwrap();
        assert_eq!(
            plain.resolve(&[
                ("x-a".into(), "a".into()),
                ("x-dynamo-session-final".into(), "true".into())
            ]),
            ids("a", None, false)
        );
    }
}

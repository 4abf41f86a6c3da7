//! The hosts: they only translate a protocol into the selection core's calls and back.
//! [`extproc`] serves Envoy's ext_proc stream (headers, body, routing headers, the response
//! phase); [`api`] serves the gRPC selection API. Neither decides anything: the pick is
//! `crate::selection`'s.

pub mod api;
pub mod extproc;

//! The bytes on the wire and what they may cost: [`net`] (listeners, connection limits),
//! [`tls`], [`h2_authority`] (the HTTP/2 front that bounds frames, floods and buffered bytes),
//! [`lanes`], [`health`] (gRPC health) and [`memory_account`] (the bytes clients make kvpick
//! hold, against one limit). No routing logic lives here.

pub mod h2_authority;
pub mod health;
pub mod lanes;
pub mod memory_account;
pub mod net;
pub mod tls;

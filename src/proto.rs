//! Generated code for the project's own protos (`proto/kvpick/v1`): the gRPC selection API's
//! messages and service, as `build.rs` compiles them. A leaf every host may read: it holds no
//! logic and must not be edited by hand (change the `.proto` and rebuild).

#![allow(clippy::all)]

tonic::include_proto!("kvpick.v1");

//! Compiles the project's own protos (`proto/`) with a pure-Rust protobuf compiler (protox), so no
//! system `protoc` is needed. Envoy's protos come precompiled from the `envoy-types` crate.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile(["kvpick/v1/selection.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}

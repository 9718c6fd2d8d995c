//! Compiles `proto/stanch/v1` into Rust (messages, the gRPC client and server) with a
//! protobuf compiler written in Rust, so no `protoc` is needed to build; and writes the
//! encoded descriptors that the controller's reflection service serves.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let files = [root.join("stanch/v1/watch.proto")];
    println!("cargo:rerun-if-changed={}", root.display());
    let descriptors = protox::compile(&files, [&root])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out.join("stanch.v1.descriptors.bin"),
        prost::Message::encode_to_vec(&descriptors),
    )?;
    tonic_prost_build::configure()
        .build_transport(false)
        .compile_fds(descriptors)?;
    Ok(())
}

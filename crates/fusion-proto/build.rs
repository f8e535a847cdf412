//! Generates the protocol types and the control plane's gRPC service. protoc comes from the
//! `protoc-bin-vendored` crate, so a fresh machine builds without installing anything.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    std::env::set_var("PROTOC", protoc);
    let protos = [
        "../../proto/fusionllm.proto",
        "../../proto/fusionllm_control.proto",
    ];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    // `bytes` fields as `Bytes`, so decoding a chunk frame references the read buffer instead of
    // copying the payload.
    tonic_prost_build::configure()
        .bytes(".")
        .compile_protos(&protos, &["../../proto"])?;
    Ok(())
}

//! Generates the protocol types. protoc comes from the `protoc-bin-vendored` crate, so a fresh
//! machine builds without installing anything.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    std::env::set_var("PROTOC", protoc);
    let proto = "../../proto/fusionllm.proto";
    println!("cargo:rerun-if-changed={proto}");
    // `bytes` fields as `Bytes`, so decoding a chunk frame references the read buffer instead of
    // copying the payload.
    prost_build::Config::new()
        .bytes(["."])
        .compile_protos(&[proto], &["../../proto"])?;
    Ok(())
}

//! What each fuzz target checks. Every function takes arbitrary bytes, feeds them to one decoder
//! of outside bytes, and panics only when a property fails, returning whether the decoder accepted the input (a decoder that accepts what it should
//! refuse, answers inconsistently, or panics itself). The cargo-fuzz targets in `fuzz/` call these;
//! `tests/corpus.rs` replays the kept corpus and every crash found through them under `cargo test`.

mod inputs;
mod targets;

pub use inputs::{seeds, TARGETS};
pub use targets::{
    assignment, checkpoint, compressed_tensor, graph_json, hf_model, job_toml, model_file,
    rendezvous_preamble, run_report, shard_manifest, tensor_stream, testbed_toml,
};

/// Runs target `name` on `data`: whether its decoder accepted the input, None when there is no
/// such target.
pub fn run(name: &str, data: &[u8]) -> Option<bool> {
    let f: fn(&[u8]) -> bool = match name {
        "compressed_tensor" => compressed_tensor,
        "tensor_stream" => tensor_stream,
        "graph_json" => graph_json,
        "assignment" => assignment,
        "job_toml" => job_toml,
        "testbed_toml" => testbed_toml,
        "checkpoint" => checkpoint,
        "model_file" => model_file,
        "hf_model" => hf_model,
        "shard_manifest" => shard_manifest,
        "run_report" => run_report,
        "rendezvous_preamble" => rendezvous_preamble,
        _ => return None,
    };
    Some(f(data))
}

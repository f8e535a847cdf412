//! Training on one process: the loop that later issues distribute.
//!
//! On a backend whose tensors live in host memory (the CPU), parameters and optimizer state are
//! `f32` master copies on the host; each step lends the parameters to the backend, runs forward
//! and backward over every micro-batch, sums the gradients, clips them, and applies a fused
//! optimizer update on the host. On a GPU they stay on the device between steps (`resident.rs`)
//! and come to the host for checkpoints and at the end of a run. Checkpoints hold the same
//! `f32` state either way, independent of the backend.

mod checkpoint;
mod config;
mod error;
mod islands;
mod optim;
mod outer;
mod report;
mod resident;
mod scaler;
mod schedule;
mod shard;
mod shares;
mod tensor_file;
mod trainer;
mod weights;

pub use checkpoint::{
    island_layout, island_moment_prefix, latest_checkpoint, latest_run_id,
    layout as checkpoint_layout, load as load_checkpoint, model_signature,
    newest_valid as newest_valid_checkpoint, outer_layout, read_state as read_checkpoint_state,
    resolve as resolve_checkpoint, save as save_checkpoint,
    save_from_file as save_checkpoint_from_file, step_dirs, verify as verify_checkpoint,
    CheckpointState, CheckpointWeights, Snapshot, CHECKPOINT_FORMAT, CHECKPOINT_VERSION,
    OUTER_MOMENTUM_PREFIX, TENSORS as CHECKPOINT_TENSORS,
};
pub use config::{
    default_peak_lr, OptimizerConfig, OptimizerPlacement, Recompute, ScheduleConfig,
    ShardOptimizer, TrainConfig,
};
pub use error::{Result, TrainError};
pub use islands::IslandTrainer;
pub use optim::{clip_global_norm, square_sum, OptimizerState};
pub use outer::{
    carry_onto, decode_pseudo_gradient, fragment_due, fragment_of, round_delta, weighted_mean,
    IslandRecovery, OuterConfig, OuterOptimizer, PseudoGradientEncoder,
};
pub use report::{peak_rss_bytes, EvalRecord, OuterReport, Report, StepRecord};
pub use scaler::{unscale as unscale_gradients, LossScaler, Verdict};
pub use schedule::learning_rate;
pub use shard::{
    merge as merge_shards, valid_name as valid_shard_name, write_shard, ShardCopy, ShardEntry,
    ShardManifest, ShardState, MANIFEST as SHARD_MANIFEST,
    MANIFEST_FORMAT as SHARD_MANIFEST_FORMAT, MANIFEST_VERSION as SHARD_MANIFEST_VERSION,
};
pub use shares::{
    join as join_shares, rebalance as rebalance_shares, Shares, MAX_SHARE_FACTOR,
    REBALANCE_AFTER_STEPS,
};
pub use tensor_file::{
    link_or_copy, read_header as read_safetensors_header, sha256_file, TensorEntry, TensorFile,
};
pub use trainer::{adapt_model, decay_mask, Trainer};
pub use weights::{load_all as load_all_weights, load_checked as load_weight, WeightSource};

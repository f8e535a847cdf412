//! The wire protocol shared by every fusionllm implementation: the data plane's frames
//! (`proto/fusionllm.proto`) and the control plane's gRPC service (`proto/fusionllm_control.proto`).

#![allow(clippy::doc_lazy_continuation, clippy::large_enum_variant)]

/// Version 1 of the protocol.
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/fusionllm.v1.rs"));
}

/// The protocol version this build speaks (2: progress in heartbeats, failures attributed to a
/// peer, numbered tensor streams that survive a re-opened session; peers of version 1 would
/// leave `seq` at 0 and lose tensors, so they are refused. 3: data-plane certificates pinned to
/// the ones the broker admitted; a version-2 broker sends no pins and its nodes could not talk.
/// 4: `SaveShard` is answered by `ShardCaptured` before the shard is written; a version-3 node
/// would never send it and the broker would wait for it forever. 5: islands, `RunStep` mode
/// `OUTER_SYNC` and the `outer` section of the training config; a version-4 node would take the
/// synchronisation for a step and all-reduce its gradients every step. 6: `OUTER_SYNC` carries the
/// island's share. 7: `Assignment.keep_state` and `Assignment.islands`, for island-local
/// recovery; a version-6 node would report the parameters it was not sent as a failure. 8: f16
/// loss scaling. 9: islands snapshots keep the outer momentum and every island's moments,
/// `ParamPart::OUTER_MOMENTUM` and `SaveState {outer, moments_only}`; a version-8 node would
/// send values where only moments are asked for, no outer momentum, and refuse it on restore). 10: replicas may shard their optimizer state
/// (`shard_optimizer` in the training configuration): each then answers `SaveState` with its own
/// piece of the values and moments, and all-gathers the parameters after each update; a version-9 node
/// would ignore the setting and send whole parameters). 11: outer synchronisations travel as
/// `OUTER_EXCHANGE` pieces and may overlap the next inner steps (`RunStep.overlap`); a
/// version-10 node would send `ALL_REDUCE` pieces its peers refuse and block on every exchange.
/// 12: streaming islands synchronise one fragment of the parameters at a time
/// (`Assignment.fragments`, `RunStep.fragment`); a version-11 node would synchronise every
/// tensor, running rings its peers do not run.
pub const PROTOCOL_VERSION: u32 = 12;

pub use v1::*;

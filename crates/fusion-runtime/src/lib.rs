//! Distributed training across machines.
//!
//! A **broker** ([`run_broker`]) holds the job and serves the control plane (gRPC over mutual
//! TLS, `proto/fusionllm_control.proto`). **Compute nodes** ([`run_node`]) join it with the job's
//! token, each receives one pipeline stage (a subgraph of the OP-DAG cut by the [`Plan`]) with its
//! parameters and optimizer state, and connects directly to the peers it exchanges tensors with
//! over the data plane (length-prefixed frames over TLS, paced to an emulated link when a testbed
//! says so). For every step the broker feeds the data, each node runs forward and backward for
//! every micro-batch in the order of the pipeline schedule (GPipe or 1F1B), activations flow
//! downstream and gradients upstream to whichever stage produced or consumed them, and the broker
//! turns the nodes' gradient norms into one clipping factor before every node steps its own
//! optimizer. Heartbeats detect lost nodes; the broker then rolls back to the last checkpoint and
//! continues once a replacement has joined.

pub mod assignment;
mod broker;
mod dataplane;
mod error;
mod fetch;
mod hostile;
mod identity;
mod job;
mod listen;
mod mailbox;
mod node;
mod outgoing;
pub mod path;
mod plan;
mod probe;
mod progress;
mod pull;
pub mod rendezvous;
mod service;
mod session;
mod shards;
mod wire;
mod worker;

pub use broker::new_run_id;
pub use broker::{
    run_broker, BrokerConfig, BrokerEvent, ClusterOutcome, ClusterReport, JobSpec, LinkCodec,
    LinkProbe, LinkRecord, LinkStep, MeasuredLink, NodeStep, Scheduler, StagePlacement, StepDetail,
    StepTiming,
};
pub use error::{Result, RuntimeError};
pub use fusion_exec::{passes, Pass, Schedule};
pub use identity::{load_identity, save_identity};
pub use job::{open_dataset, parse_schedule, parse_scheduler, JobFile};
pub use node::{
    capabilities, run_node, BadResult, NodeConfig, TestHooks, MAX_CONTROL_MESSAGE, MAX_NODE_MESSAGE,
};
pub use plan::{assignment_from_cuts, Plan, Source};
pub use service::{canonical_node_id, TOKEN_METADATA};

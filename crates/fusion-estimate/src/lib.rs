//! The workload estimator. It answers the planner's three questions: how much work and memory
//! each operator is ([`Workload`]), how fast a device runs it ([`DeviceProfile`], from a published
//! device class or from a short profiling run of real operators on a node's backend), and how
//! many bytes cross any cut of the graph (every tensor produced before a fence and read after it,
//! skip connections included).

mod device;
mod error;
mod profile;
mod workload;

pub use device::{
    DeviceProfile, ProfileSource, ADAM_UPDATE_BYTES_PER_PARAM, CALIBRATION_RANGE,
    GPU_DENSE_EFFICIENCY, GPU_MEMORY_EFFICIENCY, MIN_ROOFLINE_RATIO,
};
pub use error::EstimateError;
pub use profile::{profile_backend, ProfileRun};
pub use workload::{
    OpKind, OpWorkload, SharedParam, TensorFlow, Workload, ADAM_STATE_BYTES_PER_PARAM,
};

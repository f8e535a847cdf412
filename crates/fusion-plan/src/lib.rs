//! Scheduling: where every operator runs. A [`Problem`] joins the estimator's workload with the
//! devices and links of a [`Network`]; a scheduler returns a [`Plan`] (fences in topological
//! order and the devices of each stage); one cost model ([`Problem::evaluate`]) judges every
//! scheduler the same way, and the discrete-event simulator ([`Problem::simulate`]) replays the
//! chosen plan step by step.

pub mod anneal;
mod baselines;
mod cluster;
mod error;
mod exchange;
mod explain;
mod file;
mod hierarchy;
mod network;
mod opfence;
mod optimal;
mod plan;
pub mod random;
mod refine;
mod sharding;

pub use baselines::{compute, dtfm, even};
pub use cluster::{cluster_by_bandwidth, device_sequence, order_clusters, Clustering};
pub use error::PlanError;
pub use exchange::{
    fragment_bands, fragment_seconds, parameterised_ops, round_seconds, sync_seconds,
};
pub use explain::explain;
pub use file::{PlanFile, PlanStage, Prediction as PlanPrediction, PLAN_FORMAT, PLAN_VERSION};
pub use hierarchy::{
    plan_hierarchy, simulate_hierarchy, sub_network, ConvergencePenalty, Hierarchy, Island,
    OuterCodec, OuterOptions, SimulatedHierarchy,
};
pub use network::Network;
pub use opfence::{opfence, OpFenceOptions, OpFenceResult};
pub use optimal::optimal;
pub use plan::{Evaluation, Plan, Problem, Resource};
pub use sharding::{
    plan_sharding_where_memory_binds, sharding_pays, sharding_verdict, ShardingChoice,
};

use serde::Serialize;

/// Every scheduler behind one interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Scheduler {
    OpFence,
    Even,
    Compute,
    Dtfm,
    Optimal,
}

impl Scheduler {
    pub const ALL: [Scheduler; 5] = [
        Scheduler::OpFence,
        Scheduler::Even,
        Scheduler::Compute,
        Scheduler::Dtfm,
        Scheduler::Optimal,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Scheduler::OpFence => "opfence",
            Scheduler::Even => "even",
            Scheduler::Compute => "compute",
            Scheduler::Dtfm => "dtfm",
            Scheduler::Optimal => "optimal",
        }
    }

    pub fn parse(s: &str) -> Result<Self, PlanError> {
        Self::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                PlanError::Invalid(format!(
                    "unknown scheduler '{s}' (known: opfence, even, compute, dtfm, optimal)"
                ))
            })
    }
}

/// Constraints and effort shared by the schedulers.
#[derive(Clone, Debug)]
pub struct PlanOptions {
    /// Exactly this many stages with every device busy (a broker's fixed set of nodes).
    pub stages: Option<usize>,
    /// Exactly this many data-parallel replicas.
    pub replicas: Option<usize>,
    pub opfence: OpFenceOptions,
    /// Evaluations the DT-FM-like search spends per replica count, and its seed.
    pub dtfm_budget: usize,
    pub seed: u64,
    /// Search nodes after which the exact search gives up.
    pub optimal_node_limit: u64,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            stages: None,
            replicas: None,
            opfence: OpFenceOptions::default(),
            dtfm_budget: 4000,
            seed: 7,
            optimal_node_limit: 50_000_000,
        }
    }
}

/// A scheduler's answer.
#[derive(Clone, Debug)]
pub struct Planned {
    pub scheduler: Scheduler,
    pub plan: Plan,
    pub evaluation: Evaluation,
    /// OP-Fence's device clusters, in pipeline order.
    pub clustering: Option<Clustering>,
}

/// Plans `p` with `scheduler`.
pub fn plan(p: &Problem, scheduler: Scheduler, o: &PlanOptions) -> Result<Planned, PlanError> {
    let fence = |replicas: Option<usize>| {
        let opts = OpFenceOptions {
            stages: o.stages,
            replicas,
            ..o.opfence.clone()
        };
        opfence(p, &opts)
    };
    let (plan, evaluation, clustering) = match scheduler {
        Scheduler::OpFence => {
            let r = fence(o.replicas)?;
            (r.plan, r.evaluation, Some(r.clustering))
        }
        Scheduler::Even => {
            let (pl, e) = even(p, o.stages)?;
            (pl, e, None)
        }
        Scheduler::Compute => {
            let (pl, e) = compute(p, o.stages)?;
            (pl, e, None)
        }
        Scheduler::Dtfm => {
            let (pl, e) = dtfm(p, o.stages, o.replicas, o.dtfm_budget, o.seed)?;
            (pl, e, None)
        }
        Scheduler::Optimal => {
            if o.replicas.is_some_and(|r| r != 1) || o.stages.is_some() {
                return Err(PlanError::TooLarge {
                    scheduler: "optimal",
                    why: "the exact search plans one replica with a free number of stages".into(),
                });
            }
            let start = fence(Some(1)).ok().map(|r| (r.plan, r.evaluation));
            let (pl, e) = optimal(p, start, o.optimal_node_limit)?;
            (pl, e, None)
        }
    };
    Ok(Planned {
        scheduler,
        plan,
        evaluation,
        clustering,
    })
}

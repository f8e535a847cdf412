//! The node distrusts the broker: an assignment is parsed and checked (its graph valid, its plan's
//! indices in range, its training configuration sane, its replica numbers consistent, its memory
//! within the node's own) before anything is allocated or indexed for it.

use crate::error::{Result, RuntimeError};
use crate::plan::Plan;
use crate::wire::schedule_from_wire;
use crate::worker::StageWorker;
use fusion_backend::Backend;
use fusion_exec::Schedule;
use fusion_graph::Graph;
use fusion_proto::Assignment;
use fusion_train::{ShardOptimizer, TrainConfig};

/// Most bytes of stage graph, plan or configuration JSON a node reads from an assignment.
pub const MAX_ASSIGNMENT_JSON: usize = 64 << 20;

/// Most operators a stage may have.
pub const MAX_STAGE_OPERATORS: usize = 1 << 20;

/// An assignment that passed every check: what the node builds its stage from.
#[derive(Debug)]
pub struct CheckedAssignment {
    pub stage: usize,
    pub graph: Graph,
    pub plan: Plan,
    pub train: TrainConfig,
    /// Global ids of the stage's parameters, in its graph's order.
    pub param_ids: Vec<usize>,
    pub schedule: Schedule,
    pub replica: usize,
    pub replicas: usize,
    /// Streaming islands: the fragment of each of the stage's parameters (empty: none).
    pub fragments: Vec<u32>,
}

/// Checks `a` against this node's `memory_limit` in bytes (0: no limit). Every refusal is a
/// protocol error that says what was wrong.
pub fn check_assignment(a: &Assignment, memory_limit: u64) -> Result<CheckedAssignment> {
    let proto = |m: String| RuntimeError::Protocol(m);
    for (what, json) in [
        ("stage graph", &a.stage_graph_json),
        ("plan", &a.plan_json),
        ("training configuration", &a.config_json),
    ] {
        if json.len() > MAX_ASSIGNMENT_JSON {
            return Err(proto(format!(
                "the {what} is {} bytes (at most {MAX_ASSIGNMENT_JSON})",
                json.len()
            )));
        }
    }
    let graph =
        Graph::from_json(&a.stage_graph_json).map_err(|e| proto(format!("stage graph: {e}")))?;
    if graph.nodes.len() > MAX_STAGE_OPERATORS {
        return Err(proto(format!(
            "a stage of {} operators (at most {MAX_STAGE_OPERATORS})",
            graph.nodes.len()
        )));
    }
    let plan: Plan = serde_json::from_str(&a.plan_json).map_err(|e| proto(format!("plan: {e}")))?;
    let train: TrainConfig = serde_json::from_str(&a.config_json)
        .map_err(|e| proto(format!("training configuration: {e}")))?;
    let stage = usize::try_from(a.stage).unwrap_or(usize::MAX);
    plan.check(stage)?;
    train
        .validate()
        .map_err(|e| proto(format!("training configuration: {e}")))?;
    let replicas = (a.replicas as usize).max(1);
    if train.shard_optimizer == ShardOptimizer::Auto {
        return Err(proto(
            "training configuration: shard_optimizer 'auto' is the broker's to resolve before it \
             assigns (a node is told on or off)"
                .into(),
        ));
    }
    let shards = match train.shard_optimizer.is_on() && !a.islands {
        true => replicas as u64,
        false => 1,
    };
    check_fits(&graph, shards, memory_limit)?;
    let param_ids = params_of(&plan, stage, &graph)?;
    let schedule = schedule_from_wire(a.schedule())?;
    let replica = a.replica as usize;
    if replica >= replicas || (replicas > 1 && a.ring.len() != replicas) {
        return Err(proto(format!(
            "replica {replica} of {replicas} with a ring of {} nodes",
            a.ring.len()
        )));
    }
    let fragments = check_fragments(a, &train, param_ids.len())?;
    Ok(CheckedAssignment {
        stage,
        graph,
        plan,
        train,
        param_ids,
        schedule,
        replica,
        replicas,
        fragments,
    })
}

/// What building an assignment's stage gave (for the fuzz targets, which drive the whole path
/// from the broker's bytes to a stage worker without a network).
#[doc(hidden)]
#[derive(Debug)]
pub struct BuiltStage {
    pub stage: usize,
    pub params: usize,
    pub inbound: usize,
    pub peers: Vec<usize>,
}

/// Checks `a` and builds its stage worker on `backend`, as a node does before it connects.
#[doc(hidden)]
pub fn build_stage<B: Backend>(
    backend: &B,
    a: &Assignment,
    memory_limit: u64,
) -> Result<BuiltStage> {
    let c = check_assignment(a, memory_limit)?;
    let plan = std::sync::Arc::new(c.plan);
    let mut worker = StageWorker::new(
        backend.clone(),
        c.stage,
        plan.clone(),
        c.graph,
        c.param_ids,
        c.train,
        std::time::Duration::from_secs(1),
    )?;
    // As a node sets it up: its ring position and, for a streaming island, its fragments
    // (every ring set it may run is in the shapes it receives).
    worker.set_replica(c.replica, c.replicas, a.islands, "");
    worker.fragments = c.fragments;
    Ok(BuiltStage {
        stage: c.stage,
        params: worker.params.len(),
        inbound: worker.expected_inbound().len(),
        peers: plan.peers_of(c.stage),
    })
}

/// Stage 0 of `graph` cut in half by operator count, assigned as the broker would (GPipe, one
/// replica, the default training configuration): the honest input of the tests and fuzz targets.
#[doc(hidden)]
pub fn first_of_two(graph: &Graph) -> Result<Assignment> {
    let n = graph.nodes.len();
    let cut: Vec<usize> = (0..n).map(|i| usize::from(i >= n / 2)).collect();
    let (plan, stages) = Plan::new(graph, cut, vec!["node0".into(), "node1".into()])?;
    let json = |e: serde_json::Error| RuntimeError::Protocol(e.to_string());
    let stage = stages
        .first()
        .ok_or_else(|| RuntimeError::Protocol("the cut gave no stages".into()))?;
    Ok(Assignment {
        stage: 0,
        stage_graph_json: serde_json::to_string(&stage.graph).map_err(json)?,
        plan_json: serde_json::to_string(&plan).map_err(json)?,
        config_json: serde_json::to_string(&TrainConfig::default()).map_err(json)?,
        schedule: fusion_proto::PipelineSchedule::Gpipe as i32,
        replicas: 1,
        ..Default::default()
    })
}

/// The fragment of each of the stage's `params` parameters (`Assignment.fragments`), checked:
/// one each, below the job's fragment count, and only for the islands of a streaming job.
fn check_fragments(a: &Assignment, train: &TrainConfig, params: usize) -> Result<Vec<u32>> {
    if a.fragments.is_empty() {
        return Ok(Vec::new());
    }
    let count = train.outer.as_ref().map_or(1, |o| o.fragments);
    let refuse = |why: String| Err(RuntimeError::Protocol(format!("stage fragments: {why}")));
    if !a.islands || count < 2 {
        return refuse("sent for a stage that is not an island of a streaming job".into());
    }
    if a.fragments.len() != params {
        return refuse(format!("{} for {params} parameters", a.fragments.len()));
    }
    match a.fragments.iter().find(|&&f| f >= count) {
        Some(f) => refuse(format!("fragment {f} of a job of {count}")),
        None => Ok(a.fragments.clone()),
    }
}

/// Global parameter ids of the stage's parameters, checked against its graph: one per
/// parameter, each once.
fn params_of(plan: &Plan, stage: usize, graph: &Graph) -> Result<Vec<usize>> {
    let ids = plan.stage_params.get(stage).cloned().ok_or_else(|| {
        RuntimeError::Protocol(format!("the plan has no parameters for stage {stage}"))
    })?;
    if ids.len() != graph.params.len() {
        return Err(RuntimeError::Protocol(format!(
            "stage {stage}: {} parameter ids for {} parameters",
            ids.len(),
            graph.params.len()
        )));
    }
    let mut sorted = ids.clone();
    sorted.sort_unstable();
    if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
        return Err(RuntimeError::Protocol(format!(
            "stage {stage}: parameter id {} is given twice",
            w[0]
        )));
    }
    Ok(ids)
}

/// Bytes a stage needs at least: its parameters with their gradients and two optimizer moments
/// (16 bytes a value; with the moments sharded among `shards` replicas, 8 + 8 / shards) and
/// every tensor of its graph with its gradient (8 bytes a value), or None past 2^64.
pub fn stage_bytes(graph: &Graph, shards: u64) -> Option<u64> {
    let numel = |shape: &[usize]| shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d as u64));
    let params = graph
        .params
        .iter()
        .try_fold(0u64, |a, p| a.checked_add(numel(&p.shape)?))?;
    let tensors = graph
        .tensors
        .iter()
        .try_fold(0u64, |a, t| a.checked_add(numel(&t.shape)?))?;
    let moments = params.checked_mul(8)?.div_ceil(shards.max(1));
    params
        .checked_mul(8)?
        .checked_add(moments)?
        .checked_add(tensors.checked_mul(8)?)
}

/// Refuses a stage that cannot fit in `limit` bytes (0: no limit), before anything is allocated
/// for it.
fn check_fits(graph: &Graph, shards: u64, limit: u64) -> Result<()> {
    match stage_bytes(graph, shards) {
        Some(need) if limit == 0 || need <= limit => Ok(()),
        need => Err(RuntimeError::Protocol(format!(
            "the stage needs {} bytes for its parameters, optimizer state and activations; \
             this node has {limit}",
            need.map_or("more than 2^64".to_string(), |n| n.to_string())
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Stage 0 of gpt2-tiny cut in two, as the broker would assign it.
    fn assignment() -> Assignment {
        let graph = fusion_models::ModelSpec::preset("gpt2-tiny")
            .and_then(|m| m.graph(1, 8))
            .expect("graph");
        first_of_two(&graph).expect("assignment")
    }

    fn refusal(a: &Assignment, limit: u64) -> String {
        match check_assignment(a, limit) {
            Ok(_) => panic!("accepted"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn an_honest_assignment_passes() {
        let c = check_assignment(&assignment(), 0).expect("valid");
        assert_eq!((c.stage, c.replica, c.replicas), (0, 0, 1));
        assert_eq!(c.param_ids.len(), c.graph.params.len());
    }

    #[test]
    fn a_stage_larger_than_the_node_is_refused_before_allocation() {
        let a = assignment();
        let graph = Graph::from_json(&a.stage_graph_json).expect("graph");
        let need = stage_bytes(&graph, 1).expect("bytes");
        assert!(check_assignment(&a, need).is_ok());
        assert!(refusal(&a, need - 1).contains("needs"));
        // Two replicas sharding their moments need 4 bytes a parameter less.
        let params: u64 = graph.params.iter().map(|p| p.numel() as u64).sum();
        assert_eq!(stage_bytes(&graph, 2), Some(need - 4 * params));
        // A parameter of 2^40 x 2^40 values overflows nothing and is refused.
        let mut g = Graph::from_json(&a.stage_graph_json).expect("graph");
        g.params[0].shape = vec![1 << 40, 1 << 40];
        assert_eq!(stage_bytes(&g, 1), None);
    }

    #[test]
    fn an_unresolved_sharding_choice_is_refused() {
        let mut a = assignment();
        let cfg = TrainConfig {
            shard_optimizer: ShardOptimizer::Auto,
            ..TrainConfig::default()
        };
        a.config_json = serde_json::to_string(&cfg).expect("json");
        assert!(refusal(&a, 0).contains("shard_optimizer 'auto' is the broker's to resolve"));
    }

    /// An islands stage of a streaming job (3 fragments) as the broker assigns it: `fragments`
    /// gives each of its parameters' fragment.
    fn streaming(fragments: Vec<u32>) -> Assignment {
        let mut a = assignment();
        let cfg = TrainConfig {
            outer: Some(fusion_train::OuterConfig {
                fragments: 3,
                ..fusion_train::OuterConfig::averaging(6)
            }),
            ..TrainConfig::default()
        };
        a.config_json = serde_json::to_string(&cfg).expect("json");
        a.islands = true;
        a.fragments = fragments;
        a
    }

    #[test]
    fn stage_fragments_are_checked() {
        let n = check_assignment(&assignment(), 0)
            .expect("valid")
            .param_ids
            .len();
        let ok: Vec<u32> = (0..n).map(|i| (i * 3 / n) as u32).collect();
        let c = check_assignment(&streaming(ok.clone()), 0).expect("valid");
        assert_eq!(c.fragments, ok);
        assert!(refusal(&streaming(vec![0; n - 1]), 0).contains(&format!("{} for {n}", n - 1)));
        let mut high = ok.clone();
        high[0] = 3;
        assert!(refusal(&streaming(high), 0).contains("fragment 3 of a job of 3"));
        let mut not_island = streaming(ok.clone());
        not_island.islands = false;
        assert!(refusal(&not_island, 0).contains("not an island of a streaming job"));
        let mut whole = assignment();
        whole.fragments = ok;
        assert!(refusal(&whole, 0).contains("not an island of a streaming job"));
    }

    #[test]
    fn bad_plans_and_configurations_are_refused_with_the_reason() {
        let mut a = assignment();
        a.stage = 7;
        assert!(refusal(&a, 0).contains("stage 7"));
        let mut a = assignment();
        a.plan_json = a.plan_json.replacen("\"node1\"", "\"node1\",\"node2\"", 1);
        assert!(refusal(&a, 0).contains("3 nodes"));
        let mut a = assignment();
        a.stage_graph_json = "{".into();
        assert!(refusal(&a, 0).contains("stage graph"));
        let mut a = assignment();
        a.replica = 2;
        a.replicas = 2;
        assert!(refusal(&a, 0).contains("replica 2 of 2"));
        let mut a = assignment();
        let cfg = TrainConfig {
            micro_batches: 0,
            ..TrainConfig::default()
        };
        a.config_json = serde_json::to_string(&cfg).expect("json");
        assert!(refusal(&a, 0).contains("training configuration"));
        let mut a = assignment();
        a.plan_json = "x".repeat(MAX_ASSIGNMENT_JSON + 1);
        assert!(refusal(&a, 0).contains("bytes (at most"));
    }
}

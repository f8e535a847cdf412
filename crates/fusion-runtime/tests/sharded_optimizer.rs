//! Replicas that shard their optimizer state (ZeRO stage 1) over the real control and data
//! planes on loopback: each keeps 1/R of the moments, reduce-scatters the gradients and
//! all-gathers the parameters, and trains to the same bits as replicas that all-reduce.

mod common;

use common::*;
use fusion_models::ModelSpec;
use fusion_runtime::assignment::stage_bytes;
use fusion_runtime::{BrokerConfig, ClusterOutcome, JobSpec, Schedule};
use fusion_train::{ShardOptimizer, TensorFile, TrainConfig, CHECKPOINT_TENSORS};
use std::path::{Path, PathBuf};

/// gpt2-tiny as `stages` pipeline stages of `replicas` replicas each, under 1F1B.
fn replicated(train: TrainConfig, stages: usize, replicas: usize) -> JobSpec {
    JobSpec {
        nodes: stages * replicas,
        replicas,
        ..job(
            ModelSpec::preset("gpt2-tiny").expect("preset"),
            markov(),
            train,
            Schedule::OneFOneB,
        )
    }
}

/// AdamW without clipping: the sharded replicas sum the gradient norm chunk by chunk, which can
/// round its last bit otherwise than one sum does (and a clipped step with it).
fn config(steps: u64, checkpoints: Option<&Path>) -> TrainConfig {
    TrainConfig {
        clip_norm: None,
        checkpoint_dir: checkpoints.map(Path::to_path_buf),
        checkpoint_every: 2,
        eval_every: 3,
        ..lm_config(steps)
    }
}

fn sharded(cfg: &TrainConfig) -> TrainConfig {
    TrainConfig {
        shard_optimizer: ShardOptimizer::On,
        ..cfg.clone()
    }
}

fn assert_same_params(a: &ClusterOutcome, b: &ClusterOutcome, what: &str) {
    let (a, b) = (a.params().expect("params"), b.params().expect("params"));
    let differ = a.iter().zip(&b).position(|(a, b)| a != b);
    assert_eq!(differ, None, "{what}: parameter #{differ:?} differs");
}

fn eval_bits(o: &ClusterOutcome) -> Vec<u32> {
    o.report
        .report
        .evals
        .iter()
        .map(|e| e.loss.to_bits())
        .collect()
}

/// The checkpoint of step `step` under `dir`.
fn checkpoint(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!("step-{step:08}"))
}

/// Every tensor of a checkpoint (parameters and both AdamW moments), by name.
fn tensors(ckpt: &Path) -> Vec<(String, Vec<u32>)> {
    let file = TensorFile::open(&ckpt.join(CHECKPOINT_TENSORS)).expect("checkpoint tensors");
    let mut out: Vec<(String, Vec<u32>)> = (0..file.entries().len())
        .map(|i| {
            let name = file.entries()[i].name.clone();
            let values = file.read(i).expect("tensor");
            (name, values.iter().map(|x| x.to_bits()).collect())
        })
        .collect();
    out.sort();
    out
}

/// Two stages of two replicas (tied embeddings across the stages) and one stage of three
/// replicas (uneven chunks): sharded replicas report the same losses and evaluations and end
/// with the same parameters as replicas that all-reduce, bit for bit, and their checkpoints
/// (gathered piece by piece from every replica) hold the same values and moments.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sharded_replicas_train_bit_for_bit_as_replicas_that_all_reduce() {
    let pki = pki();
    for (stages, replicas) in [(2, 2), (1, 3)] {
        let (plain_dir, shard_dir) = (
            tempfile::tempdir().expect("tmp"),
            tempfile::tempdir().expect("tmp"),
        );
        let cfg = config(5, Some(plain_dir.path()));
        let nodes = vec![Kind::Reference; stages * replicas];
        let plain = run_cluster(&pki, replicated(cfg.clone(), stages, replicas), &nodes).await;
        let cfg = sharded(&config(5, Some(shard_dir.path())));
        let shard = run_cluster(&pki, replicated(cfg, stages, replicas), &nodes).await;
        let what = format!("{stages} stages x {replicas} replicas");
        assert_eq!(loss_bits(&shard), loss_bits(&plain), "{what}: losses");
        assert_eq!(eval_bits(&shard), eval_bits(&plain), "{what}: evaluations");
        for (a, b) in shard
            .report
            .report
            .steps
            .iter()
            .zip(&plain.report.report.steps)
        {
            let rel = ((a.grad_norm - b.grad_norm) / b.grad_norm).abs();
            assert!(
                rel < 1e-6,
                "{what}: step {} norm {} vs {}",
                a.step,
                a.grad_norm,
                b.grad_norm
            );
        }
        assert_same_params(&shard, &plain, &what);
        let (a, b) = (
            tensors(&checkpoint(shard_dir.path(), 4)),
            tensors(&checkpoint(plain_dir.path(), 4)),
        );
        let names: Vec<&str> = a.iter().map(|(n, _)| n.as_str()).collect();
        assert!(
            names.iter().any(|n| n.starts_with("opt.second.")),
            "{names:?}"
        );
        assert_eq!(a.len(), b.len(), "{what}: {names:?}");
        for ((na, va), (nb, vb)) in a.iter().zip(&b) {
            assert_eq!(na, nb);
            assert!(va == vb, "{what}: checkpoint tensor {na} differs");
        }
    }
}

/// A sharded run resumed from its step-4 checkpoint goes on as if never stopped: every
/// replica takes its piece of the gathered moments back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sharded_run_resumes_from_its_checkpoint_bit_for_bit() {
    let pki = pki();
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = sharded(&config(6, Some(dir.path())));
    let nodes = [Kind::Reference; 4];
    let whole = run_cluster(&pki, replicated(cfg.clone(), 2, 2), &nodes).await;
    let again = tempfile::tempdir().expect("tmp");
    let mut broker = BrokerConfig::new(TOKEN, pki.broker.clone());
    broker.resume = Some(checkpoint(dir.path(), 4));
    let resumed_cfg = sharded(&config(6, Some(again.path())));
    let resumed = run_cluster_configured(
        &pki,
        replicated(resumed_cfg, 2, 2),
        broker,
        &nodes,
        |_, _| {},
    )
    .await;
    let steps: Vec<u64> = resumed.report.report.steps.iter().map(|s| s.step).collect();
    assert_eq!(steps, [5, 6]);
    assert_eq!(loss_bits(&resumed), loss_bits(&whole)[4..]);
    assert_same_params(&resumed, &whole, "resumed");
}

/// Bytes of weights, gradients and moments the planner counts for `graph` (whole moments and
/// moments halved over two replicas), and its activation bytes.
fn planned_bytes(graph: &fusion_graph::Graph) -> (f64, f64, f64) {
    let w = fusion_estimate::Workload::of(graph, fusion_estimate::ADAM_STATE_BYTES_PER_PARAM)
        .expect("workload");
    let state: f64 = w
        .ops
        .iter()
        .map(|o| o.param_bytes + o.grad_bytes + o.optimizer_bytes)
        .sum();
    let moments: f64 = w.ops.iter().map(|o| o.optimizer_bytes).sum();
    let act: f64 = w.ops.iter().map(|o| o.activation_bytes).sum();
    (state, state - moments / 2.0, act)
}

/// `--shard-optimizer auto` on nodes whose memory holds the stage only with its moments
/// sharded: the broker's plan shards (and says why), and the run trains bit for bit as one
/// that asks for sharding; on roomy nodes the same job does not shard.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn auto_sharding_shards_where_memory_binds_and_trains_as_sharding_does() {
    let pki = pki();
    let auto = TrainConfig {
        shard_optimizer: ShardOptimizer::Auto,
        ..config(3, None)
    };
    // gpt2-tiny with the corpus's vocabulary, as the broker builds it.
    let model = ModelSpec::preset("gpt2-tiny").expect("preset");
    let model = fusion_train::adapt_model(model, markov().kind()).expect("model");
    let graph = model.graph(auto.batch_size, auto.seq_len).expect("graph");
    let (whole, halved, act) = planned_bytes(&graph);
    let node_sharded = stage_bytes(&graph, 2).expect("bytes") as f64;
    let limit = (halved + act).max(node_sharded).ceil();
    assert!(
        limit < whole && (stage_bytes(&graph, 1).expect("bytes") as f64) > limit,
        "whole moments must not fit in {limit} bytes ({whole} of state)"
    );
    let nodes = vec![Kind::Reference; 2];
    let tight = |_: usize, c: &mut fusion_runtime::NodeConfig| c.memory_limit = limit as u64;
    // OP-Fence places the stages (the helper's even split does not plan memory).
    let planned = |train: TrainConfig| JobSpec {
        scheduler: fusion_runtime::Scheduler::OpFence,
        ..replicated(train, 1, 2)
    };
    let got = run_cluster_with(&pki, planned(auto.clone()), &nodes, tight).await;
    let why = got.report.plan.join("\n");
    assert!(
        why.contains("replicas shard their optimizer state because memory binds")
            && why.contains("stage 0 shards its optimizer state over its 2 replicas"),
        "{why}"
    );
    let on = TrainConfig {
        shard_optimizer: ShardOptimizer::On,
        ..auto.clone()
    };
    let asked = run_cluster_with(&pki, planned(on), &nodes, tight).await;
    assert_eq!(loss_bits(&got), loss_bits(&asked), "losses");
    assert_same_params(&got, &asked, "auto against on");
    let roomy = run_cluster(&pki, planned(auto), &nodes).await;
    let why = roomy.report.plan.join("\n");
    assert!(!why.contains("shards its optimizer state"), "{why}");
}

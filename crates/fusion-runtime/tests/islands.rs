//! Islands on a cluster: every pipeline replica applies its own gradients and the replicas meet
//! at outer synchronisations, over the real control and data planes on loopback.

mod common;

use common::*;
use fusion_backend::ReferenceBackend;
use fusion_compress::Codec;
use fusion_models::ModelSpec;
use fusion_runtime::{BadResult, BrokerConfig, ClusterOutcome, JobSpec, NodeConfig, Schedule};
use fusion_train::{OuterConfig, Shares, TrainConfig};

/// One process over both islands' micro-batches of `cfg` (2 islands), without islands.
fn synchronous_over_both_islands(cfg: &TrainConfig) -> (fusion_train::Report, Vec<Vec<f32>>) {
    let single_cfg = TrainConfig {
        micro_batches: 2 * cfg.micro_batches,
        outer: None,
        ..cfg.clone()
    };
    let model = ModelSpec::preset("gpt2-tiny").expect("preset");
    single_process(ReferenceBackend, &model, markov(), &single_cfg)
}

/// Two islands of two stages, averaged after every step (outer SGD at rate 1 without momentum),
/// train as synchronous data parallelism does: as one process over both islands' micro-batches.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn islands_averaged_after_every_step_match_synchronous_data_parallelism() {
    let cfg = TrainConfig {
        clip_norm: None,
        // Equal shares, as the synchronous run reads: automatic ones follow the islands' measured
        // speed, which the other tests running beside this one can make unequal.
        outer: Some(OuterConfig {
            shares: Shares::Equal,
            ..OuterConfig::averaging(1)
        }),
        ..sgd_config(12)
    };
    let single = synchronous_over_both_islands(&cfg);
    let dist = run_cluster(&pki(), two_islands(cfg), &[Kind::Reference; 4]).await;
    // Each island is a pipeline on consecutive nodes.
    let layout: Vec<(usize, usize, &str)> = dist
        .report
        .placement
        .iter()
        .map(|p| (p.stage, p.replica, p.node.as_str()))
        .collect();
    assert_eq!(
        layout,
        [
            (0, 0, "node0"),
            (0, 1, "node2"),
            (1, 0, "node1"),
            (1, 1, "node3")
        ]
    );
    let outer = dist.report.report.outer.clone().expect("an islands report");
    assert_eq!((outer.islands, outer.syncs), (2, 12));
    assert!(outer.disagreements.is_empty(), "{:?}", outer.disagreements);
    assert_matches(&single, &dist, 1e-5);
}

/// Islands of unequal batch shares (4 and 2 micro-batches of a 6-micro-batch step), averaged
/// after every step with each island weighed by its share, still train as one process over
/// all the step's micro-batches: the weights make the mean of the islands' means the step's mean.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn islands_of_unequal_shares_match_synchronous_data_parallelism() {
    let cfg = TrainConfig {
        clip_norm: None,
        outer: Some(OuterConfig {
            shares: Shares::Fixed(vec![4, 2]),
            ..OuterConfig::averaging(1)
        }),
        ..sgd_config(8)
    };
    let single = synchronous_over_both_islands(&cfg);
    let dist = run_cluster(&pki(), two_islands(cfg), &[Kind::Reference; 4]).await;
    let outer = dist.report.report.outer.clone().expect("an islands report");
    assert_eq!((outer.syncs, outer.shares.as_slice()), (8, &[4, 2][..]));
    // The report's throughput counts every island's tokens (2 × 3 micro-batches per step).
    let r = &dist.report.report;
    let tokens = (r.steps.len() * r.config.batch_size * r.config.seq_len * 6) as f64;
    let counted = r.throughput * r.wall_s;
    assert!(
        (counted - tokens).abs() <= 1e-6 * tokens,
        "{counted} of {tokens}"
    );
    assert!(outer.rebalances.is_empty(), "{:?}", outer.rebalances);
    assert!(outer.disagreements.is_empty(), "{:?}", outer.disagreements);
    assert_matches(&single, &dist, 1e-5);
}

/// With automatic shares, an island whose second stage computes 2.5 times slower (a throttled
/// device; below the straggler threshold, so no re-plan) is measured and, at the one
/// synchronisation where the shares may move (after step 6 of 12: the last one is not), given
/// fewer micro-batches than the fast island (the median of 5 measured steps: one step of a
/// machine busy with the other tests does not decide it); the islands still agree bit for bit
/// and the run learns.
/// Two islands of `cfg` on the reference backend, the broker snapshotting every `snapshot_every`
/// steps (a snapshot takes every fragment and blocks), with `adjust` applied to node `i`.
async fn run_two_reference_islands(
    cfg: TrainConfig,
    snapshot_every: u64,
    adjust: impl Fn(usize, &mut NodeConfig),
) -> ClusterOutcome {
    let pki = pki();
    let mut broker = BrokerConfig::new(TOKEN, pki.broker.clone());
    broker.snapshots.every_steps = snapshot_every;
    run_cluster_configured(
        &pki,
        two_islands(cfg),
        broker,
        &[Kind::Reference; 4],
        adjust,
    )
    .await
}

/// The tests whose outcome follows the islands' measured speed take turns: run side by side,
/// each one's nodes slow the other's on this machine's cores (the full suite once read a 2.5x
/// slower island within 10% of the fast one's rate).
static MEASURED_RATES: std::sync::LazyLock<tokio::sync::Mutex<()>> =
    std::sync::LazyLock::new(|| tokio::sync::Mutex::new(()));

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slow_island_is_given_a_smaller_share() {
    let _turn = MEASURED_RATES.lock().await;
    let cfg = TrainConfig {
        outer: Some(OuterConfig::averaging(6)),
        eval_every: 6,
        ..lm_config(12)
    };
    let dist = run_cluster_with(&pki(), two_islands(cfg), &[Kind::Reference; 4], |i, c| {
        if i == 3 {
            c.test_hooks.slowdown_from_step = Some((0, 2.5));
        }
    })
    .await;
    let r = &dist.report;
    assert!(r.failures.is_empty(), "{:?}", r.failures);
    assert!(r.recoveries.is_empty(), "{:?}", r.recoveries);
    // Island 1 is node2 and node3.
    assert!(
        r.placement
            .iter()
            .any(|p| p.node == "node3" && p.replica == 1),
        "{:?}",
        r.placement
    );
    let outer = r.report.outer.clone().expect("an islands report");
    assert_eq!(outer.rebalances.len(), 1, "{:?}", outer.rebalances);
    assert!(
        outer.rebalances[0].starts_with("after step 6: island shares 3/3 -> "),
        "{:?}",
        outer.rebalances
    );
    assert_eq!(outer.shares.iter().sum::<usize>(), 6, "{:?}", outer.shares);
    assert!(outer.shares[0] > outer.shares[1], "{:?}", outer.rebalances);
    assert!(outer.disagreements.is_empty(), "{:?}", outer.disagreements);
    let (first, last) = (
        r.report.steps[0].loss,
        r.report.evals.last().expect("eval").loss,
    );
    assert!(last < first, "{first} -> {last}");
}

/// Islands that synchronise every 4 steps with int8 pseudo-gradients and DiLoCo's outer Nesterov
/// momentum learn, exchange between
/// islands only at the synchronisations, and send about a quarter of the dense bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn islands_synchronising_rarely_with_int8_learn_and_send_a_quarter() {
    let cfg = TrainConfig {
        // DiLoCo's outer Nesterov momentum, so the cluster runs that path too.
        outer: Some(OuterConfig {
            codec: Codec::Int8 { block: 256 },
            ..OuterConfig::diloco(4)
        }),
        eval_every: 4,
        ..lm_config(10)
    };
    let dist = run_cluster(&pki(), two_islands(cfg), &[Kind::Reference; 4]).await;
    let r = &dist.report.report;
    let outer = r.outer.clone().expect("an islands report");
    // Steps 4 and 8, and the last (10).
    assert_eq!(outer.syncs, 3);
    // Every island holds the same bits after each synchronisation (the broker compares each
    // stage's islands).
    assert!(outer.disagreements.is_empty(), "{:?}", outer.disagreements);
    assert!(
        dist.report.failures.is_empty(),
        "{:?}",
        dist.report.failures
    );
    let ratio = outer.sent_bytes as f64 / outer.dense_bytes as f64;
    assert!((0.2..0.35).contains(&ratio), "int8 sent {ratio} of dense");
    // Evaluations only of synchronised states.
    let evals: Vec<u64> = r.evals.iter().map(|e| e.step).collect();
    assert_eq!(evals, [4, 8, 10]);
    let (first, last) = (r.steps[0].loss, r.evals.last().expect("eval").loss);
    assert!(last < first, "{first} -> {last}");
    // Islands never exchange activations: node0/node1 and node2/node3 talk to each other only
    // as stages of one pipeline; across islands only stage peers (node0-node2, node1-node3).
    for l in &dist.report.links {
        let island = |n: &str| n == "node0" || n == "node1";
        if island(&l.from) != island(&l.to) {
            let stage = |n: &str| n == "node0" || n == "node2";
            assert_eq!(stage(&l.from), stage(&l.to), "{l:?}");
        }
    }
}

/// Top-k pseudo-gradients (10%, with error feedback, as SparseLoCo): a ring cannot add sparse
/// messages up on the way, so each island's message travels around whole and every node sums
/// them in island order. The islands agree bit for bit after every synchronisation, learn, and
/// send a fraction of the dense ring's bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn islands_with_top_k_pseudo_gradients_agree_learn_and_send_little() {
    let cfg = TrainConfig {
        outer: Some(OuterConfig {
            codec: Codec::TopK { density: 0.1 },
            ..OuterConfig::averaging(2)
        }),
        eval_every: 4,
        ..lm_config(8)
    };
    let dist = run_cluster(&pki(), two_islands(cfg), &[Kind::Reference; 4]).await;
    let r = &dist.report.report;
    assert!(
        dist.report.failures.is_empty(),
        "{:?}",
        dist.report.failures
    );
    let outer = r.outer.clone().expect("an islands report");
    assert_eq!(outer.syncs, 4);
    assert!(outer.disagreements.is_empty(), "{:?}", outer.disagreements);
    let ratio = outer.sent_bytes as f64 / outer.dense_bytes as f64;
    assert!((0.05..0.25).contains(&ratio), "top-k sent {ratio} of dense");
    let (first, last) = (r.steps[0].loss, r.evals.last().expect("eval").loss);
    assert!(last < first, "{first} -> {last}");
}

/// Top-k islands on the cluster compute what the one-process island trainer computes: 2 islands
/// × 2 stages, 30% top-k with error feedback, a synchronisation every 2 steps, against
/// `IslandTrainer` on the same data (the same selection, residuals and outer step; the
/// pipeline's sums differ from one process's only in the last bits). With a third of every
/// parameter left out of each message, a wrong sum, weight or residual would be far off.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn top_k_islands_match_the_one_process_island_trainer() {
    let cfg = TrainConfig {
        clip_norm: None,
        outer: Some(OuterConfig {
            codec: Codec::TopK { density: 0.3 },
            shares: Shares::Equal,
            ..OuterConfig::averaging(2)
        }),
        ..sgd_config(6)
    };
    let single = one_process_islands(&cfg, 2);
    let dist = run_cluster(&pki(), two_islands(cfg), &[Kind::Reference; 4]).await;
    let outer = dist.report.report.outer.clone().expect("an islands report");
    assert!(outer.disagreements.is_empty(), "{:?}", outer.disagreements);
    // Messages carry f16 values: a value the pipeline's last bits push across an f16 rounding
    // boundary moves by an f16 step (about 1e-3 of it) in the parameters, not in the losses.
    assert_matches_within(&single, &dist, 1e-4, 1e-3);
}

/// Islands that overlap their synchronisations compute on the cluster what the one-process
/// island trainer computes: 2 islands × 2 stages synchronising every 2 steps, each exchange
/// running on its own thread beside the next round and applied one round late, every island
/// keeping its own progress; the synchronisations before the evaluation and snapshot of step 4
/// and the last block, the others overlap. A round applied at the wrong time, or an island
/// moved onto the anchor without its own progress, would be far off.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn overlapping_islands_match_the_one_process_island_trainer() {
    let cfg = TrainConfig {
        clip_norm: None,
        eval_every: 4,
        outer: Some(OuterConfig {
            shares: Shares::Equal,
            overlap: true,
            ..OuterConfig::averaging(2)
        }),
        ..sgd_config(8)
    };
    let single = one_process_islands(&cfg, 2);
    assert_eq!(single.0.outer.as_ref().map(|o| o.overlapped), Some(2));
    // Snapshots with the evaluations, as the one-process trainer blocks for them only.
    let dist = run_two_reference_islands(cfg, 4, |_, _| {}).await;
    assert!(
        dist.report.failures.is_empty(),
        "{:?}",
        dist.report.failures
    );
    let outer = dist.report.report.outer.clone().expect("an islands report");
    // Steps 2 and 6 overlap; 4 (evaluated, snapshotted) and 8 (the last) block.
    assert_eq!((outer.syncs, outer.overlapped), (4, 2));
    // The anchors agree after every synchronisation, overlapped ones included.
    assert!(outer.disagreements.is_empty(), "{:?}", outer.disagreements);
    assert!(
        outer.sent_bytes >= outer.dense_bytes,
        "{} of {}",
        outer.sent_bytes,
        outer.dense_bytes
    );
    let evals: Vec<u64> = dist.report.report.evals.iter().map(|e| e.step).collect();
    assert_eq!(evals, [4, 8]);
    assert_matches(&single, &dist, 1e-5);
}

/// Streaming islands compute on the cluster what the one-process island trainer computes,
/// blocking and overlapped: 2 islands × 2 stages, the model cut into 2 fragments, one
/// synchronised after every step in turn (H = 2), each node running only the rings of its
/// stage's part of the fragment (edges of their own, so a stage whose part is empty sends
/// nothing); the synchronisations before the evaluation and snapshot of step 4 and the last
/// take every fragment. A fragment applied to the wrong tensors, or measured from the wrong
/// start, would be far off.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn streaming_islands_match_the_one_process_island_trainer() {
    for overlap in [false, true] {
        let cfg = TrainConfig {
            clip_norm: None,
            eval_every: 4,
            outer: Some(OuterConfig {
                shares: Shares::Equal,
                overlap,
                fragments: 2,
                ..OuterConfig::averaging(2)
            }),
            ..sgd_config(8)
        };
        let single = one_process_islands(&cfg, 2);
        let one = single.0.outer.clone().expect("an islands report");
        assert_eq!(one.partial, 6, "overlap {overlap}");
        let dist = run_two_reference_islands(cfg, 4, |_, _| {}).await;
        assert!(
            dist.report.failures.is_empty(),
            "{:?}",
            dist.report.failures
        );
        let outer = dist.report.report.outer.clone().expect("an islands report");
        let overlapped = if overlap { 6 } else { 0 };
        assert_eq!(
            (outer.syncs, outer.partial, outer.overlapped),
            (8, 6, overlapped),
            "overlap {overlap}"
        );
        assert!(outer.disagreements.is_empty(), "{:?}", outer.disagreements);
        // Six synchronisations of about half the model and two of all of it: about 5 of the
        // 8 models' worth of values (dense f32 over a ring of two) that whole ones move.
        let values: usize = single.1.iter().map(Vec::len).sum();
        let ratio = outer.dense_bytes as f64 / (8 * 8 * values) as f64;
        assert!(
            (0.5..0.75).contains(&ratio),
            "{ratio} of whole synchronisations"
        );
        // The one process encodes the same tensors: as many dense values in all.
        assert_eq!(outer.dense_bytes, one.dense_bytes, "overlap {overlap}");
        let evals: Vec<u64> = dist.report.report.evals.iter().map(|e| e.step).collect();
        assert_eq!(evals, [4, 8]);
        assert_matches(&single, &dist, 1e-5);
    }
}

/// Top-k pseudo-gradients overlapping the next round: each island's message goes around the
/// ring on the exchange's own thread, with the error-feedback encoder handed to it and back;
/// the islands' anchors agree after every synchronisation and the run learns.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn overlapping_top_k_islands_agree_and_learn() {
    let cfg = TrainConfig {
        outer: Some(OuterConfig {
            codec: Codec::TopK { density: 0.1 },
            overlap: true,
            ..OuterConfig::averaging(2)
        }),
        eval_every: 8,
        ..lm_config(8)
    };
    let dist = run_two_reference_islands(cfg, 8, |_, _| {}).await;
    assert!(
        dist.report.failures.is_empty(),
        "{:?}",
        dist.report.failures
    );
    let r = &dist.report.report;
    let outer = r.outer.clone().expect("an islands report");
    assert_eq!((outer.syncs, outer.overlapped), (4, 3));
    assert!(outer.disagreements.is_empty(), "{:?}", outer.disagreements);
    let ratio = outer.sent_bytes as f64 / outer.dense_bytes as f64;
    assert!((0.05..0.25).contains(&ratio), "top-k sent {ratio} of dense");
    let (first, last) = (r.steps[0].loss, r.evals.last().expect("eval").loss);
    assert!(last < first, "{first} -> {last}");
}

/// Three one-stage islands of a ResNet with batch norm and top-k pseudo-gradients: every
/// island's message goes around a ring of three (each node forwards the others'), batch-norm
/// statistics are averaged exactly beside the sparse parameters, and the islands hold the same
/// bits after every synchronisation.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_top_k_islands_with_batch_norm_agree() {
    let data: std::sync::Arc<dyn fusion_data::Dataset> =
        std::sync::Arc::new(fusion_data::SyntheticImages::new(8, 3, 0.3, 2));
    let cfg = TrainConfig {
        steps: 6,
        batch_size: 4,
        micro_batches: 2,
        eval_every: 3,
        eval_batches: Some(2),
        outer: Some(OuterConfig {
            codec: Codec::TopK { density: 0.2 },
            ..OuterConfig::averaging(3)
        }),
        ..TrainConfig::default()
    };
    let spec = JobSpec {
        precision: Default::default(),
        nodes: 3,
        replicas: 3,
        ..job(small_resnet(), data, cfg, Schedule::OneFOneB)
    };
    let dist = run_cluster(&pki(), spec, &[Kind::Reference; 3]).await;
    assert!(
        dist.report.failures.is_empty(),
        "{:?}",
        dist.report.failures
    );
    let outer = dist.report.report.outer.clone().expect("an islands report");
    assert_eq!((outer.islands, outer.syncs), (3, 2));
    assert!(outer.disagreements.is_empty(), "{:?}", outer.disagreements);
    // Every island's message reached both other islands: each node sent to its successor.
    let sent: Vec<(&str, &str)> = dist
        .report
        .links
        .iter()
        .map(|l| (l.from.as_str(), l.to.as_str()))
        .collect();
    for pair in [("node0", "node1"), ("node1", "node2"), ("node2", "node0")] {
        assert!(sent.contains(&pair), "{sent:?}");
    }
}

/// Random-k pseudo-gradients are refused on a cluster, by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn random_k_pseudo_gradients_on_a_cluster_are_refused() {
    let cfg = TrainConfig {
        outer: Some(OuterConfig {
            codec: Codec::RandomK { density: 0.1 },
            ..OuterConfig::default()
        }),
        ..lm_config(2)
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let broker = fusion_runtime::BrokerConfig::new(TOKEN, pki().broker.clone());
    let e = fusion_runtime::run_broker(two_islands(cfg), broker, listener, |_| {})
        .await
        .err()
        .expect("refused");
    assert!(e.to_string().contains("not random-k 10.00%"), "{e}");
}

/// Three one-node islands (DiLoCo's outer momentum, int8 pseudo-gradients); node2, island 2,
/// lies in its result of step 5 and is evicted. Its island alone is taken out: islands 0 and 1
/// keep their state (inner moments, the anchor, outer momentum) and go on from step 5 without a
/// rollback. Two nodes cannot form three islands again, so they finish the run as two, agreeing
/// bit for bit after every synchronisation. (Rolling every island back instead, the job could
/// not go on at all: three islands need three nodes.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_evicted_islands_node_takes_only_its_island_out_and_the_others_go_on() {
    let cfg = TrainConfig {
        outer: Some(OuterConfig {
            codec: Codec::Int8 { block: 256 },
            shares: Shares::Equal,
            ..OuterConfig::diloco(4)
        }),
        eval_every: 4,
        ..lm_config(12)
    };
    let job = JobSpec {
        precision: Default::default(),
        nodes: 3,
        replicas: 3,
        ..two_islands(cfg)
    };
    let pki = pki();
    let broker = BrokerConfig::new(TOKEN, pki.broker.clone());
    let (dist, ends) = run_cluster_ends(&pki, job, broker, &[Kind::Reference; 3], |i, c| {
        if i == 2 {
            c.test_hooks.bad_result_at_step = Some((5, BadResult::ExtraLoss));
        }
    })
    .await;
    assert!(ends[0].is_ok() && ends[1].is_ok(), "{ends:?}");
    let err = ends[2].as_ref().expect_err("the liar is stopped");
    assert!(err.to_string().contains("evicted"), "{err}");
    let r = &dist.report;
    assert_eq!(r.recoveries.len(), 1, "{:?}", r.recoveries);
    let rec = &r.recoveries[0];
    assert!(rec.evicted && rec.node == "node2", "{rec:?}");
    assert_eq!(rec.island_out, Some(2), "{rec:?}");
    assert_eq!(
        (
            rec.interrupted_at_step,
            rec.resumed_from_step,
            rec.steps_lost
        ),
        (5, 5, 0),
        "{rec:?}"
    );
    assert_eq!((rec.nodes_before, rec.nodes_after), (3, 2), "{rec:?}");
    // Every step ran once, in order: nothing was rolled back.
    let steps: Vec<u64> = r.report.steps.iter().map(|s| s.step).collect();
    assert_eq!(steps, (1..=12).collect::<Vec<u64>>());
    let outer = r.report.outer.clone().expect("an islands report");
    assert_eq!(outer.syncs, 3);
    assert!(outer.disagreements.is_empty(), "{:?}", outer.disagreements);
    let islands_at_end: std::collections::BTreeSet<usize> =
        r.placement.iter().map(|p| p.replica).collect();
    assert_eq!(islands_at_end.len(), 2, "{:?}", r.placement);
    let evals: Vec<u64> = r.report.evals.iter().map(|e| e.step).collect();
    assert_eq!(evals, [4, 8, 12]);
    let (first, last) = (
        r.report.steps[0].loss,
        r.report.evals.last().expect("eval").loss,
    );
    assert!(last < first, "{first} -> {last}");
}

/// An islands run resumed from its checkpoint goes on as if never stopped: the checkpoint keeps
/// the outer optimizer's momentum (DiLoCo's Nesterov 0.9) and every island's own AdamW moments
/// beside the synchronised parameters, so the resumed steps and final parameters equal the
/// uninterrupted run's bit for bit. (Equal shares and uncompressed pseudo-gradients: no
/// residuals, which a snapshot does not keep.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_islands_run_resumes_with_its_outer_momentum_and_moments_bit_for_bit() {
    let dir = tempfile::tempdir().expect("temp dir");
    let cfg = TrainConfig {
        outer: Some(OuterConfig {
            shares: Shares::Equal,
            ..OuterConfig::diloco(2)
        }),
        checkpoint_dir: Some(dir.path().to_path_buf()),
        checkpoint_every: 2,
        eval_every: 100,
        ..lm_config(6)
    };
    let pki = pki();
    let whole = run_cluster(&pki, two_islands(cfg.clone()), &[Kind::Reference; 4]).await;
    let step4 = std::fs::read_dir(dir.path())
        .expect("checkpoint directory")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.ends_with("step-00000004"))
        .expect("a checkpoint of step 4");
    let tensors = fusion_train::TensorFile::open(&step4.join(fusion_train::CHECKPOINT_TENSORS))
        .expect("checkpoint tensors");
    let names: Vec<&str> = tensors.entries().iter().map(|e| e.name.as_str()).collect();
    for prefix in [
        "outer.momentum.",
        "island1.opt.first.",
        "island1.opt.second.",
    ] {
        assert!(names.iter().any(|n| n.starts_with(prefix)), "{names:?}");
    }
    let again = tempfile::tempdir().expect("temp dir");
    let resumed_cfg = TrainConfig {
        checkpoint_dir: Some(again.path().to_path_buf()),
        ..cfg
    };
    let mut broker = BrokerConfig::new(TOKEN, pki.broker.clone());
    broker.resume = Some(step4);
    let resumed = run_cluster_configured(
        &pki,
        two_islands(resumed_cfg),
        broker,
        &[Kind::Reference; 4],
        |_, _| {},
    )
    .await;
    let steps: Vec<u64> = resumed.report.report.steps.iter().map(|s| s.step).collect();
    assert_eq!(steps, [5, 6]);
    assert_eq!(loss_bits(&resumed), loss_bits(&whole)[4..]);
    let (a, b) = (
        resumed.params().expect("params"),
        whole.params().expect("params"),
    );
    let differ = a.iter().zip(&b).position(|(a, b)| a != b);
    assert_eq!(
        differ, None,
        "parameter #{differ:?} differs after the resume"
    );
}

/// A streaming job checkpoints once per `checkpoint_every`: 2 fragments synchronised in turn
/// every 2 steps (H = 4), checkpoints every 4 steps over 8. The synchronisations of steps 4 and
/// 8 take the whole model (a checkpoint, the last step) and those of steps 2 and 6 one
/// fragment each. A checkpoint window as wide as H would make step 6's whole as well, and
/// checkpoint it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_streaming_job_checkpoints_once_per_interval() {
    let dir = tempfile::tempdir().expect("temp dir");
    let cfg = TrainConfig {
        clip_norm: None,
        outer: Some(OuterConfig {
            shares: Shares::Equal,
            fragments: 2,
            ..OuterConfig::averaging(4)
        }),
        checkpoint_dir: Some(dir.path().to_path_buf()),
        checkpoint_every: 4,
        eval_every: 100,
        ..sgd_config(8)
    };
    // No snapshot but the checkpoints' and the last.
    let dist = run_two_reference_islands(cfg, 100, |_, _| {}).await;
    let outer = dist.report.report.outer.clone().expect("an islands report");
    assert_eq!((outer.syncs, outer.partial), (4, 2), "{outer:?}");
    let mut saved: Vec<String> = std::fs::read_dir(dir.path())
        .expect("checkpoint directory")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| n.starts_with("step-"))
        .collect();
    saved.sort();
    assert_eq!(saved, ["step-00000004", "step-00000008"]);
}

/// Streaming with automatic shares: a slow island is given a smaller share only where every
/// fragment's round ends, a whole-model synchronisation, so that each fragment's round runs one
/// set of shares. H = 6 in 3 fragments over 18 steps, an evaluation after step 12: of the
/// synchronisations after steps 2, 4, .., 18 only 12's and 18's take the whole model (the last
/// one's shares would never run). Enough steps are measured long before step 12: moving shares
/// at one-fragment synchronisations too moves them after step 4 (and again after step 16).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_streaming_job_rebalances_only_at_whole_model_synchronisations() {
    let _turn = MEASURED_RATES.lock().await;
    let cfg = TrainConfig {
        outer: Some(OuterConfig {
            fragments: 3,
            ..OuterConfig::averaging(6)
        }),
        eval_every: 12,
        ..lm_config(18)
    };
    let dist = run_two_reference_islands(cfg, 100, |i, c| {
        if i == 3 {
            c.test_hooks.slowdown_from_step = Some((0, 2.5));
        }
    })
    .await;
    let r = &dist.report;
    assert!(r.failures.is_empty(), "{:?}", r.failures);
    let outer = r.report.outer.clone().expect("an islands report");
    assert_eq!((outer.syncs, outer.partial), (9, 7), "{outer:?}");
    assert_eq!(outer.rebalances.len(), 1, "{:?}", outer.rebalances);
    assert!(
        outer.rebalances[0].starts_with("after step 12: island shares 3/3 -> "),
        "{:?}",
        outer.rebalances
    );
    assert!(outer.shares[0] > outer.shares[1], "{:?}", outer.rebalances);
    assert!(outer.disagreements.is_empty(), "{:?}", outer.disagreements);
}

//! Islands synchronised by an outer optimizer: averaging after every step is synchronous data
//! parallelism; fewer synchronisations and compressed pseudo-gradients still learn.

use fusion_backend::{CandleBackend, ReferenceBackend};
use fusion_compress::Codec;
use fusion_data::{Dataset, MarkovCorpus, SyntheticImages};
use fusion_models::ModelSpec;
use fusion_train::{
    IslandTrainer, OptimizerConfig, OuterConfig, ScheduleConfig, Shares, TrainConfig, Trainer,
};
use std::sync::Arc;

fn sgd_config(steps: u64, micro_batches: usize) -> TrainConfig {
    TrainConfig {
        steps,
        batch_size: 2,
        seq_len: 8,
        micro_batches,
        optimizer: OptimizerConfig::Sgd {
            momentum: 0.9,
            weight_decay: 0.01,
        },
        schedule: ScheduleConfig {
            lr: 0.05,
            min_lr: 0.005,
            warmup_steps: 2,
        },
        clip_norm: None,
        eval_batches: Some(1),
        ..TrainConfig::default()
    }
}

fn markov() -> Arc<dyn Dataset> {
    Arc::new(MarkovCorpus::new(32, 4, 0.5, 9).expect("corpus"))
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs()))
        .fold(0.0, f32::max)
}

/// One synchronous trainer over 4 micro-batches per step, run for `steps` steps.
fn synchronous(steps: u64) -> (Trainer<ReferenceBackend>, fusion_train::Report) {
    let model = ModelSpec::preset("gpt2-tiny").expect("preset");
    let mut sync =
        Trainer::new(ReferenceBackend, model, markov(), sgd_config(steps, 4)).expect("trainer");
    let report = sync.run(|_, _| {}).expect("sync run");
    (sync, report)
}

/// Two islands of 2 micro-batches per step on average, run for `steps` steps: the synchronised
/// parameters and the report.
fn two_islands(steps: u64, cfg: OuterConfig) -> (Vec<Vec<f32>>, fusion_train::Report) {
    let model = ModelSpec::preset("gpt2-tiny").expect("preset");
    let inner =
        Trainer::new(ReferenceBackend, model, markov(), sgd_config(steps, 2)).expect("trainer");
    let mut islands = IslandTrainer::new(inner, 2, cfg).expect("islands");
    let report = islands.run(|_, _| {}).expect("islands run");
    (islands.anchor().to_vec(), report)
}

#[test]
fn averaging_islands_after_every_step_is_synchronous_data_parallelism() {
    let steps = 5;
    let (sync, _) = synchronous(steps);
    let (anchor, report) = two_islands(steps, OuterConfig::averaging(1));
    let d = max_diff(sync.params(), &anchor);
    assert!(
        d < 1e-6,
        "islands differ from synchronous data parallelism by {d}"
    );
    // The parameters moved, so the comparison is not between two untouched models.
    let untouched = Trainer::new(
        ReferenceBackend,
        ModelSpec::preset("gpt2-tiny").expect("preset"),
        markov(),
        sgd_config(steps, 4),
    )
    .expect("trainer");
    let moved = max_diff(sync.params(), untouched.params());
    assert!(
        moved > 1e-3,
        "training did not move the parameters ({moved})"
    );
    let outer = report.outer.expect("an islands report");
    assert_eq!((outer.islands, outer.syncs), (2, steps));
    // Dense messages: the values and a small header each.
    assert!(
        outer.sent_bytes > outer.dense_bytes
            && outer.sent_bytes < outer.dense_bytes + outer.dense_bytes / 100
    );
}

/// Islands of unequal shares (3 and 1 micro-batches of a 4-micro-batch step), weighted by their
/// shares at every synchronisation, are still synchronous data parallelism: each island's
/// gradient is the mean over its own micro-batches, so its share times it is its part of the
/// step's mean.
#[test]
fn islands_of_unequal_shares_weighted_by_them_are_synchronous_data_parallelism() {
    let steps = 4;
    let (sync, sync_report) = synchronous(steps);
    let cfg = OuterConfig {
        shares: Shares::Fixed(vec![3, 1]),
        ..OuterConfig::averaging(1)
    };
    let (unequal, report) = two_islands(steps, cfg);
    let d = max_diff(sync.params(), &unequal);
    assert!(
        d < 1e-6,
        "3/1 islands differ from synchronous data parallelism by {d}"
    );
    for (a, b) in sync_report.steps.iter().zip(&report.steps) {
        assert!(
            (a.loss - b.loss).abs() < 1e-5,
            "step {}: {} against {}",
            a.step,
            a.loss,
            b.loss
        );
    }
    assert_eq!(report.outer.expect("islands").shares, vec![3, 1]);
    // Shares that do not add up to the step are refused by name.
    let model = ModelSpec::preset("gpt2-tiny").expect("preset");
    let inner =
        Trainer::new(ReferenceBackend, model, markov(), sgd_config(steps, 2)).expect("trainer");
    let bad = OuterConfig {
        shares: Shares::Fixed(vec![3, 2]),
        ..OuterConfig::averaging(1)
    };
    let e = IslandTrainer::new(inner, 2, bad)
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("add up to 5"), "{e}");
}

#[test]
fn islands_with_batch_norm_average_their_statistics() {
    let cfg = TrainConfig {
        steps: 3,
        batch_size: 4,
        optimizer: OptimizerConfig::Sgd {
            momentum: 0.0,
            weight_decay: 0.0,
        },
        clip_norm: None,
        eval_batches: Some(1),
        ..TrainConfig::default()
    };
    let data: Arc<dyn Dataset> = Arc::new(SyntheticImages::new(8, 3, 0.3, 2));
    let model = ModelSpec::preset("resnet-tiny").expect("preset");
    let inner = Trainer::new(ReferenceBackend, model, data, cfg).expect("trainer");
    let mut islands = IslandTrainer::new(inner, 2, OuterConfig::averaging(3)).expect("islands");
    islands.train_step().expect("step");
    islands.train_step().expect("step");
    islands.train_step().expect("step");
    let (a, b) = (
        islands.island_params(0).expect("island 0").to_vec(),
        islands.island_params(1).expect("island 1").to_vec(),
    );
    assert!(max_diff(&a, &b) > 0.0, "the islands saw different data");
    islands.synchronise().expect("sync");
    let anchor = islands.anchor();
    for (i, ((x, y), z)) in a.iter().zip(&b).zip(anchor).enumerate() {
        for ((p, q), r) in x.iter().zip(y).zip(z) {
            let mean = ((*p as f64 + *q as f64) / 2.0) as f32;
            assert!(
                (mean - r).abs() <= 1e-6,
                "parameter {i}: {r} is not the mean {mean}"
            );
        }
    }
    assert_eq!(islands.island_params(1).expect("island 1"), anchor);
}

#[test]
fn rare_compressed_synchronisation_still_learns() {
    let cfg = TrainConfig {
        steps: 40,
        eval_batches: Some(4),
        ..TrainConfig::default()
    };
    let model = ModelSpec::preset("gpt2-tiny").expect("preset");
    let backend = CandleBackend::cpu();
    let mut first = Trainer::new(backend.clone(), model.clone(), markov(), cfg.clone()).expect("t");
    let before = first.evaluate().expect("eval").loss;
    for codec in [Codec::Int8 { block: 256 }, Codec::TopK { density: 0.1 }] {
        let inner = Trainer::new(backend.clone(), model.clone(), markov(), cfg.clone()).expect("t");
        let outer = OuterConfig {
            every: 10,
            codec,
            ..OuterConfig::default()
        };
        let mut islands = IslandTrainer::new(inner, 2, outer).expect("islands");
        let report = islands.run(|_, _| {}).expect("run");
        let after = report.evals.last().expect("final eval").loss;
        assert!(after < before - 0.3, "{codec}: {before} -> {after}");
        let o = report.outer.expect("islands report");
        assert_eq!(o.syncs, 4);
        assert!(
            o.sent_bytes * 3 < o.dense_bytes,
            "{codec}: {} of {}",
            o.sent_bytes,
            o.dense_bytes
        );
    }
}

#[test]
fn islands_refuse_nonsense() {
    let model = ModelSpec::preset("gpt2-tiny").expect("preset");
    let t =
        || Trainer::new(ReferenceBackend, model.clone(), markov(), sgd_config(2, 1)).expect("t");
    assert!(IslandTrainer::new(t(), 0, OuterConfig::default()).is_err());
    let bad = OuterConfig {
        every: 0,
        ..OuterConfig::default()
    };
    let e = IslandTrainer::new(t(), 2, bad).err().expect("refused");
    assert!(e.to_string().contains("H >= 1"), "{e}");
    // More fragments than the model has tensors; a membership of the wrong length.
    let many = OuterConfig {
        fragments: 1000,
        ..OuterConfig::averaging(1000)
    };
    let e = IslandTrainer::new(t(), 2, many).err().expect("refused");
    assert!(
        e.to_string().contains("1000 fragments for a model of"),
        "{e}"
    );
    let mut two = IslandTrainer::new(t(), 2, OuterConfig::averaging(2)).expect("islands");
    let e = two.synchronise_part(&[true], true).expect_err("refused");
    assert!(e.to_string().contains("membership"), "{e}");
}

/// `a - mean_i(start_i - now_i)` with equal weights, tensor by tensor.
fn outer_average(a: &[Vec<f32>], start: &[Vec<Vec<f32>>], now: &[Vec<Vec<f32>>]) -> Vec<Vec<f32>> {
    (0..a.len())
        .map(|t| {
            (0..a[t].len())
                .map(|j| {
                    let k = start.len() as f64;
                    let mean: f64 = (0..start.len())
                        .map(|i| (start[i][t][j] - now[i][t][j]) as f64 / k)
                        .sum();
                    a[t][j] - mean as f32
                })
                .collect()
        })
        .collect()
}

fn island_params(t: &IslandTrainer<ReferenceBackend>, n: usize) -> Vec<Vec<Vec<f32>>> {
    (0..n)
        .map(|i| t.island_params(i).expect("island").to_vec())
        .collect()
}

/// Overlapped synchronisation applies each round's average one round late: after the second
/// round the anchor has taken the first round's outer step and every island sits on it plus
/// the progress of its own second round; a blocking synchronisation then leaves every island
/// on the anchor, bit for bit.
#[test]
fn overlapped_islands_apply_each_round_one_round_late() {
    let model = ModelSpec::preset("gpt2-tiny").expect("preset");
    let inner = Trainer::new(ReferenceBackend, model, markov(), sgd_config(4, 1)).expect("t");
    let cfg = OuterConfig {
        overlap: true,
        ..OuterConfig::averaging(1)
    };
    let mut t = IslandTrainer::new(inner, 2, cfg).expect("islands");
    let a0 = t.anchor().to_vec();
    t.train_step().expect("step 1");
    let first = island_params(&t, 2);
    assert!(
        max_diff(&first[0], &first[1]) > 1e-4,
        "islands saw the same data"
    );
    t.synchronise_overlapped(false).expect("overlapped sync 1");
    assert_eq!(t.anchor(), &a0[..], "nothing arrived yet: the anchor stays");
    assert_eq!(
        island_params(&t, 2),
        first,
        "each island keeps its own progress"
    );
    t.train_step().expect("step 2");
    let second = island_params(&t, 2);
    t.synchronise_overlapped(false).expect("overlapped sync 2");
    let a1 = outer_average(&a0, &[a0.clone(), a0.clone()], &first);
    assert!(max_diff(t.anchor(), &a1) < 1e-6, "the first round's step");
    for i in 0..2 {
        let carried: Vec<Vec<f32>> = (0..a1.len())
            .map(|k| {
                (0..a1[k].len())
                    .map(|j| second[i][k][j] + (a1[k][j] - first[i][k][j]))
                    .collect()
            })
            .collect();
        let d = max_diff(t.island_params(i).expect("island"), &carried);
        assert!(
            d < 1e-6,
            "island {i} is not the anchor plus its second round ({d})"
        );
    }
    let now = island_params(&t, 2);
    t.synchronise_overlapped(true).expect("blocking sync");
    // The pending round (second - first) lands, then nothing more was trained.
    let a2 = outer_average(&a1, &first, &second);
    assert!(max_diff(t.anchor(), &a2) < 1e-6, "the second round's step");
    for i in 0..2 {
        assert_eq!(
            t.island_params(i).expect("island"),
            t.anchor(),
            "island {i}"
        );
    }
    assert!(max_diff(&now[0], &now[1]) > 1e-4);
}

/// One island overlapping its synchronisations trains as the plain trainer: each delayed outer
/// step puts it back where its own progress took it.
#[test]
fn one_overlapped_island_trains_as_one_trainer() {
    let steps = 6;
    let model = ModelSpec::preset("gpt2-tiny").expect("preset");
    let mut plain = Trainer::new(
        ReferenceBackend,
        model.clone(),
        markov(),
        sgd_config(steps, 2),
    )
    .expect("t");
    plain.run(|_, _| {}).expect("plain run");
    let inner = Trainer::new(ReferenceBackend, model, markov(), sgd_config(steps, 2)).expect("t");
    let cfg = OuterConfig {
        overlap: true,
        ..OuterConfig::averaging(2)
    };
    let mut one = IslandTrainer::new(inner, 1, cfg).expect("islands");
    let report = one.run(|_, _| {}).expect("islands run");
    assert_eq!(report.outer.expect("islands").syncs, steps / 2);
    let d = max_diff(plain.params(), one.anchor());
    assert!(
        d < 1e-5,
        "one overlapped island differs from the trainer by {d}"
    );
}

/// `synchronise` after overlapped synchronisations applies the round under way first (a
/// blocking `synchronise_overlapped`), instead of dropping it and measuring the next delta from
/// the wrong start.
#[test]
fn a_plain_synchronisation_after_overlapped_ones_applies_the_pending_round() {
    let model = ModelSpec::preset("gpt2-tiny").expect("preset");
    let cfg = OuterConfig {
        overlap: true,
        ..OuterConfig::averaging(2)
    };
    let make = || {
        let inner =
            Trainer::new(ReferenceBackend, model.clone(), markov(), sgd_config(4, 2)).expect("t");
        IslandTrainer::new(inner, 2, cfg.clone()).expect("islands")
    };
    let (mut a, mut b) = (make(), make());
    for t in [&mut a, &mut b] {
        t.train_step().expect("step");
        t.synchronise_overlapped(false).expect("overlapped");
        t.train_step().expect("step");
    }
    a.synchronise().expect("plain");
    b.synchronise_overlapped(true).expect("blocking");
    assert_eq!(max_diff(a.anchor(), b.anchor()), 0.0);
    for i in 0..2 {
        let (pa, pb) = (a.island_params(i), b.island_params(i));
        assert_eq!(max_diff(pa.expect("island"), pb.expect("island")), 0.0);
    }
}

/// The tensors of fragment `f` of `t`'s model, as a mask.
fn fragment_mask(t: &IslandTrainer<ReferenceBackend>, fragments: u32, f: u32) -> Vec<bool> {
    let sizes: Vec<usize> = t.anchor().iter().map(Vec::len).collect();
    fusion_train::fragment_of(&sizes, fragments)
        .into_iter()
        .map(|g| g == f)
        .collect()
}

/// Largest difference between `a` and `b` over the tensors `mask` selects.
fn masked_diff(a: &[Vec<f32>], b: &[Vec<f32>], mask: &[bool]) -> f32 {
    let pick = |x: &[Vec<f32>]| -> Vec<Vec<f32>> {
        x.iter()
            .zip(mask)
            .map(|(v, &m)| if m { v.clone() } else { Vec::new() })
            .collect()
    };
    max_diff(&pick(a), &pick(b))
}

/// Streaming synchronisation takes one fragment at a time: after a blocking synchronisation of
/// fragment 1 its tensors are the outer step's on every island, while fragment 0's keep each
/// island's own progress and the anchor's old values.
#[test]
fn a_fragment_synchronisation_moves_only_that_fragment() {
    let model = ModelSpec::preset("gpt2-tiny").expect("preset");
    let inner = Trainer::new(ReferenceBackend, model, markov(), sgd_config(4, 1)).expect("t");
    let cfg = OuterConfig {
        fragments: 2,
        ..OuterConfig::averaging(2)
    };
    let mut t = IslandTrainer::new(inner, 2, cfg).expect("islands");
    let (zero, one) = (fragment_mask(&t, 2, 0), fragment_mask(&t, 2, 1));
    assert!(zero.iter().any(|&m| m) && one.iter().any(|&m| m));
    let a0 = t.anchor().to_vec();
    t.train_step().expect("step 1");
    let trained = island_params(&t, 2);
    t.synchronise_part(&one, true).expect("fragment 1");
    let a1 = outer_average(&a0, &[a0.clone(), a0.clone()], &trained);
    assert!(
        masked_diff(t.anchor(), &a1, &one) < 1e-6,
        "fragment 1 moved"
    );
    assert_eq!(masked_diff(t.anchor(), &a0, &zero), 0.0, "fragment 0 waits");
    for (i, trained) in trained.iter().enumerate() {
        let own = t.island_params(i).expect("island");
        assert_eq!(
            masked_diff(own, t.anchor(), &one),
            0.0,
            "island {i} on fragment 1"
        );
        assert_eq!(
            masked_diff(own, trained, &zero),
            0.0,
            "island {i} keeps fragment 0"
        );
    }
    let both = island_params(&t, 2);
    assert!(
        masked_diff(&both[0], &both[1], &zero) > 1e-4,
        "islands saw the same data"
    );
}

/// Fragments overlapping the next inner steps: fragment 1's average arrives at fragment 0's
/// synchronisation, which carries each island onto it with the progress it made since, while
/// fragment 0's own exchange begins there; fragment 0 is then measured from where it began.
#[test]
fn overlapped_fragments_arrive_one_synchronisation_late() {
    let model = ModelSpec::preset("gpt2-tiny").expect("preset");
    let inner = Trainer::new(ReferenceBackend, model, markov(), sgd_config(4, 1)).expect("t");
    let cfg = OuterConfig {
        fragments: 2,
        overlap: true,
        ..OuterConfig::averaging(2)
    };
    let mut t = IslandTrainer::new(inner, 2, cfg).expect("islands");
    let (zero, one) = (fragment_mask(&t, 2, 0), fragment_mask(&t, 2, 1));
    let a0 = t.anchor().to_vec();
    t.train_step().expect("step 1");
    let first = island_params(&t, 2);
    t.synchronise_part(&one, false)
        .expect("fragment 1, overlapped");
    assert_eq!(t.anchor(), &a0[..], "nothing arrived yet");
    assert_eq!(island_params(&t, 2), first);
    t.train_step().expect("step 2");
    let second = island_params(&t, 2);
    t.synchronise_part(&zero, false)
        .expect("fragment 0, overlapped");
    let a1 = outer_average(&a0, &[a0.clone(), a0.clone()], &first);
    assert!(
        masked_diff(t.anchor(), &a1, &one) < 1e-6,
        "fragment 1 arrived"
    );
    assert_eq!(
        masked_diff(t.anchor(), &a0, &zero),
        0.0,
        "fragment 0 is under way"
    );
    for i in 0..2 {
        let carried: Vec<Vec<f32>> = (0..a1.len())
            .map(|k| match one[k] {
                true => (0..a1[k].len())
                    .map(|j| second[i][k][j] + (a1[k][j] - first[i][k][j]))
                    .collect(),
                false => second[i][k].clone(),
            })
            .collect();
        let d = max_diff(t.island_params(i).expect("island"), &carried);
        assert!(
            d < 1e-6,
            "island {i}: fragment 1 carried, fragment 0 its own ({d})"
        );
    }
    t.synchronise().expect("blocking, every fragment");
    // Fragment 0's round (from a0 to `second`) lands, then the blocking one (nothing trained
    // since) leaves every island on the anchor.
    let a2 = outer_average(&a0, &[a0.clone(), a0.clone()], &second);
    assert!(
        masked_diff(t.anchor(), &a2, &zero) < 1e-6,
        "fragment 0 arrived"
    );
    for i in 0..2 {
        assert_eq!(
            t.island_params(i).expect("island"),
            t.anchor(),
            "island {i}"
        );
    }
}

/// One island synchronising by fragments, blocking or overlapped, trains as the plain trainer
/// (averaging one island at outer rate 1 puts it back where it was): a fragment measured from
/// the wrong start, or progress carried twice, would move it.
#[test]
fn one_island_streaming_fragments_trains_as_one_trainer() {
    let steps = 12;
    let model = ModelSpec::preset("gpt2-tiny").expect("preset");
    let mut plain = Trainer::new(
        ReferenceBackend,
        model.clone(),
        markov(),
        sgd_config(steps, 2),
    )
    .expect("t");
    plain.run(|_, _| {}).expect("plain run");
    for overlap in [false, true] {
        let inner = Trainer::new(
            ReferenceBackend,
            model.clone(),
            markov(),
            sgd_config(steps, 2),
        )
        .expect("t");
        let cfg = OuterConfig {
            fragments: 3,
            overlap,
            ..OuterConfig::averaging(6)
        };
        let mut one = IslandTrainer::new(inner, 1, cfg).expect("islands");
        let report = one.run(|_, _| {}).expect("islands run");
        let outer = report.outer.expect("islands");
        // Every 2 steps one fragment; the last synchronisation takes them all.
        assert_eq!(outer.partial, 5, "overlap {overlap}");
        let d = max_diff(plain.params(), one.anchor());
        assert!(d < 1e-5, "overlap {overlap}: {d} from the trainer");
    }
}

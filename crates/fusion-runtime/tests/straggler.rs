//! Straggler detection on a cluster in one test process. Alone in its test binary: cargo runs
//! test binaries one after another, so no other cluster test of this crate runs beside it (the
//! detection compares the nodes' compute times with one another, which a dozen clusters training
//! at once on two cores swing widely).

mod common;

use common::*;
use fusion_backend::ReferenceBackend;
use fusion_models::ModelSpec;
use fusion_runtime::{JobSpec, Schedule};

/// A node that computes sixty times slower than its measured profile from step 2 on (a throttled
/// or shared device) is found a straggler after five such steps; the scheduler re-plans around
/// it at the next step boundary (its figures derated, or without it), with no rollback, and the
/// run ends where a single process does. Sixty, not a bare multiple of the threshold: a light
/// stage's compute (an embedding, the loss) is predicted far less well than a heavy one's, and
/// as the middle of three nodes it can set the median the slowdown is measured against. Twelve
/// steps: the re-plan's placement runs too few steps after it for a second judgement, which on
/// two nodes would weigh such a light stage alone against the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_straggler_is_found_and_planned_around_without_a_rollback() {
    let model = ModelSpec::preset("gpt2-tiny").expect("preset");
    let cfg = lm_config(12);
    let single = single_process(ReferenceBackend, &model, markov(), &cfg);
    let spec = JobSpec {
        precision: Default::default(),
        nodes: 3,
        scheduler: fusion_runtime::Scheduler::OpFence,
        ..job(model, markov(), cfg, Schedule::GPipe)
    };
    let dist = run_cluster_with(&pki(), spec, &[Kind::Reference; 3], |i, c| {
        if i == 2 {
            c.test_hooks.slowdown_from_step = Some((2, 60.0));
        }
    })
    .await;
    assert_matches(&single, &dist, 1e-5);
    let r = &dist.report;
    assert!(r.recoveries.is_empty(), "{:?}", r.recoveries);
    assert_eq!(r.stragglers.len(), 1, "{:?}", r.stragglers);
    assert!(
        r.stragglers[0].starts_with("node2 computed")
            && r.stragglers[0].contains("slower than planned"),
        "{:?}",
        r.stragglers
    );
    assert_eq!(r.reshapes.len(), 1, "{:?}", r.reshapes);
    let reshape = &r.reshapes[0];
    assert!(reshape.why.starts_with("node2 computed"), "{reshape:?}");
    // Five slow steps (3 to 7) make the straggler; the re-plan follows at that step boundary.
    assert_eq!(reshape.step, 7, "{reshape:?}");
    if reshape.why.contains("without it") {
        assert!(
            r.placement.iter().all(|p| p.node != "node2"),
            "{:?}",
            r.placement
        );
        assert_eq!(reshape.nodes_after, 2);
    } else {
        assert!(reshape.why.contains("derated"), "{reshape:?}");
    }
}

//! Hierarchical plans: islands synchronised across slow links against OP-Fence's flat plan.

use fusion_estimate::{
    DeviceProfile, OpKind, OpWorkload, ProfileSource, TensorFlow, Workload,
    ADAM_STATE_BYTES_PER_PARAM,
};
use fusion_exec::Schedule;
use fusion_plan::{
    fragment_seconds, opfence, plan_hierarchy, simulate_hierarchy, sync_seconds, Network,
    OpFenceOptions, OuterOptions, Problem,
};
use fusion_testbed::{DeviceCatalog, Testbed};

/// `n` identical operators of `flops` each, `param_bytes` of parameters each, a chain of
/// `bytes` tensors between them.
fn chain(n: usize, flops: f64, bytes: f64, param_bytes: f64) -> Workload {
    let ops = (0..n)
        .map(|i| OpWorkload {
            name: format!("op{i}"),
            op: "linear".into(),
            kind: OpKind::Dense,
            fwd_flops: flops,
            bwd_flops: 2.0 * flops,
            fwd_bytes: 0.0,
            bwd_bytes: 0.0,
            params: (param_bytes / 4.0) as usize,
            param_bytes,
            grad_bytes: param_bytes,
            optimizer_bytes: 2.0 * param_bytes,
            activation_bytes: bytes,
        })
        .collect();
    let flows = (0..n - 1)
        .map(|i| TensorFlow {
            name: format!("t{i}"),
            bytes,
            producer: i,
            consumers: vec![i + 1],
        })
        .collect();
    Workload::from_parts("chain", ops, flows)
}

/// Two sites of `per_site` devices: `inside` bytes/s within a site, `between` across.
fn two_sites(per_site: usize, inside: f64, between: f64) -> Network {
    let d = 2 * per_site;
    let dev = |k: usize| DeviceProfile {
        name: format!("d{k}"),
        class: "test".into(),
        dense_flops_per_s: 1e12,
        memory_bytes_per_s: 1e12,
        memory_capacity_bytes: 1e12,
        calibration: 1.0,
        op_overhead_s: 0.0,
        source: ProfileSource::Class,
    };
    let site = |k: usize| k / per_site;
    let bandwidth = (0..d)
        .map(|i| {
            (0..d)
                .map(|j| match (i == j, site(i) == site(j)) {
                    (true, _) => f64::INFINITY,
                    (false, true) => inside,
                    (false, false) => between,
                })
                .collect()
        })
        .collect();
    Network {
        devices: (0..d).map(dev).collect(),
        bandwidth,
        latency: vec![vec![0.0; d]; d],
    }
}

#[test]
fn across_a_slow_link_the_planner_synchronises_instead_of_leaving_a_site_idle() {
    // Neither activations of 100 MB per micro-batch nor every step's all-reduce of 400 MB of
    // gradients can cross 10 MB/s; the parameters can, once every H steps.
    let w = chain(8, 1e10, 1e8, 5e7);
    let net = two_sites(2, 1e10, 1e7);
    let p = Problem::new(&w, &net, 8, Schedule::OneFOneB).expect("problem");
    let flat = opfence(&p, &OpFenceOptions::default()).expect("flat");
    let used: usize = flat.plan.devices.iter().map(Vec::len).sum();
    assert_eq!(used, 2, "the flat plan stays on one site: {:?}", flat.plan);
    let h = plan_hierarchy(&p, &OuterOptions::default()).expect("hierarchy");
    assert_eq!(h.islands.len(), 2, "{h:#?}");
    assert!(h.idle.is_empty());
    let flat_rate = (8 * flat.plan.replicas()) as f64 / flat.evaluation.step_s;
    // Twice the devices, less the convergence penalty.
    assert!(
        h.effective_rate > 1.6 * flat_rate,
        "{} vs {flat_rate}",
        h.effective_rate
    );
    assert!(h.penalty > 1.0);
    // Equal islands share the batch equally.
    assert!((h.islands[0].share - 0.5).abs() < 1e-9);
}

#[test]
fn without_a_slow_link_one_island_is_the_flat_plan() {
    let w = chain(8, 1e10, 1e6, 5e5);
    let net = two_sites(2, 1e10, 1e10);
    let p = Problem::new(&w, &net, 8, Schedule::OneFOneB).expect("problem");
    let flat = opfence(&p, &OpFenceOptions::default()).expect("flat");
    let h = plan_hierarchy(&p, &OuterOptions::default()).expect("hierarchy");
    assert_eq!(h.islands.len(), 1);
    assert_eq!(h.penalty, 1.0);
    let flat_rate = (8 * flat.plan.replicas()) as f64 / flat.evaluation.step_s;
    assert!((h.effective_rate - flat_rate).abs() < 1e-9 * flat_rate);
    assert_eq!(h.islands[0].plan, flat.plan);
}

#[test]
fn a_fixed_island_count_is_honoured_or_refused() {
    let w = chain(8, 1e10, 1e8, 5e7);
    let net = two_sites(2, 1e10, 1e7);
    let p = Problem::new(&w, &net, 8, Schedule::OneFOneB).expect("problem");
    let one = OuterOptions {
        islands: Some(1),
        ..OuterOptions::default()
    };
    assert_eq!(plan_hierarchy(&p, &one).expect("one").islands.len(), 1);
    let five = OuterOptions {
        islands: Some(5),
        ..OuterOptions::default()
    };
    let e = plan_hierarchy(&p, &five).unwrap_err();
    assert!(e.to_string().contains("no 5 islands"), "{e}");
}

#[test]
fn the_exchange_costs_the_ring_share_of_each_device_over_its_link() {
    // 8 operators x 50 MB = 400 MB of parameters, held half by each of an island's two devices
    // (two stages, or two replicas of one); a ring of two islands sends 2 (2 - 1) / 2 = 1 times
    // a device's share at 10 MB/s: 20 s; int8 a quarter of it.
    let w = chain(8, 1e10, 1e8, 5e7);
    let net = two_sites(2, 1e10, 1e7);
    let p = Problem::new(&w, &net, 8, Schedule::OneFOneB).expect("problem");
    let h = plan_hierarchy(&p, &OuterOptions::default()).expect("hierarchy");
    assert_eq!(h.islands.len(), 2);
    let dense = sync_seconds(&p, &h.islands, 1.0);
    assert!((dense - 20.0).abs() < 1e-9, "{dense}");
    assert!((sync_seconds(&p, &h.islands, 0.25) - 5.0).abs() < 1e-9);
    // A round is at least its exchange.
    assert!(h.round_s >= h.sync_s);
}

#[test]
fn fragments_split_the_exchange_and_pay_the_ring_latency_each_time() {
    // The network of the test above with 0.5 s between the sites: the whole model's exchange is
    // 20 s of bytes plus 2 hops of latency. In 4 fragments of 100 MB (two operators) each lies
    // in one stage and goes alone, split among that stage's replicas: 10 s in islands of two
    // stages, 5 s in islands of two replicas of one, plus the 1 s of latency each time.
    let w = chain(8, 1e10, 1e8, 5e7);
    let mut net = two_sites(2, 1e10, 1e7);
    for (i, row) in net.latency.iter_mut().enumerate() {
        for (j, l) in row.iter_mut().enumerate() {
            *l = if i / 2 == j / 2 { 0.0 } else { 0.5 };
        }
    }
    let p = Problem::new(&w, &net, 8, Schedule::OneFOneB).expect("problem");
    let pipelined = OuterOptions {
        fence: OpFenceOptions {
            stages: Some(2),
            ..OpFenceOptions::default()
        },
        ..OuterOptions::default()
    };
    for (o, stages, fragment_s) in [(OuterOptions::default(), 1, 6.0), (pipelined, 2, 11.0)] {
        let whole = plan_hierarchy(&p, &o).expect("hierarchy");
        assert_eq!(whole.islands.len(), 2);
        assert!(whole.islands.iter().all(|i| i.plan.stages() == stages));
        assert_eq!(whole.fragments, 1);
        let dense = sync_seconds(&p, &whole.islands, 1.0);
        assert!((dense - 21.0).abs() < 1e-9, "{dense}");
        let parts = fragment_seconds(&p, &whole.islands, 1.0, 4);
        assert_eq!(parts.len(), 4);
        assert!(
            parts.iter().all(|&x| (x - fragment_s).abs() < 1e-9),
            "{parts:?}"
        );
        // The planner charges them: blocking, the four exchanges add to the round (at the codec
        // it chose); with 4 fragments only the intervals 4 divides are tried.
        let streamed = OuterOptions {
            fragments: 4,
            ..o.clone()
        };
        let h = plan_hierarchy(&p, &streamed).expect("streaming hierarchy");
        assert_eq!((h.fragments, h.fragment_sync_s.len()), (4, 4));
        assert!(h.every.is_multiple_of(4), "every {}", h.every);
        let priced: f64 = fragment_seconds(&p, &h.islands, h.codec.ratio, 4)
            .iter()
            .sum();
        assert!((h.sync_s - priced).abs() < 1e-9, "{} {priced}", h.sync_s);
        assert!(h.sync_s > whole.sync_s, "the latency is paid four times");
        let compute = h.every as f64 * h.inner_step_s;
        assert!((h.round_s - compute - h.sync_s).abs() < 1e-6 * h.round_s);
        assert!(h.effective_rate <= whole.effective_rate);
        // Overlapped, each fragment hides behind a quarter of the round; the simulator composes
        // the round the same way.
        let overlapped = OuterOptions {
            overlap: true,
            ..streamed
        };
        let h = plan_hierarchy(&p, &overlapped).expect("overlapped streaming hierarchy");
        let slot = compute_slot(&h);
        let expected: f64 = h.fragment_sync_s.iter().map(|&x| slot.max(x)).sum();
        assert!((h.round_s - expected).abs() < 1e-6 * h.round_s);
        let sim = simulate_hierarchy(&p, &h, true).expect("simulated");
        let sim_slot = h.every as f64 * sim.inner_step_s / 4.0;
        let sim_round: f64 = h.fragment_sync_s.iter().map(|&x| sim_slot.max(x)).sum();
        assert!((sim.round_s - sim_round).abs() < 1e-6 * sim.round_s);
    }
    // No interval the fragments divide, or more fragments than operators with parameters: a
    // clear refusal.
    let odd = OuterOptions {
        fragments: 3,
        every: vec![10, 25],
        ..OuterOptions::default()
    };
    let e = plan_hierarchy(&p, &odd).expect_err("3 divides neither 10 nor 25");
    assert!(e.to_string().contains("3 fragments divide none"), "{e}");
    let many = OuterOptions {
        fragments: 10,
        every: vec![10, 20],
        ..OuterOptions::default()
    };
    let e = plan_hierarchy(&p, &many).expect_err("10 fragments of 8 operators");
    assert!(
        e.to_string().contains("10 fragments of a model with 8"),
        "{e}"
    );
}

/// Compute seconds between two of `h`'s fragment exchanges.
fn compute_slot(h: &fusion_plan::Hierarchy) -> f64 {
    h.every as f64 * h.inner_step_s / f64::from(h.fragments)
}

fn testbed(name: &str) -> Testbed {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../testbeds")
        .join(name);
    Testbed::from_file(&path).expect("testbed")
}

#[test]
fn on_the_paper_testbeds_islands_use_idle_devices_and_the_simulator_agrees() {
    let cat = DeviceCatalog::builtin().expect("catalog");
    let g = fusion_models::ModelSpec::preset("gpt2-small")
        .expect("preset")
        .graph(4, 1024)
        .expect("graph");
    let w = Workload::of(&g, ADAM_STATE_BYTES_PER_PARAM).expect("workload");
    for name in ["paper-a.toml", "paper-c.toml"] {
        let net = Network::from_testbed(&testbed(name), &cat).expect("network");
        let p = Problem::new(&w, &net, 8, Schedule::OneFOneB).expect("problem");
        let flat = opfence(&p, &OpFenceOptions::default()).expect("flat");
        let flat_rate = (8 * flat.plan.replicas()) as f64 / flat.evaluation.step_s;
        let h = plan_hierarchy(&p, &OuterOptions::default()).expect("hierarchy");
        let used: usize = h
            .islands
            .iter()
            .map(|i| i.plan.devices.iter().flatten().count())
            .sum();
        let flat_used: usize = flat.plan.devices.iter().flatten().count();
        assert!(used > flat_used, "{name}: {used} devices vs {flat_used}");
        assert!(h.effective_rate > flat_rate, "{name}");
        let sim = simulate_hierarchy(&p, &h, false).expect("simulate");
        let gap = (sim.effective_rate / h.effective_rate - 1.0).abs();
        assert!(
            gap < 0.05,
            "{name}: cost model and simulator differ by {gap}"
        );
    }
}

#[test]
fn replicas_whose_all_reduce_costs_more_than_the_penalty_become_islands() {
    // One cluster of four devices at 1 GB/s. A fence costs 1 GB per micro-batch each way, so
    // OP-Fence replicates: 4 replicas all-reduce 4 GB of gradients every step (6 s against
    // 19 s of compute). As islands they exchange the same bytes once every H steps instead.
    let w = chain(8, 1e11, 1e9, 5e8);
    let net = two_sites(2, 1e9, 1e9);
    let p = Problem::new(&w, &net, 8, Schedule::OneFOneB).expect("problem");
    let flat = opfence(&p, &OpFenceOptions::default()).expect("flat");
    assert_eq!(flat.plan.replicas(), 4, "{:?}", flat.plan);
    let flat_rate = (8 * 4) as f64 / p.simulate(&flat.plan, 1.0).expect("sim").step_s;
    let h = plan_hierarchy(&p, &OuterOptions::default()).expect("hierarchy");
    assert_eq!(h.islands.len(), 4, "{h:?}");
    assert!(h.islands.iter().all(|i| i.plan.replicas() == 1));
    let sim = simulate_hierarchy(&p, &h, false).expect("simulate");
    assert!(
        sim.effective_rate > 1.2 * flat_rate,
        "{} against {flat_rate}",
        sim.effective_rate
    );
    // Never more islands than the penalty is trusted for.
    let capped = OuterOptions {
        max_islands: 2,
        ..OuterOptions::default()
    };
    assert_eq!(
        plan_hierarchy(&p, &capped).expect("capped").islands.len(),
        2
    );
}

//! Nodes that accept no connections (homes behind NAT, firewalls) on loopback: each binds its
//! data-plane port without listening, so every dial to it is refused, as the probe rounds then
//! find. They train bit for bit as the same job with every node public, over reversed, punched
//! and relayed sessions the report names; a relay that alters what it forwards is caught by TLS at
//! the far end and its pairs re-routed through another relay.

mod common;

use common::*;
use fusion_models::ModelSpec;
use fusion_runtime::{BrokerConfig, ClusterOutcome, Schedule};
use fusion_testbed::Nat;
use std::time::Duration;

fn path_of(outcome: &ClusterOutcome, from: &str, to: &str) -> String {
    outcome
        .report
        .links
        .iter()
        .find(|l| l.from == from && l.to == to)
        .map(|l| l.path.clone())
        .unwrap_or_else(|| panic!("no link {from} -> {to} in {:?}", outcome.report.links))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn homes_behind_nat_train_bit_for_bit_as_public_nodes() {
    let model = ModelSpec::preset("gpt2-tiny").expect("preset");
    let cfg = lm_config(6);
    let job = || job(model.clone(), markov(), cfg.clone(), Schedule::OneFOneB);
    let kinds = [Kind::Reference; 4];
    let public = run_cluster(&pki(), job(), &kinds).await;
    // node0 is the only node that accepts connections: the other three are homes, node1 and
    // node2 behind NATs that keep ports (punched between them), node3 behind a symmetric one.
    // Sharded snapshots every 2 steps: a buddy cannot dial a home for its copy, so the homes'
    // shards are committed without one, and no snapshot fails.
    let pki = pki();
    let mut broker = BrokerConfig::new(TOKEN, pki.broker.clone());
    broker.snapshots.sharded = true;
    broker.snapshots.every_steps = 2;
    let homes = run_cluster_configured(&pki, job(), broker, &kinds, |i, c| {
        c.emulated_nat = match i {
            0 => Nat::None,
            1 | 2 => Nat::PortRestricted,
            _ => Nat::Symmetric,
        };
    })
    .await;
    let snaps = &homes.report.snapshots;
    assert!(snaps.snapshot_failures.is_empty(), "{snaps:?}");
    // At least one completes: the next one is skipped while one is still in flight, which on
    // a loaded machine can be every one but the first.
    assert!(
        snaps.sharded >= 1,
        "{snaps:?}; recoveries {:?}; failures {:?}; reshapes {:?}; stragglers {:?}",
        homes.report.recoveries,
        homes.report.failures,
        homes.report.reshapes,
        homes.report.stragglers
    );
    assert_eq!(loss_bits(&public), loss_bits(&homes));
    assert_eq!(
        public.params().expect("params"),
        homes.params().expect("params"),
        "final parameters differ"
    );
    let reachable: Vec<bool> = homes.report.placement.iter().map(|p| p.reachable).collect();
    assert_eq!(reachable, [true, false, false, false]);
    assert_eq!(path_of(&homes, "node1", "node0"), "direct");
    assert_eq!(path_of(&homes, "node0", "node1"), "reversed");
    assert_eq!(path_of(&homes, "node1", "node2"), "punched");
    assert_eq!(path_of(&homes, "node2", "node1"), "punched");
    assert_eq!(path_of(&homes, "node3", "node2"), "relayed via node0");
    assert_eq!(path_of(&homes, "node2", "node3"), "relayed via node0");
    assert_eq!(path_of(&public, "node1", "node2"), "direct");
    // The links that are not dialled directly were probed over the paths they take.
    let probed = |from: &str, to: &str| {
        homes
            .report
            .measured_links
            .iter()
            .find(|l| l.from == from && l.to == to)
            .map(|l| (l.path.name(), l.bandwidth_mbps > 0.0 && l.latency_ms >= 0.0))
    };
    assert_eq!(probed("node0", "node1"), Some(("reversed".into(), true)));
    assert_eq!(probed("node1", "node2"), Some(("punched".into(), true)));
    assert_eq!(probed("node2", "node1"), Some(("punched".into(), true)));
    assert_eq!(
        probed("node2", "node3"),
        Some(("relayed via node0".into(), true))
    );
    assert_eq!(
        probed("node3", "node2"),
        Some(("relayed via node0".into(), true))
    );
    assert_eq!(probed("node1", "node0"), Some(("direct".into(), true)));
    let paths = &homes.report.placement[2].paths;
    assert!(
        paths.contains(&"to node3: relayed via node0".to_string()),
        "{paths:?}"
    );
    assert!(
        paths.contains(&"to node1: punched".to_string()),
        "{paths:?}"
    );
}

/// Five devices, one per site: node0's links are fast (200 Mbit/s), node4's slow (20 Mbit/s),
/// the homes' between themselves 100 Mbit/s. Paced to these, the probes make node0 the homes'
/// relay, and node4 the only other choice.
fn relay_testbed() -> fusion_testbed::Testbed {
    let mut toml = String::from("name = \"relays\"\ndescription = \"two relays\"\n");
    for i in 0..5 {
        toml.push_str(&format!(
            "[[site]]\nname = \"s{i}\"\ninternal = {{ bandwidth_mbps = 1000.0, latency_ms = 0.1 }}\n[[device]]\nname = \"node{i}\"\nsite = \"s{i}\"\n"
        ));
    }
    for a in 0..5 {
        for b in a + 1..5 {
            let mbps = match (a, b) {
                (0, _) => 200.0,
                (_, 4) => 20.0,
                _ => 100.0,
            };
            toml.push_str(&format!(
                "[[link]]\nbetween = [\"s{a}\", \"s{b}\"]\nbandwidth_mbps = {mbps}\nlatency_ms = 1.0\n"
            ));
        }
    }
    fusion_testbed::Testbed::from_toml(&toml).expect("testbed")
}

/// Two public nodes (node0, the faster, relays for the homes first) and three homes. node0
/// alters one byte of every session it relays: the receiving home's TLS refuses the record and
/// reports the path (it cannot tell the relay's tampering from a sender's forgery), and the
/// broker routes that pair through node4 from then on. Nobody is evicted, and the run ends bit
/// for bit where the same run with an honest relay does (reference backend).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_relay_that_alters_a_session_is_routed_around() {
    let model = ModelSpec::preset("gpt2-tiny").expect("preset");
    let run = |tamper: bool| {
        let mut job = job(model.clone(), markov(), lm_config(6), Schedule::OneFOneB);
        job.nodes = 5;
        job.testbed = Some(relay_testbed());
        let pki = pki();
        let mut broker = BrokerConfig::new(TOKEN, pki.broker.clone());
        broker.replace_grace = Duration::from_secs(1);
        broker.snapshots.every_steps = 2;
        async move {
            run_cluster_ends(&pki, job, broker, &[Kind::Reference; 5], |i, c| {
                if (1..=3).contains(&i) {
                    c.emulated_nat = Nat::Symmetric;
                }
                if i == 0 && tamper {
                    // Past the TLS handshakes and the session hellos: inside the first tensors.
                    c.test_hooks.tamper_relayed_byte = Some(20_000);
                }
            })
            .await
        }
    };
    let (outcome, ends) = run(true).await;
    let r = &outcome.report;
    assert!(!r.recoveries.is_empty(), "the tampering was not noticed");
    for rec in &r.recoveries {
        assert!(!rec.evicted, "{rec:?}");
        assert!(rec.reason.contains("altered on the way"), "{}", rec.reason);
        assert_eq!((rec.nodes_before, rec.nodes_after), (5, 5));
    }
    for (i, end) in ends.iter().enumerate() {
        assert!(end.is_ok(), "node{i}: {end:?}");
    }
    assert_eq!(path_of(&outcome, "node1", "node2"), "relayed via node4");
    // Nothing of the training state was lost: bit for bit the run without the tampering relay.
    let (honest, _) = run(false).await;
    assert!(honest.report.recoveries.is_empty());
    assert_eq!(path_of(&honest, "node1", "node2"), "relayed via node0");
    assert_eq!(loss_bits(&outcome), loss_bits(&honest));
    assert_eq!(
        outcome.params().expect("params"),
        honest.params().expect("params")
    );
}

/// Two homes behind symmetric NATs and nobody to relay: the broker says what is missing instead
/// of retrying connections that cannot be made.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_homes_with_nobody_to_relay_are_told_what_is_missing() {
    let model = ModelSpec::preset("gpt2-tiny").expect("preset");
    let mut job = job(model, markov(), lm_config(2), Schedule::OneFOneB);
    job.nodes = 2;
    let pki = pki();
    let (url, broker) = start_broker(job, BrokerConfig::new(TOKEN, pki.broker.clone())).await;
    let nodes: Vec<_> = (0..2)
        .map(|i| {
            let name = format!("node{i}");
            let id = pki.ca.issue(&name, &[]).expect("node cert");
            let mut cfg = fusion_runtime::NodeConfig::local(&name, &url, TOKEN, id);
            cfg.emulated_nat = Nat::Symmetric;
            cfg.reconnect_for = Duration::ZERO;
            spawn_node(Kind::Candle, cfg)
        })
        .collect();
    let Err(err) = tokio::time::timeout(LIMIT, broker)
        .await
        .expect("the broker ends in time")
        .expect("broker task")
    else {
        panic!("the job ran without anyone to relay between its homes");
    };
    assert!(
        err.to_string()
            .contains("no node of the job accepts connections"),
        "{err}"
    );
    for n in nodes {
        let _ = tokio::time::timeout(LIMIT, n).await.expect("nodes stop");
    }
}

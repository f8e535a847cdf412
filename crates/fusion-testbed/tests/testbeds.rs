use fusion_testbed::{Testbed, TestbedError};
use std::path::Path;

fn shipped(name: &str) -> Testbed {
    Testbed::from_file(
        &Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../testbeds")
            .join(name),
    )
    .unwrap()
}

#[test]
fn default_testbed_has_two_sites_and_a_slow_link() {
    let t = shipped("default.toml");
    assert_eq!(t.devices.len(), 4);
    let wan = t.link("node0", "node2").unwrap();
    assert_eq!((wan.bandwidth_mbps, wan.latency_ms), (50.0, 40.0));
    assert_eq!(t.link("node0", "node1").unwrap().bandwidth_mbps, 1000.0);
    // 50 Mbit/s is 6.25 MB/s: 6.25 MB take one second plus the 40 ms latency.
    let secs = wan.transfer_time(6_250_000).as_secs_f64();
    assert!((secs - 1.04).abs() < 1e-9);
}

#[test]
fn heterogeneous_testbed_spans_8_mbps_to_10_gbps() {
    let t = shipped("heterogeneous.toml");
    assert_eq!(t.bandwidth_range(), (8.0, 10000.0));
    let lossy = t.link("campus0", "home-b0").expect("link");
    assert_eq!(lossy.loss, 0.001);
    fusion_testbed::DeviceCatalog::builtin()
        .unwrap()
        .check(&t)
        .unwrap();
}

#[test]
fn bad_testbeds_are_rejected_with_the_reason() {
    let base = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testbeds/default.toml"),
    )
    .unwrap();
    let cases = [
        (
            base.replace("site = \"home\"", "site = \"mars\""),
            "unknown site 'mars'",
        ),
        (
            base.replace("bandwidth_mbps = 50.0", "bandwidth_mbps = -5.0"),
            "bandwidth must be positive",
        ),
        (
            base.replace(
                "between = [\"lab\", \"home\"]",
                "between = [\"lab\", \"lab\"]",
            ),
            "to itself",
        ),
        (
            base.replace("latency_ms = 40.0", "latency_ms = 40.0\nloss = 1.5"),
            "loss in [0, 1)",
        ),
        (
            base.replace("name = \"node3\"", "name = \"node2\""),
            "duplicate device 'node2'",
        ),
        (
            base.replace("latency_ms = 40.0", "latency_ms = 40.0\njitter = 3"),
            "unknown field",
        ),
        ("name = [".to_string(), "not valid TOML"),
    ];
    for (text, want) in cases {
        let err = Testbed::from_toml(&text).unwrap_err().to_string();
        assert!(err.contains(want), "expected '{want}' in: {err}");
    }
    let no_link = base.split("[[link]]").next().unwrap().to_string()
        + &base[base.find("[[device]]").unwrap()..];
    let err = Testbed::from_toml(&no_link).unwrap_err();
    assert!(
        matches!(err, TestbedError::Invalid { .. }) && err.to_string().contains("no link between"),
        "{err}"
    );
}

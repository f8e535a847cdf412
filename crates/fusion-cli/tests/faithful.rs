//! Faithful emulation (root only; skipped with a message elsewhere): namespaces, tc-shaped links
//! and the delay bridge carry real traffic and a real training run, and are always removed.

use std::process::{Command, Output};

fn fusionllm(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fusionllm"))
        .args(args)
        .output()
        .expect("run fusionllm")
}

fn namespaces(prefix: &str) -> Vec<String> {
    let out = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(&format!("{prefix}-")))
        .map(String::from)
        .collect()
}

/// Whether this machine lets the test create network namespaces, run in them, make veths and
/// shape with tbf (a container without CAP_SYS_ADMIN, or a kernel without sch_tbf, cannot).
fn netns_available() -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return false;
    }
    let has_tc = Command::new("tc")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_tc {
        return false;
    }
    let name = format!("flprobe{}", std::process::id());
    let run = |args: &[&str]| {
        Command::new(args[0])
            .args(&args[1..])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if !run(&["ip", "netns", "add", &name]) {
        return false;
    }
    let ok = run(&[
        "ip", "netns", "exec", &name, "ip", "link", "set", "dev", "lo", "up",
    ]) && run(&[
        "ip", "-n", &name, "link", "add", "fla", "type", "veth", "peer", "name", "flb",
    ]) && run(&[
        "tc", "-n", &name, "qdisc", "add", "dev", "fla", "root", "tbf", "rate", "1mbit", "burst",
        "32k", "latency", "10ms",
    ]);
    let _ = Command::new("ip").args(["netns", "del", &name]).output();
    ok
}

struct Down(String);
impl Drop for Down {
    fn drop(&mut self) {
        let _ = fusionllm(&["testbed", "down", "--prefix", &self.0]);
    }
}

const TWO_SITES: &str = r#"
name = "two"
description = "two devices, 50 Mbit/s and 20 ms apart"
[[site]]
name = "a"
internal = { bandwidth_mbps = 1000.0, latency_ms = 0.2 }
[[site]]
name = "b"
internal = { bandwidth_mbps = 1000.0, latency_ms = 0.2 }
[[link]]
between = ["a", "b"]
bandwidth_mbps = 50.0
latency_ms = 20.0
[[device]]
name = "node0"
site = "a"
[[device]]
name = "node1"
site = "b"
"#;

#[test]
fn faithful_emulation_carries_traffic_with_the_link_delay_and_cleans_up() {
    if !netns_available() {
        eprintln!("skipped: faithful emulation needs root, CAP_SYS_ADMIN and iproute2 (ip, tc)");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let tb = dir.path().join("two.toml");
    std::fs::write(&tb, TWO_SITES).expect("testbed");
    let tb = tb.to_str().expect("utf8");
    let prefix = format!("t{:04x}", std::process::id() & 0xffff);
    {
        let _guard = Down(prefix.clone());
        let up = fusionllm(&["testbed", "up", tb, "--prefix", &prefix]);
        assert!(
            up.status.success(),
            "{}",
            String::from_utf8_lossy(&up.stderr)
        );
        assert_eq!(
            namespaces(&prefix).len(),
            3,
            "two devices and one link namespace"
        );
        // A second `up` with the same prefix is refused, naming the way out.
        let again = fusionllm(&["testbed", "up", tb, "--prefix", &prefix]);
        assert!(String::from_utf8_lossy(&again.stderr).contains("testbed down --prefix"));

        let exe = env!("CARGO_BIN_EXE_fusionllm");
        let mut server = Command::new("ip")
            .args([
                "netns",
                "exec",
                &format!("{prefix}-d1"),
                exe,
                "testbed",
                "probe",
            ])
            .args(["--listen", "10.201.0.2:9000"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("server");
        {
            use std::io::{BufRead, BufReader};
            let mut line = String::new();
            BufReader::new(server.stdout.as_mut().expect("stdout"))
                .read_line(&mut line)
                .expect("listening line");
        }
        let client = Command::new("ip")
            .args([
                "netns",
                "exec",
                &format!("{prefix}-d0"),
                exe,
                "testbed",
                "probe",
            ])
            .args(["--connect", "10.201.0.2:9000", "--bytes", "1000000"])
            .output()
            .expect("client");
        let _ = server.wait();
        let text = String::from_utf8_lossy(&client.stdout).to_string();
        assert!(
            client.status.success(),
            "{text}{}",
            String::from_utf8_lossy(&client.stderr)
        );
        let field = |k: &str| -> f64 {
            let mut it = text.split_whitespace();
            while let Some(w) = it.next() {
                if w == k {
                    return it.next().and_then(|v| v.parse().ok()).expect("number");
                }
            }
            panic!("no {k} in {text}");
        };
        assert_eq!(field("bytes"), 1_000_000.0);
        // The bridge holds every frame 20 ms each way: no round trip can be shorter.
        assert!(field("rtt_ms") >= 40.0, "{text}");
        let down = fusionllm(&["testbed", "down", "--prefix", &prefix]);
        assert!(down.status.success());
        assert!(namespaces(&prefix).is_empty());
    }

    // A training run inside the emulated network removes its namespaces when it ends.
    let out = fusionllm(&[
        "train",
        "--faithful",
        "--nodes",
        "2",
        "--testbed",
        tb,
        "--steps",
        "3",
        "--batch",
        "2",
        "--seq",
        "16",
        "--eval-batches",
        "1",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let run_prefix = err
        .split("namespaces ")
        .nth(1)
        .and_then(|s| s.split('-').next())
        .expect("the run names its namespaces")
        .to_string();
    assert!(
        namespaces(&run_prefix).is_empty(),
        "namespaces of {run_prefix} left behind"
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("done: 3 steps"), "{stdout}");
}

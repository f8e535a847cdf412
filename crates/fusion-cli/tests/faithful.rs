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
    // One name per check: the tests of this file run at once.
    static CHECKS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let check = CHECKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = format!("flprobe{}-{check}", std::process::id());
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

/// One emulated network at a time (they share the 10.202.0.0/16 control links): each test holds
/// this while it runs.
static ONE_NETWORK: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_network() -> std::sync::MutexGuard<'static, ()> {
    ONE_NETWORK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether the test can run; under CI=true a machine that cannot is a failure, not a skip.
fn require_netns(needs_nft: bool) -> bool {
    let nft = !needs_nft
        || Command::new("nft")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
    if netns_available() && nft {
        return true;
    }
    let what = "faithful emulation needs root, CAP_SYS_ADMIN, iproute2 (ip, tc) and nftables (nft)";
    assert!(std::env::var("CI").as_deref() != Ok("true"), "{what}");
    eprintln!("skipped: {what}");
    false
}

#[test]
fn faithful_emulation_carries_traffic_with_the_link_delay_and_cleans_up() {
    let _one = one_network();
    if !require_netns(false) {
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

const HOMES: &str = r#"
name = "homes"
description = "a lab and homes behind a NAT or a firewall"
[[site]]
name = "lab"
internal = { bandwidth_mbps = 1000.0, latency_ms = 0.2 }
[[site]]
name = "homes"
internal = { bandwidth_mbps = 100.0, latency_ms = 5.0 }
[[link]]
between = ["lab", "homes"]
bandwidth_mbps = 100.0
latency_ms = 5.0
[[device]]
name = "lab0"
site = "lab"
[[device]]
name = "home-a"
site = "homes"
nat = "port-restricted"
[[device]]
name = "home-b"
site = "homes"
nat = "firewall"
[[device]]
name = "home-c"
site = "homes"
nat = "symmetric"
"#;

/// Runs `testbed probe` as a server in namespace `ns` on `listen`.
fn probe_server(ns: &str, listen: &str) -> std::process::Child {
    use std::io::{BufRead, BufReader};
    let mut server = Command::new("ip")
        .args(["netns", "exec", ns, env!("CARGO_BIN_EXE_fusionllm")])
        .args(["testbed", "probe", "--listen", listen])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("server");
    let mut line = String::new();
    BufReader::new(server.stdout.as_mut().expect("stdout"))
        .read_line(&mut line)
        .expect("listening line");
    server
}

/// Runs `testbed probe` as a client in namespace `ns` against `to`: its output, or its error.
fn probe_client(ns: &str, to: &str) -> Result<String, String> {
    let out = Command::new("ip")
        .args(["netns", "exec", ns, env!("CARGO_BIN_EXE_fusionllm")])
        .args(["testbed", "probe", "--connect", to, "--bytes", "10000"])
        .output()
        .expect("client");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    match out.status.success() {
        true => Ok(text),
        false => Err(String::from_utf8_lossy(&out.stderr).to_string()),
    }
}

/// The server's view of the data connection (its second), and the client's own address.
fn seen_and_local(server: std::process::Child, client: &str) -> (String, String) {
    let out = server.wait_with_output().expect("server output");
    let seen = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.strip_prefix("from "))
        .next_back()
        .expect("the server saw a connection")
        .to_string();
    let local = client
        .split_whitespace()
        .skip_while(|w| *w != "local")
        .nth(1)
        .expect("the client's address")
        .to_string();
    (seen, local)
}

fn port(addr: &str) -> &str {
    addr.rsplit(':').next().expect("port")
}

/// The emulated home routers translate as their kind says and let nothing in unasked; a
/// training run with its homes behind them trains as the same run with every device public, its
/// sessions reversed, punched and relayed.
#[test]
fn homes_behind_emulated_nat_are_unreachable_yet_train_as_public_ones() {
    let _one = one_network();
    if !require_netns(true) {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let homes = dir.path().join("homes.toml");
    std::fs::write(&homes, HOMES).expect("testbed");
    let public = dir.path().join("public.toml");
    let all_public: String = HOMES
        .lines()
        .filter(|l| !l.starts_with("nat ="))
        .collect::<Vec<_>>()
        .join("\n");
    std::fs::write(&public, all_public).expect("testbed");
    let (homes, public) = (
        homes.to_str().expect("utf8"),
        public.to_str().expect("utf8"),
    );
    let prefix = format!("n{:04x}", std::process::id() & 0xffff);
    {
        let _guard = Down(prefix.clone());
        let up = fusionllm(&["testbed", "up", homes, "--prefix", &prefix]);
        assert!(
            up.status.success(),
            "{}",
            String::from_utf8_lossy(&up.stderr)
        );
        let ns = |i: usize| format!("{prefix}-d{i}");
        // Port-restricted: the lab sees the router's address and the home's own port.
        let server = probe_server(&ns(0), "10.201.0.1:9000");
        let client = probe_client(&ns(1), "10.201.0.1:9000").expect("home-a dials out");
        let (seen, local) = seen_and_local(server, &client);
        assert!(local.starts_with("10.203.1.2:"), "{local}");
        assert_eq!(seen, format!("10.201.0.2:{}", port(&local)));
        // Symmetric: the router's address, another port.
        let server = probe_server(&ns(0), "10.201.0.1:9000");
        let client = probe_client(&ns(3), "10.201.0.1:9000").expect("home-c dials out");
        let (seen, local) = seen_and_local(server, &client);
        assert!(seen.starts_with("10.201.0.4:"), "{seen}");
        assert_ne!(port(&seen), port(&local), "a symmetric NAT keeps no port");
        // Nothing gets in: not to the home's private address, not to its router's, not through
        // the firewall (the firewall answers nothing: the dial times out).
        let mut inside = probe_server(&ns(1), "10.203.1.2:9000");
        assert!(probe_client(&ns(0), "10.203.1.2:9000").is_err());
        assert!(probe_client(&ns(0), "10.201.0.2:9000").is_err());
        let _ = inside.kill();
        let _ = inside.wait();
        let mut walled = probe_server(&ns(2), "10.201.0.3:9000");
        let refused = probe_client(&ns(0), "10.201.0.3:9000").expect_err("the firewall drops it");
        assert!(refused.to_lowercase().contains("timed out"), "{refused}");
        let _ = walled.kill();
        let _ = walled.wait();
    }
    assert!(namespaces(&prefix).is_empty());

    let train = |testbed: &str| {
        let out = fusionllm(&[
            "train",
            "--faithful",
            "--nodes",
            "4",
            "--testbed",
            testbed,
            "--scheduler",
            "even",
            "--steps",
            "3",
            "--batch",
            "2",
            "--seq",
            "16",
            "--eval-batches",
            "1",
        ]);
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "{err}");
        let text = format!("{}{err}", String::from_utf8_lossy(&out.stdout));
        let losses: Vec<String> = text
            .lines()
            .filter(|l| l.starts_with("step ") && l.contains("loss"))
            .map(|l| l.split("lr").next().unwrap_or(l).to_string())
            .collect();
        (losses, text)
    };
    let (nat_losses, nat_text) = train(homes);
    let (public_losses, _) = train(public);
    assert_eq!(nat_losses.len(), 4, "{nat_text}");
    assert_eq!(nat_losses, public_losses);
    // The even split places the stages in name order. home-c sits behind a symmetric NAT:
    // its sessions with home-b go through the lab. home-a's NAT and home-b's firewall keep
    // ports: their sessions are punched through both.
    let said = |line: &str| nat_text.contains(line);
    assert!(said("to home-c: relayed via lab0"), "{nat_text}");
    assert!(said("to home-b: relayed via lab0"), "{nat_text}");
    assert!(said("to home-b: punched"), "{nat_text}");
    assert!(said("to home-a: punched"), "{nat_text}");
    assert!(said("to home-a: reversed"), "{nat_text}");
    // The probes of those links went through the same routers and the same relay.
    let probed = |from: &str, to: &str, path: &str| {
        nat_text.lines().any(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            words.first() == Some(&from)
                && words.get(2) == Some(&to)
                && l.contains("Mbit/s")
                && l.ends_with(&format!("({path})"))
        })
    };
    assert!(probed("home-b", "home-c", "relayed via lab0"), "{nat_text}");
    assert!(probed("home-c", "home-b", "relayed via lab0"), "{nat_text}");
    assert!(probed("home-a", "home-b", "punched"), "{nat_text}");
    assert!(probed("lab0", "home-a", "reversed"), "{nat_text}");
}

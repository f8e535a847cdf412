//! Chaos: real broker and node processes on loopback, faults injected for real (SIGKILL with
//! and without a spare, SIGSTOP, SIGTERM, a killed and restarted broker, a stalled
//! coordinator, a wedged compute thread and a data plane that stops reading (test hooks), links
//! into a node cut by a fault-injecting TCP proxy, the broker's disk filled up). Every case must finish the job, lose at most one snapshot interval of steps (as
//! its report states), and end with parameters and optimizer moments bit-identical to an
//! uninterrupted run (reference backend; gradient clipping is off so that the stage count cannot
//! change the clipping factor's last bit).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Mutex, OnceLock};
use std::time::{Duration, Instant};

const TOKEN: &str = "chaos-test-token";
const STEPS: u64 = 80;
/// Snapshots (and checkpoints) every this many steps: the most a fault may cost.
const INTERVAL: u64 = 5;

/// One cluster at a time: each runs four or five processes on a small machine.
static SERIAL: Mutex<()> = Mutex::new(());

fn exe() -> Command {
    Command::new(env!("CARGO_BIN_EXE_fusionllm"))
}

struct Cluster {
    dir: tempfile::TempDir,
    port: u16,
    /// The brokers' URLs the nodes are given.
    brokers: String,
    broker: Option<Child>,
    /// Other brokers (standbys), killed with the cluster.
    standbys: Vec<Child>,
    nodes: BTreeMap<String, Child>,
    lines: mpsc::Receiver<String>,
    tx: mpsc::Sender<String>,
    seen: Vec<String>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let all = self
            .broker
            .iter_mut()
            .chain(self.standbys.iter_mut())
            .chain(self.nodes.values_mut());
        for c in all {
            let _ = signal(c, "CONT");
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn signal(c: &Child, sig: &str) -> std::io::Result<std::process::ExitStatus> {
    Command::new("kill")
        .args([&format!("-{sig}"), &c.id().to_string()])
        .stderr(Stdio::null())
        .status()
}

impl Cluster {
    /// Certificates for the broker and `names`, a job file of `nodes` nodes, a free port.
    fn new(nodes: usize, names: &[&str]) -> Cluster {
        Cluster::with_job(nodes, names, "", "")
    }

    /// [`Cluster::new`] whose job file has `top` among its top-level keys and `tables` (TOML
    /// tables) at its end.
    fn with_job(nodes: usize, names: &[&str], top: &str, tables: &str) -> Cluster {
        Cluster::with_job_train(nodes, names, top, "", tables)
    }

    /// [`Cluster::with_job`] with `train` among the keys of its `[train]` table.
    fn with_job_train(
        nodes: usize,
        names: &[&str],
        top: &str,
        train: &str,
        tables: &str,
    ) -> Cluster {
        let dir = tempfile::tempdir().expect("tempdir");
        let certs = dir.path().join("certs");
        let all = std::iter::once("broker")
            .chain(names.iter().copied())
            .collect::<Vec<_>>();
        let out = exe()
            .args([
                "cert",
                "--out",
                certs.to_str().expect("utf8"),
                "--names",
                &all.join(","),
            ])
            .output()
            .expect("cert");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let job = format!(
            "model = \"gpt2-tiny\"\nnodes = {nodes}\nschedule = \"1f1b\"\nprobe_links = false\n{top}\
             [train]\n{train}steps = {STEPS}\nbatch_size = 2\nseq_len = 16\nmicro_batches = 2\n\
             eval_batches = 1\nclip_norm = 1e30\ncheckpoint_every = {INTERVAL}\ncheckpoint_dir = \"{}\"\n\
             [train.schedule]\nlr = 1e-3\n{tables}",
            dir.path().join("ckpt").display()
        );
        std::fs::write(dir.path().join("job.toml"), job).expect("job");
        let port = free_port();
        let (tx, lines) = mpsc::channel();
        Cluster {
            dir,
            port,
            brokers: format!("https://127.0.0.1:{port}"),
            broker: None,
            standbys: Vec::new(),
            nodes: BTreeMap::new(),
            lines,
            tx,
            seen: Vec::new(),
        }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    /// Starts the broker (resuming from the checkpoint directory when `resume`), with `extra`
    /// arguments, and waits until it listens.
    fn start_broker(&mut self, resume: bool, extra: &[&str]) {
        self.start_broker_under(&[], resume, extra);
    }

    /// Like [`Cluster::start_broker`], the broker run by the command `prefix` (which execs it).
    fn start_broker_under(&mut self, prefix: &[&str], resume: bool, extra: &[&str]) {
        let child = self.spawn_broker(prefix, self.port, resume, extra);
        self.broker = Some(child);
        self.wait_for("its listening line", |l| l.contains("broker listening"));
    }

    /// A broker process listening on `port`, its output lines forwarded to the test.
    fn spawn_broker(&self, prefix: &[&str], port: u16, resume: bool, extra: &[&str]) -> Child {
        let mut cmd = match prefix {
            [] => exe(),
            [program, args @ ..] => {
                let mut c = Command::new(program);
                c.args(args).arg(env!("CARGO_BIN_EXE_fusionllm"));
                c
            }
        };
        cmd.args([
            "broker",
            "--job",
            self.path("job.toml").to_str().expect("utf8"),
        ])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--certs", self.path("certs").to_str().expect("utf8")])
        .args([
            "--token",
            TOKEN,
            "--node-timeout",
            "3",
            "--replace-grace",
            "2",
        ])
        .args(if extra.contains(&"--snapshot-every") {
            Vec::new()
        } else {
            vec!["--snapshot-every".to_string(), INTERVAL.to_string()]
        })
        .args(["--test-step-delay-ms", "100"])
        .args(["--report", self.path("report.json").to_str().expect("utf8")])
        .args(extra);
        if resume {
            cmd.args(["--resume", self.path("ckpt").to_str().expect("utf8")]);
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start broker");
        for stream in [
            Box::new(child.stderr.take().expect("stderr")) as Box<dyn std::io::Read + Send>,
            Box::new(child.stdout.take().expect("stdout")),
        ] {
            let tx = self.tx.clone();
            std::thread::spawn(move || {
                for l in BufReader::new(stream).lines().map_while(Result::ok) {
                    if tx.send(l).is_err() {
                        return;
                    }
                }
            });
        }
        child
    }

    fn start_node(&mut self, name: &str) {
        self.start_node_with(name, &[]);
    }

    /// Starts a node with `extra` arguments (test hooks).
    fn start_node_with(&mut self, name: &str, extra: &[&str]) {
        let log = std::fs::File::create(self.path(&format!("{name}.log"))).expect("log");
        let child = exe()
            .args(["node", "--broker", &self.brokers])
            .args([
                "--name",
                name,
                "--certs",
                self.path("certs").to_str().expect("utf8"),
            ])
            .args(["--token", TOKEN, "--backend", "reference"])
            .args(if extra.contains(&"--data-listen") {
                &[][..]
            } else {
                &["--data-listen", "127.0.0.1:0"][..]
            })
            .args([
                "--heartbeat-ms",
                "200",
                "--peer-timeout",
                "30",
                "--reconnect-for",
                "60",
            ])
            .args(extra)
            // The healing case reads the nodes' warnings.
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start node");
        self.nodes.insert(name.to_string(), child);
    }

    /// Waits (bounded) for a broker output line satisfying `pred`; returns it.
    fn wait_for(&mut self, what: &str, pred: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(240);
        while Instant::now() < deadline {
            match self.lines.recv_timeout(Duration::from_millis(200)) {
                Ok(l) => {
                    self.seen.push(l.clone());
                    if pred(&l) {
                        return l;
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
        panic!(
            "broker never printed {what}; output so far:\n{}",
            self.seen.join("\n")
        );
    }

    fn wait_for_step(&mut self, at_least: u64) -> u64 {
        let line = self.wait_for(&format!("progress past step {at_least}"), |l| {
            step_of(l).is_some_and(|s| s >= at_least)
        });
        step_of(&line).expect("step")
    }

    /// Waits for the broker to finish and returns its report.
    fn finish(&mut self) -> serde_json::Value {
        self.wait_for("the end", |l| l.starts_with("done:"));
        let mut broker = self.broker.take().expect("broker");
        let status = broker.wait().expect("broker exit");
        assert!(status.success(), "broker failed:\n{}", self.seen.join("\n"));
        let report = std::fs::read(self.path("report.json")).expect("report");
        let v: serde_json::Value = serde_json::from_slice(&report).expect("json");
        let last = &v["steps"]
            .as_array()
            .expect("steps")
            .last()
            .expect("a step")["step"];
        assert_eq!(last.as_u64(), Some(STEPS), "{v}");
        v
    }

    /// The final checkpoint's tensor checksum (parameters and optimizer moments).
    fn final_tensors(&self) -> String {
        final_checksum(&self.path("ckpt"))
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port()
}

fn final_checksum(ckpt: &Path) -> String {
    let state = ckpt.join(format!("step-{STEPS:08}")).join("state.json");
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&state).expect("final checkpoint")).expect("json");
    v["tensors_sha256"].as_str().expect("checksum").to_string()
}

fn step_of(line: &str) -> Option<u64> {
    let rest = line.strip_prefix("step")?.trim_start();
    rest.split(['/', ':']).next()?.trim().parse().ok()
}

/// The checksum of an uninterrupted run of the same job on three nodes, computed once.
fn uninterrupted() -> &'static str {
    static BASELINE: OnceLock<String> = OnceLock::new();
    BASELINE.get_or_init(|| {
        let mut c = Cluster::new(3, &NODES);
        c.start_broker(false, &[]);
        for n in NODES {
            c.start_node(n);
        }
        let r = c.finish();
        assert!(
            r["recoveries"].as_array().expect("recoveries").is_empty(),
            "{r}"
        );
        c.final_tensors()
    })
}

fn lock() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

const NODES: [&str; 3] = ["node0", "node1", "node2"];

/// A running three-node job (certificates also for `spares`), with `broker_args`; the guard
/// keeps other cases from running at the same time.
fn three_nodes(
    spares: &[&str],
    broker_args: &[&str],
) -> (std::sync::MutexGuard<'static, ()>, Cluster) {
    three_nodes_with(spares, broker_args, "", &[])
}

/// Like [`three_nodes`], node `hooked` started with `hooks` (test hooks).
fn three_nodes_with(
    spares: &[&str],
    broker_args: &[&str],
    hooked: &str,
    hooks: &[&str],
) -> (std::sync::MutexGuard<'static, ()>, Cluster) {
    let guard = lock();
    uninterrupted();
    let names: Vec<&str> = NODES.iter().chain(spares).copied().collect();
    let mut c = Cluster::new(3, &names);
    c.start_broker(false, broker_args);
    for n in NODES {
        c.start_node_with(n, if n == hooked { hooks } else { &[] });
    }
    (guard, c)
}

impl Cluster {
    /// Asserts that the run ended where an uninterrupted one does, bit for bit.
    fn assert_matches_uninterrupted(&self) {
        assert_eq!(
            self.final_tensors(),
            uninterrupted(),
            "the final state differs from an uninterrupted run"
        );
    }

    fn kill_node(&mut self, name: &str) {
        let mut victim = self.nodes.remove(name).expect("a running node");
        victim.kill().expect("SIGKILL");
        victim.wait().expect("reap");
    }
}

fn placed(r: &serde_json::Value) -> Vec<&str> {
    let placement = r["placement"].as_array().expect("placement");
    placement
        .iter()
        .filter_map(|p| p["node"].as_str())
        .collect()
}

fn nodes_before_after(record: &serde_json::Value) -> (Option<u64>, Option<u64>) {
    (
        record["nodes_before"].as_u64(),
        record["nodes_after"].as_u64(),
    )
}

/// The single recovery a report lists, checked to have lost at most one snapshot interval.
fn one_recovery(r: &serde_json::Value) -> &serde_json::Value {
    let recoveries = r["recoveries"].as_array().expect("recoveries");
    assert_eq!(recoveries.len(), 1, "{r}");
    let rec = &recoveries[0];
    let lost = rec["steps_lost"].as_u64().expect("steps lost");
    assert!(
        lost <= INTERVAL,
        "lost {lost} steps, more than one interval: {rec}"
    );
    rec
}

#[test]
fn a_killed_node_is_replaced_by_a_spare_and_training_resumes_from_the_snapshot() {
    let (_serial, mut c) = three_nodes(&["node3"], &[]);
    // The spare joins once the three are placed (on a loaded machine it could otherwise join
    // before one of them and take its place).
    c.wait_for_step(1);
    c.start_node("node3");
    c.wait_for("the spare", |l| l.starts_with("node3 joined"));
    c.wait_for_step(10);
    c.kill_node("node1");
    // Either node1's own stream end or a peer's report of it comes first.
    c.wait_for("the lost node", |l| l.starts_with("node lost:"));
    c.wait_for("the rollback", |l| {
        l.contains("resuming from the snapshot at step")
    });
    let r = c.finish();
    let rec = one_recovery(&r);
    assert_eq!(nodes_before_after(rec), (Some(3), Some(3)), "{rec}");
    let placed = placed(&r);
    assert!(
        placed.contains(&"node3") && !placed.contains(&"node1"),
        "{placed:?}"
    );
    assert!(c.path("ckpt").join(format!("step-{STEPS:08}")).is_dir());
    c.assert_matches_uninterrupted();
}

/// Two replicas that shard their optimizer state (ZeRO stage 1), and a spare: one replica is
/// killed, the spare takes its place, each replica takes its piece of the moments back from the
/// snapshot (gathered piece by piece from both), and the run ends bit for bit where an
/// uninterrupted run of replicas that do not shard ends.
#[test]
fn a_killed_replica_of_a_sharded_optimizer_is_replaced_and_the_run_ends_as_unsharded() {
    let _serial = lock();
    let names = ["node0", "node1", "node2"];
    let run = |train: &str| Cluster::with_job_train(2, &names, "replicas = 2\n", train, "");
    let unsharded = {
        let mut c = run("");
        c.start_broker(false, &[]);
        c.start_node("node0");
        c.start_node("node1");
        let r = c.finish();
        assert!(r["recoveries"].as_array().is_some_and(Vec::is_empty), "{r}");
        c.final_tensors()
    };
    let mut c = run("shard_optimizer = true\n");
    c.start_broker(false, &[]);
    c.start_node("node0");
    c.start_node("node1");
    c.wait_for_step(1);
    c.start_node("node2");
    c.wait_for("the spare", |l| l.starts_with("node2 joined"));
    c.wait_for_step(10);
    c.kill_node("node1");
    c.wait_for("the lost node", |l| l.starts_with("node lost:"));
    c.wait_for("the rollback", |l| {
        l.contains("resuming from the snapshot at step")
    });
    let r = c.finish();
    let rec = one_recovery(&r);
    assert_eq!(nodes_before_after(rec), (Some(2), Some(2)), "{rec}");
    let placed = placed(&r);
    assert!(
        placed.contains(&"node2") && !placed.contains(&"node1"),
        "{placed:?}"
    );
    assert_eq!(
        c.final_tensors(),
        unsharded,
        "the sharded run's final state differs from the unsharded run's"
    );
}

#[test]
fn a_killed_node_is_dropped_after_the_grace_period_and_the_job_grows_when_one_joins() {
    let (_serial, mut c) = three_nodes(&["node3"], &[]);
    c.wait_for_step(10);
    c.kill_node("node1");
    c.wait_for("the lost node", |l| l.starts_with("node lost:"));
    c.wait_for("the rollback", |l| {
        l.contains("resuming from the snapshot at step")
    });
    // No replacement within the grace period: the job goes on with two nodes; then one joins.
    c.wait_for("the placement on two nodes", |l| {
        l.starts_with("stage placement:")
    });
    c.start_node("node3");
    c.wait_for("the scale-up", |l| {
        l.contains("re-planned without a rollback")
    });
    let r = c.finish();
    let rec = one_recovery(&r);
    assert_eq!(nodes_before_after(rec), (Some(3), Some(2)), "{rec}");
    let grow = &r["reshapes"].as_array().expect("reshapes")[0];
    assert_eq!(nodes_before_after(grow), (Some(2), Some(3)), "{grow}");
    let placed = placed(&r);
    assert!(
        placed.contains(&"node3") && !placed.contains(&"node1"),
        "{placed:?}"
    );
    c.assert_matches_uninterrupted();
}

#[test]
fn a_stopped_node_is_evicted_after_the_node_timeout_and_the_job_finishes() {
    let (_serial, mut c) = three_nodes(&[], &[]);
    c.wait_for_step(10);
    assert!(signal(&c.nodes["node2"], "STOP").expect("kill").success());
    let lost = c.wait_for("the silent node", |l| l.starts_with("node lost: node2"));
    assert!(lost.contains("no heartbeat"), "{lost}");
    let r = c.finish();
    let rec = one_recovery(&r);
    assert_eq!(nodes_before_after(rec), (Some(3), Some(2)), "{rec}");
    c.assert_matches_uninterrupted();
}

#[test]
fn a_killed_broker_is_restarted_and_the_nodes_rejoin_its_run() {
    let (_serial, mut c) = three_nodes(&[], &[]);
    let killed_at = c.wait_for_step(2 * INTERVAL + 2);
    let mut broker = c.broker.take().expect("broker");
    broker.kill().expect("SIGKILL the broker");
    broker.wait().expect("reap");
    c.start_broker(true, &[]);
    let from = c.wait_for_resume(killed_at);
    c.finish_resumed_run(from);
}

impl Cluster {
    /// Waits for a new broker's resume after its predecessor was killed past `killed_at`; the
    /// step it resumed from, checked to be a checkpoint at most two intervals back (the one due
    /// just before the kill may still have been on its way to disk).
    fn wait_for_resume(&mut self, killed_at: u64) -> u64 {
        let resumed = self.wait_for("the resume", |l| l.starts_with("resumed from"));
        let from: u64 = resumed
            .rsplit(' ')
            .next()
            .and_then(|s| s.parse().ok())
            .expect("step");
        assert!(
            from.is_multiple_of(INTERVAL) && from + 2 * INTERVAL >= killed_at,
            "{resumed} (killed at {killed_at})"
        );
        from
    }

    /// Finishes a run a new broker resumed from step `from`: every node rejoined and ended
    /// cleanly, and the final state is an uninterrupted run's.
    fn finish_resumed_run(&mut self, from: u64) {
        let r = self.finish();
        assert_eq!(r["start_step"].as_u64(), Some(from), "{r}");
        for (name, node) in &mut self.nodes {
            let status = node.wait().expect("node exit");
            assert!(
                status.success(),
                "{name} did not finish cleanly after rejoining"
            );
        }
        self.assert_matches_uninterrupted();
    }
}

/// A real etcd for the standby case, or None where it is not installed and this is not CI.
fn etcd() -> Option<(tokio::runtime::Runtime, fusion_coord::LocalEtcd)> {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let server = rt
        .block_on(fusion_coord::LocalEtcd::start_if_installed())
        .expect("etcd starts")?;
    Some((rt, server))
}

#[test]
fn a_standby_broker_elected_through_etcd_takes_the_run_over_when_the_leader_is_killed() {
    let _serial = lock();
    uninterrupted();
    let Some((_rt, etcd)) = etcd() else { return };
    let mut c = Cluster::new(3, &NODES);
    let standby_port = free_port();
    c.brokers = format!(
        "https://127.0.0.1:{},https://127.0.0.1:{standby_port}",
        c.port
    );
    let elect = ["--etcd", &etcd.endpoint, "--lease-ttl", "3"];
    c.start_broker(false, &elect);
    let standby = c.spawn_broker(&[], standby_port, false, &elect);
    c.standbys.push(standby);
    c.wait_for("the standby", |l| l.starts_with("standing by"));
    for n in NODES {
        c.start_node(n);
    }
    let killed_at = c.wait_for_step(2 * INTERVAL + 2);
    let standby = c.standbys.pop().expect("the standby");
    let mut leader = c.broker.replace(standby).expect("leader");
    leader.kill().expect("SIGKILL the leader");
    leader.wait().expect("reap");
    c.wait_for("the election", |l| l.starts_with("elected leader"));
    c.wait_for("the takeover", |l| l.starts_with("taking over run"));
    let from = c.wait_for_resume(killed_at);
    // A third broker stands by behind the new leader, on the dead one's port.
    let third = c.spawn_broker(&[], c.port, false, &elect);
    c.standbys.push(third);
    c.wait_for("the third broker", |l| l.starts_with("standing by"));
    c.finish_resumed_run(from);
    // Elected once the run is over, the third sees it finished and exits cleanly.
    c.broker = c.standbys.pop();
    let finished_elsewhere = |l: &str| l.contains("finished under another broker");
    // It may have said so before the new leader printed its summary.
    if !c.seen.iter().any(|l| finished_elsewhere(l)) {
        c.wait_for("the third broker's exit", finished_elsewhere);
    }
    let status = c.broker.take().expect("third").wait().expect("exit");
    assert!(status.success(), "{}", c.seen.join("\n"));
}

#[test]
fn a_node_leaving_on_sigterm_hands_over_its_stage_without_a_rollback() {
    let (_serial, mut c) = three_nodes(&[], &[]);
    c.wait_for_step(10);
    assert!(signal(&c.nodes["node1"], "TERM").expect("kill").success());
    c.wait_for("the re-plan", |l| {
        l.contains("re-planned without a rollback: node1 leaves")
    });
    let mut leaver = c.nodes.remove("node1").expect("node1");
    let status = leaver.wait().expect("node1 exit");
    assert!(status.success(), "the leaving node exits cleanly: {status}");
    let r = c.finish();
    assert!(
        r["recoveries"].as_array().expect("recoveries").is_empty(),
        "{r}"
    );
    assert!(
        r["failures"].as_array().expect("failures").is_empty(),
        "{r}"
    );
    assert_eq!(r["reshapes"].as_array().expect("reshapes").len(), 1, "{r}");
    c.assert_matches_uninterrupted();
}

#[test]
fn a_coordinator_stalled_longer_than_the_node_timeout_loses_no_node() {
    // The first snapshot stalls the coordinator 4 s, past the 3 s node timeout.
    let (_serial, mut c) = three_nodes(&[], &["--test-snapshot-stall-ms", "4000"]);
    let r = c.finish();
    assert!(
        r["failures"].as_array().expect("failures").is_empty(),
        "{r}"
    );
    let taken = r["snapshots"]["taken"].as_u64();
    assert!(taken.is_some_and(|n| n >= STEPS / INTERVAL), "{r}");
    c.assert_matches_uninterrupted();
}

/// Asserts that an evicted node's process ended with an error that names its eviction.
fn assert_exited_evicted(c: &mut Cluster, name: &str) {
    let mut node = c.nodes.remove(name).expect("the evicted node");
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = node.try_wait().expect("exit status") {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = node.kill();
            panic!("{name} did not exit after its eviction");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(!status.success(), "{name} exits with an error when evicted");
    let log = std::fs::read_to_string(c.path(&format!("{name}.log"))).expect("log");
    assert!(log.contains("evicted by the broker"), "{log}");
}

/// Waits for the first lost node, which must be node1 evicted with a reason containing every
/// part of `why`; then checks that the run finished with that one recovery (marked evicted, 3
/// nodes before and 2 after), that node1 exited with an error, and that the final state matches
/// an uninterrupted run.
fn assert_node1_evicted_and_the_job_finished(c: &mut Cluster, why: &[&str]) {
    let lost = c.wait_for("the eviction", |l| l.starts_with("node lost: "));
    assert!(
        lost.starts_with("node lost: node1: evicted: ") && why.iter().all(|w| lost.contains(w)),
        "{lost}"
    );
    let r = c.finish();
    let rec = one_recovery(&r);
    assert_eq!(rec["evicted"].as_bool(), Some(true), "{rec}");
    assert_eq!(nodes_before_after(rec), (Some(3), Some(2)), "{rec}");
    assert_exited_evicted(c, "node1");
    c.assert_matches_uninterrupted();
}

/// Three nodes with a 3 s stall timeout, node1 started with `hooks`.
fn three_nodes_node1_with(hooks: &[&str]) -> (std::sync::MutexGuard<'static, ()>, Cluster) {
    three_nodes_with(&[], &["--stall-timeout", "3"], "node1", hooks)
}

#[test]
fn a_wedged_compute_thread_is_blamed_and_evicted_though_its_heartbeats_go_on() {
    let (_serial, mut c) = three_nodes_node1_with(&["--test-wedge-at-step", "12"]);
    assert_node1_evicted_and_the_job_finished(&mut c, &["stalled", "computing (step 12"]);
}

#[test]
fn a_node_that_stops_reading_is_blamed_through_the_tensors_it_never_took_in() {
    let (_serial, mut c) = three_nodes_node1_with(&["--test-stop-reading-at-step", "12"]);
    assert_node1_evicted_and_the_job_finished(&mut c, &["has not taken in the tensors"]);
}

/// A fault-injecting TCP proxy in front of one node's data plane: it forwards both ways until
/// cut, then reads and drops everything, as a link that lost its route (the senders' writes still
/// succeed; nothing arrives); or, once armed to reset, it forwards half of the next bytes that
/// pass and drops that connection, as a TCP reset in the middle of a tensor.
struct CuttableProxy {
    port: u16,
    faults: std::sync::Arc<Faults>,
}

#[derive(Default)]
struct Faults {
    cut: std::sync::atomic::AtomicBool,
    reset: std::sync::atomic::AtomicBool,
    stop: std::sync::atomic::AtomicBool,
}

impl CuttableProxy {
    /// Listens on 127.0.0.1 and forwards to the same port on 127.0.0.2, where the node listens.
    fn start() -> CuttableProxy {
        use std::sync::atomic::Ordering;
        use std::sync::Arc;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("proxy listener");
        listener.set_nonblocking(true).expect("nonblocking");
        let port = listener.local_addr().expect("address").port();
        let faults = Arc::new(Faults::default());
        let f = faults.clone();
        std::thread::spawn(move || {
            while !f.stop.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((down, _)) => {
                        let Ok(up) = std::net::TcpStream::connect(("127.0.0.2", port)) else {
                            continue;
                        };
                        for (from, to) in [(&down, &up), (&up, &down)] {
                            let (from, to) = (from.try_clone(), to.try_clone());
                            let (Ok(from), Ok(to)) = (from, to) else {
                                continue;
                            };
                            let f = f.clone();
                            std::thread::spawn(move || pump(from, to, &f));
                        }
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        });
        CuttableProxy { port, faults }
    }

    fn cut(&self) {
        self.faults
            .cut
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Drops the next connection that carries data, half-way through what it carries; waits
    /// (bounded) until it has.
    fn reset_once(&self) {
        use std::sync::atomic::Ordering;
        self.faults.reset.store(true, Ordering::SeqCst);
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.faults.reset.load(Ordering::SeqCst) {
            assert!(Instant::now() < deadline, "no data crossed the proxy");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for CuttableProxy {
    fn drop(&mut self) {
        self.faults
            .stop
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Copies `from` to `to` until either closes or the proxy stops; once cut, drops what it reads;
/// armed to reset, forwards half of what it reads next and closes both sides.
fn pump(mut from: std::net::TcpStream, mut to: std::net::TcpStream, f: &Faults) {
    use std::io::{Read, Write};
    use std::sync::atomic::Ordering;
    let _ = from.set_read_timeout(Some(Duration::from_millis(200)));
    let mut buf = vec![0u8; 64 << 10];
    while !f.stop.load(Ordering::Relaxed) {
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) if n > 1 && f.reset.swap(false, Ordering::SeqCst) => {
                let _ = to.write_all(&buf[..n / 2]);
                let _ = from.shutdown(std::net::Shutdown::Both);
                break;
            }
            Ok(n) if !f.cut.load(Ordering::SeqCst) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => break,
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Both);
}

/// Three nodes, every data-plane link into node1 through a proxy (the broker reaches node1
/// directly), trained past step 10.
fn three_nodes_node1_behind_a_proxy() -> (CuttableProxy, std::sync::MutexGuard<'static, ()>, Cluster)
{
    let proxy = CuttableProxy::start();
    let listen = format!("127.0.0.2:{}", proxy.port);
    let (serial, mut c) =
        three_nodes_node1_with(&["--data-listen", &listen, "--advertise", "127.0.0.1"]);
    c.wait_for_step(10);
    (proxy, serial, c)
}

#[test]
fn a_cut_link_into_a_node_blames_the_node_that_never_receives_and_the_job_goes_on() {
    let (proxy, _serial, mut c) = three_nodes_node1_behind_a_proxy();
    proxy.cut();
    assert_node1_evicted_and_the_job_finished(&mut c, &["has not taken in the tensors"]);
}

#[test]
fn a_connection_dropped_mid_tensor_is_reopened_and_nothing_is_rolled_back() {
    let (proxy, _serial, mut c) = three_nodes_node1_behind_a_proxy();
    proxy.reset_once();
    let r = c.finish();
    for key in ["recoveries", "failures"] {
        assert!(r[key].as_array().expect(key).is_empty(), "{r}");
    }
    let healed = NODES.iter().any(|n| {
        std::fs::read_to_string(c.path(&format!("{n}.log")))
            .is_ok_and(|l| l.contains("the session to node1 broke"))
    });
    assert!(healed, "a sender to node1 re-opened its session");
    c.assert_matches_uninterrupted();
}

/// Fills the file system of `dir` (as the broker process `pid` sees it) with one file until a
/// write fails for want of space; returns the file.
fn fill_up(pid: u32, dir: &Path) -> PathBuf {
    use std::io::Write;
    let seen =
        PathBuf::from(format!("/proc/{pid}/root")).join(dir.strip_prefix("/").expect("absolute"));
    let ballast = seen.join("ballast");
    let mut f = std::fs::File::create(&ballast).expect("ballast");
    let block = vec![0xA5u8; 1 << 16];
    // A 64 MiB file system: at most 1024 blocks.
    for _ in 0..2048 {
        if let Err(e) = f.write_all(&block).and_then(|()| f.sync_all()) {
            assert_eq!(e.raw_os_error(), Some(28), "{e}");
            return ballast;
        }
    }
    panic!("{} never filled up", seen.display());
}

#[test]
fn a_full_disk_skips_snapshots_with_a_warning_and_the_run_goes_on_once_space_returns() {
    let _serial = lock();
    uninterrupted();
    let mut c = Cluster::new(3, &NODES);
    // The broker keeps its state on a 64 MiB tmpfs of its own (a mount namespace), which the
    // test fills up; checkpoints stay on the real disk (so they are copies, not links).
    let state = c.path("state");
    std::fs::create_dir_all(&state).expect("state dir");
    let mount = "mount -t tmpfs -o size=64m tmpfs \"$0\" && exec \"$@\"";
    let st = state.to_str().expect("utf8");
    c.start_broker_under(
        &["unshare", "--mount", "sh", "-c", mount, st],
        false,
        &["--state-dir", st],
    );
    for n in NODES {
        c.start_node(n);
    }
    c.wait_for_step(INTERVAL + 2);
    let pid = c.broker.as_ref().expect("broker").id();
    let ballast = fill_up(pid, &state);
    let warned = c.wait_for("a skipped snapshot", |l| l.contains("was not taken"));
    assert!(warned.contains("No space left on device"), "{warned}");
    std::fs::remove_file(&ballast).expect("free the space");
    let r = c.finish();
    let skipped = r["snapshots"]["snapshot_failures"]
        .as_array()
        .expect("failures");
    assert!(!skipped.is_empty(), "{r}");
    assert!(
        r["recoveries"].as_array().expect("recoveries").is_empty(),
        "{r}"
    );
    // Snapshots went on once space returned, and nothing was lost.
    let taken = r["snapshots"]["taken"].as_u64().unwrap_or(0);
    assert!(taken + skipped.len() as u64 >= STEPS / INTERVAL, "{r}");
    c.assert_matches_uninterrupted();
}

impl Cluster {
    /// The step of the newest sharded snapshot whose manifest the broker wrote.
    fn newest_sharded_snapshot(&self) -> Option<u64> {
        let dir = self.path("ckpt").join("sharded");
        std::fs::read_dir(dir)
            .ok()?
            .flatten()
            .filter(|e| e.path().join("manifest.json").is_file())
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().to_string();
                name.strip_prefix("step-")?.parse().ok()
            })
            .max()
    }

    /// Waits (bounded) until the broker wrote the manifest of a sharded snapshot newer than
    /// any now (so that the next one is a step away); returns its step.
    fn wait_for_new_sharded_snapshot(&mut self) -> u64 {
        let before = self.newest_sharded_snapshot();
        let deadline = Instant::now() + Duration::from_secs(240);
        loop {
            if let Some(step) = self.newest_sharded_snapshot().filter(|&s| Some(s) > before) {
                return step;
            }
            assert!(
                Instant::now() < deadline,
                "no new sharded snapshot; output so far:\n{}",
                self.seen.join("\n")
            );
            while let Ok(l) = self.lines.try_recv() {
                self.seen.push(l);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Sharded snapshots every 2 steps between the checkpoints (every 5): node1, holding its stage's
/// shard and a buddy's copy of another, is killed; the spare, whose disk holds nothing, fetches
/// the shards its stage needs from the surviving copies and the run goes on from the sharded
/// snapshot, bit for bit. The manifest the broker wrote merges into a checkpoint that loads.
#[test]
fn a_killed_node_is_restored_from_its_buddys_copy_of_a_sharded_snapshot() {
    let _serial = lock();
    uninterrupted();
    let mut c = Cluster::new(3, &["node0", "node1", "node2", "node3"]);
    c.start_broker(false, &["--snapshots", "sharded", "--snapshot-every", "2"]);
    let state = |c: &Cluster, n: &str| c.path(&format!("state-{n}"));
    for n in NODES {
        let dir = state(&c, n);
        c.start_node_with(n, &["--state-dir", dir.to_str().expect("utf8")]);
    }
    c.wait_for_step(1);
    let dir = state(&c, "node3");
    c.start_node_with("node3", &["--state-dir", dir.to_str().expect("utf8")]);
    c.wait_for("the spare", |l| l.starts_with("node3 joined"));
    c.wait_for_new_sharded_snapshot();
    c.kill_node("node1");
    c.wait_for("the lost node", |l| l.starts_with("node lost:"));
    let r = c.finish();
    let rec = one_recovery(&r);
    assert_eq!(rec["from_shards"].as_bool(), Some(true), "{rec}");
    let from = rec["resumed_from_step"].as_u64().expect("step");
    assert!(!from.is_multiple_of(INTERVAL), "{rec}");
    assert_eq!(nodes_before_after(rec), (Some(3), Some(3)), "{rec}");
    c.assert_matches_uninterrupted();
    // The newest manifest names shards on the nodes' disks; merged, it is a checkpoint of its step.
    let sharded = c.path("ckpt").join("sharded");
    let newest = std::fs::read_dir(&sharded)
        .expect("manifests")
        .flatten()
        .map(|e| e.path())
        .max()
        .expect("a manifest");
    let out = c.path("merged");
    let merged = exe()
        .args(["checkpoint", "merge", newest.to_str().expect("utf8")])
        .args(["--out", out.to_str().expect("utf8")])
        .output()
        .expect("merge");
    assert!(
        merged.status.success(),
        "{}",
        String::from_utf8_lossy(&merged.stderr)
    );
    let step: u64 = newest
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("step-"))
        .and_then(|n| n.parse().ok())
        .expect("step directory");
    let state = out.join(format!("step-{step:08}")).join("state.json");
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&state).expect("merged checkpoint")).expect("json");
    assert_eq!(v["step"].as_u64(), Some(step), "{v}");
}

/// Sharded snapshots every 2 steps, made beside training: each node writes its shard only once it
/// has begun the training step two steps later (a test hook; a pipeline that waited for the write
/// would never get there, and the hook would give up and say so after two minutes). Snapshots are
/// made, none fails, and training is unchanged, bit for bit.
#[test]
fn sharded_snapshots_are_written_and_copied_while_training_goes_on() {
    let _serial = lock();
    uninterrupted();
    let mut c = Cluster::new(3, &NODES);
    // Checkpoints (gathered, which give a sharded snapshot in flight up) only at the end.
    let job = std::fs::read_to_string(c.path("job.toml")).expect("job");
    let every = format!("checkpoint_every = {INTERVAL}");
    assert!(job.contains(&every), "{job}");
    std::fs::write(
        c.path("job.toml"),
        job.replace(&every, "checkpoint_every = 0"),
    )
    .expect("job");
    c.start_broker(false, &["--snapshots", "sharded", "--snapshot-every", "2"]);
    for n in NODES {
        c.start_node_with(n, &["--test-shard-write-after-steps", "2"]);
    }
    let r = c.finish();
    let snaps = &r["snapshots"];
    assert!(snaps["sharded"].as_u64().is_some_and(|n| n >= 3), "{snaps}");
    let failures = snaps["snapshot_failures"].as_array().expect("failures");
    assert!(failures.is_empty(), "{snaps}");
    assert!(
        r["recoveries"].as_array().expect("recoveries").is_empty(),
        "{r}"
    );
    for n in NODES {
        let log = std::fs::read_to_string(c.path(&format!("{n}.log"))).expect("node log");
        assert!(
            log.contains("test hook: writing the shard of step"),
            "{n}:\n{log}"
        );
        assert!(!log.contains("did not go on beside"), "{n}:\n{log}");
    }
    c.assert_matches_uninterrupted();
}

/// Sharded snapshots every 2 steps, gathered checkpoints every 20: the broker is SIGKILLed once
/// a sharded snapshot newer than the checkpoint is on record and restarted with `--resume`. It
/// goes on from that snapshot's manifest (not the older checkpoint), the nodes, which kept their
/// disks, load or fetch their stages' shards, and the run ends as an uninterrupted one.
#[test]
fn a_restarted_broker_resumes_from_the_nodes_sharded_snapshot() {
    let _serial = lock();
    uninterrupted();
    let mut c = Cluster::new(3, &NODES);
    let job = std::fs::read_to_string(c.path("job.toml")).expect("job");
    let every = format!("checkpoint_every = {INTERVAL}");
    std::fs::write(
        c.path("job.toml"),
        job.replace(&every, "checkpoint_every = 20"),
    )
    .expect("job");
    c.start_broker(false, &["--snapshots", "sharded", "--snapshot-every", "2"]);
    for n in NODES {
        c.start_node(n);
    }
    c.wait_for_step(21);
    let mut at = c.wait_for_new_sharded_snapshot();
    while at <= 20 {
        at = c.wait_for_new_sharded_snapshot();
    }
    let mut broker = c.broker.take().expect("broker");
    broker.kill().expect("SIGKILL the broker");
    broker.wait().expect("reap");
    c.start_broker(true, &["--snapshots", "sharded", "--snapshot-every", "2"]);
    let resumed = c.wait_for("the resume", |l| l.starts_with("resumed from"));
    let from: u64 = resumed
        .rsplit(' ')
        .next()
        .and_then(|s| s.parse().ok())
        .expect("step");
    assert!(resumed.contains("sharded"), "{resumed}");
    assert!(
        from >= at && !from.is_multiple_of(20),
        "{resumed} (snapshot {at})"
    );
    c.finish_resumed_run(from);
}

/// Sharded snapshots as above, but node1 and node2, which hold both copies of stage 1's shard,
/// are killed together: no copy survives, so the broker goes on from its own snapshot (the
/// checkpoint before) instead, on the nodes it has, bit for bit.
#[test]
fn losing_every_copy_of_a_shard_rolls_back_to_the_brokers_snapshot() {
    let _serial = lock();
    uninterrupted();
    let mut c = Cluster::new(3, &NODES);
    c.start_broker(false, &["--snapshots", "sharded", "--snapshot-every", "2"]);
    for n in NODES {
        c.start_node(n);
    }
    let at = c.wait_for_new_sharded_snapshot();
    c.kill_node("node1");
    c.kill_node("node2");
    // The broker's own snapshot is the checkpoint before: every INTERVAL steps.
    let base = at - at % INTERVAL;
    let gone = c.wait_for("the lost copies", |l| l.contains("every copy of shard"));
    assert!(
        gone.contains(&format!(
            "going on from the broker's snapshot of step {base}"
        )),
        "{gone}"
    );
    c.start_node("node1");
    c.start_node("node2");
    let r = c.finish();
    let recoveries = r["recoveries"].as_array().expect("recoveries");
    let rec = recoveries.last().expect("a recovery");
    assert_eq!(rec["from_shards"].as_bool(), Some(false), "{rec}");
    assert_eq!(rec["resumed_from_step"].as_u64(), Some(base), "{rec}");
    c.assert_matches_uninterrupted();
}

/// Two islands of two nodes (replicas synchronised every INTERVAL steps by outer SGD at rate 1
/// without momentum; SGD without momentum inside, so a synchronised state is the parameters
/// alone) and a spare. Equal shares: automatic ones follow measured speed, and two runs would
/// not end on the same bits.
fn islands_cluster(recovery: &str, node1: &[&str]) -> Cluster {
    islands_cluster_with(INTERVAL, false, recovery, node1)
}

/// [`islands_cluster`], synchronising every `every` steps, overlapped or not.
fn islands_cluster_with(every: u64, overlap: bool, recovery: &str, node1: &[&str]) -> Cluster {
    let names = ["node0", "node1", "node2", "node3", "node4"];
    let mut c = Cluster::with_job(
        4,
        &names,
        "replicas = 2\n",
        &format!(
            "[train.optimizer]\nkind = \"sgd\"\nmomentum = 0.0\nweight_decay = 0.0\n\
             [train.outer]\nevery = {every}\nlr = 1.0\nmomentum = 0.0\nshares = \"equal\"\n\
             recovery = \"{recovery}\"\noverlap = {overlap}\n"
        ),
    );
    c.start_broker(false, &[]);
    for n in &names[..4] {
        c.start_node_with(n, if *n == "node1" { node1 } else { &[] });
    }
    c
}

/// A node of one island dying in the middle of a round (its process exits when the broker runs
/// step 12, as a crash would: the kernel closes its connections) takes only its island out: the
/// other island keeps its state and goes on from the interrupted step without a rollback, the
/// next synchronisation is the survivor's alone, and there the islands are re-formed from a
/// snapshot with the spare and the lost island's other node.
#[test]
fn an_islands_node_dying_mid_round_takes_only_its_island_out_until_the_next_synchronisation() {
    let _serial = lock();
    let crash_at = (2 * INTERVAL + 2).to_string();
    let mut c = islands_cluster("local", &["--test-crash-at-step", &crash_at]);
    c.wait_for_step(1);
    c.start_node("node4");
    c.wait_for("the spare", |l| l.starts_with("node4 joined"));
    c.wait_for("a failure", |l| {
        l.starts_with("node lost:") || l.starts_with("step failed")
    });
    let out = c.wait_for("the island taken out", |l| l.contains(" is out; "));
    let island = out
        .split("island ")
        .nth(1)
        .and_then(|t| t.split_whitespace().next())
        .and_then(|n| n.parse::<u64>().ok())
        .unwrap_or_else(|| panic!("which island: {out}"));
    let r = c.finish();
    assert!(
        !c.seen
            .iter()
            .any(|l| l.contains("resuming from the snapshot")),
        "an island's loss rolled every island back:\n{}",
        c.seen.join("\n")
    );
    let rec = one_recovery(&r);
    // node1's, or its island peer's report of losing it, whichever the broker heard first.
    assert_eq!(rec["island_out"].as_u64(), Some(island), "{rec}");
    assert_eq!(rec["steps_lost"].as_u64(), Some(0), "{rec}");
    assert_eq!(
        rec["resumed_from_step"], rec["interrupted_at_step"],
        "{rec}"
    );
    assert_eq!(nodes_before_after(rec), (Some(4), Some(2)), "{rec}");
    // Every step ran once, in order: nothing was rolled back or repeated.
    let steps: Vec<u64> = r["steps"]
        .as_array()
        .expect("steps")
        .iter()
        .filter_map(|s| s["step"].as_u64())
        .collect();
    assert_eq!(steps, (1..=STEPS).collect::<Vec<u64>>());
    // Re-formed at the first synchronisation after the loss, with the spare.
    let reshapes = r["reshapes"].as_array().expect("reshapes");
    let reform = reshapes
        .iter()
        .find(|x| {
            x["why"]
                .as_str()
                .is_some_and(|w| w.starts_with("re-forming 2 islands"))
        })
        .unwrap_or_else(|| panic!("no re-forming reshape: {r}"));
    let at = reform["step"].as_u64().expect("step");
    let lost_at = rec["interrupted_at_step"].as_u64().expect("step");
    assert_eq!(
        at,
        (lost_at / INTERVAL + 1) * INTERVAL,
        "{reform} after {rec}"
    );
    assert_eq!(reform["nodes_after"].as_u64(), Some(4), "{reform}");
    assert!(placed(&r).contains(&"node4"), "{:?}", placed(&r));
    assert_eq!(r["outer"]["syncs"].as_u64(), Some(STEPS / INTERVAL), "{r}");
    // Listed only when there are any.
    assert!(r["outer"]["disagreements"].is_null(), "{}", r["outer"]);
}

/// A finished islands run that lost a node of one island: only that island was taken out
/// (no rollback, nothing lost, every step run once, in order), and the islands were re-formed
/// with the spare at the first synchronisation after the loss (they come every `period` steps).
fn assert_island_out_and_reformed(c: &Cluster, r: &serde_json::Value, period: u64) {
    assert!(
        !c.seen
            .iter()
            .any(|l| l.contains("resuming from the snapshot")),
        "an island's loss rolled every island back:\n{}",
        c.seen.join("\n")
    );
    let rec = one_recovery(r);
    assert!(rec["island_out"].as_u64().is_some(), "{rec}");
    assert_eq!(rec["steps_lost"].as_u64(), Some(0), "{rec}");
    let steps: Vec<u64> = r["steps"]
        .as_array()
        .expect("steps")
        .iter()
        .filter_map(|s| s["step"].as_u64())
        .collect();
    assert_eq!(steps, (1..=STEPS).collect::<Vec<u64>>());
    let reform = r["reshapes"]
        .as_array()
        .expect("reshapes")
        .iter()
        .find(|x| {
            x["why"]
                .as_str()
                .is_some_and(|w| w.starts_with("re-forming 2 islands"))
        })
        .unwrap_or_else(|| panic!("no re-forming reshape: {r}"));
    let lost_at = rec["interrupted_at_step"].as_u64().expect("step");
    assert_eq!(
        reform["step"].as_u64(),
        Some((lost_at / period + 1) * period),
        "{reform} after {rec}"
    );
    assert!(placed(r).contains(&"node4"), "{:?}", placed(r));
}

/// Islands that overlap their synchronisations (every 2 steps) lose a node under the default
/// `recovery = "local"`: only its island is taken out; the island left drops the exchange under
/// way with the old placement (its ring held the lost island) and goes on from the interrupted
/// step without a rollback, its next synchronisation (blocking, its own) carrying the dropped
/// round; there the islands are re-formed with the spare.
#[test]
fn an_overlapping_islands_node_killed_mid_run_takes_only_its_island_out() {
    let _serial = lock();
    let mut c = islands_cluster_with(2, true, "local", &[]);
    c.wait_for_step(1);
    c.start_node("node4");
    c.wait_for("the spare", |l| l.starts_with("node4 joined"));
    // Step 12's synchronisation overlaps (a snapshot's, at 16, blocks): an exchange is under
    // way from here until then.
    c.wait_for_step(2 * INTERVAL + 2);
    c.kill_node("node1");
    c.wait_for("the lost node", |l| l.starts_with("node lost:"));
    let r = c.finish();
    assert_island_out_and_reformed(&c, &r, 2);
    assert!(
        r["outer"]["overlapped"].as_u64().is_some_and(|o| o > 0),
        "{}",
        r["outer"]
    );
    // The survivors held an exchange under way when the island was taken out.
    assert!(
        c.seen
            .iter()
            .any(|l| l.contains("the islands left drop the overlapped exchange of step")),
        "no exchange was under way:\n{}",
        c.seen.join("\n")
    );
    assert!(r["outer"]["disagreements"].is_null(), "{}", r["outer"]);
}

/// Streaming islands lose a node: two islands synchronising one of 2 fragments every 2 steps
/// (H = 4) and a spare. node1 is SIGKILLed mid-run: only its island is taken out, the other
/// goes on from the interrupted step (its next synchronisations are its own), the next one
/// after the loss takes every fragment, so the islands hold the same parameters, and there
/// they are re-formed with the spare.
#[test]
fn a_streaming_islands_node_killed_mid_run_takes_only_its_island_out() {
    let _serial = lock();
    let names = ["node0", "node1", "node2", "node3", "node4"];
    let mut c = Cluster::with_job(
        4,
        &names,
        "replicas = 2\n",
        "[train.optimizer]\nkind = \"sgd\"\nmomentum = 0.0\nweight_decay = 0.0\n\
         [train.outer]\nevery = 4\nfragments = 2\nlr = 1.0\nmomentum = 0.0\n\
         shares = \"equal\"\nrecovery = \"local\"\n",
    );
    // Snapshots and checkpoints (which take every fragment) rarely: the islands re-form at the
    // next synchronisation after the loss because it is one, not because a snapshot was due.
    let job = std::fs::read_to_string(c.path("job.toml")).expect("job");
    let rare = job.replace(
        &format!("checkpoint_every = {INTERVAL}"),
        "checkpoint_every = 40",
    );
    assert_ne!(job, rare, "the job's checkpoint interval");
    std::fs::write(c.path("job.toml"), rare).expect("job");
    c.start_broker(false, &["--snapshot-every", "40"]);
    for n in &names[..4] {
        c.start_node(n);
    }
    c.wait_for_step(1);
    c.start_node("node4");
    c.wait_for("the spare", |l| l.starts_with("node4 joined"));
    c.wait_for_step(2 * INTERVAL + 3);
    c.kill_node("node1");
    c.wait_for("the lost node", |l| l.starts_with("node lost:"));
    let r = c.finish();
    assert_island_out_and_reformed(&c, &r, 2);
    // 40 synchronisations: the snapshot's, the last, the one after the loss and those of
    // the re-formed placement's setup take every fragment; the others one.
    let partial = r["outer"]["partial"].as_u64().expect("partial");
    assert!(partial >= 30, "{}", r["outer"]);
    assert!(r["outer"]["disagreements"].is_null(), "{}", r["outer"]);
}

/// With `recovery = "rollback"` an island's lost node rolls every island back to the last
/// synchronisation's snapshot, and the run ends on the bits of an uninterrupted one.
#[test]
fn an_islands_node_killed_mid_run_under_rollback_recovery_rolls_every_island_back() {
    let _serial = lock();
    let mut clean = islands_cluster("rollback", &[]);
    let r = clean.finish();
    assert!(r["recoveries"].as_array().expect("recoveries").is_empty());
    assert_eq!(r["outer"]["syncs"].as_u64(), Some(STEPS / INTERVAL), "{r}");
    let mut c = islands_cluster("rollback", &[]);
    c.wait_for_step(1);
    c.start_node("node4");
    c.wait_for("the spare", |l| l.starts_with("node4 joined"));
    c.wait_for_step(2 * INTERVAL + 2);
    c.kill_node("node1");
    c.wait_for("the lost node", |l| l.starts_with("node lost:"));
    let resumed = c.wait_for("the rollback", |l| {
        l.contains("resuming from the snapshot at step")
    });
    // Islands are snapshotted only where they agree: right after a synchronisation.
    let at = resumed
        .split("snapshot at step ")
        .nth(1)
        .and_then(|t| t.split_whitespace().next())
        .and_then(|n| n.parse::<u64>().ok())
        .expect("the step resumed from");
    assert!(at > 0 && at.is_multiple_of(INTERVAL), "{resumed}");
    let r = c.finish();
    let rec = one_recovery(&r);
    assert_eq!(nodes_before_after(rec), (Some(4), Some(4)), "{rec}");
    assert!(placed(&r).contains(&"node4"), "{:?}", placed(&r));
    assert_eq!(
        c.final_tensors(),
        clean.final_tensors(),
        "the islands' final state differs from an uninterrupted run"
    );
}

/// Islands that overlap their synchronisations (every 2 steps; the ones before a snapshot, every
/// INTERVAL steps, block) under `recovery = "rollback"` recover from a killed node by rolling
/// every island back: the exchange under way belongs to the abandoned placement and ends on
/// its poisoned mailbox, and the run resumes from the last snapshot, taken where the islands
/// agree, and ends on the bits of an uninterrupted overlapping run.
#[test]
fn an_overlapping_islands_node_killed_mid_run_rolls_every_island_back_to_the_same_bits() {
    let _serial = lock();
    let mut clean = islands_cluster_with(2, true, "rollback", &[]);
    let r = clean.finish();
    assert!(r["recoveries"].as_array().expect("recoveries").is_empty());
    let overlapped = r["outer"]["overlapped"].as_u64().expect("overlapped");
    assert!(
        overlapped > 0,
        "no synchronisation overlapped: {}",
        r["outer"]
    );
    let mut c = islands_cluster_with(2, true, "rollback", &[]);
    c.wait_for_step(1);
    c.start_node("node4");
    c.wait_for("the spare", |l| l.starts_with("node4 joined"));
    c.wait_for_step(2 * INTERVAL + 3);
    c.kill_node("node1");
    c.wait_for("the lost node", |l| l.starts_with("node lost:"));
    c.wait_for("the rollback", |l| {
        l.contains("resuming from the snapshot at step")
    });
    let r = c.finish();
    let recoveries = r["recoveries"].as_array().expect("recoveries");
    assert_eq!(recoveries.len(), 1, "{r}");
    let rec = &recoveries[0];
    assert!(
        rec["island_out"].is_null(),
        "an island alone was taken out: {rec}"
    );
    // Islands snapshot right after a synchronisation: a snapshot due between two waits for
    // the next, so a loss costs at most the interval and one round more.
    let resumed = rec["resumed_from_step"].as_u64().expect("resumed from");
    let lost = rec["steps_lost"].as_u64().expect("steps lost");
    assert!(resumed > 0 && resumed.is_multiple_of(2), "{rec}");
    assert!(lost < INTERVAL + 2, "{rec}");
    assert_eq!(
        r["outer"]["overlapped"].as_u64().map(|o| o > 0),
        Some(true),
        "{r}"
    );
    assert_eq!(
        c.final_tensors(),
        clean.final_tensors(),
        "the islands' final state differs from an uninterrupted overlapping run"
    );
}

//! `fusionllm bench --soak`: a long run of seeded random faults on a local cluster of separate
//! processes (a `fusionllm broker` and four `fusionllm node`s on loopback, gpt2-tiny on the
//! local launcher's two emulated sites, checkpoints every 20 steps, an evaluation every 5).
//! About every `--soak-every` seconds one fault from a seeded schedule lands:
//! a node SIGKILLed (restarted 5 s later, as a supervisor would), a node SIGSTOPped for 30 s
//! (evicted, then it learns so, exits and is restarted), a node SIGTERMed (it leaves without a
//! rollback, and comes back 20 s later: a join that grows the job), the links into node1's data
//! plane cut for 20 or 75 s in turn (a proxy in front of it stops moving bytes; the broker still
//! reaches it), or the broker SIGKILLed (a new one resumes the run from its checkpoints 2 s later; the
//! nodes rejoin it by themselves).
//! The run must finish; the table gives, per fault, what the broker said, the steps lost and
//! the time until the next placement was under way.

use anyhow::{bail, Context, Result};
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::soak_proxy::PartitionProxy;

const NODES: [&str; 4] = ["node0", "node1", "node2", "node3"];
const TOKEN: &str = "soak-bench-token";
/// How long a stopped node stays stopped (past the broker's 10 s node timeout).
const STOP_FOR: Duration = Duration::from_secs(30);
/// The node whose data plane a partition cuts off, and for how long: in turn shorter than the
/// broker's stall deadline (60 s; the sessions heal) and longer (someone is blamed).
const PARTITIONED: &str = "node1";
const PARTITION_FOR: [Duration; 2] = [Duration::from_secs(20), Duration::from_secs(75)];
/// How long after the next fault a fault's own loss may still be reported (the stall deadline).
const LATE_WORD: Duration = Duration::from_secs(60);

/// What the soak runs.
pub struct SoakConfig {
    pub seed: u64,
    pub minutes: u64,
    /// Mean seconds between faults.
    pub every_s: f64,
    /// Training steps of the job.
    pub steps: u64,
    /// Sharded snapshots between the checkpoints (else the broker's).
    pub sharded: bool,
}

/// What the schedule does to the cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Fault {
    KillNode,
    StopNode,
    LeaveNode,
    Partition,
    KillBroker,
}

/// One fault of the schedule: at `at_s` seconds into training, `fault` on `target`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Planned {
    pub at_s: f64,
    pub fault: Fault,
    pub target: String,
}

/// The seeded schedule: a fault every `every_s` seconds (±25%) for `minutes`, kinds and target
/// nodes drawn uniformly.
pub fn schedule(seed: u64, minutes: u64, every_s: f64) -> Vec<Planned> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let kinds = [
        Fault::KillNode,
        Fault::StopNode,
        Fault::LeaveNode,
        Fault::Partition,
        Fault::KillBroker,
    ];
    let end = minutes as f64 * 60.0;
    let mut out = Vec::new();
    let mut at = 0.0;
    loop {
        at += every_s * rng.random_range(0.75..1.25);
        if at >= end {
            return out;
        }
        let fault = kinds[rng.random_range(0..kinds.len())];
        let target = match fault {
            Fault::KillBroker => "broker".to_string(),
            Fault::Partition => PARTITIONED.to_string(),
            _ => NODES[rng.random_range(0..NODES.len())].to_string(),
        };
        out.push(Planned {
            at_s: at,
            fault,
            target,
        });
    }
}

/// What one fault cost, as the broker reported it.
#[derive(Clone, Debug, Default, Serialize)]
struct Outcome {
    at_s: f64,
    fault: String,
    target: String,
    /// The broker's first word on it (a lost node, a leave, a resume).
    said: String,
    /// Steps trained again (from the broker's rollback line; for a lost broker, the last step
    /// it printed minus where its successor resumed).
    steps_lost: Option<u64>,
    /// From the fault to the next placement (the run under way again), seconds.
    recovery_s: Option<f64>,
}

/// A broker output line, stamped when it was read.
type Line = (Instant, String);

struct Cluster {
    dir: PathBuf,
    port: u16,
    broker: Child,
    brokers_started: u32,
    nodes: BTreeMap<String, Child>,
    /// Nodes to start again, and when.
    restart_at: BTreeMap<String, Instant>,
    /// Stopped nodes, and when to continue them.
    cont_at: BTreeMap<String, Instant>,
    /// In front of PARTITIONED's data plane, and when to heal it once cut.
    proxy: PartitionProxy,
    heal_at: Option<Instant>,
    partitions: usize,
    sharded: bool,
    lines: mpsc::Receiver<Line>,
    tx: mpsc::Sender<Line>,
    log: Vec<Line>,
}

fn exe() -> Result<Command> {
    Ok(Command::new(std::env::current_exe()?))
}

fn signal(c: &Child, sig: &str) -> Result<()> {
    let ok = Command::new("kill")
        .args([&format!("-{sig}"), &c.id().to_string()])
        .stderr(Stdio::null())
        .status()
        .context("kill(1) (procps) is needed to signal processes")?;
    if !ok.success() {
        bail!("kill -{sig} {} failed", c.id());
    }
    Ok(())
}

impl Cluster {
    fn start(dir: &Path, steps: u64, sharded: bool) -> Result<Cluster> {
        let certs = dir.join("certs");
        let names = std::iter::once("broker").chain(NODES).collect::<Vec<_>>();
        let out = exe()?
            .args(["cert", "--out"])
            .arg(&certs)
            .args(["--names", &names.join(",")])
            .output()?;
        if !out.status.success() {
            bail!("cert: {}", String::from_utf8_lossy(&out.stderr));
        }
        // The local launcher's two sites: nodes pace their sends to the testbed's links.
        let testbed = dir.join("testbed.toml");
        std::fs::write(&testbed, crate::cluster::DEFAULT_TESTBED)?;
        let job = format!(
            "model = \"gpt2-tiny\"\nnodes = 4\ntestbed = \"{}\"\n[train]\nsteps = {steps}\n\
             eval_every = 5\neval_batches = 1\ncheckpoint_every = 20\ncheckpoint_dir = \"{}\"\n",
            testbed.display(),
            dir.join("ckpt").display()
        );
        std::fs::write(dir.join("job.toml"), job)?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let (tx, lines) = mpsc::channel();
        let broker = spawn_broker(dir, port, false, sharded, &tx)?;
        let mut c = Cluster {
            dir: dir.to_path_buf(),
            port,
            broker,
            brokers_started: 1,
            nodes: BTreeMap::new(),
            restart_at: BTreeMap::new(),
            cont_at: BTreeMap::new(),
            proxy: PartitionProxy::start().context("starting the partition proxy")?,
            heal_at: None,
            partitions: 0,
            sharded,
            lines,
            tx,
            log: Vec::new(),
        };
        for n in NODES {
            c.start_node(n)?;
        }
        Ok(c)
    }

    fn start_node(&mut self, name: &str) -> Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("{name}.log")))?;
        let child = exe()?
            .args([
                "node",
                "--broker",
                &format!("https://127.0.0.1:{}", self.port),
            ])
            .args(["--name", name, "--certs"])
            .arg(self.dir.join("certs"))
            .args(["--token", TOKEN])
            .args(if name == PARTITIONED {
                let listen = format!("127.0.0.2:{}", self.proxy.port);
                vec![
                    "--data-listen".into(),
                    listen,
                    "--advertise".into(),
                    "127.0.0.1".into(),
                ]
            } else {
                vec!["--data-listen".to_string(), "127.0.0.1:0".into()]
            })
            .args(["--reconnect-for", "120"])
            .env("RAYON_NUM_THREADS", "1")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting a node")?;
        self.nodes.insert(name.to_string(), child);
        Ok(())
    }

    /// Reads the broker's lines so far into the log.
    fn drain(&mut self) {
        while let Ok(l) = self.lines.try_recv() {
            self.log.push(l);
        }
    }

    /// Restarts nodes that exited (after their delay) and continues stopped ones when due.
    fn supervise(&mut self, now: Instant) -> Result<()> {
        if self.heal_at.is_some_and(|t| t <= now) {
            self.proxy.set_cut(false);
            self.heal_at = None;
        }
        let exited: Vec<String> = self
            .nodes
            .iter_mut()
            .filter_map(|(n, c)| matches!(c.try_wait(), Ok(Some(_))).then(|| n.clone()))
            .collect();
        for n in exited {
            self.nodes.remove(&n);
            self.restart_at
                .entry(n)
                .or_insert(now + Duration::from_secs(5));
        }
        let due: Vec<String> = self
            .restart_at
            .iter()
            .filter(|(_, &t)| t <= now)
            .map(|(n, _)| n.clone())
            .collect();
        for n in due {
            self.restart_at.remove(&n);
            // A node that left but has not exited yet is not left behind as an orphan.
            if let Some(mut old) = self.nodes.remove(&n) {
                let _ = old.kill();
                let _ = old.wait();
            }
            self.start_node(&n)?;
        }
        let cont: Vec<String> = self
            .cont_at
            .iter()
            .filter(|(_, &t)| t <= now)
            .map(|(n, _)| n.clone())
            .collect();
        for n in cont {
            self.cont_at.remove(&n);
            if let Some(c) = self.nodes.get(&n) {
                let _ = signal(c, "CONT");
            }
        }
        Ok(())
    }

    /// Injects `p`; false when its target is not there to be hit (already down).
    fn inject(&mut self, p: &Planned, now: Instant) -> Result<bool> {
        if p.fault == Fault::KillBroker {
            self.broker.kill()?;
            self.broker.wait()?;
            std::thread::sleep(Duration::from_secs(2));
            self.broker = spawn_broker(&self.dir, self.port, true, self.sharded, &self.tx)?;
            self.brokers_started += 1;
            return Ok(true);
        }
        if self.cont_at.contains_key(&p.target)
            || self.restart_at.contains_key(&p.target)
            || self.proxy.is_cut()
        {
            return Ok(false);
        }
        let Some(child) = self.nodes.get_mut(&p.target) else {
            return Ok(false);
        };
        match p.fault {
            Fault::KillNode => {
                child.kill()?;
                child.wait()?;
                self.nodes.remove(&p.target);
                self.restart_at
                    .insert(p.target.clone(), now + Duration::from_secs(5));
            }
            Fault::StopNode => {
                signal(child, "STOP")?;
                self.cont_at.insert(p.target.clone(), now + STOP_FOR);
            }
            Fault::LeaveNode => {
                signal(child, "TERM")?;
                // Back after a while: a join that grows the job again.
                self.restart_at
                    .insert(p.target.clone(), now + Duration::from_secs(20));
            }
            Fault::Partition => {
                self.proxy.set_cut(true);
                let hold = PARTITION_FOR[self.partitions % PARTITION_FOR.len()];
                self.partitions += 1;
                self.heal_at = Some(now + hold);
            }
            Fault::KillBroker => {}
        }
        Ok(true)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for c in std::iter::once(&mut self.broker).chain(self.nodes.values_mut()) {
            // Only a process not reaped yet (its pid cannot have been reused).
            if matches!(c.try_wait(), Ok(None)) {
                let _ = signal(c, "CONT");
                let _ = c.kill();
            }
            let _ = c.wait();
        }
    }
}

fn spawn_broker(
    dir: &Path,
    port: u16,
    resume: bool,
    sharded: bool,
    tx: &mpsc::Sender<Line>,
) -> Result<Child> {
    let mut cmd = exe()?;
    cmd.args(["broker", "--job"])
        .arg(dir.join("job.toml"))
        .args(["--listen", &format!("127.0.0.1:{port}"), "--certs"])
        .arg(dir.join("certs"))
        .args(["--token", TOKEN, "--replace-grace", "10"])
        .arg("--report")
        .arg(dir.join("report.json"));
    if sharded {
        cmd.args(["--snapshots", "sharded"]);
    }
    if resume {
        cmd.arg("--resume").arg(dir.join("ckpt"));
    }
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting the broker")?;
    let streams: [Box<dyn std::io::Read + Send>; 2] = [
        Box::new(child.stderr.take().context("stderr")?),
        Box::new(child.stdout.take().context("stdout")?),
    ];
    for stream in streams {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for l in BufReader::new(stream).lines().map_while(Result::ok) {
                if tx.send((Instant::now(), l)).is_err() {
                    return;
                }
            }
        });
    }
    Ok(child)
}

/// Whether the broker, which printed its last line, exits successfully within 60 s.
fn broker_exit(broker: &mut Child) -> Result<bool> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if let Some(status) = broker.try_wait()? {
            return Ok(status.success());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!("soak: the broker did not exit within 60 s of its last line");
    Ok(false)
}

/// The step a progress or evaluation line reports.
fn step_of(line: &str) -> Option<u64> {
    let rest = line.strip_prefix("step")?.trim_start();
    rest.split(['/', ':']).next()?.trim().parse().ok()
}

/// The step a rollback or resume line names, and the steps it says were lost.
fn resumed_at(line: &str) -> Option<(u64, Option<u64>)> {
    if let Some(rest) =
        line.strip_prefix("waiting for the nodes, then resuming from the snapshot at step ")
    {
        let (step, lost) = rest.split_once(" (")?;
        let lost = lost.split_whitespace().next()?.parse().ok();
        return Some((step.parse().ok()?, lost));
    }
    let rest = line.strip_prefix("resumed from ")?;
    Some((rest.rsplit(' ').next()?.parse().ok()?, None))
}

/// What the broker's lines after `from` say of the fault injected then: the first line about a
/// loss, a re-plan or a resume before `until` (the next fault), else the first one after it that
/// names the fault's target. Nothing said while training went on at least two steps: no step lost.
fn outcome_of(
    p: &Planned,
    from: Instant,
    until: Option<Instant>,
    t0: Instant,
    log: &[Line],
) -> Outcome {
    let before = log
        .iter()
        .filter(|(t, _)| *t <= from)
        .filter_map(|(_, l)| step_of(l))
        .max();
    let relevant = |l: &str| {
        l.starts_with("node lost:")
            || l.starts_with("step failed on")
            || l.contains("re-planned without a rollback")
            || resumed_at(l).is_some()
    };
    let window: Vec<&Line> = log
        .iter()
        .filter(|(t, _)| *t > from && until.is_none_or(|u| *t <= u))
        .collect();
    // Said late: within a minute of the next fault (a node timeout, a stall deadline), no later.
    let late_until = until.map(|u| u + LATE_WORD);
    let late = log
        .iter()
        .filter(|(t, _)| *t > from && late_until.is_none_or(|u| *t <= u))
        .find(|(_, l)| relevant(l) && l.contains(p.target.as_str()))
        .map(|(t, _)| *t);
    let after: Vec<&Line> = if window.iter().any(|(_, l)| relevant(l)) {
        window.clone()
    } else {
        // Said after the next fault: that line, and what followed it.
        match late {
            Some(s) => log.iter().filter(|(t, _)| *t >= s).collect(),
            None => window.clone(),
        }
    };
    let mut said = after
        .iter()
        .find(|(_, l)| relevant(l))
        .map(|(_, l)| l.clone())
        .unwrap_or_default();
    let went_on = match (before, window.iter().filter_map(|(_, l)| step_of(l)).max()) {
        (Some(b), Some(a)) => a >= b + 2,
        _ => false,
    };
    let resumed = after.iter().find_map(|(_, l)| resumed_at(l));
    let steps_lost = match (p.fault, resumed) {
        (Fault::KillBroker, Some((at, _))) => before.map(|b| b.saturating_sub(at)),
        (_, Some((_, lost)))
            if said.starts_with("node lost:") || said.starts_with("step failed on") =>
        {
            lost
        }
        _ if said.contains("re-planned without a rollback") => Some(0),
        _ if said.is_empty() && went_on => {
            said = "(nothing: training went on)".into();
            Some(0)
        }
        _ => None,
    };
    let recovery_s = after
        .iter()
        .find(|(_, l)| l.starts_with("stage placement:"))
        .filter(|_| !said.starts_with('('))
        .map(|(t, _)| t.duration_since(from).as_secs_f64());
    Outcome {
        at_s: from.duration_since(t0).as_secs_f64(),
        fault: format!("{:?}", p.fault),
        target: p.target.clone(),
        said,
        steps_lost,
        recovery_s,
    }
}

#[derive(Serialize)]
struct SoakReport {
    seed: u64,
    minutes: u64,
    steps: u64,
    sharded_snapshots: bool,
    finished: bool,
    wall_s: f64,
    brokers_started: u32,
    faults: Vec<Outcome>,
}

/// Runs the soak: `steps` steps of the job, faults from the schedule of `seed` over `minutes`.
pub fn run(cfg: &SoakConfig, json: Option<&Path>) -> Result<()> {
    let SoakConfig {
        seed,
        minutes,
        every_s,
        steps,
        sharded,
    } = *cfg;
    let plan = schedule(seed, minutes, every_s);
    let dir = tempfile::Builder::new()
        .prefix("fusionllm-soak-")
        .tempdir()?;
    eprintln!(
        "soak: {} faults over {minutes} min (seed {seed}), {steps} steps; logs in {}",
        plan.len(),
        dir.path().display()
    );
    let mut c = Cluster::start(dir.path(), steps, sharded)?;
    let t0 = Instant::now();
    let limit = t0 + Duration::from_secs(minutes * 60 + 1800);
    let mut injected: Vec<(Planned, Instant)> = Vec::new();
    let mut next = plan.iter().peekable();
    let finished = loop {
        std::thread::sleep(Duration::from_millis(200));
        let now = Instant::now();
        c.drain();
        if c.log.iter().any(|(_, l)| l.starts_with("done:")) {
            break broker_exit(&mut c.broker)?;
        }
        if let Ok(Some(status)) = c.broker.try_wait() {
            eprintln!("soak: the broker exited ({status}) before the end");
            break false;
        }
        if now > limit {
            eprintln!("soak: the run did not finish within the limit");
            break false;
        }
        c.supervise(now)?;
        if let Some(p) = next.next_if(|p| now.duration_since(t0).as_secs_f64() >= p.at_s) {
            if c.inject(p, now)? {
                eprintln!("soak: {:.0} s: {:?} {}", p.at_s, p.fault, p.target);
                injected.push((p.clone(), now));
            }
        }
    };
    c.drain();
    let faults: Vec<Outcome> = injected
        .iter()
        .enumerate()
        .map(|(i, (p, at))| {
            let until = injected.get(i + 1).map(|(_, t)| *t);
            outcome_of(p, *at, until, t0, &c.log)
        })
        .collect();
    let report = SoakReport {
        seed,
        minutes,
        steps,
        sharded_snapshots: sharded,
        finished,
        wall_s: t0.elapsed().as_secs_f64(),
        brokers_started: c.brokers_started,
        faults,
    };
    print_table(&report);
    if let Some(path) = json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if !finished {
        let keep = dir.keep();
        bail!(
            "the soak run did not finish; logs kept in {}",
            keep.display()
        );
    }
    Ok(())
}

fn print_table(r: &SoakReport) {
    println!(
        "{:>7} {:<11} {:<7} {:>6} {:>10}  broker said",
        "at s", "fault", "target", "lost", "recovery s"
    );
    let opt = |v: Option<String>| v.unwrap_or_else(|| "-".into());
    for f in &r.faults {
        println!(
            "{:>7.0} {:<11} {:<7} {:>6} {:>10}  {}",
            f.at_s,
            f.fault,
            f.target,
            opt(f.steps_lost.map(|v| v.to_string())),
            opt(f.recovery_s.map(|v| format!("{v:.1}"))),
            f.said.chars().take(90).collect::<String>()
        );
    }
    println!(
        "finished: {} after {:.0} s, {} faults, {} brokers",
        r.finished,
        r.wall_s,
        r.faults.len(),
        r.brokers_started
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_schedule_is_seeded_spaced_and_bounded() {
        let a = schedule(7, 60, 120.0);
        assert_eq!(a, schedule(7, 60, 120.0));
        assert_ne!(a, schedule(8, 60, 120.0));
        // About one fault every two minutes over the hour.
        assert!((22..=40).contains(&a.len()), "{}", a.len());
        for w in a.windows(2) {
            let gap = w[1].at_s - w[0].at_s;
            assert!((90.0..150.0).contains(&gap), "{gap}");
        }
        assert!(a.iter().all(|p| p.at_s < 3600.0));
        for kind in [
            Fault::KillNode,
            Fault::StopNode,
            Fault::LeaveNode,
            Fault::Partition,
            Fault::KillBroker,
        ] {
            assert!(a.iter().any(|p| p.fault == kind), "{kind:?} never drawn");
        }
        assert!(a
            .iter()
            .all(|p| (p.fault == Fault::KillBroker) == (p.target == "broker")));
        assert!(a
            .iter()
            .filter(|p| p.fault == Fault::Partition)
            .all(|p| p.target == PARTITIONED));
    }

    #[test]
    fn the_brokers_lines_give_the_step_and_the_loss() {
        assert_eq!(
            resumed_at(
                "waiting for the nodes, then resuming from the snapshot at step 120 (3 steps lost)"
            ),
            Some((120, Some(3)))
        );
        assert_eq!(
            resumed_at("resumed from /x/ckpt/step-00000100 at step 100"),
            Some((100, None))
        );
        assert_eq!(step_of("step    140/9000: loss 2.1"), Some(140));
        assert_eq!(step_of("step 140: eval loss 2.0"), Some(140));
        assert_eq!(resumed_at("node lost: node1: gone"), None);
    }

    #[test]
    fn a_faults_outcome_is_read_from_the_brokers_lines_before_the_next_fault() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let line = |s: u64, l: &str| (at(s), l.to_string());
        let log = vec![
            line(1, "step     10/100: loss 3.0"),
            line(3, "step     11/100: loss 3.0"),
            line(5, "step     12/100: loss 3.0"),
            line(7, "node lost: node2: no heartbeat for 10.0 s"),
            line(
                8,
                "waiting for the nodes, then resuming from the snapshot at step 10 (2 steps lost)",
            ),
            line(9, "stage placement:"),
        ];
        let fault = |fault, target: &str| Planned {
            at_s: 0.0,
            fault,
            target: target.into(),
        };
        // A partition healed before anything was said: training went on, nothing lost.
        let o = outcome_of(
            &fault(Fault::Partition, "node1"),
            at(2),
            Some(at(6)),
            t0,
            &log,
        );
        assert_eq!((o.steps_lost, o.recovery_s), (Some(0), None));
        assert!(o.said.contains("training went on"), "{}", o.said);
        // A loss said only after the next fault landed is still this fault's when it names it.
        let o = outcome_of(
            &fault(Fault::StopNode, "node2"),
            at(2),
            Some(at(4)),
            t0,
            &log,
        );
        assert_eq!(o.steps_lost, Some(2));
        assert!(o.said.starts_with("node lost: node2"), "{}", o.said);
        // ...but not one said long after the next fault: that is another fault's.
        let o = outcome_of(
            &fault(Fault::StopNode, "node2"),
            at(0),
            Some(at(0)),
            t0,
            &log,
        );
        assert_eq!(o.steps_lost, Some(2), "within a minute");
        let mut far = log.clone();
        far.push(line(200, "node lost: node1: evicted"));
        let o = outcome_of(
            &fault(Fault::Partition, "node1"),
            at(2),
            Some(at(6)),
            t0,
            &far,
        );
        assert!(o.said.contains("training went on"), "{}", o.said);
        // The loss after the next fault is that fault's.
        let o = outcome_of(&fault(Fault::KillNode, "node2"), at(6), None, t0, &log);
        assert_eq!(o.steps_lost, Some(2));
        assert!(o.said.starts_with("node lost: node2"), "{}", o.said);
        assert!(o.recovery_s.is_some_and(|s| (s - 3.0).abs() < 1e-9));
    }
}

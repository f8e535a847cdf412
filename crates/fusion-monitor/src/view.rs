//! The run as the dashboard shows it: a [`RunView`] folded from the broker's events, and the
//! [`Patch`] each event makes to it (what the page applies to its own copy).

use fusion_compress::Codec;
use fusion_runtime::BrokerEvent;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use std::collections::{BTreeMap, HashMap};

/// Points of a curve kept before the oldest half is thinned to every other point.
pub const MAX_POINTS: usize = 20_000;
/// Membership events and codec changes kept (the newest).
pub const MAX_EVENTS: usize = 2_000;

/// What is known of the run before it starts.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RunInfo {
    pub model: String,
    pub data: String,
    /// Steps the run trains.
    pub steps: u64,
    /// Throughput unit: `tok/s` or `img/s`.
    pub unit: String,
    /// The site of every node, from the testbed (for the placement picture).
    pub sites: BTreeMap<String, String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepPoint {
    pub step: u64,
    /// Seconds since the run started.
    pub t: f64,
    pub loss: f32,
    pub lr: f32,
    pub grad_norm: f32,
    pub throughput: f64,
}

impl From<&fusion_train::StepRecord> for StepPoint {
    fn from(s: &fusion_train::StepRecord) -> Self {
        StepPoint {
            step: s.step,
            t: s.elapsed_s,
            loss: s.loss,
            lr: s.lr,
            grad_norm: s.grad_norm,
            throughput: s.throughput,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EvalPoint {
    pub step: u64,
    pub t: f64,
    pub loss: f32,
    pub accuracy: f32,
}

/// One node: what it is, where it runs, and how its last step went.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeView {
    pub node: String,
    pub site: String,
    /// `joined`, `training`, `lost` or `standby` (joined but not placed).
    pub status: String,
    pub backend: String,
    pub device: String,
    pub gflops: f64,
    /// Where the current placement puts it (None: not placed).
    pub stage: Option<usize>,
    pub replica: Option<usize>,
    pub operators: usize,
    pub params: usize,
    pub compute_s: f64,
    pub wait_s: f64,
    pub peak_memory_bytes: u64,
    pub heartbeat_age_s: f64,
    /// The step its figures are from.
    pub last_step: u64,
}

/// One directed link between nodes.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LinkView {
    pub from: String,
    pub to: String,
    /// As probed (smoothed).
    pub bandwidth_mbps: Option<f64>,
    pub latency_ms: Option<f64>,
    pub bytes_last_step: u64,
    pub bytes_total: u64,
    /// Share of the probed bandwidth the last step's bytes used over its wall time.
    pub utilisation: Option<f64>,
    /// Codec per direction of the tensors on it (`activations`, `gradients`).
    pub codecs: BTreeMap<String, String>,
}

/// A link as the nodes probed it (every pair is probed, used or not).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ProbedLink {
    pub from: String,
    pub to: String,
    pub bandwidth_mbps: f64,
    pub latency_ms: f64,
}

/// AdaTopK (or the first settings) put `codec` on a link direction.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CodecChange {
    pub t: f64,
    pub step: u64,
    pub from: String,
    pub to: String,
    pub direction: String,
    pub codec: String,
    /// Share of the values sent (1: all, quantised or not).
    pub density: f64,
}

/// Something that happened to the run, on its time axis.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunEvent {
    pub t: f64,
    pub step: u64,
    /// `joined`, `placed`, `lost`, `failed`, `recovered`, `island-out`, `reshaped`, `resumed`,
    /// `warning` or `finished`.
    pub kind: String,
    pub node: Option<String>,
    pub text: String,
}

/// Everything the dashboard shows.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RunView {
    /// Patches applied so far.
    pub seq: u64,
    /// `live` (a broker's monitor) or `report` (drawn from a finished run's report).
    pub source: String,
    pub info: RunInfo,
    /// `starting`, `training`, `recovering`, `finished` or `failed`.
    pub status: String,
    pub step: u64,
    pub snapshot_step: u64,
    pub steps: Vec<StepPoint>,
    pub evals: Vec<EvalPoint>,
    pub nodes: BTreeMap<String, NodeView>,
    /// The links that carried data or have a codec set (the placement's).
    pub links: Vec<LinkView>,
    /// Every probed link.
    pub probed: Vec<ProbedLink>,
    pub plan: Vec<String>,
    pub codec_history: Vec<CodecChange>,
    pub events: Vec<RunEvent>,
    /// The monitor's clock minus the broker's run clock (steps' `elapsed_s`), from the latest
    /// step: events are placed on the steps' time axis.
    #[serde(skip)]
    clock_offset: Option<f64>,
    /// Positions in `links` and `probed` by (from, to).
    #[serde(skip)]
    link_at: HashMap<(String, String), usize>,
    #[serde(skip)]
    probe_at: HashMap<(String, String), usize>,
}

/// What one event changed: fields replaced whole, items appended to lists, and curve points
/// past a rolled-back step dropped. Values are kept as the JSON the whole view serialises to
/// (field order, f32 digits), so a page that applies patches holds what `/api/state` holds.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Patch {
    pub seq: u64,
    pub set: BTreeMap<String, Box<RawValue>>,
    pub push: BTreeMap<String, Vec<Box<RawValue>>>,
    pub truncate_after: Option<u64>,
}

impl Patch {
    fn set(&mut self, key: &str, value: impl Serialize) {
        self.set.insert(key.into(), raw(value));
    }

    fn push(&mut self, key: &str, item: impl Serialize) {
        self.push
            .entry(key.to_string())
            .or_default()
            .push(raw(item));
    }
}

fn raw(v: impl Serialize) -> Box<RawValue> {
    // Our own plain structs and maps (finite floats): serialising them cannot fail.
    serde_json::value::to_raw_value(&v).unwrap_or_else(|_| RawValue::NULL.to_owned())
}

/// Share of the values a codec sends.
pub fn codec_density(codec: &Codec) -> f64 {
    match codec {
        Codec::TopK { density } | Codec::RandomK { density } => *density,
        _ => 1.0,
    }
}

/// Appends `item`, thinning the oldest half to every other item past `max`.
pub fn push_bounded<T>(list: &mut Vec<T>, item: T, max: usize) {
    list.push(item);
    if list.len() > max {
        let half = list.len() / 2;
        let mut i = 0;
        list.retain(|_| {
            i += 1;
            i > half || i % 2 == 0
        });
    }
}

/// Positions by (from, to).
fn index<'a>(
    pairs: impl Iterator<Item = (&'a String, &'a String)>,
) -> HashMap<(String, String), usize> {
    pairs
        .enumerate()
        .map(|(i, (a, b))| ((a.clone(), b.clone()), i))
        .collect()
}

/// Appends `item`, dropping the oldest past `max`.
fn push_newest<T>(list: &mut Vec<T>, item: T, max: usize) {
    list.push(item);
    if list.len() > max {
        list.remove(0);
    }
}

impl RunView {
    pub fn new(info: RunInfo) -> Self {
        RunView {
            info,
            source: "live".into(),
            status: "starting".into(),
            ..Default::default()
        }
    }

    /// Folds one broker event in, seen `now` seconds after the monitor started; returns what
    /// changed.
    pub fn apply(&mut self, ev: &BrokerEvent, now: f64) -> Patch {
        if let BrokerEvent::Step(s, _) = ev {
            self.clock_offset = Some(now - s.elapsed_s);
        }
        let t = self.run_time(now);
        let mut p = Patch::default();
        match ev {
            BrokerEvent::Joined { node, capabilities } => {
                let site = self.info.sites.get(*node).cloned().unwrap_or_default();
                let n = self.nodes.entry(node.to_string()).or_default();
                *n = NodeView {
                    node: node.to_string(),
                    site,
                    status: "joined".into(),
                    backend: capabilities.backend.clone(),
                    device: capabilities.device.clone(),
                    gflops: capabilities.measured_gflops,
                    ..Default::default()
                };
                let text = format!("{node} joined ({} on {})", n.backend, n.device);
                self.event(&mut p, t, "joined", Some(node), text);
                p.set("nodes", &self.nodes);
            }
            BrokerEvent::Placement(stages) => self.place(&mut p, stages, t),
            BrokerEvent::Plan(lines) => {
                self.plan = lines.to_vec();
                p.set("plan", &self.plan);
            }
            BrokerEvent::Compression(codecs) => self.codecs(&mut p, codecs, t),
            BrokerEvent::Links { changed, .. } => {
                for m in changed.iter() {
                    let probe = ProbedLink {
                        from: m.from.clone(),
                        to: m.to.clone(),
                        bandwidth_mbps: m.bandwidth_mbps,
                        latency_ms: m.latency_ms,
                    };
                    self.probe(probe);
                    if let Some(&i) = self.link_at.get(&(m.from.clone(), m.to.clone())) {
                        self.links[i].bandwidth_mbps = Some(m.bandwidth_mbps);
                        self.links[i].latency_ms = Some(m.latency_ms);
                    }
                }
                p.set("probed", &self.probed);
                p.set("links", &self.links);
            }
            BrokerEvent::Step(s, eval) => self.step(&mut p, s, *eval, t),
            BrokerEvent::StepDetail(d) => self.detail(&mut p, d),
            BrokerEvent::Resumed { path, step } => {
                self.step = *step;
                let text = format!("resumed from {} at step {step}", path.display());
                self.event(&mut p, t, "resumed", None, text);
                p.set("step", self.step);
            }
            BrokerEvent::NodeLost { node, reason } => {
                if let Some(n) = self.nodes.get_mut(*node) {
                    n.status = "lost".into();
                }
                self.status = "recovering".into();
                self.event(
                    &mut p,
                    t,
                    "lost",
                    Some(node),
                    format!("{node} lost: {reason}"),
                );
                p.set("nodes", &self.nodes);
                p.set("status", &self.status);
            }
            BrokerEvent::StepFailed { node, reason } => {
                self.status = "recovering".into();
                let text = format!("{node} reported a failed step: {reason}");
                self.event(&mut p, t, "failed", Some(node), text);
                p.set("status", &self.status);
            }
            BrokerEvent::Recovered { step, lost } => self.rollback(&mut p, *step, *lost, t),
            BrokerEvent::IslandOut {
                island,
                step,
                islands_left,
            } => {
                let text = format!(
                    "island {island} out at step {step}: {islands_left} islands go on without a \
                     rollback until the next synchronisation"
                );
                self.event(&mut p, t, "island-out", None, text);
            }
            BrokerEvent::Reshaped { step, why } => {
                let text = format!("re-planned at step {step} without a rollback: {why}");
                self.event(&mut p, t, "reshaped", None, text);
            }
            BrokerEvent::SkippedCheckpoint { path, reason } => {
                let text = format!("skipped checkpoint {}: {reason}", path.display());
                self.event(&mut p, t, "warning", None, text);
            }
            BrokerEvent::CheckpointFailed { reason } => {
                self.event(&mut p, t, "warning", None, reason.to_string());
            }
        }
        self.seal(p)
    }

    /// The run ended (`ok`: trained to the last step).
    pub fn finish(&mut self, ok: bool, text: &str, now: f64) -> Patch {
        let t = self.run_time(now);
        let mut p = Patch::default();
        self.status = if ok { "finished" } else { "failed" }.into();
        p.set("status", &self.status);
        self.event(&mut p, t, "finished", None, text.to_string());
        self.seal(p)
    }

    /// Seconds on the steps' clock (the monitor's own before the first step).
    fn run_time(&self, now: f64) -> f64 {
        (now - self.clock_offset.unwrap_or(0.0)).max(0.0)
    }

    fn seal(&mut self, mut p: Patch) -> Patch {
        self.seq += 1;
        p.seq = self.seq;
        p
    }

    fn event(&mut self, p: &mut Patch, t: f64, kind: &str, node: Option<&str>, text: String) {
        let e = RunEvent {
            t,
            step: self.step,
            kind: kind.into(),
            node: node.map(str::to_string),
            text,
        };
        p.push("events", &e);
        push_newest(&mut self.events, e, MAX_EVENTS);
    }

    /// The link from `from` to `to`, added (with its probed figures) when new.
    fn link(&mut self, from: &str, to: &str) -> &mut LinkView {
        if self.link_at.len() != self.links.len() {
            self.link_at = index(self.links.iter().map(|l| (&l.from, &l.to)));
        }
        let key = (from.to_string(), to.to_string());
        let i = match self.link_at.get(&key) {
            Some(&i) => i,
            None => {
                let probed = self.probed_link(from, to);
                self.links.push(LinkView {
                    from: from.into(),
                    to: to.into(),
                    bandwidth_mbps: probed.map(|p| p.0),
                    latency_ms: probed.map(|p| p.1),
                    ..Default::default()
                });
                self.link_at.insert(key, self.links.len() - 1);
                self.links.len() - 1
            }
        };
        &mut self.links[i]
    }

    fn probed_link(&mut self, from: &str, to: &str) -> Option<(f64, f64)> {
        if self.probe_at.len() != self.probed.len() {
            self.probe_at = index(self.probed.iter().map(|l| (&l.from, &l.to)));
        }
        let i = *self.probe_at.get(&(from.to_string(), to.to_string()))?;
        Some((self.probed[i].bandwidth_mbps, self.probed[i].latency_ms))
    }

    fn probe(&mut self, probe: ProbedLink) {
        let _ = self.probed_link(&probe.from, &probe.to);
        let key = (probe.from.clone(), probe.to.clone());
        match self.probe_at.get(&key) {
            Some(&i) => self.probed[i] = probe,
            None => {
                self.probed.push(probe);
                self.probe_at.insert(key, self.probed.len() - 1);
            }
        }
    }

    fn place(&mut self, p: &mut Patch, stages: &[fusion_runtime::StagePlacement], t: f64) {
        for n in self.nodes.values_mut() {
            n.stage = None;
            n.replica = None;
            if n.status != "lost" {
                n.status = "standby".into();
            }
        }
        for s in stages {
            let site = match &s.site {
                known if !known.is_empty() => known.clone(),
                _ => self.info.sites.get(&s.node).cloned().unwrap_or_default(),
            };
            let n = self.nodes.entry(s.node.clone()).or_default();
            n.node = s.node.clone();
            n.site = site;
            n.status = "training".into();
            n.stage = Some(s.stage);
            n.replica = Some(s.replica);
            n.backend = s.backend.clone();
            n.device = s.device.clone();
            n.operators = s.operators;
            n.params = s.params;
        }
        let pipelines = stages.iter().map(|s| s.replica + 1).max().unwrap_or(0);
        let depth = stages.iter().map(|s| s.stage + 1).max().unwrap_or(0);
        let text = format!("placed: {depth} stages x {pipelines} replicas");
        self.event(p, t, "placed", None, text);
        self.status = "training".into();
        p.set("nodes", &self.nodes);
        p.set("status", &self.status);
    }

    fn codecs(&mut self, p: &mut Patch, codecs: &[fusion_runtime::LinkCodec], t: f64) {
        for c in codecs {
            let name = c.codec.to_string();
            let l = self.link(&c.from, &c.to);
            if l.codecs.get(&c.direction) == Some(&name) {
                continue;
            }
            l.codecs.insert(c.direction.clone(), name.clone());
            let change = CodecChange {
                t,
                step: self.step,
                from: c.from.clone(),
                to: c.to.clone(),
                direction: c.direction.clone(),
                codec: name,
                density: codec_density(&c.codec),
            };
            p.push("codec_history", &change);
            push_newest(&mut self.codec_history, change, MAX_EVENTS);
        }
        p.set("links", &self.links);
    }

    fn step(
        &mut self,
        p: &mut Patch,
        s: &fusion_train::StepRecord,
        eval: Option<&fusion_train::EvalRecord>,
        t: f64,
    ) {
        let point = StepPoint::from(s);
        p.push("steps", &point);
        push_bounded(&mut self.steps, point, MAX_POINTS);
        if let Some(e) = eval {
            let point = EvalPoint {
                step: e.step,
                t,
                loss: e.loss,
                accuracy: e.accuracy,
            };
            p.push("evals", &point);
            push_bounded(&mut self.evals, point, MAX_POINTS);
        }
        self.step = s.step;
        self.status = "training".into();
        p.set("step", self.step);
        p.set("status", &self.status);
    }

    fn detail(&mut self, p: &mut Patch, d: &fusion_runtime::StepDetail) {
        for n in &d.nodes {
            if let Some(v) = self.nodes.get_mut(&n.node) {
                v.compute_s = n.compute_s;
                v.wait_s = n.wait_s;
                v.peak_memory_bytes = n.peak_memory_bytes;
                v.heartbeat_age_s = n.heartbeat_age_s;
                v.last_step = d.step;
            }
        }
        for l in self.links.iter_mut() {
            l.bytes_last_step = 0;
        }
        for s in &d.links {
            let l = self.link(&s.from, &s.to);
            // Figures nodes report: saturating, so that no count can overflow.
            l.bytes_last_step = l.bytes_last_step.saturating_add(s.bytes);
            l.bytes_total = l.bytes_total.saturating_add(s.bytes);
        }
        for l in self.links.iter_mut() {
            l.utilisation = l
                .bandwidth_mbps
                .filter(|&b| b > 0.0)
                .map(|b| (l.bytes_last_step as f64 * 8.0) / (b * 1e6 * d.wall_s.max(1e-9)));
        }
        self.snapshot_step = d.snapshot_step;
        p.set("nodes", &self.nodes);
        p.set("links", &self.links);
        p.set("snapshot_step", self.snapshot_step);
    }

    fn rollback(&mut self, p: &mut Patch, step: u64, lost: u64, t: f64) {
        self.steps.retain(|s| s.step <= step);
        self.evals.retain(|e| e.step <= step);
        self.step = step;
        p.truncate_after = Some(step);
        let text = format!("rolled back to the snapshot at step {step} ({lost} steps lost)");
        self.event(p, t, "recovered", None, text);
        p.set("step", self.step);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thinning_keeps_the_newest_half_whole_and_every_other_older_point() {
        let mut v: Vec<u32> = Vec::new();
        for i in 0..11 {
            push_bounded(&mut v, i, 10);
        }
        // 11 items over 10: the oldest 5 thinned to 1, 3; the newest 6 kept.
        assert_eq!(v, vec![1, 3, 5, 6, 7, 8, 9, 10]);
        let mut w: Vec<u32> = (0..5).collect();
        push_bounded(&mut w, 5, 10);
        assert_eq!(w, vec![0, 1, 2, 3, 4, 5]);
    }
}

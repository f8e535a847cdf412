//! Prometheus metrics of a run, exposed in the text exposition format: names carry their base
//! unit (seconds, bytes, ratio), counters end in `_total`, labels name nodes and links.

use crate::view::codec_density;
use fusion_runtime::BrokerEvent;
use prometheus::core::Collector;
use prometheus::{
    exponential_buckets, CounterVec, Gauge, GaugeVec, Histogram, HistogramOpts, IntCounter,
    IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};
use std::sync::Mutex;
use std::time::Instant;

/// The run's metrics and the registry that exposes them.
pub struct Metrics {
    registry: Registry,
    steps: IntCounter,
    step: IntGauge,
    step_seconds: Histogram,
    throughput: Gauge,
    loss: Gauge,
    eval_loss: Gauge,
    eval_accuracy: Gauge,
    lr: Gauge,
    grad_norm: Gauge,
    link_bytes: IntCounterVec,
    link_bandwidth: GaugeVec,
    link_latency: GaugeVec,
    codec_density: GaugeVec,
    compute: CounterVec,
    wait: CounterVec,
    memory: IntGaugeVec,
    heartbeat_age: GaugeVec,
    up: IntGaugeVec,
    losses: IntCounter,
    failures: IntCounter,
    recoveries: IntCounter,
    steps_lost: IntCounter,
    reshapes: IntCounter,
    snapshot_steps: IntGauge,
    snapshot_seconds: Gauge,
    /// The newest snapshot's step and when the broker first reported it.
    snapshot: Mutex<(u64, Instant)>,
}

/// Registers `c` in `r` and hands it back.
fn reg<C: Collector + Clone + 'static>(r: &Registry, c: C) -> prometheus::Result<C> {
    r.register(Box::new(c.clone()))?;
    Ok(c)
}

const NODE: &[&str] = &["node"];
const LINK: &[&str] = &["from", "to"];
const CODEC: &[&str] = &["from", "to", "direction"];

impl Metrics {
    /// `unit` is the run's throughput unit (`tok/s` or `img/s`).
    pub fn new(unit: &str) -> prometheus::Result<Self> {
        let r = Registry::new_custom(Some("fusionllm".into()), None)?;
        let (name, what) = match unit {
            "img/s" => ("samples_per_second", "Images"),
            _ => ("tokens_per_second", "Tokens"),
        };
        let buckets = exponential_buckets(0.01, 2.0, 16)?;
        let duration = HistogramOpts::new("step_duration_seconds", "Wall time of a training step");
        let m = Metrics {
            steps: reg(&r, IntCounter::new("steps_total", "Training steps finished (again after a rollback)")?)?,
            step: reg(&r, IntGauge::new("step", "The step the run has reached")?)?,
            step_seconds: reg(&r, Histogram::with_opts(duration.buckets(buckets))?)?,
            throughput: reg(&r, Gauge::new(name, format!("{what} trained per second over the last step"))?)?,
            loss: reg(&r, Gauge::new("train_loss", "Training loss of the last step")?)?,
            eval_loss: reg(&r, Gauge::new("eval_loss", "Loss of the last evaluation")?)?,
            eval_accuracy: reg(&r, Gauge::new("eval_accuracy_ratio", "Accuracy of the last evaluation")?)?,
            lr: reg(&r, Gauge::new("learning_rate", "Learning rate of the last step")?)?,
            grad_norm: reg(&r, Gauge::new("grad_norm", "Gradient norm of the last step, before clipping")?)?,
            link_bytes: reg(&r, IntCounterVec::new(Opts::new("link_sent_bytes_total", "Data-plane bytes sent from one node to another"), LINK)?)?,
            link_bandwidth: reg(&r, GaugeVec::new(Opts::new("link_bandwidth_bytes_per_second", "Probed bandwidth of a link (smoothed)"), LINK)?)?,
            link_latency: reg(&r, GaugeVec::new(Opts::new("link_latency_seconds", "Probed one-way latency of a link (smoothed)"), LINK)?)?,
            codec_density: reg(&r, GaugeVec::new(Opts::new("link_codec_density_ratio", "Share of the values the codec of a link direction sends (1: all, quantised or not)"), CODEC)?)?,
            compute: reg(&r, CounterVec::new(Opts::new("node_compute_seconds_total", "Time a node spent computing in training steps"), NODE)?)?,
            wait: reg(&r, CounterVec::new(Opts::new("node_wait_seconds_total", "Time a node spent waiting for its peers in training steps"), NODE)?)?,
            memory: reg(&r, IntGaugeVec::new(Opts::new("node_peak_memory_bytes", "Peak resident memory of a node process"), NODE)?)?,
            heartbeat_age: reg(&r, GaugeVec::new(Opts::new("node_heartbeat_age_seconds", "Time since the broker last heard from a node, at the end of the last step"), NODE)?)?,
            up: reg(&r, IntGaugeVec::new(Opts::new("node_up", "1 while a node is a member of the run, 0 once lost"), NODE)?)?,
            losses: reg(&r, IntCounter::new("node_losses_total", "Nodes that left the run: connection closed, silent or evicted")?)?,
            failures: reg(&r, IntCounter::new("step_failures_total", "Steps a node reported failed (each rolls the run back)")?)?,
            recoveries: reg(&r, IntCounter::new("recoveries_total", "Recoveries after a loss: rollbacks to a snapshot and islands taken out")?)?,
            steps_lost: reg(&r, IntCounter::new("rolled_back_steps_total", "Steps trained again after rollbacks")?)?,
            reshapes: reg(&r, IntCounter::new("reshapes_total", "Re-plans at a step boundary without a rollback")?)?,
            snapshot_steps: reg(&r, IntGauge::new("snapshot_age_steps", "Steps since the snapshot a loss would roll back to")?)?,
            snapshot_seconds: reg(&r, Gauge::new("snapshot_age_seconds", "Time since the snapshot a loss would roll back to was taken")?)?,
            snapshot: Mutex::new((0, Instant::now())),
            registry: r,
        };
        Ok(m)
    }

    /// The exposition, in the Prometheus text format.
    pub fn encode(&self) -> String {
        if let Ok(snap) = self.snapshot.lock() {
            self.snapshot_seconds.set(snap.1.elapsed().as_secs_f64());
        }
        TextEncoder::new()
            .encode_to_string(&self.registry.gather())
            .unwrap_or_default()
    }

    /// Updates the metrics for one broker event.
    pub fn observe(&self, ev: &BrokerEvent) {
        match ev {
            BrokerEvent::Joined { node, .. } => self.up.with_label_values(&[*node]).set(1),
            BrokerEvent::Links { changed, .. } => {
                for m in changed.iter() {
                    let l = [m.from.as_str(), m.to.as_str()];
                    self.link_bandwidth
                        .with_label_values(&l)
                        .set(m.bandwidth_mbps * 1e6 / 8.0);
                    self.link_latency
                        .with_label_values(&l)
                        .set(m.latency_ms / 1e3);
                }
            }
            BrokerEvent::Compression(codecs) => {
                for c in codecs.iter() {
                    let l = [c.from.as_str(), c.to.as_str(), c.direction.as_str()];
                    self.codec_density
                        .with_label_values(&l)
                        .set(codec_density(&c.codec));
                }
            }
            BrokerEvent::Step(s, eval) => {
                self.steps.inc();
                self.step.set(s.step as i64);
                self.throughput.set(s.throughput);
                self.loss.set(s.loss as f64);
                self.lr.set(s.lr as f64);
                self.grad_norm.set(s.grad_norm as f64);
                if let Some(e) = eval {
                    self.eval_loss.set(e.loss as f64);
                    self.eval_accuracy.set(e.accuracy as f64);
                }
            }
            BrokerEvent::StepDetail(d) => self.detail(d),
            BrokerEvent::NodeLost { node, .. } => {
                self.losses.inc();
                self.up.with_label_values(&[*node]).set(0);
            }
            BrokerEvent::StepFailed { .. } => self.failures.inc(),
            BrokerEvent::Recovered { lost, .. } => {
                self.recoveries.inc();
                self.steps_lost.inc_by(*lost);
            }
            BrokerEvent::Reshaped { .. } => self.reshapes.inc(),
            BrokerEvent::IslandOut { .. } => self.recoveries.inc(),
            BrokerEvent::Placement(stages) => {
                for s in stages.iter() {
                    self.up.with_label_values(&[s.node.as_str()]).set(1);
                }
            }
            _ => {}
        }
    }

    fn detail(&self, d: &fusion_runtime::StepDetail) {
        self.step_seconds.observe(d.wall_s);
        for n in &d.nodes {
            let l = [n.node.as_str()];
            self.compute
                .with_label_values(&l)
                .inc_by(n.compute_s.max(0.0));
            self.wait.with_label_values(&l).inc_by(n.wait_s.max(0.0));
            self.memory
                .with_label_values(&l)
                .set(n.peak_memory_bytes as i64);
            self.heartbeat_age
                .with_label_values(&l)
                .set(n.heartbeat_age_s);
        }
        for s in &d.links {
            let l = [s.from.as_str(), s.to.as_str()];
            self.link_bytes.with_label_values(&l).inc_by(s.bytes);
        }
        let Ok(mut snap) = self.snapshot.lock() else {
            return;
        };
        if snap.0 != d.snapshot_step {
            *snap = (d.snapshot_step, Instant::now());
        }
        self.snapshot_steps
            .set(d.step.saturating_sub(snap.0) as i64);
    }
}

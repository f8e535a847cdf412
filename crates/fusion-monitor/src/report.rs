//! `fusionllm report RUN.json --html OUT.html`: the dashboard's page, drawn from a finished
//! run's JSON report (a cluster run's, or a single process's) instead of the live view.

use crate::view::{
    push_bounded, CodecChange, EvalPoint, LinkView, NodeView, ProbedLink, RunEvent, StepPoint,
};
use crate::{codec_density, page, MonitorError, RunInfo, RunView, MAX_POINTS};
use fusion_compress::Codec;
use fusion_train::{EvalRecord, StepRecord};
use serde::Deserialize;
use std::path::Path;

/// The parts of a report the page shows; cluster-only fields default to empty.
#[derive(Deserialize)]
struct ReportFile {
    model: String,
    data: String,
    #[serde(default)]
    throughput_unit: String,
    config: Config,
    steps: Vec<StepRecord>,
    evals: Vec<EvalRecord>,
    #[serde(default)]
    placement: Vec<PlacementIn>,
    #[serde(default)]
    links: Vec<LinkIn>,
    #[serde(default)]
    timings: Vec<TimingIn>,
    #[serde(default)]
    plan: Vec<String>,
    #[serde(default)]
    measured_links: Vec<MeasuredIn>,
    #[serde(default)]
    compression: Vec<CodecIn>,
    #[serde(default)]
    recoveries: Vec<RecoveryIn>,
    #[serde(default)]
    reshapes: Vec<ReshapeIn>,
}

#[derive(Deserialize)]
struct Config {
    steps: u64,
}

#[derive(Deserialize)]
struct PlacementIn {
    stage: usize,
    replica: usize,
    node: String,
    #[serde(default)]
    site: String,
    backend: String,
    device: String,
    operators: usize,
    params: usize,
    #[serde(default)]
    measured_gflops: f64,
}

#[derive(Deserialize)]
struct LinkIn {
    from: String,
    to: String,
    bytes: u64,
}

#[derive(Deserialize)]
struct TimingIn {
    #[serde(default)]
    step: u64,
    #[serde(default)]
    wall_s: f64,
    compute_s: Vec<f64>,
    wait_s: Vec<f64>,
}

#[derive(Deserialize)]
struct MeasuredIn {
    from: String,
    to: String,
    bandwidth_mbps: f64,
    latency_ms: f64,
}

#[derive(Deserialize)]
struct CodecIn {
    from: String,
    to: String,
    direction: String,
    codec: Codec,
}

#[derive(Deserialize)]
struct RecoveryIn {
    node: String,
    reason: String,
    interrupted_at_step: u64,
    resumed_from_step: u64,
    steps_lost: u64,
    #[serde(default)]
    seconds: f64,
    /// The island taken out instead of a rollback.
    #[serde(default)]
    island_out: Option<usize>,
}

#[derive(Deserialize)]
struct ReshapeIn {
    step: u64,
    why: String,
}

/// Reads the report at `input` and writes its page to `output`.
pub fn report_page(input: &Path, output: &Path) -> Result<(), MonitorError> {
    let text = std::fs::read_to_string(input).map_err(|source| MonitorError::ReadReport {
        path: input.display().to_string(),
        source,
    })?;
    let view = view_from_report(&text).map_err(|source| MonitorError::BadReport {
        path: input.display().to_string(),
        source,
    })?;
    let title = format!("{} on {} (report)", view.info.model, view.info.data);
    std::fs::write(output, page(&title, Some(&view))).map_err(|source| MonitorError::Write {
        path: output.display().to_string(),
        source,
    })
}

/// The view a report shows: its curves, last placement, links, final codecs and recoveries.
pub fn view_from_report(json: &str) -> Result<RunView, serde_json::Error> {
    let r: ReportFile = serde_json::from_str(json)?;
    let time_of = |step: u64| {
        r.steps
            .iter()
            .find(|s| s.step >= step)
            .or(r.steps.last())
            .map_or(0.0, |s| s.elapsed_s)
    };
    let mut v = RunView::new(RunInfo {
        model: r.model.clone(),
        data: r.data.clone(),
        steps: r.config.steps,
        unit: r.throughput_unit.clone(),
        sites: Default::default(),
    });
    // A report is a file anyone can hand over: values beyond f32 read as infinities, which the
    // page could not draw; such points are left out.
    let finite = |xs: &[f32]| xs.iter().all(|x| x.is_finite());
    for s in r
        .steps
        .iter()
        .filter(|s| finite(&[s.loss, s.lr, s.grad_norm]))
    {
        push_bounded(&mut v.steps, StepPoint::from(s), MAX_POINTS);
    }
    for e in r.evals.iter().filter(|e| finite(&[e.loss, e.accuracy])) {
        let point = EvalPoint {
            step: e.step,
            t: time_of(e.step),
            loss: e.loss,
            accuracy: e.accuracy,
        };
        push_bounded(&mut v.evals, point, MAX_POINTS);
    }
    v.step = r.steps.last().map_or(0, |s| s.step);
    v.plan = r.plan.clone();
    v.status = "finished".into();
    v.source = "report".into();
    nodes(&mut v, &r);
    links(&mut v, &r);
    events(&mut v, &r, &time_of);
    Ok(v)
}

fn nodes(v: &mut RunView, r: &ReportFile) {
    let last = r.timings.last();
    // Timings list nodes pipeline by pipeline (replica-major); the placement is stage-major.
    let stages = r.placement.iter().map(|p| p.stage.saturating_add(1)).max();
    for p in &r.placement {
        let i = stages.and_then(|n| p.replica.checked_mul(n)?.checked_add(p.stage));
        let n = NodeView {
            node: p.node.clone(),
            site: p.site.clone(),
            status: "training".into(),
            backend: p.backend.clone(),
            device: p.device.clone(),
            gflops: p.measured_gflops,
            stage: Some(p.stage),
            replica: Some(p.replica),
            operators: p.operators,
            params: p.params,
            compute_s: last
                .zip(i)
                .and_then(|(t, i)| t.compute_s.get(i).copied())
                .unwrap_or(0.0),
            wait_s: last
                .zip(i)
                .and_then(|(t, i)| t.wait_s.get(i).copied())
                .unwrap_or(0.0),
            last_step: v.step,
            ..Default::default()
        };
        v.nodes.insert(p.node.clone(), n);
    }
}

fn links(v: &mut RunView, r: &ReportFile) {
    let steps = r.steps.len().max(1) as u64;
    for l in &r.links {
        let m = r
            .measured_links
            .iter()
            .find(|m| m.from == l.from && m.to == l.to);
        v.links.push(LinkView {
            from: l.from.clone(),
            to: l.to.clone(),
            bandwidth_mbps: m.map(|m| m.bandwidth_mbps),
            latency_ms: m.map(|m| m.latency_ms),
            // Shown as the mean over the run's steps (evaluations and re-placements included).
            bytes_last_step: l.bytes / steps,
            bytes_total: l.bytes,
            ..Default::default()
        });
    }
    v.probed = r
        .measured_links
        .iter()
        .map(|m| ProbedLink {
            from: m.from.clone(),
            to: m.to.clone(),
            bandwidth_mbps: m.bandwidth_mbps,
            latency_ms: m.latency_ms,
        })
        .collect();
    for c in &r.compression {
        if let Some(l) = v
            .links
            .iter_mut()
            .find(|l| l.from == c.from && l.to == c.to)
        {
            l.codecs.insert(c.direction.clone(), c.codec.to_string());
        }
        v.codec_history.push(CodecChange {
            t: 0.0,
            step: v.step,
            from: c.from.clone(),
            to: c.to.clone(),
            direction: c.direction.clone(),
            codec: c.codec.to_string(),
            density: codec_density(&c.codec),
        });
    }
}

fn events(v: &mut RunView, r: &ReportFile, time_of: &dyn Fn(u64) -> f64) {
    let event = |step: u64, kind: &str, node: Option<&str>, text: String| RunEvent {
        t: time_of(step),
        step,
        kind: kind.into(),
        node: node.map(str::to_string),
        text,
    };
    for rec in &r.recoveries {
        let lost = format!("{} lost: {}", rec.node, rec.reason);
        let mut lost = event(rec.interrupted_at_step, "lost", Some(&rec.node), lost);
        if let Some(island) = rec.island_out {
            let text = format!(
                "island {island} out at step {}: the other islands went on without a rollback \
                 ({:.1} s to resume)",
                rec.interrupted_at_step, rec.seconds
            );
            let mut out = event(rec.interrupted_at_step, "island-out", None, text);
            out.t = lost.t + rec.seconds;
            v.events.extend([lost, out]);
            continue;
        }
        // The steps past the snapshot were trained again: the loss came `seconds` before the
        // first retrained step began.
        if let Some(t) = retrained_start(r, rec.resumed_from_step) {
            lost.t = (t - rec.seconds).max(0.0);
        }
        let back = format!(
            "rolled back to the snapshot at step {} ({} steps lost, {:.1} s to resume)",
            rec.resumed_from_step, rec.steps_lost, rec.seconds
        );
        let mut back = event(rec.resumed_from_step, "recovered", None, back);
        back.t = lost.t + rec.seconds;
        v.events.extend([lost, back]);
    }
    for s in &r.reshapes {
        let text = format!(
            "re-planned at step {} without a rollback: {}",
            s.step, s.why
        );
        v.events.push(event(s.step, "reshaped", None, text));
    }
    for e in &mut v.events {
        e.t = if e.t.is_finite() { e.t } else { 0.0 };
    }
    // Stable: a rollback stays after the loss it follows.
    v.events.sort_by(|a, b| a.t.total_cmp(&b.t));
    let end = format!("finished at step {}", v.step);
    v.events.push(event(v.step, "finished", None, end));
}

/// When the first step after `snapshot` began (its end minus its wall time), if the report has
/// it.
fn retrained_start(r: &ReportFile, snapshot: u64) -> Option<f64> {
    let next = snapshot.checked_add(1)?;
    let end = r.steps.iter().find(|s| s.step == next)?.elapsed_s;
    let wall = r
        .timings
        .iter()
        .find(|t| t.step == next)
        .map_or(0.0, |t| t.wall_s);
    Some(end - wall)
}

//! Predicts the time of one training step of a pipeline from the compute time of each stage and
//! the links between stages, by replaying the schedule the runtime executes.
//!
//! Every stage is a server that runs its passes (`fusion_exec::passes`: GPipe or 1F1B) in order;
//! a pass starts when the stage is free and everything it reads has arrived. Every directed link
//! is a FIFO server: a tensor starts transmitting when it is produced and the link is free, takes
//! `bytes / (bandwidth × compression ratio)`, and arrives one latency later. After its last
//! backward pass a stage exchanges the gradients of parameters it shares with another stage
//! (GPT-2's tied embedding lives on the first and the last), then runs its optimizer update. The
//! step ends when every stage has updated and, with data-parallel replicas, after the ring
//! all-reduce of the gradients. The
//! simulator is deterministic and exact for this model; what it leaves out (kernel launch and
//! framing overheads, TCP dynamics) is measured against real runs in `docs/BENCHMARKS.md`.

use fusion_exec::{passes, Pass, Schedule};
use serde::Serialize;
use thiserror::Error;

#[derive(Debug, Error, PartialEq)]
pub enum SimError {
    #[error("{0}")]
    Invalid(String),
}

/// Compute time of one micro-batch on one stage.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct StageTime {
    pub forward_s: f64,
    pub backward_s: f64,
}

/// A directed link's speed.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Link {
    pub bytes_per_s: f64,
    pub latency_s: f64,
}

impl Link {
    fn duration(&self, bytes: f64) -> f64 {
        if bytes <= 0.0 {
            0.0
        } else {
            bytes / self.bytes_per_s
        }
    }
}

/// Tensors stage `from` sends stage `to` per micro-batch (activations forward; the same bytes
/// of gradients come back), over `forward` (from → to) and `backward` (to → from) links.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Edge {
    pub from: usize,
    pub to: usize,
    pub bytes: f64,
    pub forward: Link,
    pub backward: Link,
    /// Compression ratio on this edge (1: none; 10: a tenth of the bytes is sent each way).
    pub compression: f64,
}

impl Edge {
    /// An uncompressed edge.
    pub fn new(from: usize, to: usize, bytes: f64, forward: Link, backward: Link) -> Self {
        Edge {
            from,
            to,
            bytes,
            forward,
            backward,
            compression: 1.0,
        }
    }

    fn sent_bytes(&self) -> f64 {
        self.bytes / self.compression
    }
}

/// Gradients of a parameter that two stages share (GPT-2's tied token embedding): once stage `a`
/// has run its last backward pass it sends its part to stage `b` over `a_to_b`, and the other way
/// round; neither may update before the other's part has arrived.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Exchange {
    pub a: usize,
    pub b: usize,
    pub bytes: f64,
    pub a_to_b: Link,
    pub b_to_a: Link,
}

/// Data-parallel replicas of every stage and the rings they all-reduce gradients over.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Replication {
    pub replicas: usize,
    /// The slowest link of each stage's ring (the stages all-reduce at the same time).
    pub rings: Vec<Link>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Pipeline {
    pub stages: Vec<StageTime>,
    pub edges: Vec<Edge>,
    /// Gradient bytes of each stage's parameters (for the all-reduce).
    pub grad_bytes: Vec<f64>,
    pub micro_batches: usize,
    #[serde(skip)]
    pub schedule: Schedule,
    pub replication: Option<Replication>,
    /// Shared-parameter gradient exchanges after the last backward pass.
    pub exchanges: Vec<Exchange>,
    /// Seconds each stage's optimizer update takes once its gradients are complete (empty: none).
    pub update_s: Vec<f64>,
}

/// What limits the step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub enum Bottleneck {
    Stage(usize),
    Link { from: usize, to: usize },
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Prediction {
    pub step_s: f64,
    /// Time each stage computes per step, and its share of the step.
    pub stage_busy_s: Vec<f64>,
    pub stage_utilisation: Vec<f64>,
    /// Busy time of each edge's forward and backward link per step.
    pub link_busy_s: Vec<(f64, f64)>,
    pub allreduce_s: f64,
    /// The busiest resource (compute or link), which bounds the step from below.
    pub bottleneck: Bottleneck,
}

impl Pipeline {
    fn validate(&self) -> Result<(), SimError> {
        let n = self.stages.len();
        let bad = |m: String| Err(SimError::Invalid(m));
        if n == 0 || self.micro_batches == 0 {
            return bad("a pipeline needs at least one stage and one micro-batch".into());
        }
        if self.grad_bytes.len() != n {
            return bad(format!(
                "{} gradient sizes for {n} stages",
                self.grad_bytes.len()
            ));
        }
        for (i, s) in self.stages.iter().enumerate() {
            if !(s.forward_s >= 0.0
                && s.backward_s >= 0.0
                && s.forward_s.is_finite()
                && s.backward_s.is_finite())
            {
                return bad(format!(
                    "stage {i}: compute times must be finite and non-negative"
                ));
            }
        }
        for e in &self.edges {
            if e.from >= e.to || e.to >= n {
                return bad(format!(
                    "edge {} -> {}: must go to a later stage of {n}",
                    e.from, e.to
                ));
            }
            for l in [e.forward, e.backward] {
                if !(l.bytes_per_s > 0.0 && l.latency_s >= 0.0 && l.latency_s.is_finite()) {
                    return bad(format!(
                        "edge {} -> {}: bandwidth must be positive",
                        e.from, e.to
                    ));
                }
            }
            if !(e.compression.is_finite() && e.compression >= 1.0) {
                return bad(format!(
                    "edge {} -> {}: compression ratio must be at least 1, got {}",
                    e.from, e.to, e.compression
                ));
            }
        }
        for x in &self.exchanges {
            let links_ok = [x.a_to_b, x.b_to_a]
                .iter()
                .all(|l| l.bytes_per_s > 0.0 && l.latency_s >= 0.0 && l.latency_s.is_finite());
            if x.a >= n
                || x.b >= n
                || x.a == x.b
                || !links_ok
                || !(x.bytes.is_finite() && x.bytes.is_sign_positive())
            {
                return bad(format!(
                    "exchange {} <-> {}: needs two distinct stages of {n}, non-negative bytes and positive bandwidth",
                    x.a, x.b
                ));
            }
        }
        if !self.update_s.is_empty()
            && (self.update_s.len() != n
                || self.update_s.iter().any(|u| !(u.is_finite() && *u >= 0.0)))
        {
            return bad(format!(
                "{} update times for {n} stages (each finite and non-negative)",
                self.update_s.len()
            ));
        }
        if let Some(r) = &self.replication {
            let rings_ok = r.rings.len() == n
                && r.rings
                    .iter()
                    .all(|l| l.bytes_per_s > 0.0 && l.latency_s >= 0.0 && l.latency_s.is_finite());
            if r.replicas == 0 || !rings_ok {
                return bad(format!(
                    "replication needs at least one replica and one ring of positive bandwidth per stage ({} rings for {n} stages)",
                    r.rings.len()
                ));
            }
        }
        Ok(())
    }
}

/// Simulates one step of `p`.
pub fn simulate(p: &Pipeline) -> Result<Prediction, SimError> {
    p.validate()?;
    let (n, m) = (p.stages.len(), p.micro_batches);
    let orders: Vec<Vec<Pass>> = (0..n).map(|s| passes(p.schedule, s, n, m)).collect();
    let mut next = vec![0usize; n];
    let mut free = vec![0.0f64; n];
    let mut busy = vec![0.0f64; n];
    // Arrival time of each edge's activation / gradient per micro-batch.
    let mut act_arrival = vec![vec![None::<f64>; m]; p.edges.len()];
    let mut grad_arrival = vec![vec![None::<f64>; m]; p.edges.len()];
    let mut link_free = vec![(0.0f64, 0.0f64); p.edges.len()];
    let mut link_busy = vec![(0.0f64, 0.0f64); p.edges.len()];
    let total: usize = orders.iter().map(Vec::len).sum();
    for _ in 0..total {
        // Of every stage's next pass whose inputs have arrived, run the one that can start first.
        let mut best: Option<(f64, usize)> = None;
        for s in 0..n {
            let Some(&pass) = orders[s].get(next[s]) else {
                continue;
            };
            let ready = match pass {
                Pass::Forward(mb) => p
                    .edges
                    .iter()
                    .enumerate()
                    .filter(|(_, e)| e.to == s)
                    .try_fold(0.0f64, |t, (i, _)| act_arrival[i][mb].map(|a| t.max(a))),
                Pass::Backward(mb) => p
                    .edges
                    .iter()
                    .enumerate()
                    .filter(|(_, e)| e.from == s)
                    .try_fold(0.0f64, |t, (i, _)| grad_arrival[i][mb].map(|a| t.max(a))),
            };
            if let Some(r) = ready {
                let start = r.max(free[s]);
                if best.is_none_or(|(b, _)| start < b) {
                    best = Some((start, s));
                }
            }
        }
        let Some((start, s)) = best else {
            return Err(SimError::Invalid(
                "the schedule deadlocks (no pass can start)".into(),
            ));
        };
        let pass = orders[s][next[s]];
        next[s] += 1;
        let (dur, mb) = match pass {
            Pass::Forward(mb) => (p.stages[s].forward_s, mb),
            Pass::Backward(mb) => (p.stages[s].backward_s, mb),
        };
        let done = start + dur;
        free[s] = done;
        busy[s] += dur;
        for (i, e) in p.edges.iter().enumerate() {
            match pass {
                Pass::Forward(_) if e.from == s => {
                    let t0 = done.max(link_free[i].0);
                    let d = e.forward.duration(e.sent_bytes());
                    link_free[i].0 = t0 + d;
                    link_busy[i].0 += d;
                    act_arrival[i][mb] = Some(t0 + d + e.forward.latency_s);
                }
                Pass::Backward(_) if e.to == s => {
                    let t0 = done.max(link_free[i].1);
                    let d = e.backward.duration(e.sent_bytes());
                    link_free[i].1 = t0 + d;
                    link_busy[i].1 += d;
                    grad_arrival[i][mb] = Some(t0 + d + e.backward.latency_s);
                }
                _ => {}
            }
        }
    }
    // A stage's gradients are complete when its last pass is done and every shared part has
    // arrived; its update follows.
    let mut complete = free.clone();
    for x in &p.exchanges {
        let to_b = free[x.a] + x.a_to_b.duration(x.bytes) + x.a_to_b.latency_s;
        let to_a = free[x.b] + x.b_to_a.duration(x.bytes) + x.b_to_a.latency_s;
        complete[x.b] = complete[x.b].max(to_b);
        complete[x.a] = complete[x.a].max(to_a);
    }
    let updated = |s: usize| complete[s] + p.update_s.get(s).copied().unwrap_or(0.0);
    let pipeline_end = (0..n).map(updated).fold(0.0, f64::max);
    let allreduce_s = match &p.replication {
        Some(r) if r.replicas > 1 => {
            let k = r.replicas as f64;
            p.grad_bytes
                .iter()
                .zip(&r.rings)
                .map(|(g, ring)| {
                    2.0 * (k - 1.0) / k * g / ring.bytes_per_s + 2.0 * (k - 1.0) * ring.latency_s
                })
                .fold(0.0, f64::max)
        }
        _ => 0.0,
    };
    let step_s = pipeline_end + allreduce_s;
    let (mut bottleneck, mut worst) = (Bottleneck::Stage(0), -1.0);
    for (s, &b) in busy.iter().enumerate() {
        if b > worst {
            (bottleneck, worst) = (Bottleneck::Stage(s), b);
        }
    }
    for (e, &(f, b)) in p.edges.iter().zip(&link_busy) {
        if f > worst {
            (bottleneck, worst) = (
                Bottleneck::Link {
                    from: e.from,
                    to: e.to,
                },
                f,
            );
        }
        if b > worst {
            (bottleneck, worst) = (
                Bottleneck::Link {
                    from: e.to,
                    to: e.from,
                },
                b,
            );
        }
    }
    Ok(Prediction {
        step_s,
        stage_utilisation: busy.iter().map(|b| b / step_s.max(1e-12)).collect(),
        stage_busy_s: busy,
        link_busy_s: link_busy,
        allreduce_s,
        bottleneck,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fast() -> Link {
        Link {
            bytes_per_s: 1e18,
            latency_s: 0.0,
        }
    }

    fn chain(
        stages: usize,
        f: f64,
        b: f64,
        m: usize,
        schedule: Schedule,
        link: Link,
        bytes: f64,
    ) -> Pipeline {
        Pipeline {
            stages: vec![
                StageTime {
                    forward_s: f,
                    backward_s: b
                };
                stages
            ],
            edges: (0..stages.saturating_sub(1))
                .map(|s| Edge::new(s, s + 1, bytes, link, link))
                .collect(),
            grad_bytes: vec![0.0; stages],
            micro_batches: m,
            schedule,
            replication: None,
            exchanges: Vec::new(),
            update_s: Vec::new(),
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * b.abs().max(1.0)
    }

    #[test]
    fn balanced_pipelines_take_the_textbook_time() {
        // S equal stages, M micro-batches, free links: (M + S - 1) (f + b) for both schedules.
        for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
            for (s, m) in [(1, 1), (1, 5), (4, 1), (4, 4), (4, 8), (3, 7)] {
                let p = chain(s, 1.0, 2.0, m, schedule, fast(), 1.0);
                let r = simulate(&p).expect("valid");
                let want = (m + s - 1) as f64 * 3.0;
                assert!(
                    close(r.step_s, want),
                    "{schedule:?} S={s} M={m}: {} vs {want}",
                    r.step_s
                );
                assert!(r.stage_busy_s.iter().all(|&b| close(b, 3.0 * m as f64)));
            }
        }
    }

    #[test]
    fn shared_gradients_and_updates_extend_the_step() {
        // Three stages of 1 s forward and 2 s backward, two micro-batches, GPipe: stage 2 is done
        // at 8 s, stage 0 at 12 s. They share a parameter of 2 bytes over 1 byte/s links with
        // 0.5 s latency: stage 0's part reaches stage 2 at 14.5 s; stage 2's reached stage 0 at
        // 10.5 s. Every update takes 1 s.
        let mut p = chain(3, 1.0, 2.0, 2, Schedule::GPipe, fast(), 1.0);
        let slow = Link {
            bytes_per_s: 1.0,
            latency_s: 0.5,
        };
        p.exchanges.push(Exchange {
            a: 0,
            b: 2,
            bytes: 2.0,
            a_to_b: slow,
            b_to_a: slow,
        });
        p.update_s = vec![1.0; 3];
        let r = simulate(&p).expect("valid");
        assert!(close(r.step_s, 15.5), "{}", r.step_s);
        p.exchanges[0].b = 0;
        assert!(simulate(&p).is_err(), "an exchange needs two stages");
        p.exchanges.clear();
        p.update_s = vec![1.0; 2];
        assert!(simulate(&p).is_err(), "one update time per stage");
    }
    #[test]
    fn a_slow_link_dominates_and_is_named() {
        // Two stages with no compute joined by a link that takes 1 s per tensor plus 0.5 s of
        // latency: M activations stream forward, then M gradients stream back.
        let link = Link {
            bytes_per_s: 1.0,
            latency_s: 0.5,
        };
        let p = chain(2, 0.0, 0.0, 3, Schedule::GPipe, link, 1.0);
        let r = simulate(&p).expect("valid");
        // Forward: the last activation arrives at 3 + 0.5; backward of micro-batch 0 starts then
        // on stage 1 and its gradient needs 1 + 0.5, the other two follow on the link: 3.5 + 3 + 0.5.
        assert!(close(r.step_s, 7.0), "{}", r.step_s);
        assert_eq!(r.bottleneck, Bottleneck::Link { from: 0, to: 1 });
        // Compressing the edge 2x halves every transfer but not the latency: 1.5 + 0.5 + 1.5 + 0.5.
        let mut c = p.clone();
        c.edges[0].compression = 2.0;
        let r = simulate(&c).expect("valid");
        assert!(close(r.step_s, 4.0), "{}", r.step_s);
    }

    #[test]
    fn skip_edges_and_allreduce_are_counted() {
        let mut p = chain(3, 1.0, 1.0, 2, Schedule::OneFOneB, fast(), 0.0);
        // A residual edge from stage 0 straight to stage 2, slow.
        let slow = Link {
            bytes_per_s: 1.0,
            latency_s: 0.0,
        };
        p.edges.push(Edge::new(0, 2, 10.0, slow, slow));
        let r = simulate(&p).expect("valid");
        assert!(
            r.step_s > 20.0,
            "the 10 s transfers must show: {}",
            r.step_s
        );
        assert_eq!(r.bottleneck, Bottleneck::Link { from: 0, to: 2 });

        let mut q = chain(2, 1.0, 1.0, 1, Schedule::GPipe, fast(), 0.0);
        q.grad_bytes = vec![100.0, 50.0];
        let ring = Link {
            bytes_per_s: 10.0,
            latency_s: 0.1,
        };
        q.replication = Some(Replication {
            replicas: 4,
            rings: vec![ring, ring],
        });
        let r = simulate(&q).expect("valid");
        // 2 (R-1)/R of the largest stage's gradients, plus 2 latencies.
        assert!(close(r.allreduce_s, 1.5 * 100.0 / 10.0 + 0.6));
        assert!(close(r.step_s, 4.0 + r.allreduce_s));
        // A slower ring on the stage with fewer gradients can be what bounds the step.
        q.replication = Some(Replication {
            replicas: 4,
            rings: vec![
                ring,
                Link {
                    bytes_per_s: 1.0,
                    latency_s: 0.1,
                },
            ],
        });
        let r = simulate(&q).expect("valid");
        assert!(close(r.allreduce_s, 1.5 * 50.0 / 1.0 + 0.6));
    }

    #[test]
    fn invalid_pipelines_say_why() {
        let mut p = chain(2, 1.0, 1.0, 1, Schedule::GPipe, fast(), 1.0);
        p.edges[0].from = 1;
        p.edges[0].to = 0;
        assert!(simulate(&p)
            .unwrap_err()
            .to_string()
            .contains("later stage"));
        let mut q = chain(2, 1.0, 1.0, 1, Schedule::GPipe, fast(), 1.0);
        q.edges[0].forward.bytes_per_s = 0.0;
        assert!(simulate(&q).unwrap_err().to_string().contains("bandwidth"));
        let mut c = chain(2, 1.0, 1.0, 1, Schedule::GPipe, fast(), 1.0);
        c.edges[0].compression = 0.5;
        assert!(simulate(&c)
            .unwrap_err()
            .to_string()
            .contains("compression"));
        let mut r = chain(2, 1.0, 1.0, 0, Schedule::GPipe, fast(), 1.0);
        r.micro_batches = 0;
        assert!(simulate(&r).is_err());
    }
}

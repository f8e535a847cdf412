//! What a node's stage is doing, as its heartbeats tell the broker: the step and micro-batch, the
//! phase (computing, waiting for a peer, blocked sending to one, updating, saving), a counter that
//! moves with every bit of progress, and how many tensors went to and came from each peer in the
//! current generation. The broker uses it to tell a stalled node from a busy one, and to find the
//! node a stuck pipeline waits for.

use fusion_proto::{PeerTensors, Phase, Progress};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

#[derive(Default)]
struct State {
    /// None before the first assignment.
    generation: Option<u64>,
    step: u64,
    phase: Phase,
    micro_batch: u32,
    waiting_for: String,
    counter: u64,
    /// (started, sent, received) tensors per peer in this generation.
    peers: BTreeMap<String, [u64; 3]>,
}

/// A node's progress, written by its compute thread and data-plane tasks (through a [`Handle`]
/// of their generation), read by its heartbeats.
#[derive(Default)]
pub struct Tracker {
    state: Mutex<State>,
}

impl Tracker {
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies `f` and moves the counter, if `generation` is the current one (None: whatever
    /// is current).
    fn with(&self, generation: Option<u64>, f: impl FnOnce(&mut State)) {
        if let Ok(mut s) = self.state.lock() {
            if generation.is_none() || generation == s.generation {
                f(&mut s);
                s.counter += 1;
            }
        }
    }

    /// A new assignment: counts start again. Returns the handle its stage reports through.
    pub fn start_generation(self: &Arc<Self>, generation: u64) -> Handle {
        self.with(None, |s| {
            s.generation = Some(generation);
            s.peers.clear();
            s.phase = Phase::Idle;
            s.waiting_for.clear();
        });
        Handle {
            tracker: self.clone(),
            generation,
        }
    }

    /// The current stage enters `phase` at `step` (for the node's own work, such as saving).
    pub fn enter(&self, phase: Phase, step: u64) {
        self.with(None, |s| set_phase(s, phase, step, 0, ""));
    }

    /// The current stage has nothing to do until the broker's next command.
    pub fn idle(&self) {
        self.with(None, |s| {
            s.phase = Phase::Idle;
            s.waiting_for.clear();
        });
    }

    /// The heartbeat's view (None before any assignment).
    pub fn report(&self) -> Option<Progress> {
        let s = self.state.lock().ok()?;
        let generation = s.generation?;
        Some(Progress {
            generation,
            step: s.step,
            phase: s.phase as i32,
            micro_batch: s.micro_batch,
            waiting_for: s.waiting_for.clone(),
            counter: s.counter,
            peers: s
                .peers
                .iter()
                .map(|(peer, &[started, sent, received])| PeerTensors {
                    peer: peer.clone(),
                    sent,
                    received,
                    started,
                })
                .collect(),
        })
    }
}

fn set_phase(s: &mut State, phase: Phase, step: u64, micro_batch: usize, peer: &str) {
    s.phase = phase;
    s.step = step;
    s.micro_batch = micro_batch as u32;
    s.waiting_for.clear();
    s.waiting_for.push_str(peer);
}

/// Where one generation's stage reports its progress: once the node has moved on to another
/// assignment, whatever is left of the old one (a compute thread still unwinding, a session still
/// draining) reports nothing.
#[derive(Clone)]
pub struct Handle {
    tracker: Arc<Tracker>,
    generation: u64,
}

impl Handle {
    /// A handle of its own, for a stage outside a node (tests, benchmarks).
    pub fn detached() -> Handle {
        Arc::new(Tracker::new()).start_generation(0)
    }

    fn with(&self, f: impl FnOnce(&mut State)) {
        self.tracker.with(Some(self.generation), f);
    }

    /// The stage enters `phase` at (`step`, `micro_batch`), waiting on `peer` (empty: nobody).
    pub fn enter(&self, phase: Phase, step: u64, micro_batch: usize, peer: &str) {
        self.with(|s| set_phase(s, phase, step, micro_batch, peer));
    }

    /// Back to computing the current micro-batch (after a wait or a blocked send).
    pub fn resume(&self) {
        self.with(|s| {
            s.phase = Phase::Computing;
            s.waiting_for.clear();
        });
    }

    /// The stage has nothing to do until the broker's next command.
    pub fn idle(&self) {
        self.with(|s| {
            s.phase = Phase::Idle;
            s.waiting_for.clear();
        });
    }

    /// Writing a tensor to `peer` began.
    pub fn started(&self, peer: &str) {
        self.count(peer, 0);
    }

    /// A piece of a tensor was written (progress, nothing counted).
    pub fn chunk(&self) {
        self.with(|_| {});
    }

    /// A tensor was fully written to `peer`'s session.
    pub fn sent(&self, peer: &str) {
        self.count(peer, 1);
    }

    /// A tensor from `peer` was taken into the mailbox.
    pub fn received(&self, peer: &str) {
        self.count(peer, 2);
    }

    fn count(&self, peer: &str, which: usize) {
        self.with(|s| match s.peers.get_mut(peer) {
            Some(c) => c[which] += 1,
            None => {
                let mut c = [0; 3];
                c[which] = 1;
                s.peers.insert(peer.to_string(), c);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_moves_with_phases_and_an_old_generation_reports_nothing() {
        let t = Arc::new(Tracker::new());
        assert!(t.report().is_none(), "nothing before an assignment");
        let old = t.start_generation(2);
        let h = t.start_generation(3);
        let c0 = t.report().expect("report").counter;
        h.enter(Phase::Waiting, 7, 1, "node2");
        h.started("node2");
        h.sent("node2");
        h.started("node2");
        h.received("node0");
        old.sent("node2");
        old.enter(Phase::Computing, 6, 0, "");
        let r = t.report().expect("report");
        assert!(r.counter > c0);
        assert_eq!((r.step, r.micro_batch, r.phase()), (7, 1, Phase::Waiting));
        assert_eq!(r.waiting_for, "node2");
        let counts: Vec<(String, u64, u64, u64)> = r
            .peers
            .iter()
            .map(|p| (p.peer.clone(), p.started, p.sent, p.received))
            .collect();
        assert_eq!(
            counts,
            vec![("node0".into(), 0, 0, 1), ("node2".into(), 2, 1, 0)],
            "the old generation's send and phase are not counted"
        );
        h.resume();
        assert_eq!(t.report().expect("report").waiting_for, "");
        t.start_generation(4);
        assert!(t.report().expect("report").peers.is_empty());
    }
}

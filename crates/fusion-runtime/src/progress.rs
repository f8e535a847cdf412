//! What a node's stage is doing, as its heartbeats tell the broker: the step and micro-batch, the
//! phase (computing, waiting for a peer, blocked sending to one, updating, saving), a counter that
//! moves with every bit of progress, and how many tensors went to and came from each peer in the
//! current generation. The broker uses it to tell a stalled node from a busy one, and to find the
//! node a stuck pipeline waits for.

use fusion_proto::{PeerTensors, Phase, Progress};
use std::collections::BTreeMap;
use std::sync::Mutex;

#[derive(Default)]
struct State {
    /// None before the first assignment.
    generation: Option<u64>,
    step: u64,
    phase: Phase,
    micro_batch: u32,
    waiting_for: String,
    counter: u64,
    /// (sent, received) tensors per peer in this generation.
    peers: BTreeMap<String, (u64, u64)>,
}

/// A node's progress, written by its compute thread and data-plane tasks, read by its
/// heartbeats.
#[derive(Default)]
pub struct Tracker {
    state: Mutex<State>,
}

impl Tracker {
    pub fn new() -> Self {
        Self::default()
    }

    fn with(&self, f: impl FnOnce(&mut State)) {
        if let Ok(mut s) = self.state.lock() {
            f(&mut s);
            s.counter += 1;
        }
    }

    /// A new assignment: counts start again.
    pub fn start_generation(&self, generation: u64) {
        self.with(|s| {
            s.generation = Some(generation);
            s.peers.clear();
            s.phase = Phase::Idle;
            s.waiting_for.clear();
        });
    }

    /// The stage enters `phase` at (`step`, `micro_batch`), waiting on `peer` (empty: nobody).
    pub fn enter(&self, phase: Phase, step: u64, micro_batch: usize, peer: &str) {
        self.with(|s| {
            s.phase = phase;
            s.step = step;
            s.micro_batch = micro_batch as u32;
            s.waiting_for.clear();
            s.waiting_for.push_str(peer);
        });
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

    /// A tensor of `generation` was fully written to `peer`'s session.
    pub fn sent(&self, generation: u64, peer: &str) {
        self.count(generation, peer, true);
    }

    /// A tensor of `generation` from `peer` was taken into the mailbox.
    pub fn received(&self, generation: u64, peer: &str) {
        self.count(generation, peer, false);
    }

    fn count(&self, generation: u64, peer: &str, sent: bool) {
        self.with(|s| {
            // A session of an older assignment still draining does not count.
            if s.generation == Some(generation) {
                let e = s.peers.entry(peer.to_string()).or_default();
                if sent {
                    e.0 += 1;
                } else {
                    e.1 += 1;
                }
            }
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
                .map(|(peer, &(sent, received))| PeerTensors {
                    peer: peer.clone(),
                    sent,
                    received,
                })
                .collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_moves_with_phases_and_counts_only_the_current_generation() {
        let t = Tracker::new();
        assert!(t.report().is_none(), "nothing before an assignment");
        t.start_generation(3);
        let c0 = t.report().expect("report").counter;
        t.enter(Phase::Waiting, 7, 1, "node2");
        t.sent(3, "node2");
        t.sent(2, "node2");
        t.received(3, "node0");
        let r = t.report().expect("report");
        assert!(r.counter > c0);
        assert_eq!((r.step, r.micro_batch, r.phase()), (7, 1, Phase::Waiting));
        assert_eq!(r.waiting_for, "node2");
        let counts: Vec<(String, u64, u64)> = r
            .peers
            .iter()
            .map(|p| (p.peer.clone(), p.sent, p.received))
            .collect();
        assert_eq!(
            counts,
            vec![("node0".into(), 0, 1), ("node2".into(), 1, 0)],
            "the old generation's send is not counted"
        );
        t.resume();
        assert_eq!(t.report().expect("report").waiting_for, "");
        t.start_generation(4);
        assert!(t.report().expect("report").peers.is_empty());
    }
}

//! Stalls: when the nodes a step waits for have all stopped making progress, which one is to
//! blame. A pure function of their progress reports, so that it is tested without a network.
//!
//! A node that is working (computing, updating, saving) but whose progress has not moved for the
//! deadline is stuck itself. Otherwise every awaited node waits for a peer, and the waits are
//! followed: a tensor the peer wrote but the waiting node never took in points at the receiver
//! (its reader is stuck, or the way to it is cut); a node blocked sending to a peer points at that
//! peer; a wait on a node that is not waiting itself points at that node.

use fusion_proto::{Phase, Progress};
use std::time::Duration;

/// What the broker knows of one node a step waits on, or that already answered.
pub(super) struct Observed {
    pub node: String,
    /// Its latest progress in the current generation (None: none reported yet).
    pub progress: Option<Progress>,
    /// How long its progress has not moved.
    pub still_for: Duration,
    /// It has already sent what the broker waits for.
    pub done: bool,
}

impl Observed {
    /// Tensors this node began writing to `peer`, finished writing to it, and took in from it.
    fn counts(&self, peer: &str) -> (u64, u64, u64) {
        self.progress
            .as_ref()
            .and_then(|p| p.peers.iter().find(|c| c.peer == peer))
            .map_or((0, 0, 0), |c| (c.started.max(c.sent), c.sent, c.received))
    }
}

/// The node to evict, by index into `nodes`, and why; None while any awaited node still moves
/// (or reports nothing), or when no node is awaited.
pub(super) fn blame(nodes: &[Observed], deadline: Duration) -> Option<(usize, String)> {
    let pending: Vec<usize> = (0..nodes.len()).filter(|&i| !nodes[i].done).collect();
    let all_still = pending
        .iter()
        .all(|&i| nodes[i].progress.is_some() && nodes[i].still_for >= deadline);
    if pending.is_empty() || !all_still || in_flight(nodes, &pending, deadline) {
        return None;
    }
    stuck_working(nodes, &pending)
        .or_else(|| undelivered(nodes, &pending))
        .or_else(|| awaited(nodes, &pending))
}

fn phase(o: &Observed) -> Phase {
    o.progress.as_ref().map_or(Phase::Idle, |p| p.phase())
}

fn waiting_for(o: &Observed) -> &str {
    o.progress.as_ref().map_or("", |p| p.waiting_for.as_str())
}

fn index_of(nodes: &[Observed], name: &str) -> Option<usize> {
    nodes.iter().position(|o| o.node == name)
}

/// Whether a waiting node's peer is still writing to it (a large tensor on a slow link): the
/// pipeline moves, however slowly.
fn in_flight(nodes: &[Observed], pending: &[usize], deadline: Duration) -> bool {
    pending.iter().any(|&r| {
        let peer = waiting_for(&nodes[r]);
        index_of(nodes, peer).is_some_and(|s| {
            let (started, sent, _) = nodes[s].counts(&nodes[r].node);
            started > sent && nodes[s].still_for < deadline
        })
    })
}

/// An awaited node that is not waiting on anyone, yet does not move.
fn stuck_working(nodes: &[Observed], pending: &[usize]) -> Option<(usize, String)> {
    let i = pending
        .iter()
        .copied()
        .filter(|&i| !matches!(phase(&nodes[i]), Phase::Waiting | Phase::Sending))
        .max_by_key(|&i| nodes[i].still_for)?;
    let o = &nodes[i];
    let (step, mb) = o
        .progress
        .as_ref()
        .map_or((0, 0), |p| (p.step, p.micro_batch));
    let doing = match phase(o) {
        Phase::Idle => "idle while its step result is awaited".to_string(),
        p => format!(
            "{} (step {step}, micro-batch {mb})",
            p.as_str_name().trim_start_matches("PHASE_").to_lowercase()
        ),
    };
    Some((
        i,
        format!(
            "stalled: no progress for {:.1} s while {doing}",
            o.still_for.as_secs_f64()
        ),
    ))
}

/// A waiting node that never took in tensors its peer wrote to it; or the peer a node is blocked
/// sending to.
fn undelivered(nodes: &[Observed], pending: &[usize]) -> Option<(usize, String)> {
    for &r in pending {
        let peer = waiting_for(&nodes[r]);
        let Some(s) = index_of(nodes, peer) else {
            continue;
        };
        let (started, _, _) = nodes[s].counts(&nodes[r].node);
        let (_, _, received) = nodes[r].counts(peer);
        if phase(&nodes[r]) == Phase::Waiting && started > received {
            let reason = format!(
                "stalled: has not taken in the tensors {peer} wrote to it ({started} written, \
                 {received} taken in) for {:.1} s",
                nodes[r].still_for.as_secs_f64()
            );
            return Some((r, reason));
        }
        if phase(&nodes[r]) == Phase::Sending {
            let reason = format!(
                "stalled: has not read what {} sends it for {:.1} s",
                nodes[r].node,
                nodes[r].still_for.as_secs_f64()
            );
            return Some((s, reason));
        }
    }
    None
}

/// The node the longest-waiting node waits for, followed while that one waits too (a cycle of
/// waits ends at the node where it closes).
fn awaited(nodes: &[Observed], pending: &[usize]) -> Option<(usize, String)> {
    let mut at = pending
        .iter()
        .copied()
        .max_by_key(|&i| nodes[i].still_for)?;
    let mut seen = vec![at];
    loop {
        let next = index_of(nodes, waiting_for(&nodes[at]))?;
        let waits = !nodes[next].done && phase(&nodes[next]) == Phase::Waiting;
        if !waits || seen.contains(&next) {
            let reason = format!(
                "stalled: {} waits for a tensor {} has not sent ({:.1} s)",
                nodes[at].node,
                nodes[next].node,
                nodes[at].still_for.as_secs_f64()
            );
            return Some((next, reason));
        }
        seen.push(next);
        at = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fusion_proto::PeerTensors;

    fn node(name: &str, phase: Phase, waiting_for: &str, peers: &[(&str, u64, u64)]) -> Observed {
        Observed {
            node: name.into(),
            progress: Some(Progress {
                generation: 1,
                step: 12,
                phase: phase as i32,
                micro_batch: 1,
                waiting_for: waiting_for.into(),
                counter: 7,
                peers: peers
                    .iter()
                    .map(|&(p, sent, received)| PeerTensors {
                        peer: p.into(),
                        sent,
                        received,
                        started: sent,
                    })
                    .collect(),
            }),
            still_for: Duration::from_secs(10),
            done: false,
        }
    }

    const DEADLINE: Duration = Duration::from_secs(5);

    #[test]
    fn a_wedged_compute_thread_is_blamed_not_the_nodes_waiting_for_it() {
        let nodes = [
            node("node0", Phase::Waiting, "node1", &[("node1", 2, 0)]),
            node("node1", Phase::Computing, "", &[("node0", 0, 2)]),
            node("node2", Phase::Waiting, "node1", &[]),
        ];
        let (i, why) = blame(&nodes, DEADLINE).expect("a culprit");
        assert_eq!(nodes[i].node, "node1");
        assert!(why.contains("computing (step 12, micro-batch 1)"), "{why}");
    }

    #[test]
    fn a_node_that_stopped_reading_is_blamed_through_the_tensors_it_never_took_in() {
        // node1 waits for node0's activation, which node0 wrote; node0 and node2 wait for node1.
        let nodes = [
            node("node0", Phase::Waiting, "node1", &[("node1", 3, 2)]),
            node(
                "node1",
                Phase::Waiting,
                "node0",
                &[("node0", 2, 2), ("node2", 2, 0)],
            ),
            node("node2", Phase::Waiting, "node1", &[("node1", 2, 2)]),
        ];
        let (i, why) = blame(&nodes, DEADLINE).expect("a culprit");
        assert_eq!(nodes[i].node, "node1", "{why}");
        assert!(why.contains("3 written, 2 taken in"), "{why}");
    }

    #[test]
    fn a_large_tensor_still_being_written_is_progress_and_a_stuck_write_blames_the_receiver() {
        // node0 is half-way through writing a tensor to node1 (started 3, sent 2).
        let mut writer = node("node0", Phase::Idle, "", &[("node1", 2, 0)]);
        writer.done = true;
        if let Some(p) = writer.progress.as_mut() {
            p.peers[0].started = 3;
        }
        writer.still_for = Duration::from_secs(1);
        let waiting = || node("node1", Phase::Waiting, "node0", &[("node0", 0, 2)]);
        assert!(blame(&[writer, waiting()], DEADLINE).is_none());
        let mut stuck = node("node0", Phase::Idle, "", &[("node1", 2, 0)]);
        stuck.done = true;
        if let Some(p) = stuck.progress.as_mut() {
            p.peers[0].started = 3;
        }
        let nodes = [stuck, waiting()];
        let (i, why) = blame(&nodes, DEADLINE).expect("a culprit");
        assert_eq!(nodes[i].node, "node1", "{why}");
        assert!(why.contains("3 written, 2 taken in"), "{why}");
    }

    #[test]
    fn a_blocked_sender_blames_the_peer_it_sends_to() {
        let nodes = [
            node("node0", Phase::Sending, "node1", &[]),
            node("node1", Phase::Waiting, "node2", &[]),
            node("node2", Phase::Waiting, "node0", &[]),
        ];
        let (i, _) = blame(&nodes, DEADLINE).expect("a culprit");
        assert_eq!(nodes[i].node, "node1");
    }

    #[test]
    fn a_wait_on_a_node_that_finished_without_sending_blames_that_node() {
        let mut done = node("node2", Phase::Idle, "", &[]);
        done.done = true;
        let nodes = [
            node("node0", Phase::Waiting, "node1", &[]),
            node("node1", Phase::Waiting, "node2", &[]),
            done,
        ];
        let (i, why) = blame(&nodes, DEADLINE).expect("a culprit");
        assert_eq!(nodes[i].node, "node2", "{why}");
    }

    #[test]
    fn nobody_is_blamed_while_anything_moves_or_reports_nothing() {
        let mut moving = node("node1", Phase::Computing, "", &[]);
        moving.still_for = Duration::from_secs(1);
        let nodes = [node("node0", Phase::Waiting, "node1", &[]), moving];
        assert!(blame(&nodes, DEADLINE).is_none());
        let mut silent = node("node1", Phase::Computing, "", &[]);
        silent.progress = None;
        let nodes = [node("node0", Phase::Waiting, "node1", &[]), silent];
        assert!(blame(&nodes, DEADLINE).is_none());
        let mut all_done = node("node0", Phase::Idle, "", &[]);
        all_done.done = true;
        assert!(blame(&[all_done], DEADLINE).is_none());
    }

    #[test]
    fn a_cycle_of_waits_with_nothing_in_flight_blames_the_node_where_it_closes() {
        let mut a = node("node0", Phase::Waiting, "node1", &[]);
        a.still_for = Duration::from_secs(20);
        let nodes = [a, node("node1", Phase::Waiting, "node0", &[])];
        let (i, _) = blame(&nodes, DEADLINE).expect("a culprit");
        assert_eq!(nodes[i].node, "node0");
    }
}

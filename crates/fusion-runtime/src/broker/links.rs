//! The links between members: the testbed's figures and probe rounds that measure them.

use super::*;
use crate::path::LinkPath;

/// Weight of a new probe in a link's smoothed figures (exponential moving average).
pub(super) const PROBE_SMOOTHING: f64 = 0.5;
/// A smoothed bandwidth that moves by more than this share is logged as a change.
pub(super) const PROBE_CHANGE: f64 = 0.2;

/// The directed links a placement sends tensors over (both directions of every pair of peers,
/// all-reduce rings included), as positions in `active`.
pub(super) fn used_links(plan: &Plan, layout: &Layout, active: &[usize]) -> Vec<(usize, usize)> {
    let pos = |m: usize| active.iter().position(|&a| a == m);
    let mut pairs = std::collections::BTreeSet::new();
    let mut add = |a: usize, b: usize| {
        if let (Some(x), Some(y)) = (pos(a), pos(b)) {
            if x != y {
                pairs.insert((x, y));
                pairs.insert((y, x));
            }
        }
    };
    let stages = layout.replicas.first().map_or(0, Vec::len);
    for nodes in &layout.replicas {
        for s in 0..stages {
            for p in plan.peers_of(s) {
                add(nodes[s], nodes[p]);
            }
        }
    }
    for s in 0..stages {
        let ring: Vec<usize> = layout.replicas.iter().map(|n| n[s]).collect();
        for (i, &m) in ring.iter().enumerate() {
            add(m, ring[(i + 1) % ring.len()]);
        }
    }
    pairs.into_iter().collect()
}

impl Coordinator<'_> {
    pub(super) fn link_between(&self, a: usize, b: usize) -> Option<(f64, f64)> {
        let tb = self.job.testbed.as_ref()?;
        let device = |i: usize| {
            let id = &self.members[i].id;
            tb.device(id)
                .map_or_else(|| tb.devices[i].name.clone(), |d| d.name.clone())
        };
        tb.link(&device(a), &device(b))
            .map(|l| (l.bandwidth_mbps, l.latency_ms))
    }

    /// The figures of the path from member `a` to member `b` as probed: over that very path
    /// when a round over the paths measured it; otherwise from the legs a probe could measure
    /// (see `reach`).
    pub(super) fn measured_between(&self, a: usize, b: usize) -> Option<(f64, f64)> {
        let path = self.path_between(a, b);
        let key = (self.members[a].id.clone(), self.members[b].id.clone());
        match self.measured.get(&key) {
            Some(l) if path != LinkPath::Direct && l.path == path => {
                Some((l.bandwidth_mbps, l.latency_ms))
            }
            _ => self.over_path(a, b, |x, y| self.probed_between(x, y)),
        }
    }

    /// The testbed's figures of the path from member `a` to member `b`.
    pub(super) fn testbed_path(&self, a: usize, b: usize) -> Option<(f64, f64)> {
        self.over_path(a, b, |x, y| self.link_between(x, y))
    }

    /// The smoothed probed figures of the wire from member `a` to member `b` (a probe through a
    /// relay measured two wires, not this one).
    pub(super) fn probed_between(&self, a: usize, b: usize) -> Option<(f64, f64)> {
        let key = (self.members[a].id.clone(), self.members[b].id.clone());
        self.measured
            .get(&key)
            .filter(|l| !matches!(l.path, LinkPath::Relayed { .. }))
            .map(|l| (l.bandwidth_mbps, l.latency_ms))
    }

    /// Measures the links among `pairs` (directed, positions in `active`) that are not dialled
    /// directly (reversed, punched, relayed) over the path each takes: one round over every
    /// such pair (both directions, so that each end admits the other's probe), those already
    /// measured over their path only when `refresh`.
    pub(super) async fn probe_paths(
        &mut self,
        active: &[usize],
        pairs: &[(usize, usize)],
        refresh: bool,
    ) -> Flow<()> {
        let mut routed = std::collections::BTreeSet::new();
        for &(a, b) in pairs {
            let path = self.path_between(active[a], active[b]);
            let key = (
                self.members[active[a]].id.clone(),
                self.members[active[b]].id.clone(),
            );
            let known = self.measured.get(&key).is_some_and(|l| l.path == path);
            if path != LinkPath::Direct && (refresh || !known) {
                routed.insert((a, b));
                routed.insert((b, a));
            }
        }
        let routed: Vec<(usize, usize)> = routed.into_iter().collect();
        self.probe_round_of(active, &routed, true).await
    }

    /// Has every member in `pairs` (directed, positions in `active`) probe its peers, one probe
    /// round, and folds the results into the smoothed link figures. Rounds are symmetric: the
    /// pairs must list both directions.
    pub(super) async fn probe_links(
        &mut self,
        active: &[usize],
        pairs: &[(usize, usize)],
    ) -> Flow<()> {
        self.probe_round_of(active, pairs, false).await
    }

    /// The peer entry of `b` in `a`'s list of a probe round: routed as `a`'s sessions to `b`
    /// (the relay is the same for both directions: `relay_for` is symmetric), or, in a round
    /// of direct dials, without the path fields.
    fn probe_entry(&self, a: usize, b: usize, routed: bool) -> PeerLink {
        let link = self.peer_link(a, b, 0);
        if routed {
            return link;
        }
        PeerLink {
            self_unreachable: false,
            peer_unreachable: false,
            punch_peer_ip: String::new(),
            relay_node: String::new(),
            relay_address: String::new(),
            ..link
        }
    }

    /// One probe round over `pairs` (see `probe_links`): direct dials, or over the links' paths
    /// (`routed`; then the relays are asked to relay the probes, and the outcomes say nothing
    /// of who accepts connections).
    async fn probe_round_of(
        &mut self,
        active: &[usize],
        pairs: &[(usize, usize)],
        routed: bool,
    ) -> Flow<()> {
        // A member known to accept no connections cannot be dialled (its links are known from
        // the directions and legs that can, and from rounds over the paths).
        let pairs: Vec<(usize, usize)> = pairs
            .iter()
            .copied()
            .filter(|&(_, b)| routed || self.reachable(active[b]))
            .collect();
        if pairs.is_empty() {
            return Ok(());
        }
        self.probe_round += 1;
        let round = self.probe_round;
        let mut lists: BTreeMap<usize, Vec<PeerLink>> = BTreeMap::new();
        let mut relayed: BTreeMap<usize, Vec<String>> = BTreeMap::new();
        let mut paths = BTreeMap::new();
        for &(a, b) in &pairs {
            let (ma, mb) = (active[a], active[b]);
            let path = if routed {
                self.path_between(ma, mb)
            } else {
                LinkPath::Direct
            };
            if let LinkPath::Relayed { via } = &path {
                if let Some(r) = self.members.iter().position(|m| &m.id == via) {
                    let pair = format!("{}/{}", self.members[ma].id, self.members[mb].id);
                    relayed.entry(r).or_default().push(pair);
                }
            }
            paths.insert(
                (self.members[ma].id.clone(), self.members[mb].id.clone()),
                path,
            );
            lists
                .entry(ma)
                .or_default()
                .push(self.probe_entry(ma, mb, routed));
        }
        for &r in relayed.keys() {
            lists.entry(r).or_default();
        }
        let asked: Vec<usize> = lists.keys().copied().collect();
        for (&a, peers) in &lists {
            self.send(
                a,
                broker_message::Body::Probe(ProbeLinks {
                    round,
                    peers: peers.clone(),
                    max_bytes: self.job.probe.max_bytes,
                    relay_pairs: relayed.get(&a).cloned().unwrap_or_default(),
                }),
            )
            .await?;
        }
        let reports = self
            .gather(&asked, "link probes", Watch::Liveness, |_, _, m| {
                Ok(match m.body {
                    Some(node_message::Body::Links(r)) if r.round == round => Some(r),
                    _ => None,
                })
            })
            .await?;
        let mut changed = Vec::new();
        let mut outcomes = Vec::new();
        for (&member, report) in asked.iter().zip(&reports) {
            let from = self.members[member].id.clone();
            for l in &report.links {
                let Some(path) = paths.get(&(from.clone(), l.peer.clone())) else {
                    tracing::warn!("{from} reported a probe of {}, not in its round", l.peer);
                    continue;
                };
                // A round over the paths also has each end probe the other's direction, which
                // may be a direct one the direct rounds measure.
                if routed && *path == LinkPath::Direct {
                    continue;
                }
                changed.extend(self.fold_probe(&from, l, round, path.clone()));
                outcomes.push((from.clone(), l));
            }
        }
        if !routed {
            self.fold_reachability(&outcomes);
        }
        if !changed.is_empty() {
            (self.on_event)(BrokerEvent::Links {
                round,
                changed: &changed,
            });
        }
        Ok(())
    }

    /// Folds one probed link into its smoothed figures; returns them when they are new or moved
    /// noticeably. A failed or nonsensical measurement is logged and left out.
    fn fold_probe(
        &mut self,
        from: &str,
        l: &fusion_proto::LinkMeasurement,
        round: u64,
        path: LinkPath,
    ) -> Option<MeasuredLink> {
        let sane = l.bandwidth_mbps.is_finite()
            && l.bandwidth_mbps > 0.0
            && l.latency_ms.is_finite()
            && l.latency_ms >= 0.0;
        if !l.error.is_empty() || !sane {
            let why = if l.error.is_empty() {
                "nonsensical figures"
            } else {
                &l.error
            };
            tracing::warn!("probe {from} -> {}: {why}", l.peer);
            return None;
        }
        let key = (from.to_string(), l.peer.clone());
        // A link measured over another path than before starts afresh.
        if self.measured.get(&key).is_some_and(|m| m.path != path) {
            self.measured.remove(&key);
        }
        let entry = self.measured.entry(key).or_insert_with(|| MeasuredLink {
            from: from.to_string(),
            to: l.peer.clone(),
            bandwidth_mbps: l.bandwidth_mbps,
            latency_ms: l.latency_ms,
            samples: 0,
            last_bandwidth_mbps: 0.0,
            last_latency_ms: 0.0,
            path: path.clone(),
        });
        let before = entry.bandwidth_mbps;
        if entry.samples > 0 {
            let k = PROBE_SMOOTHING;
            entry.bandwidth_mbps = (1.0 - k) * entry.bandwidth_mbps + k * l.bandwidth_mbps;
            entry.latency_ms = (1.0 - k) * entry.latency_ms + k * l.latency_ms;
        }
        entry.samples += 1;
        entry.last_bandwidth_mbps = l.bandwidth_mbps;
        entry.last_latency_ms = l.latency_ms;
        let moved = (entry.bandwidth_mbps - before).abs() > PROBE_CHANGE * before;
        if entry.samples > 1 && !moved {
            return None;
        }
        tracing::info!(
            "link {} -> {} ({}): {:.1} Mbit/s, {:.1} ms (probe round {round})",
            entry.from,
            entry.to,
            entry.path.name(),
            entry.bandwidth_mbps,
            entry.latency_ms
        );
        Some(entry.clone())
    }
}

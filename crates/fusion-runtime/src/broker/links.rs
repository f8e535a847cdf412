//! The links between members: the testbed's figures and probe rounds that measure them.

use super::*;

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

    /// The figures of the path from member `a` to member `b` as probed (see `reach`: a reversed
    /// or relayed link is known from the legs a probe could measure).
    pub(super) fn measured_between(&self, a: usize, b: usize) -> Option<(f64, f64)> {
        self.over_path(a, b, |x, y| self.probed_between(x, y))
    }

    /// The testbed's figures of the path from member `a` to member `b`.
    pub(super) fn testbed_path(&self, a: usize, b: usize) -> Option<(f64, f64)> {
        self.over_path(a, b, |x, y| self.link_between(x, y))
    }

    /// The smoothed probed figures of the link from member `a` to member `b`.
    pub(super) fn probed_between(&self, a: usize, b: usize) -> Option<(f64, f64)> {
        let key = (self.members[a].id.clone(), self.members[b].id.clone());
        self.measured
            .get(&key)
            .map(|l| (l.bandwidth_mbps, l.latency_ms))
    }

    /// Has every member in `pairs` (directed, by member index) probe its peers, one probe round,
    /// and folds the results into the smoothed link figures. Rounds are symmetric: the pairs
    /// must list both directions.
    pub(super) async fn probe_links(
        &mut self,
        active: &[usize],
        pairs: &[(usize, usize)],
    ) -> Flow<()> {
        // A member known to accept no connections cannot be probed (its links are known from
        // the directions and legs that can).
        let pairs: Vec<(usize, usize)> = pairs
            .iter()
            .copied()
            .filter(|&(_, b)| self.reachable(active[b]))
            .collect();
        if pairs.is_empty() {
            return Ok(());
        }
        self.probe_round += 1;
        let round = self.probe_round;
        let mut lists: BTreeMap<usize, Vec<PeerLink>> = BTreeMap::new();
        for &(a, b) in &pairs {
            let (bw, lat) = if self.job.pace_links {
                self.link_between(active[a], active[b])
                    .unwrap_or((0.0, 0.0))
            } else {
                (0.0, 0.0)
            };
            let m = &self.members[active[b]];
            lists.entry(a).or_default().push(PeerLink {
                node_id: m.id.clone(),
                address: m.data_address.clone(),
                stage: 0,
                bandwidth_mbps: bw,
                latency_ms: lat,
                certificate_sha256: m.certificate.to_vec().into(),
                ..Default::default()
            });
        }
        let asked: Vec<usize> = lists.keys().map(|&a| active[a]).collect();
        for (&a, peers) in &lists {
            self.send(
                active[a],
                broker_message::Body::Probe(ProbeLinks {
                    round,
                    peers: peers.clone(),
                    max_bytes: self.job.probe.max_bytes,
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
                changed.extend(self.fold_probe(&from, l, round));
                outcomes.push((from.clone(), l));
            }
        }
        self.fold_reachability(&outcomes);
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
        let entry = self
            .measured
            .entry((from.to_string(), l.peer.clone()))
            .or_insert_with(|| MeasuredLink {
                from: from.to_string(),
                to: l.peer.clone(),
                bandwidth_mbps: l.bandwidth_mbps,
                latency_ms: l.latency_ms,
                samples: 0,
                last_bandwidth_mbps: 0.0,
                last_latency_ms: 0.0,
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
            "link {} -> {}: {:.1} Mbit/s, {:.1} ms (probe round {round})",
            entry.from,
            entry.to,
            entry.bandwidth_mbps,
            entry.latency_ms
        );
        Some(entry.clone())
    }
}

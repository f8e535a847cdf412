//! Which members accept data-plane connections, and the path each link takes (see `path`): the
//! broker learns reachability from its probe rounds (each node dials the others), picks a relay
//! for pairs that both accept none, and gives the planner the figures of the path a link really
//! takes (a relayed link is as fast as its slower leg and as slow as both legs' latency).

use super::*;
use crate::path::LinkPath;

/// What one probe round says of one member's reachability: reached by some prober; or only
/// refused (no connection could be made), then unreachable; otherwise (only other failures, or
/// not probed) unchanged.
pub(super) fn judge(reached: usize, refused: usize) -> Option<bool> {
    match (reached, refused) {
        (0, 0) => None,
        (0, _) => Some(false),
        _ => Some(true),
    }
}

/// The relay for a pair: among `candidates` (node id, the slower of its two legs' bandwidth in
/// Mbit/s), the one with the fastest slower leg; ties go to the smaller id, so the choice is
/// stable.
pub(super) fn choose_relay(candidates: &[(String, f64)]) -> Option<&str> {
    candidates
        .iter()
        .filter(|(_, bw)| bw.is_finite())
        .max_by(|a, b| a.1.total_cmp(&b.1).then_with(|| b.0.cmp(&a.0)))
        .map(|(id, _)| id.as_str())
}

/// What a probe says of its prober's NAT: its public IP address when the peer saw it come from
/// the port it left from (a NAT that keeps ports, or none), None when from another port
/// (symmetric), nothing when either end did not say.
pub(super) fn nat_of(observed: &str, local: &str) -> Option<Option<String>> {
    let observed: std::net::SocketAddr = observed.parse().ok()?;
    let local: std::net::SocketAddr = local.parse().ok()?;
    Some((observed.port() == local.port()).then(|| observed.ip().to_string()))
}

/// A pair of node ids in order.
pub(super) fn pair(a: &str, b: &str) -> (String, String) {
    if a <= b {
        (a.into(), b.into())
    } else {
        (b.into(), a.into())
    }
}

/// A relayed link's figures (bandwidth Mbit/s, one-way latency ms) from its legs'.
pub(super) fn via_relay(first: (f64, f64), second: (f64, f64)) -> (f64, f64) {
    (first.0.min(second.0), first.1 + second.1)
}

impl Coordinator<'_> {
    /// Folds one probe round's outcomes into the members' reachability and NATs (logging what
    /// changed).
    pub(super) fn fold_reachability(
        &mut self,
        outcomes: &[(String, &fusion_proto::LinkMeasurement)],
    ) {
        let mut tally: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
        let mut round_nat: BTreeMap<String, Option<String>> = BTreeMap::new();
        for (from, l) in outcomes {
            if let Some(nat) = nat_of(&l.observed_address, &l.local_address) {
                // The latest round speaks (an address can change); within a round, one probe
                // out on another port is enough to rule punching out.
                let seen = round_nat.entry(from.clone()).or_insert(nat.clone());
                if nat.is_none() {
                    *seen = None;
                }
            }
            let t = tally.entry(l.peer.as_str()).or_default();
            if l.error.is_empty() {
                t.0 += 1;
            } else if l.unreachable {
                t.1 += 1;
            }
        }
        self.public_ip.extend(round_nat);
        for (peer, (reached, refused)) in tally {
            let Some(reachable) = judge(reached, refused) else {
                continue;
            };
            let changed = if reachable {
                self.unreachable.remove(peer)
            } else {
                self.unreachable.insert(peer.to_string())
            };
            if changed {
                let how = if reachable {
                    "accepts connections again"
                } else {
                    "accepts no connections (behind a NAT or firewall): its peers reach it reversed or through a relay"
                };
                tracing::info!("{peer} {how}");
            }
        }
    }

    /// Forgets what the probes and failed paths said of node `id` (it joins again).
    pub(super) fn forget_reachability(&mut self, id: &str) {
        self.unreachable.remove(id);
        self.public_ip.remove(id);
        let involves = |p: &(String, String)| p.0 == id || p.1 == id;
        if let Ok(mut f) = self.punch_failed.lock() {
            f.retain(|p| !involves(p));
        }
        if let Ok(mut a) = self.relay_avoid.lock() {
            a.retain(|p, relays| {
                relays.remove(id);
                !involves(p) && !relays.is_empty()
            });
        }
    }

    /// Whether member `m` accepts data-plane connections (as far as the probes know).
    pub(super) fn reachable(&self, m: usize) -> bool {
        !self.unreachable.contains(&self.members[m].id)
    }

    /// Records that the path between nodes `a` and `b` (ids) failed: a punched pair is relayed
    /// from then on, a relayed one goes through another relay.
    pub(super) fn route_around(&self, a: &str, b: &str, why: &str) {
        let pair = pair(a, b);
        let index = |id: &str| self.members.iter().position(|m| m.id == id);
        let (Some(x), Some(y)) = (index(a), index(b)) else {
            return;
        };
        if self.punchable(x, y) {
            tracing::warn!("{a} and {b}: {why}; relaying them");
            if let Ok(mut failed) = self.punch_failed.lock() {
                failed.insert(pair);
            }
        } else if let Some(r) = self.relay_for(x, y) {
            let relay = self.members[r].id.clone();
            tracing::warn!("{a} and {b}: {why}; relaying them through another node than {relay}");
            if let Ok(mut avoid) = self.relay_avoid.lock() {
                avoid.entry(pair).or_default().insert(relay);
            }
        }
    }

    /// Whether relay `r` failed the pair `a`, `b` before.
    fn relay_failed(&self, a: usize, b: usize, r: usize) -> bool {
        let key = pair(&self.members[a].id, &self.members[b].id);
        self.relay_avoid
            .lock()
            .is_ok_and(|m| m.get(&key).is_some_and(|s| s.contains(&self.members[r].id)))
    }

    /// The member relaying between `a` and `b` when neither accepts connections: a reachable
    /// member of the current placement with the fastest slower leg (not one that failed them).
    /// The same for both directions: a leg is scored by its slower direction.
    pub(super) fn relay_for(&self, a: usize, b: usize) -> Option<usize> {
        if let Some(r) = self.pinned_relay(a, b) {
            return Some(r);
        }
        let candidates: Vec<(String, f64)> = self
            .placed_nodes
            .iter()
            // Members are dropped between runs: an index of an older placement may be gone.
            .filter(|&&r| r < self.members.len() && r != a && r != b)
            .filter(|&&r| self.reachable(r) && self.members[r].can_serve())
            .filter(|&&r| !self.relay_failed(a, b, r))
            .map(|&r| {
                // A direction into an unreachable member is known from the other one.
                let way = |x: usize, y: usize| {
                    self.probed_between(x, y)
                        .or_else(|| self.probed_between(y, x))
                        .or_else(|| self.link_between(x, y))
                        .map_or(1000.0, |l| l.0)
                };
                let leg = |x: usize, y: usize| way(x, y).min(way(y, x));
                (self.members[r].id.clone(), leg(a, r).min(leg(r, b)))
            })
            .collect();
        let id = choose_relay(&candidates)?;
        self.members.iter().position(|m| m.id == id)
    }

    /// The relay the current placement assigned to `a` and `b`, while it can still relay them.
    fn pinned_relay(&self, a: usize, b: usize) -> Option<usize> {
        let via = self
            .pinned_relays
            .get(&pair(&self.members[a].id, &self.members[b].id))?;
        let r = self.members.iter().position(|m| &m.id == via)?;
        (self.reachable(r) && self.members[r].can_serve() && !self.relay_failed(a, b, r))
            .then_some(r)
    }

    /// Keeps the relays of `used` (pairs of members) for the placement being recorded.
    pub(super) fn pin_relays(&mut self, used: &[(usize, usize)]) {
        self.pinned_relays.clear();
        for &(a, b) in used {
            if let LinkPath::Relayed { via } = self.path_between(a, b) {
                let key = pair(&self.members[a].id, &self.members[b].id);
                self.pinned_relays.insert(key, via);
            }
        }
    }

    /// The public IP address of member `m` when a punch can reach it.
    fn punch_ip(&self, m: usize) -> Option<&str> {
        self.public_ip.get(&self.members[m].id)?.as_deref()
    }

    /// Whether sessions between `a` and `b` (both unreachable) can be punched: both NATs keep
    /// ports and no punch between them failed.
    pub(super) fn punchable(&self, a: usize, b: usize) -> bool {
        let failed = self
            .punch_failed
            .lock()
            .is_ok_and(|f| f.contains(&pair(&self.members[a].id, &self.members[b].id)));
        self.punch_ip(a).is_some() && self.punch_ip(b).is_some() && !failed
    }

    /// The path tensors from member `a` to member `b` take.
    /// A relay is looked for only when neither accepts connections and a punch cannot do.
    pub(super) fn path_between(&self, a: usize, b: usize) -> LinkPath {
        let (ra, rb) = (self.reachable(a), self.reachable(b));
        let punch = !ra && !rb && self.punchable(a, b);
        let relay = (!ra && !rb && !punch)
            .then(|| self.relay_for(a, b))
            .flatten()
            .map(|r| self.members[r].id.clone());
        LinkPath::of(ra, rb, punch, relay.as_deref())
    }

    /// The figures of the path from `a` to `b` from `figure` (probed or testbed) of its legs: a
    /// reversed link carries the same bytes over the same wire (the reverse direction is the one
    /// a probe could measure); a relayed one crosses both of the relay's legs.
    pub(super) fn over_path(
        &self,
        a: usize,
        b: usize,
        figure: impl Fn(usize, usize) -> Option<(f64, f64)>,
    ) -> Option<(f64, f64)> {
        match (self.reachable(a), self.reachable(b)) {
            (_, true) => figure(a, b),
            (true, false) => figure(a, b).or_else(|| figure(b, a)),
            (false, false) if self.punchable(a, b) => figure(a, b).or_else(|| figure(b, a)),
            (false, false) => {
                // The relay's legs into the two unreachable members are measured the other way.
                let r = self.relay_for(a, b)?;
                let first = figure(a, r).or_else(|| figure(r, a))?;
                let second = figure(r, b).or_else(|| figure(b, r))?;
                Some(via_relay(first, second))
            }
        }
    }

    /// The sessions (as "sender/receiver") member `relay` relays in the placement.
    pub(super) fn relay_pairs(&self, plan: &Plan, layout: &Layout, relay: usize) -> Vec<String> {
        let via = LinkPath::Relayed {
            via: self.members[relay].id.clone(),
        };
        let used = super::links::used_links(plan, layout, &self.placed_nodes);
        used.iter()
            .map(|&(x, y)| (self.placed_nodes[x], self.placed_nodes[y]))
            .filter(|&(a, b)| self.path_between(a, b) == via)
            .map(|(a, b)| format!("{}/{}", self.members[a].id, self.members[b].id))
            .collect()
    }

    /// Why a placement cannot run: a link between two members that accept no connections, whose
    /// NATs do not both keep ports, with no member that could relay between them.
    pub(super) fn unroutable(&self, plan: &Plan, layout: &Layout) -> Option<String> {
        let used = super::links::used_links(plan, layout, &self.placed_nodes);
        used.iter()
            .map(|&(x, y)| (self.placed_nodes[x], self.placed_nodes[y]))
            .find(|&(a, b)| {
                !self.reachable(a)
                    && !self.reachable(b)
                    && !self.punchable(a, b)
                    && self.relay_for(a, b).is_none()
            })
            .map(|(a, b)| {
                format!(
                    "{} and {} accept no connections (behind NATs or firewalls), cannot be \
                     punched through, and no node of the job accepts connections to relay \
                     between them: add a node with a public address (or a forwarded port)",
                    self.members[a].id, self.members[b].id
                )
            })
    }

    /// Fills the reachability and relay of `me`'s entry for `peer`, for the sessions from
    /// `sender` to `receiver` (one of the two directions of the pair).
    pub(super) fn route_peer(
        &self,
        me: usize,
        peer: usize,
        (sender, receiver): (usize, usize),
        link: &mut PeerLink,
    ) {
        link.self_unreachable = !self.reachable(me);
        link.peer_unreachable = !self.reachable(peer);
        if !(link.self_unreachable && link.peer_unreachable) {
            return;
        }
        if self.punchable(me, peer) {
            link.punch_peer_ip = self.punch_ip(peer).unwrap_or_default().to_string();
        } else if let Some(r) = self.relay_for(sender, receiver) {
            link.relay_node = self.members[r].id.clone();
            link.relay_address = self.members[r].data_address.clone();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_member_no_prober_could_connect_to_is_unreachable() {
        assert_eq!(judge(0, 2), Some(false));
        assert_eq!(judge(1, 2), Some(true), "one path in is enough");
        assert_eq!(judge(0, 0), None, "other failures say nothing");
    }

    #[test]
    fn a_probe_tells_whether_its_nat_keeps_ports() {
        assert_eq!(
            nat_of("10.201.0.2:41000", "10.203.1.2:41000"),
            Some(Some("10.201.0.2".into()))
        );
        assert_eq!(nat_of("10.201.0.4:22783", "10.203.3.2:41000"), Some(None));
        assert_eq!(
            nat_of("", "10.203.3.2:41000"),
            None,
            "an old peer says nothing"
        );
        assert_eq!(pair("b", "a"), pair("a", "b"));
    }

    #[test]
    fn the_relay_is_the_one_with_the_fastest_slower_leg() {
        let c = vec![
            ("lab-b".to_string(), 100.0),
            ("lab-a".to_string(), 100.0),
            ("cloud".to_string(), 50.0),
        ];
        assert_eq!(choose_relay(&c), Some("lab-a"));
        assert_eq!(choose_relay(&[]), None);
        assert_eq!(via_relay((100.0, 5.0), (20.0, 30.0)), (20.0, 35.0));
    }
}

//! What relaying costs the relay. Every byte of a relayed link crosses both of the relay's legs
//! (in from the sender, out to the receiver), so a leg the placement also sends over directly,
//! or that another relayed link crosses, is shared. Links share a leg only while they carry
//! bytes at the same time: the step's phases (the pipeline, the replicas' all-reduce rings, the
//! shared-parameter exchanges) run one after another, so sharing is counted per phase. The
//! planner sees each of the k links crossing one leg in one phase at 1/k of the leg's bandwidth
//! (TCP's fair share when they overlap; a cautious figure when they do not).

use super::*;
use crate::path::LinkPath;
use fusion_plan::{Plan, Planned};
use std::collections::BTreeSet;

/// The relayed links: (from, to) device positions → the relay's position.
pub(super) type Relays = BTreeMap<(usize, usize), usize>;

/// A directed link between device positions.
type Link = (usize, usize);

/// The directed device links `plan` sends over in each phase of a step: the pipeline (both
/// directions of every pair of stages that exchange activations), the all-reduce rings (each
/// stage's replicas, in ring order) and the shared-parameter exchanges (both directions).
pub(super) fn phases(workload: &Workload, plan: &Plan) -> [BTreeSet<Link>; 3] {
    let replicas = plan.replicas();
    let both = |set: &mut BTreeSet<Link>, a: usize, b: usize| {
        for k in 0..replicas {
            let (x, y) = (plan.devices[a][k], plan.devices[b][k]);
            if x != y {
                set.insert((x, y));
                set.insert((y, x));
            }
        }
    };
    let mut pipeline = BTreeSet::new();
    for (a, b, _) in workload.traffic(plan.cuts()) {
        both(&mut pipeline, a, b);
    }
    let mut rings = BTreeSet::new();
    for ds in &plan.devices {
        for (i, &x) in ds.iter().enumerate() {
            let y = ds[(i + 1) % ds.len()];
            if x != y {
                rings.insert((x, y));
            }
        }
    }
    let mut exchanges = BTreeSet::new();
    for (a, b, _) in workload.exchanges(plan.cuts()) {
        both(&mut exchanges, a, b);
    }
    [pipeline, rings, exchanges]
}

/// The legs a link crosses: its two legs through its relay, or itself.
fn legs(link: Link, relays: &Relays) -> Vec<Link> {
    match relays.get(&link) {
        Some(&r) => vec![(link.0, r), (r, link.1)],
        None => vec![link],
    }
}

/// A leg carrying several links in one phase.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct SharedLeg {
    pub leg: Link,
    /// The links crossing it (a relayed link among them).
    pub links: Vec<Link>,
}

/// The links of one phase crossing each leg.
fn over_legs(links: &BTreeSet<Link>, relays: &Relays) -> BTreeMap<Link, Vec<Link>> {
    let mut over: BTreeMap<Link, Vec<Link>> = BTreeMap::new();
    for &l in links {
        for leg in legs(l, relays) {
            over.entry(leg).or_default().push(l);
        }
    }
    over
}

/// The legs that carry more than one of the links of some phase.
pub(super) fn shared_legs(phases: &[BTreeSet<Link>], relays: &Relays) -> Vec<SharedLeg> {
    let mut shared: Vec<SharedLeg> = Vec::new();
    for links in phases {
        let over = over_legs(links, relays);
        for (leg, links) in over.into_iter().filter(|(_, ls)| ls.len() > 1) {
            match shared.iter_mut().find(|s| s.leg == leg) {
                // Keep the phase where the most links share it.
                Some(s) if s.links.len() < links.len() => s.links = links,
                Some(_) => {}
                None => shared.push(SharedLeg { leg, links }),
            }
        }
    }
    shared
}

/// `base` with every link that shares a leg in some phase slowed to its share of that leg (a
/// link no leg of which is shared keeps its figures: for a relayed one, as probed through the
/// relay or derived from its legs); None when no leg is shared.
pub(super) fn charged(
    base: &Network,
    phases: &[BTreeSet<Link>],
    relays: &Relays,
) -> Option<Network> {
    let mut net = base.clone();
    let mut changed = false;
    for links in phases {
        let over = over_legs(links, relays);
        for &l in links {
            let share = legs(l, relays)
                .into_iter()
                .filter_map(|(x, y)| {
                    let k = over.get(&(x, y)).map_or(1, Vec::len);
                    (k > 1).then(|| base.bandwidth[x][y] / k as f64)
                })
                .fold(f64::INFINITY, f64::min);
            let now = &mut net.bandwidth[l.0][l.1];
            if share < *now * (1.0 - 1e-9) {
                *now = share;
                changed = true;
            }
        }
    }
    changed.then_some(net)
}

impl Coordinator<'_> {
    /// The relayed links among `active` (positions) with their relays' positions.
    pub(super) fn relays_among(&self, active: &[usize]) -> Relays {
        let mut relays = Relays::new();
        if active.iter().all(|&m| self.reachable(m)) {
            return relays;
        }
        for (i, &a) in active.iter().enumerate() {
            for (j, &b) in active.iter().enumerate() {
                if i == j {
                    continue;
                }
                if let LinkPath::Relayed { via } = self.path_between(a, b) {
                    if let Some(r) = active.iter().position(|&m| self.members[m].id == via) {
                        relays.insert((i, j), r);
                    }
                }
            }
        }
        relays
    }

    /// `plan` on `active` judged with what its relayed links cost their relays, with the
    /// network it was judged on.
    pub(super) fn judge_charged(
        &self,
        workload: &Workload,
        base: &Network,
        relays: &Relays,
        plan: &Plan,
    ) -> Result<(fusion_plan::Evaluation, Network)> {
        let net = charged(base, &phases(workload, plan), relays).unwrap_or_else(|| base.clone());
        Ok((self.evaluate_on(workload, &net, plan)?, net))
    }

    /// `plan` judged on `net`.
    pub(super) fn evaluate_on(
        &self,
        workload: &Workload,
        net: &Network,
        plan: &Plan,
    ) -> Result<fusion_plan::Evaluation> {
        self.problem(workload, net)?
            .evaluate(plan)
            .map_err(|e| RuntimeError::Config(format!("planning the placement: {e}")))
    }

    /// The scheduler's plan of `stages` stages on `active`, judged with what its relayed links
    /// cost their relays: when a relay leg of the first plan is shared, a second plan is made
    /// knowing that, and the faster of the two (each judged with its own shared legs) is kept.
    /// Returns the plan, the network it was judged on and the relayed links.
    pub(super) fn plan_charged(
        &self,
        workload: &Workload,
        active: &[usize],
        stages: usize,
    ) -> Result<(Planned, Network, Relays)> {
        let base = self.network(active);
        let planned = self.schedule(&self.problem(workload, &base)?, stages)?;
        let relays = self.relays_among(active);
        let Some(first_net) = charged(&base, &phases(workload, &planned.plan), &relays) else {
            return Ok((planned, base, relays));
        };
        let first = self.evaluate_on(workload, &first_net, &planned.plan)?;
        let again = self.schedule(&self.problem(workload, &first_net)?, stages)?;
        let (second, second_net) = self.judge_charged(workload, &base, &relays, &again.plan)?;
        Ok(if second.objective < first.objective {
            let planned = Planned {
                evaluation: second,
                ..again
            };
            (planned, second_net, relays)
        } else {
            let planned = Planned {
                evaluation: first,
                ..planned
            };
            (planned, first_net, relays)
        })
    }

    /// What the plan's relays share, for the explanation: one line per shared leg.
    pub(super) fn relay_lines(
        &self,
        active: &[usize],
        workload: &Workload,
        plan: &Plan,
        net: &Network,
        relays: &Relays,
    ) -> Vec<String> {
        let id = |d: usize| self.members[active[d]].id.as_str();
        shared_legs(&phases(workload, plan), relays)
            .iter()
            .map(|s| {
                let links: Vec<String> = s
                    .links
                    .iter()
                    .map(|&(a, b)| {
                        format!(
                            "{} -> {} ({:.1} Mbit/s)",
                            id(a),
                            id(b),
                            net.bandwidth[a][b] * 8.0 / 1e6
                        )
                    })
                    .collect();
                format!(
                    "relay leg {} -> {} is shared while it relays: {}",
                    id(s.leg.0),
                    id(s.leg.1),
                    links.join(", ")
                )
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fusion_estimate::{DeviceProfile, ProfileSource};

    /// Devices 0..n, every link at `mbps` Mbit/s (bytes per second in the matrix).
    fn network(n: usize, mbps: f64) -> Network {
        let bw = mbps * 1e6 / 8.0;
        Network {
            devices: (0..n)
                .map(|i| DeviceProfile {
                    name: format!("d{i}"),
                    class: "cpu".into(),
                    dense_flops_per_s: 1e12,
                    memory_bytes_per_s: 1e10,
                    memory_capacity_bytes: 1e10,
                    calibration: 1.0,
                    op_overhead_s: 0.0,
                    source: ProfileSource::Class,
                })
                .collect(),
            bandwidth: (0..n)
                .map(|i| {
                    (0..n)
                        .map(|j| if i == j { f64::INFINITY } else { bw })
                        .collect()
                })
                .collect(),
            latency: vec![vec![0.0; n]; n],
        }
    }

    fn mbps(net: &Network, a: usize, b: usize) -> f64 {
        net.bandwidth[a][b] * 8.0 / 1e6
    }

    #[test]
    fn a_relay_leg_also_used_directly_in_the_same_phase_is_shared() {
        let base = network(3, 8.0);
        // 0 -> 2 relayed via 1, and 1 -> 2 sent directly in the same phase.
        let relays = Relays::from([((0, 2), 1)]);
        let phases = [
            BTreeSet::from([(0, 2), (1, 2)]),
            BTreeSet::new(),
            BTreeSet::new(),
        ];
        let net = charged(&base, &phases, &relays).expect("a leg is shared");
        assert_eq!(mbps(&net, 0, 2), 4.0);
        assert_eq!(mbps(&net, 1, 2), 4.0);
        // The leg into the relay carries only the relayed link.
        assert_eq!(mbps(&net, 0, 1), 8.0);
        let shared = shared_legs(&phases, &relays);
        assert_eq!(
            shared,
            vec![SharedLeg {
                leg: (1, 2),
                links: vec![(0, 2), (1, 2)]
            }]
        );
    }

    #[test]
    fn links_of_different_phases_do_not_share() {
        let base = network(3, 8.0);
        let relays = Relays::from([((0, 2), 1)]);
        // The relayed link carries only an exchange after the pipeline, which uses 1 -> 2.
        let phases = [
            BTreeSet::from([(1, 2)]),
            BTreeSet::new(),
            BTreeSet::from([(0, 2)]),
        ];
        assert_eq!(charged(&base, &phases, &relays), None);
        assert!(shared_legs(&phases, &relays).is_empty());
    }

    #[test]
    fn two_relayed_links_through_one_relay_split_its_legs() {
        let mut base = network(4, 100.0);
        // The relay's leg to 3 is the slow one: 10 Mbit/s.
        base.bandwidth[1][3] = 10.0 * 1e6 / 8.0;
        base.bandwidth[0][3] = 10.0 * 1e6 / 8.0;
        base.bandwidth[2][3] = 10.0 * 1e6 / 8.0;
        let relays = Relays::from([((0, 3), 1), ((2, 3), 1)]);
        let phases = [
            BTreeSet::from([(0, 3), (2, 3)]),
            BTreeSet::new(),
            BTreeSet::new(),
        ];
        let net = charged(&base, &phases, &relays).expect("a leg is shared");
        assert_eq!(mbps(&net, 0, 3), 5.0);
        assert_eq!(mbps(&net, 2, 3), 5.0);
    }

    #[test]
    fn a_relayed_link_sharing_no_leg_keeps_what_its_probe_measured() {
        let mut base = network(3, 8.0);
        // Probed through the relay at 9 Mbit/s, above the 8 of its legs' figures.
        base.bandwidth[0][2] = 9.0 * 1e6 / 8.0;
        let relays = Relays::from([((0, 2), 1)]);
        let phases = [
            BTreeSet::from([(0, 2), (2, 0)]),
            BTreeSet::new(),
            BTreeSet::new(),
        ];
        assert_eq!(charged(&base, &phases, &relays), None);
    }

    #[test]
    fn without_relays_nothing_is_charged() {
        let base = network(3, 8.0);
        let phases = [
            BTreeSet::from([(0, 1), (1, 0), (1, 2), (2, 1)]),
            BTreeSet::new(),
            BTreeSet::from([(0, 2), (2, 0)]),
        ];
        assert_eq!(charged(&base, &phases, &Relays::new()), None);
    }

    #[test]
    fn a_tied_embedding_is_exchanged_after_the_pipeline() {
        let graph = fusion_models::ModelSpec::preset("gpt2-tiny")
            .and_then(|m| m.graph(1, 8))
            .expect("graph");
        let w = Workload::of(&graph, 0.0).expect("workload");
        let n = w.len();
        // Four stages on devices 3, 2, 1, 0, two replicas (devices 4..7 for the second).
        let plan = Plan {
            starts: vec![0, n / 4, n / 2, 3 * n / 4],
            devices: vec![vec![3, 7], vec![2, 6], vec![1, 5], vec![0, 4]],
        };
        let [pipeline, rings, exchanges] = phases(&w, &plan);
        for (a, b) in [(3, 2), (2, 1), (1, 0), (7, 6), (6, 5), (5, 4)] {
            assert!(pipeline.contains(&(a, b)) && pipeline.contains(&(b, a)));
        }
        assert!(!pipeline.contains(&(3, 0)));
        assert_eq!(
            rings,
            BTreeSet::from([
                (3, 7),
                (7, 3),
                (2, 6),
                (6, 2),
                (1, 5),
                (5, 1),
                (0, 4),
                (4, 0)
            ])
        );
        assert_eq!(exchanges, BTreeSet::from([(3, 0), (0, 3), (7, 4), (4, 7)]));
    }
}

//! OP-Fence's first two steps: group devices joined by fast links into clusters, then order
//! the clusters so that consecutive ones share the best links available between clusters.

use crate::network::Network;
use serde::Serialize;

/// Devices grouped by the bandwidth between them.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Clustering {
    /// Device indices of each cluster, in pipeline order.
    pub clusters: Vec<Vec<usize>>,
    /// Bytes per second at or above which two devices were put in one cluster.
    pub threshold: f64,
    /// How much faster the slowest link inside a cluster is than the fastest between clusters.
    pub separation: f64,
}

/// A gap of less than this ratio between inside and between-cluster links is not a cluster
/// boundary (measurement noise and small variations inside a site stay inside one cluster).
const MIN_SEPARATION: f64 = 1.5;

/// The symmetric speed of the link between `a` and `b` (the slower direction).
pub(crate) fn pair_bandwidth(net: &Network, a: usize, b: usize) -> f64 {
    net.bandwidth[a][b].min(net.bandwidth[b][a])
}

fn components(n: usize, linked: impl Fn(usize, usize) -> bool) -> Vec<usize> {
    let mut label: Vec<usize> = (0..n).collect();
    fn root(label: &mut [usize], mut x: usize) -> usize {
        while label[x] != x {
            label[x] = label[label[x]];
            x = label[x];
        }
        x
    }
    for a in 0..n {
        for b in a + 1..n {
            if linked(a, b) {
                let (ra, rb) = (root(&mut label, a), root(&mut label, b));
                if ra != rb {
                    label[ra.max(rb)] = ra.min(rb);
                }
            }
        }
    }
    (0..n).map(|x| root(&mut label, x)).collect()
}

/// Single-linkage clustering at the bandwidth threshold that best separates fast links from
/// slow ones: for each candidate threshold (the distinct link speeds, rounded to 5% steps), the
/// devices joined by links at least that fast form clusters, and the threshold whose fastest
/// link between clusters is slowest relative to it wins. Without a clear gap, one cluster.
pub fn cluster_by_bandwidth(net: &Network) -> Clustering {
    let n = net.len();
    let one = || Clustering {
        clusters: vec![(0..n).collect()],
        threshold: 0.0,
        separation: 1.0,
    };
    if n < 2 {
        return one();
    }
    let mut speeds: Vec<f64> = Vec::new();
    for a in 0..n {
        for b in a + 1..n {
            speeds.push(pair_bandwidth(net, a, b));
        }
    }
    speeds.sort_by(|x, y| y.total_cmp(x));
    let mut candidates: Vec<f64> = Vec::new();
    for s in speeds {
        if candidates.last().is_none_or(|&c| s < c / 1.05) {
            candidates.push(s);
        }
    }
    let mut best: Option<(f64, f64, Vec<usize>)> = None;
    for &t in &candidates {
        let label = components(n, |a, b| pair_bandwidth(net, a, b) >= t);
        let mut fastest_between: f64 = 0.0;
        for a in 0..n {
            for b in a + 1..n {
                if label[a] != label[b] {
                    fastest_between = fastest_between.max(pair_bandwidth(net, a, b));
                }
            }
        }
        if fastest_between == 0.0 {
            continue; // one cluster
        }
        let separation = t / fastest_between;
        if best.as_ref().is_none_or(|(s, _, _)| separation > *s) {
            best = Some((separation, t, label));
        }
    }
    let Some((separation, threshold, label)) = best.filter(|b| b.0 >= MIN_SEPARATION) else {
        return one();
    };
    let mut roots: Vec<usize> = label.clone();
    roots.sort_unstable();
    roots.dedup();
    let clusters = roots
        .iter()
        .map(|r| (0..n).filter(|&d| label[d] == *r).collect())
        .collect();
    Clustering {
        clusters,
        threshold,
        separation,
    }
}

/// Mean bandwidth between two clusters.
fn between(net: &Network, a: &[usize], b: &[usize]) -> f64 {
    let mut sum = 0.0;
    for &x in a {
        for &y in b {
            sum += pair_bandwidth(net, x, y);
        }
    }
    sum / (a.len() * b.len()) as f64
}

/// Orders the clusters as a path whose slowest hop is as fast as possible (then whose hops are
/// fastest on average, in log terms): exhaustive up to 8 clusters, greedy from every start above.
pub fn order_clusters(net: &Network, clustering: &mut Clustering) {
    let k = clustering.clusters.len();
    if k < 2 {
        return;
    }
    let bw: Vec<Vec<f64>> = (0..k)
        .map(|i| {
            (0..k)
                .map(|j| between(net, &clustering.clusters[i], &clustering.clusters[j]))
                .collect()
        })
        .collect();
    let score = |order: &[usize]| -> (f64, f64) {
        let hops = order.windows(2).map(|w| bw[w[0]][w[1]]);
        let slowest = hops.clone().fold(f64::INFINITY, f64::min);
        (slowest, hops.map(f64::ln).sum::<f64>())
    };
    let better = |a: (f64, f64), b: (f64, f64)| {
        a.0 > b.0 * (1.0 + 1e-9) || (a.0 >= b.0 * (1.0 - 1e-9) && a.1 > b.1)
    };
    let mut best: Vec<usize> = (0..k).collect();
    if k <= 8 {
        let mut perm: Vec<usize> = (0..k).collect();
        let mut best_score = score(&perm);
        // Heap's algorithm over all orders.
        let mut c = vec![0usize; k];
        let mut i = 0;
        while i < k {
            if c[i] < i {
                if i % 2 == 0 {
                    perm.swap(0, i);
                } else {
                    perm.swap(c[i], i);
                }
                let s = score(&perm);
                if better(s, best_score) {
                    (best, best_score) = (perm.clone(), s);
                }
                c[i] += 1;
                i = 0;
            } else {
                c[i] = 0;
                i += 1;
            }
        }
    } else {
        let mut best_score = (f64::NEG_INFINITY, f64::NEG_INFINITY);
        for start in 0..k {
            let mut order = vec![start];
            let mut left: Vec<usize> = (0..k).filter(|&c| c != start).collect();
            while !left.is_empty() {
                let last = order[order.len() - 1];
                let (pos, _) = left
                    .iter()
                    .enumerate()
                    .max_by(|a, b| bw[last][*a.1].total_cmp(&bw[last][*b.1]))
                    .unwrap_or((0, &0));
                order.push(left.remove(pos));
            }
            let s = score(&order);
            if better(s, best_score) {
                (best, best_score) = (order, s);
            }
        }
    }
    let old = std::mem::take(&mut clustering.clusters);
    clustering.clusters = best.into_iter().map(|i| old[i].clone()).collect();
}

/// The devices of one cluster, fastest first (ties by index).
pub(crate) fn fastest_first(net: &Network, cluster: &[usize]) -> Vec<usize> {
    let speed = |d: usize| {
        let p = &net.devices[d];
        p.dense_flops_per_s / p.calibration
    };
    let mut c = cluster.to_vec();
    c.sort_by(|&a, &b| speed(b).total_cmp(&speed(a)).then(a.cmp(&b)));
    c
}

/// Devices in pipeline order: clusters in their order, fastest devices first inside each.
pub fn device_sequence(net: &Network, clustering: &Clustering) -> Vec<usize> {
    clustering
        .clusters
        .iter()
        .flat_map(|c| fastest_first(net, c))
        .collect()
}

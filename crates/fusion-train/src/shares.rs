//! Batch shares of islands: how many of each inner step's micro-batches every island runs.
//!
//! Islands of different speed that run equal shares wait for the slowest at every
//! synchronisation. With shares in proportion to their throughput they reach it together, and
//! the outer step weighs each island's pseudo-gradient by its share (the tokens it saw). The
//! shares of a step always add up to islands × micro-batches, so a step reads as many tokens as
//! one with equal shares, and the data positions do not depend on them.
//!
//! Pure functions: the cluster's broker measures the islands' throughput and asks
//! [`rebalance`] whether new shares pay.

use crate::error::{Result, TrainError};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// How islands split each inner step's micro-batches.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "SharesRepr", into = "SharesRepr")]
pub enum Shares {
    /// Equal until measured; then in proportion to each island's measured throughput,
    /// re-balanced at a synchronisation when that makes the inner steps
    /// [`REBALANCE_GAIN`]-times shorter. In one process (one device) this is `Equal`.
    #[default]
    Auto,
    /// Every island runs the job's micro-batches.
    Equal,
    /// Island `i` runs `shares[i]` micro-batches (they add up to islands × micro-batches).
    Fixed(Vec<usize>),
}

/// New shares are taken only when they make the islands' inner step at most this share of the
/// current one's: measurements on shared machines move by a few percent from step to step, and
/// every change moves the outer step's weights.
pub const REBALANCE_GAIN: f64 = 0.9;

/// Steps of a round that must have been measured before the shares change.
pub const REBALANCE_AFTER_STEPS: usize = 3;

/// The serialised form: "auto", "equal", or a list of micro-batch counts.
#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum SharesRepr {
    Name(String),
    List(Vec<usize>),
}

impl TryFrom<SharesRepr> for Shares {
    type Error = TrainError;
    fn try_from(r: SharesRepr) -> Result<Self> {
        match r {
            SharesRepr::Name(s) => s.parse(),
            SharesRepr::List(l) => Ok(Shares::Fixed(l)),
        }
    }
}

impl From<Shares> for SharesRepr {
    fn from(s: Shares) -> Self {
        match s {
            Shares::Fixed(l) => SharesRepr::List(l),
            other => SharesRepr::Name(other.to_string()),
        }
    }
}

impl FromStr for Shares {
    type Err = TrainError;
    /// `auto`, `equal`, or micro-batch counts separated by commas (`6,2`).
    fn from_str(s: &str) -> Result<Self> {
        match s.trim() {
            "auto" => Ok(Shares::Auto),
            "equal" => Ok(Shares::Equal),
            list => list
                .split(',')
                .map(|x| x.trim().parse::<usize>())
                .collect::<std::result::Result<Vec<_>, _>>()
                .map(Shares::Fixed)
                .map_err(|_| {
                    TrainError::Config(format!(
                        "island shares are `auto`, `equal` or micro-batch counts such as `6,2`, \
                         not '{s}'"
                    ))
                }),
        }
    }
}

impl fmt::Display for Shares {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Shares::Auto => write!(f, "auto"),
            Shares::Equal => write!(f, "equal"),
            Shares::Fixed(l) => write!(f, "{}", join(l)),
        }
    }
}

/// `6/2`-style, for reports.
pub fn join(shares: &[usize]) -> String {
    shares
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join("/")
}

impl Shares {
    /// The shares `islands` islands of `micro_batches` each start with; fixed ones are checked
    /// (one per island, each at least 1, adding up to islands × micro-batches).
    pub fn initial(&self, islands: usize, micro_batches: usize) -> Result<Vec<usize>> {
        let total = islands * micro_batches;
        match self {
            Shares::Auto | Shares::Equal => Ok(vec![micro_batches; islands]),
            Shares::Fixed(l) if l.len() != islands => Err(TrainError::Config(format!(
                "{} island shares ({self}) for {islands} islands",
                l.len()
            ))),
            Shares::Fixed(l) if l.contains(&0) => Err(TrainError::Config(format!(
                "island shares ({self}) give an island no micro-batch"
            ))),
            Shares::Fixed(l) if l.iter().sum::<usize>() != total => {
                Err(TrainError::Config(format!(
                    "island shares ({self}) add up to {}, not islands × micro-batches = \
                     {islands} × {micro_batches} = {total}",
                    l.iter().sum::<usize>()
                )))
            }
            Shares::Fixed(l) => Ok(l.clone()),
        }
    }
}

/// Automatic shares never give an island more than this many times the job's micro-batches
/// (under 1F1B, where a stage's micro-batches in flight do not grow with its share; the cluster
/// caps shares at the job's micro-batches under GPipe, where every micro-batch of a step holds
/// its activations at once and the plan sized memory for the job's).
pub const MAX_SHARE_FACTOR: usize = 2;

/// `total` micro-batches split in proportion to `rates` (largest remainders), every island at
/// least one and at most `cap` (where `cap` × islands leaves room for `total`). Rates that are
/// not positive and finite count as the smallest positive one given (an island whose speed is
/// unknown is not starved); `total` must be at least the island count.
pub fn proportional(rates: &[f64], total: usize, cap: usize) -> Vec<usize> {
    let n = rates.len();
    if n == 0 || total < n {
        return vec![1; n];
    }
    let cap = if cap.saturating_mul(n) >= total {
        cap
    } else {
        total
    };
    let floor = rates
        .iter()
        .copied()
        .filter(|r| r.is_finite() && *r > 0.0)
        .fold(f64::INFINITY, f64::min);
    let floor = if floor.is_finite() { floor } else { 1.0 };
    let rates: Vec<f64> = rates
        .iter()
        .map(|&r| if r.is_finite() && r > 0.0 { r } else { floor })
        .collect();
    // Islands over the cap are held at it and the rest is split again among the others.
    let mut held = vec![false; n];
    loop {
        let free: Vec<usize> = (0..n).filter(|&i| !held[i]).collect();
        let rest = total - cap * (n - free.len());
        let part = largest_remainders(&free.iter().map(|&i| rates[i]).collect::<Vec<_>>(), rest);
        let over: Vec<usize> = free
            .iter()
            .zip(&part)
            .filter(|&(_, &m)| m > cap)
            .map(|(&i, _)| i)
            .collect();
        if over.is_empty() || free.len() == over.len() {
            let mut shares = vec![cap; n];
            for (&i, m) in free.iter().zip(part) {
                shares[i] = m;
            }
            return shares;
        }
        for i in over {
            held[i] = true;
        }
    }
}

/// `total` split in proportion to `rates` (positive), each at least one: one each, then the
/// floors of the ideal split, then the largest remainders (ties to the first island).
fn largest_remainders(rates: &[f64], total: usize) -> Vec<usize> {
    let n = rates.len();
    if n == 0 {
        return Vec::new();
    }
    let sum: f64 = rates.iter().sum();
    let ideal: Vec<f64> = rates.iter().map(|r| r / sum * total as f64).collect();
    let spare = total.saturating_sub(n);
    let mut shares: Vec<usize> = ideal
        .iter()
        .map(|x| (x.floor() as usize).clamp(1, 1 + spare))
        .collect();
    // The minimum of one can overshoot: take back from those furthest above their ideal.
    while shares.iter().sum::<usize>() > total {
        let Some(i) = (0..n).filter(|&i| shares[i] > 1).max_by(|&a, &b| {
            (shares[a] as f64 - ideal[a]).total_cmp(&(shares[b] as f64 - ideal[b]))
        }) else {
            break;
        };
        shares[i] -= 1;
    }
    while shares.iter().sum::<usize>() < total {
        let i = (0..n)
            .max_by(|&a, &b| {
                (ideal[a] - shares[a] as f64)
                    .total_cmp(&(ideal[b] - shares[b] as f64))
                    .then(b.cmp(&a))
            })
            .unwrap_or(0);
        shares[i] += 1;
    }
    shares
}

/// Seconds of the islands' inner step at `shares`: the slowest island's micro-batches over its
/// rate (micro-batches per second).
pub fn inner_step_s(shares: &[usize], rates: &[f64]) -> f64 {
    shares
        .iter()
        .zip(rates)
        .map(|(&m, &r)| m as f64 / r)
        .fold(0.0, f64::max)
}

/// Shares in proportion to `rates` (each island's measured micro-batches per second) with the
/// same total as `current`, none above `cap`, when they make the inner step at most
/// [`REBALANCE_GAIN`] of what `current` takes; None otherwise (or when a rate is not positive
/// and finite).
pub fn rebalance(current: &[usize], rates: &[f64], cap: usize) -> Option<Vec<usize>> {
    if current.len() != rates.len()
        || current.len() < 2
        || rates.iter().any(|r| !(r.is_finite() && *r > 0.0))
    {
        return None;
    }
    let next = proportional(rates, current.iter().sum(), cap);
    let (now, then) = (inner_step_s(current, rates), inner_step_s(&next, rates));
    (next != current && then <= REBALANCE_GAIN * now).then_some(next)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_parse_print_and_serialise() {
        assert_eq!("auto".parse::<Shares>().expect("auto"), Shares::Auto);
        assert_eq!("equal".parse::<Shares>().expect("eq"), Shares::Equal);
        let fixed: Shares = "6, 2".parse().expect("list");
        assert_eq!(fixed, Shares::Fixed(vec![6, 2]));
        assert_eq!(fixed.to_string(), "6/2");
        let e = "fast".parse::<Shares>().unwrap_err().to_string();
        assert!(e.contains("not 'fast'"), "{e}");
        #[derive(Serialize, Deserialize)]
        struct T {
            shares: Shares,
        }
        for (text, want) in [
            ("shares = \"auto\"", Shares::Auto),
            ("shares = \"equal\"", Shares::Equal),
            ("shares = [3, 1]", Shares::Fixed(vec![3, 1])),
        ] {
            let t: T = toml::from_str(text).expect(text);
            assert_eq!(t.shares, want);
            let back: T = toml::from_str(&toml::to_string(&t).expect("ser")).expect("de");
            assert_eq!(back.shares, want);
        }
        assert!(toml::from_str::<T>("shares = \"most\"").is_err());
    }

    #[test]
    fn fixed_shares_are_checked_against_the_islands() {
        assert_eq!(Shares::Auto.initial(3, 4).expect("auto"), vec![4, 4, 4]);
        assert_eq!(
            Shares::Fixed(vec![6, 2]).initial(2, 4).expect("ok"),
            vec![6, 2]
        );
        for (bad, why) in [
            (vec![6, 2, 0], "3 island shares"),
            (vec![8, 0], "no micro-batch"),
            (vec![5, 2], "add up to 7"),
        ] {
            let e = Shares::Fixed(bad).initial(2, 4).unwrap_err().to_string();
            assert!(e.contains(why), "{e}");
        }
    }

    #[test]
    fn proportional_shares_add_up_and_feed_every_island() {
        assert_eq!(proportional(&[3.0, 1.0], 8, 8), vec![6, 2]);
        assert_eq!(proportional(&[1.0, 1.0, 1.0], 8, 8), vec![3, 3, 2]);
        // A far slower island still runs one.
        assert_eq!(proportional(&[1000.0, 1.0], 4, 4), vec![3, 1]);
        assert_eq!(proportional(&[1.0, f64::NAN], 4, 4), vec![2, 2]);
        // The cap holds the fast island; the others share the rest by their rates.
        assert_eq!(proportional(&[10.0, 1.0, 1.0], 12, 8), vec![8, 2, 2]);
        assert_eq!(proportional(&[10.0, 3.0, 1.0], 12, 6), vec![6, 5, 1]);
        for total in 3..40 {
            for rates in [[1.0, 2.0, 7.5], [0.1, 50.0, 50.0], [1.0, 1.0, 1.0]] {
                for cap in [1, total / 3 + 1, total] {
                    let s = proportional(&rates, total, cap);
                    assert_eq!(s.iter().sum::<usize>(), total, "{rates:?} {total} {cap}");
                    assert!(s.iter().all(|&x| x >= 1), "{s:?}");
                    if cap * 3 >= total {
                        assert!(s.iter().all(|&x| x <= cap), "{s:?} over {cap}");
                    }
                }
            }
        }
    }

    #[test]
    fn shares_move_only_when_it_pays() {
        // Equal islands keep equal shares, whatever the noise below the gain.
        assert_eq!(rebalance(&[4, 4], &[1.0, 1.05], 8), None);
        // One island three times as fast: 6/2 takes 2 s against 4 s.
        assert_eq!(rebalance(&[4, 4], &[3.0, 1.0], 8), Some(vec![6, 2]));
        assert_eq!(rebalance(&[6, 2], &[3.0, 1.0], 8), None);
        // Back to equal when the slow island recovers.
        assert_eq!(rebalance(&[6, 2], &[1.0, 1.0], 8), Some(vec![4, 4]));
        assert_eq!(rebalance(&[4, 4], &[1.0, 0.0], 8), None);
        assert_eq!(rebalance(&[4], &[1.0], 8), None);
        assert!((inner_step_s(&[6, 2], &[3.0, 1.0]) - 2.0).abs() < 1e-12);
        // Ten times as fast: the slow island keeps its one micro-batch.
        assert_eq!(rebalance(&[4, 4], &[10.0, 1.0], 8), Some(vec![7, 1]));
        // With the cap at the job's micro-batches nothing can move.
        assert_eq!(rebalance(&[4, 4], &[3.0, 1.0], 4), None);
        assert_eq!(
            rebalance(&[4, 4, 4], &[10.0, 1.0, 1.0], 8),
            Some(vec![8, 2, 2])
        );
    }
}

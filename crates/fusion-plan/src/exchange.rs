//! What the outer synchronisation costs a round of `every` inner steps.
//!
//! The islands exchange pseudo-gradients over a ring. With one fragment the whole model goes at
//! the end of the round. With F fragments (`train --outer-fragments`, Streaming DiLoCo's
//! schedule) every `every / F` steps one contiguous band of the model goes, in turn, so a round
//! holds F smaller exchanges: a blocking one stalls the islands F times (the ring's latencies
//! are paid F times, the bytes once), an overlapped one only has `every / F` steps of compute
//! to hide behind.

use crate::hierarchy::Island;
use crate::plan::Problem;
use std::ops::Range;

/// Seconds of one ring exchange of the whole model's pseudo-gradients among `islands` (in ring
/// order): every device sends `2 (I - 1) / I` of its share of its stage's parameters (replicas
/// split a stage) over its slowest link into the next island, plus the ring's latencies.
pub fn sync_seconds(p: &Problem, islands: &[Island], ratio: f64) -> f64 {
    band_seconds(p, islands, ratio, 0..p.ops())
}

/// Seconds of one ring exchange of the parameters of operators `band` only: a stage that holds
/// none of them sends nothing (and waits for no round trip).
fn band_seconds(p: &Problem, islands: &[Island], ratio: f64, band: Range<usize>) -> f64 {
    let k = islands.len();
    if k < 2 {
        return 0.0;
    }
    let hops = 2.0 * (k - 1) as f64;
    let mut slowest: f64 = 0.0;
    for (i, isl) in islands.iter().enumerate() {
        let next = &islands[(i + 1) % k].plan.devices;
        let targets: Vec<usize> = next.iter().flatten().copied().collect();
        for (s, row) in isl.plan.devices.iter().enumerate() {
            let range = isl.plan.range(s, p.ops());
            let (lo, hi) = (range.start.max(band.start), range.end.min(band.end));
            if lo >= hi {
                continue;
            }
            let params: f64 = p.workload.ops[lo..hi].iter().map(|o| o.param_bytes).sum();
            if params <= 0.0 {
                continue;
            }
            let bytes = hops / k as f64 * params / row.len() as f64 * ratio;
            for &d in row {
                let (bw, lat) = targets.iter().fold((f64::INFINITY, 0.0f64), |(b, l), &t| {
                    (
                        b.min(p.network.bandwidth[d][t]),
                        l.max(p.network.latency[d][t]),
                    )
                });
                slowest = slowest.max(bytes / bw + hops * lat);
            }
        }
    }
    slowest
}

/// The operators of each of `fragments` contiguous bands of about equal parameter bytes, in
/// order, cut as the nodes cut their tensors (`fusion_train::fragment_of`): each parameterised
/// operator goes to the band its middle byte falls in, never behind the one before it, at most
/// one band ahead (no band is skipped) and far enough ahead that the operators left fill the
/// bands left. Operators without parameters ride in the band of the one before them (the
/// first band for those in front). With fewer parameterised operators than bands the first
/// bands are empty (as the nodes' first fragments); [`plan_hierarchy`](crate::plan_hierarchy)
/// refuses such a job.
pub fn fragment_bands(param_bytes: &[f64], fragments: u32) -> Vec<Range<usize>> {
    let f = fragments.max(1) as usize;
    let held: Vec<usize> = (0..param_bytes.len())
        .filter(|&i| param_bytes[i] > 0.0)
        .collect();
    let total: f64 = held.iter().map(|&i| param_bytes[i]).sum();
    // start[j]: the first operator of band j (bands past the last parameterised one: the end).
    let mut start = vec![param_bytes.len(); f + 1];
    start[0] = 0;
    let (mut before, mut current) = (0.0, 0usize);
    for (k, &i) in held.iter().enumerate() {
        let b = param_bytes[i];
        let by_size = ((f as f64 * (before + b / 2.0) / total) as usize).min(f - 1);
        let left = held.len() - k;
        let floor = f.saturating_sub(left).max(current);
        let next = by_size.clamp(floor, (current + usize::from(k > 0)).max(floor));
        // (Only the first operator can jump more than one band: when bands outnumber them.)
        if next > current {
            start[current + 1..=next].fill(i);
            current = next;
        }
        before += b;
    }
    debug_assert!(start.windows(2).all(|w| w[0] <= w[1]));
    (0..f).map(|j| start[j]..start[j + 1]).collect()
}

/// Operators that hold parameters: the most fragments a model can be cut into.
pub fn parameterised_ops(param_bytes: &[f64]) -> usize {
    param_bytes.iter().filter(|&&b| b > 0.0).count()
}

/// Seconds of each fragment's exchange among `islands`, in the order they go.
pub fn fragment_seconds(p: &Problem, islands: &[Island], ratio: f64, fragments: u32) -> Vec<f64> {
    let bytes: Vec<f64> = p.workload.ops.iter().map(|o| o.param_bytes).collect();
    fragment_bands(&bytes, fragments)
        .into_iter()
        .map(|band| band_seconds(p, islands, ratio, band))
        .collect()
}

/// Seconds of a round of `every` inner steps of `step_s` with these exchanges spread evenly over
/// it: a blocking exchange adds to its slot's compute, an overlapped one runs beside it and
/// only stretches a slot it outlasts.
pub fn round_seconds(step_s: f64, every: u64, exchanges: &[f64], overlap: bool) -> f64 {
    if exchanges.is_empty() {
        return every as f64 * step_s;
    }
    let slot = every as f64 * step_s / exchanges.len() as f64;
    exchanges
        .iter()
        .map(|&x| if overlap { slot.max(x) } else { slot + x })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bands_cut_the_parameters_evenly_in_order() {
        let bands = fragment_bands(&[1.0; 10], 5);
        assert_eq!(bands, vec![0..2, 2..4, 4..6, 6..8, 8..10]);
        // Operators without parameters ride in the band before them (the first for those in
        // front).
        let bands = fragment_bands(&[0.0, 4.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0], 2);
        assert_eq!(bands, vec![0..3, 3..8]);
        assert_eq!(fragment_bands(&[3.0, 1.0], 1), vec![0..2]);
        // One operator heavier than a band (GPT-2's token embedding is 31% of gpt2-small): from
        // 5 bands on the first band is it alone, and no band is left empty while operators
        // remain (cutting by bytes alone would leave the first band empty from 7 bands on).
        let mut bytes = vec![31.0];
        bytes.extend([1.0; 69]);
        assert_eq!(fragment_bands(&bytes, 2), vec![0..20, 20..70]);
        for f in [5, 7, 10] {
            let bands = fragment_bands(&bytes, f);
            assert_eq!(bands[0], 0..1, "{f}");
            assert!(bands.iter().all(|b| !b.is_empty()), "{f}: {bands:?}");
            assert!(bands.windows(2).all(|w| w[0].end == w[1].start));
            assert_eq!(bands.last().map(|b| b.end), Some(70));
        }
        // More bands than parameterised operators: the first ones are empty.
        assert_eq!(parameterised_ops(&[10.0, 0.0, 1.0]), 2);
        let bands = fragment_bands(&[10.0, 0.0, 1.0], 4);
        assert_eq!(bands, vec![0..0, 0..0, 0..2, 2..3]);
    }

    #[test]
    fn fragments_pay_latency_per_exchange_and_hide_behind_shorter_slots() {
        // One fragment: the round's compute plus the exchange, or the longer of the two.
        assert_eq!(round_seconds(1.0, 10, &[4.0], false), 14.0);
        assert_eq!(round_seconds(1.0, 10, &[4.0], true), 10.0);
        assert_eq!(round_seconds(1.0, 10, &[14.0], true), 14.0);
        // Five fragments of 1 s each (bytes split five ways, latency paid five times): blocking
        // adds every one; overlapped each must fit a 2-step slot.
        assert_eq!(round_seconds(1.0, 10, &[1.0; 5], false), 15.0);
        assert_eq!(round_seconds(1.0, 10, &[1.0; 5], true), 10.0);
        assert_eq!(round_seconds(1.0, 10, &[3.0; 5], true), 15.0);
    }
}

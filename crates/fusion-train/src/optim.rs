//! Optimizers over host `f32` parameters, updated in parallel element-wise (deterministic).

use crate::config::OptimizerConfig;
use fusion_backend::simd::dispatch;
use rayon::prelude::*;

/// Elements per parallel task of an update: each runs vectorised at the processor's level.
const CHUNK: usize = 1 << 14;

/// Optimizer state: the step count and one or two moment buffers per trainable parameter
/// (empty vectors for buffers and frozen parameters).
#[derive(Clone, Debug, PartialEq)]
pub struct OptimizerState {
    pub step: u64,
    pub first: Vec<Vec<f32>>,
    pub second: Vec<Vec<f32>>,
}

impl OptimizerState {
    pub fn new(cfg: &OptimizerConfig, sizes: &[Option<usize>]) -> Self {
        let zeros = |n: &Option<usize>| vec![0.0f32; n.unwrap_or(0)];
        let second = match cfg {
            OptimizerConfig::AdamW { .. } => sizes.iter().map(zeros).collect(),
            OptimizerConfig::Sgd { .. } => sizes.iter().map(|_| Vec::new()).collect(),
        };
        OptimizerState {
            step: 0,
            first: sizes.iter().map(zeros).collect(),
            second,
        }
    }

    /// Applies one update. `grads[i]` is None for parameters without a gradient; `decay[i]` says
    /// whether weight decay applies to parameter `i`.
    pub fn update(
        &mut self,
        cfg: &OptimizerConfig,
        params: &mut [Vec<f32>],
        grads: &[Option<Vec<f32>>],
        decay: &[bool],
        lr: f32,
    ) {
        self.update_pieces(cfg, params, grads, decay, lr, &[]);
    }

    /// [`update`](Self::update) where these moments cover only a piece of each parameter
    /// (sharded optimizer state): the moments of parameter `i` belong to its elements
    /// `offsets[i]..offsets[i] + first[i].len()`, and only those are updated (an empty `offsets`:
    /// every piece starts at 0). The update is element-wise, so the pieces of every shard
    /// together update a parameter to the same bits as one whole update.
    pub fn update_pieces(
        &mut self,
        cfg: &OptimizerConfig,
        params: &mut [Vec<f32>],
        grads: &[Option<Vec<f32>>],
        decay: &[bool],
        lr: f32,
        offsets: &[usize],
    ) {
        self.step += 1;
        let t = self.step as i32;
        for i in 0..params.len() {
            let Some(g) = grads[i].as_ref() else { continue };
            let m = &mut self.first[i];
            let off = offsets.get(i).copied().unwrap_or(0);
            let end = off + m.len();
            let fits = match offsets.is_empty() {
                true => m.len() == params[i].len(),
                false => end <= params[i].len(),
            };
            if m.is_empty() || !fits || end > g.len() {
                continue;
            }
            let (p, g) = (&mut params[i][off..end], &g[off..end]);
            let wd_on = decay[i];
            match *cfg {
                OptimizerConfig::AdamW {
                    beta1,
                    beta2,
                    eps,
                    weight_decay,
                } => {
                    let v = &mut self.second[i];
                    let wd = if wd_on { weight_decay } else { 0.0 };
                    let k = AdamW {
                        beta1,
                        beta2,
                        eps,
                        wd,
                        lr,
                        c1: 1.0 - beta1.powi(t),
                        c2: 1.0 - beta2.powi(t),
                    };
                    p.par_chunks_mut(CHUNK)
                        .zip(m.par_chunks_mut(CHUNK))
                        .zip(v.par_chunks_mut(CHUNK))
                        .zip(g.par_chunks(CHUNK))
                        .for_each(|(((p, m), v), g)| k.update(p, m, v, g));
                }
                OptimizerConfig::Sgd {
                    momentum,
                    weight_decay,
                } => {
                    let wd = if wd_on { weight_decay } else { 0.0 };
                    p.par_chunks_mut(CHUNK)
                        .zip(m.par_chunks_mut(CHUNK))
                        .zip(g.par_chunks(CHUNK))
                        .for_each(|((p, m), g)| sgd(p, m, g, momentum, wd, lr));
                }
            }
        }
    }
}

/// One AdamW step's constants: `c1`, `c2` are the bias corrections, `wd` the weight decay in
/// force for the parameter.
struct AdamW {
    beta1: f32,
    beta2: f32,
    eps: f32,
    wd: f32,
    lr: f32,
    c1: f32,
    c2: f32,
}

impl AdamW {
    /// Updates a chunk of parameters `p`, moments `m`, `v` from gradients `g`, vectorised.
    fn update(&self, p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32]) {
        let AdamW {
            beta1,
            beta2,
            eps,
            wd,
            lr,
            c1,
            c2,
        } = *self;
        dispatch(
            #[inline(always)]
            || {
                let it = p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut());
                for (((p, m), v), &g) in it.zip(g) {
                    *m = beta1 * *m + (1.0 - beta1) * g;
                    *v = beta2 * *v + (1.0 - beta2) * g * g;
                    let update = (*m / c1) / ((*v / c2).sqrt() + eps);
                    *p -= lr * (update + wd * *p);
                }
            },
        )
    }
}

/// SGD with momentum over a chunk of parameters `p`, momentum `m`, gradients `g`, vectorised.
fn sgd(p: &mut [f32], m: &mut [f32], g: &[f32], momentum: f32, wd: f32, lr: f32) {
    dispatch(
        #[inline(always)]
        || {
            for ((p, m), &g) in p.iter_mut().zip(m.iter_mut()).zip(g) {
                *m = momentum * *m + g + wd * *p;
                *p -= lr * *m;
            }
        },
    )
}

/// The sum of squares of `x` in f64: blocks of [`CHUNK`] in parallel, each summed in eight
/// lanes, the lanes and then the blocks added in a fixed order, so the bits depend on neither the
/// thread count nor the instruction set (one running sum was a chain of dependent adds;
/// `fusionllm bench --simd` times this one).
pub fn square_sum(x: &[f32]) -> f64 {
    const L: usize = 8;
    let block = |c: &[f32]| -> f64 {
        dispatch(
            #[inline(always)]
            || {
                let mut lanes = [0f64; L];
                let mut it = c.chunks_exact(L);
                for v in &mut it {
                    for (acc, &e) in lanes.iter_mut().zip(v) {
                        *acc += (e as f64) * (e as f64);
                    }
                }
                let tail: f64 = it
                    .remainder()
                    .iter()
                    .map(|&e| (e as f64) * (e as f64))
                    .sum();
                lanes.iter().sum::<f64>() + tail
            },
        )
    };
    let sums: Vec<f64> = x.par_chunks(CHUNK).map(block).collect();
    // From +0.0 (`Iterator::sum` starts from -0.0): an empty tensor's sum has the Python node's bits.
    sums.iter().fold(0.0, |a, &s| a + s)
}

/// Scales gradients so their global L2 norm is at most `max_norm`; returns the norm before.
pub fn clip_global_norm(grads: &mut [Option<Vec<f32>>], max_norm: Option<f32>) -> f32 {
    let sq: f64 = grads.iter().flatten().fold(0.0, |a, g| a + square_sum(g));
    let norm = sq.sqrt() as f32;
    if let Some(max) = max_norm {
        if norm > max && norm.is_finite() {
            let s = max / (norm + 1e-6);
            grads
                .iter_mut()
                .flatten()
                .for_each(|g| g.par_iter_mut().for_each(|x| *x *= s));
        }
    }
    norm
}

#[cfg(test)]
mod tests {
    use super::*;
    use fusion_backend::simd::{self, Level};

    /// AdamW and SGD update to the same bits at every instruction-set level the processor has
    /// (tensors longer than a parallel chunk, with a tail).
    #[test]
    fn updates_are_the_same_bits_at_every_level() {
        let n = CHUNK * 2 + 37;
        let values = |seed: u32| -> Vec<f32> {
            (0..n as u32)
                .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 2001) as f32 * 1e-3 - 1.0)
                .collect()
        };
        let sgd = OptimizerConfig::Sgd {
            momentum: 0.9,
            weight_decay: 0.01,
        };
        let run = |cfg: &OptimizerConfig| -> Vec<u32> {
            let mut st = OptimizerState::new(cfg, &[Some(n)]);
            let mut params = vec![values(1)];
            for step in 0..3u32 {
                let grads = [Some(values(step + 2))];
                st.update(cfg, &mut params, &grads, &[true], 1e-2);
            }
            params[0].iter().map(|x| x.to_bits()).collect()
        };
        for cfg in [OptimizerConfig::default(), sgd] {
            simd::force(Some(Level::Baseline));
            let want = run(&cfg);
            for level in Level::ALL.into_iter().filter(|&l| l <= simd::supported()) {
                simd::force(Some(level));
                assert!(run(&cfg) == want, "{cfg:?} differs at {level:?}");
            }
            simd::force(None);
        }
    }

    #[test]
    fn adamw_first_step_moves_by_lr() {
        let cfg = OptimizerConfig::AdamW {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        };
        let mut st = OptimizerState::new(&cfg, &[Some(2)]);
        let mut p = vec![vec![1.0, -1.0]];
        st.update(&cfg, &mut p, &[Some(vec![0.5, -2.0])], &[true], 0.1);
        assert!(
            (p[0][0] - 0.9).abs() < 1e-5 && (p[0][1] + 0.9).abs() < 1e-5,
            "{:?}",
            p
        );
    }

    #[test]
    fn sgd_momentum_accumulates() {
        let cfg = OptimizerConfig::Sgd {
            momentum: 0.5,
            weight_decay: 0.0,
        };
        let mut st = OptimizerState::new(&cfg, &[Some(1)]);
        let mut p = vec![vec![0.0]];
        st.update(&cfg, &mut p, &[Some(vec![1.0])], &[true], 1.0);
        st.update(&cfg, &mut p, &[Some(vec![1.0])], &[true], 1.0);
        assert!((p[0][0] + 2.5).abs() < 1e-6);
    }

    /// Two shards of the moments, each updating its own pieces, move every element to the
    /// same bits as one whole update, step after step (AdamW and SGD).
    #[test]
    fn sharded_pieces_update_to_the_same_bits_as_the_whole() {
        let adam = OptimizerConfig::AdamW {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let sgd = OptimizerConfig::Sgd {
            momentum: 0.9,
            weight_decay: 0.01,
        };
        for cfg in [adam, sgd] {
            let sizes = [Some(5), None, Some(7)];
            let init = |i: usize, n: usize| -> Vec<f32> {
                (0..n).map(|k| ((i * 31 + k) as f32 * 0.37).sin()).collect()
            };
            let mut whole_p: Vec<Vec<f32>> = vec![init(0, 5), init(1, 3), init(2, 7)];
            let mut shard_p = whole_p.clone();
            let decay = [true, false, false];
            let mut whole = OptimizerState::new(&cfg, &sizes);
            // Shard A: elements 0..5 of the first and 0..2 of the third; B: the rest.
            let pieces = [([0usize, 0, 0], [5usize, 0, 2]), ([5, 0, 2], [0, 0, 5])];
            let mut shards: Vec<(OptimizerState, Vec<usize>)> = pieces
                .iter()
                .map(|(offs, lens)| {
                    let piece_sizes: Vec<Option<usize>> = lens.iter().map(|&l| Some(l)).collect();
                    (OptimizerState::new(&cfg, &piece_sizes), offs.to_vec())
                })
                .collect();
            for step in 0..4 {
                let grads: Vec<Option<Vec<f32>>> =
                    vec![Some(init(step + 7, 5)), None, Some(init(step + 11, 7))];
                whole.update(&cfg, &mut whole_p, &grads, &decay, 0.05);
                for (st, offs) in &mut shards {
                    st.update_pieces(&cfg, &mut shard_p, &grads, &decay, 0.05, offs);
                }
            }
            let bits =
                |p: &[Vec<f32>]| -> Vec<u32> { p.concat().iter().map(|x| x.to_bits()).collect() };
            assert_eq!(bits(&whole_p), bits(&shard_p), "{cfg:?}");
            assert_ne!(whole_p[0], init(0, 5), "the update moved the parameters");
        }
    }

    /// The values the Python node's test sums too (python/tests/test_worker_sums.py).
    fn square_sum_values() -> Vec<f32> {
        (0..CHUNK * 2 + 13)
            .map(|i| ((i * 7919) % 2003) as f32 / 1001.5 - 1.0 + 1e-3 * (i % 7) as f32)
            .collect()
    }

    #[test]
    fn square_sum_follows_its_documented_order_at_every_level() {
        let x = square_sum_values();
        // Blocks of CHUNK; in each, eight lanes added in order, then the lanes, then the tail.
        let mut want = 0.0f64;
        for block in x.chunks(CHUNK) {
            let whole = block.len() / 8 * 8;
            let mut lanes = [0.0f64; 8];
            for (i, &e) in block[..whole].iter().enumerate() {
                lanes[i % 8] += (e as f64) * (e as f64);
            }
            let tail = block[whole..]
                .iter()
                .fold(0.0, |a, &e| a + (e as f64) * (e as f64));
            want += lanes.iter().fold(0.0, |a, &l| a + l) + tail;
        }
        for level in Level::ALL.into_iter().filter(|&l| l <= simd::supported()) {
            simd::force(Some(level));
            let got = square_sum(&x);
            simd::force(None);
            assert_eq!(got.to_bits(), want.to_bits(), "{level:?}");
        }
        // The Python node asserts the same bits for the same values.
        assert_eq!(
            want.to_bits(),
            0x40c5_57e8_e919_9605,
            "{:#x}",
            want.to_bits()
        );
        assert_eq!(square_sum(&[]).to_bits(), 0.0f64.to_bits());
        let one = (x.iter().map(|&e| (e as f64) * (e as f64)).sum::<f64>() - want).abs();
        assert!(one < 1e-9 * want, "{one}");
    }

    #[test]
    fn clipping_caps_the_norm() {
        let mut g = vec![Some(vec![3.0, 4.0]), None];
        let n = clip_global_norm(&mut g, Some(1.0));
        assert!((n - 5.0).abs() < 1e-6);
        let g0 = g[0].as_ref().unwrap();
        assert!(((g0[0] * g0[0] + g0[1] * g0[1]).sqrt() - 1.0).abs() < 1e-4);
    }
}

//! Outer synchronisation across islands (DiLoCo-style).
//!
//! Each island trains its own copy of the model for `every` inner steps from a shared starting
//! point, the *anchor*. Its pseudo-gradient is the anchor minus where it got to. The islands'
//! pseudo-gradients, each compressed with error feedback, are averaged (weighted by the tokens
//! each island saw), and an outer optimizer (SGD with Nesterov momentum) moves the anchor along
//! them. The new anchor is where every island starts the next round. With an outer step after
//! every inner step, outer learning rate 1 and no momentum, the anchor moves by the mean of the
//! islands' inner updates: with SGD inside, that is synchronous data parallelism.
//!
//! Everything here is a pure function of its inputs: the single-process island trainer
//! (`islands.rs`) uses it, and a distributed runtime can apply the same steps.

use crate::error::{Result, TrainError};
use crate::shares::Shares;
use fusion_compress::{compressor, decode, Codec, ErrorFeedback, Selection, ValueType};
use serde::{Deserialize, Serialize};

/// How islands synchronise.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct OuterConfig {
    /// Inner steps between outer synchronisations (H).
    pub every: u64,
    /// Outer learning rate.
    pub lr: f32,
    /// Outer momentum.
    pub momentum: f32,
    /// Nesterov momentum (DiLoCo's choice) rather than heavy ball.
    pub nesterov: bool,
    /// How each island's pseudo-gradient is encoded: dense f32, a cast, int8 with a scale per
    /// block, or top-k; lossy codecs carry what they left out into the next round (error
    /// feedback).
    pub codec: Codec,
    /// How the islands split each inner step's micro-batches (`shares.rs`); the outer step
    /// weighs each island's pseudo-gradient by its share.
    pub shares: Shares,
    /// What a node lost mid-round costs on a cluster.
    pub recovery: IslandRecovery,
    /// Overlap each exchange with the next round's inner steps (see [`round_delta`]): a round's
    /// averaged pseudo-gradient is applied one round late, and each island keeps the progress
    /// it made meanwhile. Synchronisations that must leave every island on the same
    /// parameters (the last, and those before an evaluation or a checkpoint) still block.
    pub overlap: bool,
    /// Streaming synchronisation: the parameters are cut into this many fragments
    /// ([`fragment_of`]), and every `every / fragments` inner steps one fragment is
    /// synchronised, in turn, so each is still synchronised every `every` steps but an exchange
    /// carries `1 / fragments` of the model. Synchronisations that must leave every island on
    /// the same parameters (the last, and those before an evaluation or a checkpoint) take
    /// every fragment. 1: the whole model at once.
    pub fragments: u32,
}

/// What a node lost while the islands train costs (on a cluster).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IslandRecovery {
    /// Only its island is taken out of the round: the others go on, keeping their state, and the
    /// islands are re-formed at the next synchronisation. No island but the lost one loses work.
    #[default]
    Local,
    /// Every island rolls back to the last snapshot, as a run without islands does: with equal or
    /// fixed shares and no momentum the run ends on the bits of an uninterrupted one.
    Rollback,
}

impl std::str::FromStr for IslandRecovery {
    type Err = TrainError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "local" => Ok(IslandRecovery::Local),
            "rollback" => Ok(IslandRecovery::Rollback),
            other => Err(TrainError::Config(format!(
                "island recovery is `local` or `rollback`, not '{other}'"
            ))),
        }
    }
}

impl Default for OuterConfig {
    /// Every 50 steps, plain averaging (outer SGD at rate 1 without momentum): in our runs
    /// (docs/BENCHMARKS.md, "Islands") it reached a lower loss than DiLoCo's published setting
    /// (Nesterov momentum 0.9, outer learning rate 0.7, tuned for larger models and H = 500) at
    /// every H we tried; [`OuterConfig::diloco`] gives that one.
    fn default() -> Self {
        OuterConfig {
            every: 50,
            lr: 1.0,
            momentum: 0.0,
            nesterov: true,
            codec: Codec::None,
            shares: Shares::Auto,
            recovery: IslandRecovery::Local,
            overlap: false,
            fragments: 1,
        }
    }
}

impl OuterConfig {
    /// Outer SGD at learning rate 1 without momentum after every inner step: the islands'
    /// average, every step.
    pub fn averaging(every: u64) -> Self {
        OuterConfig {
            every,
            lr: 1.0,
            momentum: 0.0,
            nesterov: false,
            codec: Codec::None,
            shares: Shares::Auto,
            recovery: IslandRecovery::Local,
            overlap: false,
            fragments: 1,
        }
    }

    /// DiLoCo's published setting (Douillard et al., 2023): Nesterov momentum 0.9, outer
    /// learning rate 0.7.
    pub fn diloco(every: u64) -> Self {
        OuterConfig {
            every,
            lr: 0.7,
            momentum: 0.9,
            nesterov: true,
            codec: Codec::None,
            shares: Shares::Auto,
            recovery: IslandRecovery::Local,
            overlap: false,
            fragments: 1,
        }
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(TrainError::Config(m));
        if self.every == 0 {
            return bad("islands synchronise every H >= 1 inner steps".into());
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad(format!(
                "the outer learning rate must be positive, got {}",
                self.lr
            ));
        }
        if !(0.0..1.0).contains(&self.momentum) {
            return bad(format!(
                "the outer momentum must be in [0, 1), got {}",
                self.momentum
            ));
        }
        if self.fragments == 0 || !self.every.is_multiple_of(u64::from(self.fragments)) {
            return bad(format!(
                "{} fragments do not divide the {} inner steps between synchronisations: \
                 each fragment is synchronised every H steps, one every H / fragments",
                self.fragments, self.every
            ));
        }
        if self.codec == Codec::AdaTopK {
            return bad(
                "a pseudo-gradient codec is fixed: none, fp16, bf16, int8 or topk:D".into(),
            );
        }
        Ok(())
    }
}

/// The anchor and the outer momentum.
#[derive(Clone, Debug, PartialEq)]
pub struct OuterOptimizer {
    /// Parameters (and buffers) at the last synchronisation: where every island started.
    pub anchor: Vec<Vec<f32>>,
    /// Outer momentum of each trainable parameter (empty for buffers and frozen parameters).
    pub momentum: Vec<Vec<f32>>,
    trainable: Vec<bool>,
    /// Outer steps taken.
    pub syncs: u64,
}

impl OuterOptimizer {
    /// Starts at `params`; `trainable[i]` says whether parameter `i` gets pseudo-gradients.
    pub fn new(params: &[Vec<f32>], trainable: &[bool]) -> Self {
        OuterOptimizer {
            anchor: params.to_vec(),
            momentum: Self::zero_momentum(params, trainable),
            trainable: trainable.to_vec(),
            syncs: 0,
        }
    }

    /// Zero momentum shaped for `params`: one per trainable parameter, empty elsewhere.
    pub fn zero_momentum(params: &[Vec<f32>], trainable: &[bool]) -> Vec<Vec<f32>> {
        params
            .iter()
            .zip(trainable)
            .map(|(p, &t)| if t { vec![0.0; p.len()] } else { Vec::new() })
            .collect()
    }

    /// `anchor - params` for every trainable parameter (None elsewhere).
    pub fn pseudo_gradient(&self, params: &[Vec<f32>]) -> Result<Vec<Option<Vec<f32>>>> {
        self.check(params.len(), |i| params[i].len(), "island parameters")?;
        Ok(self
            .anchor
            .iter()
            .zip(params)
            .zip(&self.trainable)
            .map(|((a, p), &t)| t.then(|| a.iter().zip(p).map(|(a, p)| a - p).collect()))
            .collect())
    }

    /// Moves the anchor along the averaged pseudo-gradient `delta` (SGD with momentum, Nesterov
    /// when configured) and sets the buffers (batch-norm statistics) to `buffers`' values.
    pub fn step(
        &mut self,
        cfg: &OuterConfig,
        delta: &[Option<Vec<f32>>],
        buffers: &[Vec<f32>],
    ) -> Result<()> {
        self.check(
            delta.len(),
            |i| delta[i].as_ref().map_or(self.anchor[i].len(), Vec::len),
            "the averaged pseudo-gradient",
        )?;
        let (lr, mu) = (cfg.lr, cfg.momentum);
        for (i, d) in delta.iter().enumerate() {
            let (anchor, m) = (&mut self.anchor[i], &mut self.momentum[i]);
            match d {
                Some(d) if self.trainable[i] => {
                    for ((a, m), &d) in anchor.iter_mut().zip(m.iter_mut()).zip(d) {
                        *m = mu * *m + d;
                        let step = if cfg.nesterov { d + mu * *m } else { *m };
                        *a -= lr * step;
                    }
                }
                _ if !self.trainable[i] => {
                    if let Some(b) = buffers.get(i).filter(|b| b.len() == anchor.len()) {
                        anchor.copy_from_slice(b);
                    }
                }
                _ => {}
            }
        }
        self.syncs += 1;
        Ok(())
    }

    fn check(&self, n: usize, len: impl Fn(usize) -> usize, what: &str) -> Result<()> {
        if n != self.anchor.len() {
            return Err(TrainError::PseudoGradient(format!(
                "{what} has {n} tensors, the anchor {}",
                self.anchor.len()
            )));
        }
        match (0..n).find(|&i| len(i) != self.anchor[i].len()) {
            Some(i) => Err(TrainError::PseudoGradient(format!(
                "{what}: tensor {i} has {} values, the anchor's {}",
                len(i),
                self.anchor[i].len()
            ))),
            None => Ok(()),
        }
    }
}

/// Streaming synchronisation ([`OuterConfig::fragments`]): the fragment of each tensor (in
/// the model's parameter order), cutting the order into `fragments` contiguous runs of about
/// equal numbers of values. Consecutive tensors are a model's consecutive layers, so a
/// fragment is a band of layers, as in Streaming DiLoCo. A tensor goes to the fragment its
/// middle value falls in; each fragment gets at least one tensor while there are enough.
pub fn fragment_of(sizes: &[usize], fragments: u32) -> Vec<u32> {
    let f = u128::from(fragments.max(1));
    let n = sizes.len();
    let total: u128 = sizes.iter().map(|&s| s as u128).sum();
    let mut out = Vec::with_capacity(n);
    let (mut before, mut current) = (0u128, 0u128);
    for (i, &s) in sizes.iter().enumerate() {
        let s = s as u128;
        // The middle value's fragment, 2·f·(before + s/2) / (2·total), in integers.
        let by_size = match total {
            0 => (i as u128 * f) / n.max(1) as u128,
            t => (f * (2 * before + s) / (2 * t)).min(f - 1),
        };
        // Never behind the previous tensor, at most one fragment ahead of it (no fragment is
        // skipped), and far enough ahead that the tensors left fill the fragments left.
        let left = (n - i) as u128;
        let floor = (f.saturating_sub(left)).max(current);
        current = by_size.clamp(floor, (current + u128::from(i > 0)).max(floor));
        out.push(current as u32);
        before += s;
    }
    out
}

/// Which fragment the synchronisation after `done` inner steps takes, by the schedule alone:
/// every `every / fragments` steps one fragment, in turn, fragment 0 at the multiples of
/// `every` (so with one fragment, every `every` steps the whole model). None: no
/// synchronisation is due.
pub fn fragment_due(done: u64, cfg: &OuterConfig) -> Option<u32> {
    let f = u64::from(cfg.fragments.max(1));
    let period = (cfg.every / f).max(1);
    (done > 0 && done.is_multiple_of(period)).then(|| ((done / period) % f) as u32)
}

/// Overlapped synchronisation ([`OuterConfig::overlap`]): one island's progress over the round
/// that just ended, `start - params` for every parameter and buffer, where `start` is where the
/// island began the round. Its exchange runs beside the next round; when it arrives the anchor
/// takes the outer step and the island moves onto it with [`carry_onto`], keeping the progress
/// of the round it trained meanwhile. (Streaming DiLoCo overlaps the same way with a delay of
/// a whole round; without the per-fragment schedule and the mixing factor.)
pub fn round_delta(start: &[Vec<f32>], params: &[Vec<f32>]) -> Result<Vec<Vec<f32>>> {
    same_shapes(
        start,
        params,
        "an island's parameters against its round's start",
    )?;
    Ok(start
        .iter()
        .zip(params)
        .map(|(s, p)| s.iter().zip(p).map(|(s, p)| s - p).collect())
        .collect())
}

/// Moves an island that began its round at `start` onto `anchor`, keeping what it learnt
/// since: `params += anchor - start`, tensor by tensor.
pub fn carry_onto(params: &mut [Vec<f32>], anchor: &[Vec<f32>], start: &[Vec<f32>]) -> Result<()> {
    same_shapes(anchor, params, "an island's parameters against the anchor")?;
    same_shapes(
        start,
        params,
        "an island's parameters against its round's start",
    )?;
    for ((p, a), s) in params.iter_mut().zip(anchor).zip(start) {
        for ((p, a), s) in p.iter_mut().zip(a).zip(s) {
            *p += a - s;
        }
    }
    Ok(())
}

fn same_shapes(a: &[Vec<f32>], b: &[Vec<f32>], what: &str) -> Result<()> {
    let lens = |x: &[Vec<f32>]| x.iter().map(Vec::len).collect::<Vec<_>>();
    if lens(a) != lens(b) {
        return Err(TrainError::PseudoGradient(format!(
            "{what}: tensors of {:?} values against {:?}",
            lens(b),
            lens(a)
        )));
    }
    Ok(())
}

/// Encodes one island's pseudo-gradients for the wire: one message per parameter, through the
/// configured codec, with error feedback per parameter (a lossy codec's residual joins the next
/// round's pseudo-gradient of the same parameter).
pub struct PseudoGradientEncoder {
    codec: Codec,
    seed: u64,
    feedback: ErrorFeedback,
}

impl PseudoGradientEncoder {
    pub fn new(codec: Codec, seed: u64) -> Self {
        PseudoGradientEncoder {
            codec,
            seed,
            feedback: ErrorFeedback::default(),
        }
    }

    /// The message for parameter `param`'s pseudo-gradient.
    pub fn encode(&mut self, param: usize, delta: &[f32]) -> Vec<u8> {
        let mut c = compressor(
            self.codec,
            ValueType::F16,
            Selection::Exact,
            self.seed ^ param as u64,
        );
        match self.codec {
            Codec::None => c.compress(delta),
            _ => self.feedback.compress(c.as_mut(), param as u64, delta),
        }
    }

    /// Forgets the residuals (after a rollback the rounds restart).
    pub fn clear(&mut self) {
        self.feedback.clear();
    }
}

/// Decodes a pseudo-gradient message of `n` values (every check of the wire format applies).
pub fn decode_pseudo_gradient(msg: &[u8], n: usize) -> Result<Vec<f32>> {
    decode(msg, n).map_err(|e| TrainError::PseudoGradient(format!("undecodable message: {e}")))
}

/// The weighted mean of the islands' decoded pseudo-gradients, summed in f64 in island order so
/// every holder computes the same bits. `weights` are the islands' shares of the round's tokens.
pub fn weighted_mean(parts: &[Vec<f32>], weights: &[f64]) -> Result<Vec<f32>> {
    let n = parts.first().map_or(0, Vec::len);
    if parts.len() != weights.len() || parts.iter().any(|p| p.len() != n) {
        return Err(TrainError::PseudoGradient(format!(
            "{} parts of lengths {:?} for {} weights",
            parts.len(),
            parts.iter().map(Vec::len).collect::<Vec<_>>(),
            weights.len()
        )));
    }
    let mut acc = vec![0.0f64; n];
    for (p, &w) in parts.iter().zip(weights) {
        acc.iter_mut().zip(p).for_each(|(a, &v)| *a += w * v as f64);
    }
    Ok(acc.into_iter().map(|v| v as f32).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn averaging_at_rate_one_lands_on_the_mean_of_the_islands() {
        let start = vec![vec![1.0f32, 2.0, 3.0], vec![5.0]];
        let mut outer = OuterOptimizer::new(&start, &[true, false]);
        let a = vec![vec![0.0f32, 2.0, 4.0], vec![7.0]];
        let b = vec![vec![1.0f32, 1.0, 3.0], vec![9.0]];
        let da = outer.pseudo_gradient(&a).expect("same shape");
        let db = outer.pseudo_gradient(&b).expect("same shape");
        assert!(da[1].is_none());
        let mean = weighted_mean(
            &[
                da[0].clone().expect("trainable"),
                db[0].clone().expect("trainable"),
            ],
            &[0.5, 0.5],
        )
        .expect("mean");
        outer
            .step(
                &OuterConfig::averaging(1),
                &[Some(mean), None],
                &[vec![], vec![8.0]],
            )
            .expect("step");
        assert_eq!(outer.anchor, vec![vec![0.5, 1.5, 3.5], vec![8.0]]);
    }

    #[test]
    fn nesterov_looks_ahead_along_the_momentum() {
        let mut outer = OuterOptimizer::new(&[vec![0.0f32]], &[true]);
        let cfg = OuterConfig {
            every: 1,
            lr: 0.5,
            momentum: 0.9,
            nesterov: true,
            codec: Codec::None,
            shares: Shares::Auto,
            recovery: IslandRecovery::Local,
            overlap: false,
            fragments: 1,
        };
        outer.step(&cfg, &[Some(vec![1.0])], &[]).expect("step");
        // m = 1, step = 1 + 0.9 * 1 = 1.9, anchor = -0.95.
        assert!((outer.anchor[0][0] + 0.95).abs() < 1e-6);
        outer.step(&cfg, &[Some(vec![1.0])], &[]).expect("step");
        // m = 1.9, step = 1 + 0.9 * 1.9 = 2.71, anchor = -0.95 - 1.355.
        assert!((outer.anchor[0][0] + 2.305).abs() < 1e-6);
        let heavy = OuterConfig {
            nesterov: false,
            ..cfg
        };
        let mut plain = OuterOptimizer::new(&[vec![0.0f32]], &[true]);
        plain.step(&heavy, &[Some(vec![1.0])], &[]).expect("step");
        assert!((plain.anchor[0][0] + 0.5).abs() < 1e-6);
    }

    #[test]
    fn mismatched_shapes_are_named() {
        let outer = OuterOptimizer::new(&[vec![0.0f32; 3]], &[true]);
        let e = outer.pseudo_gradient(&[vec![0.0; 2]]).unwrap_err();
        assert!(e.to_string().contains("tensor 0 has 2 values"), "{e}");
        assert!(weighted_mean(&[vec![1.0], vec![1.0, 2.0]], &[0.5, 0.5]).is_err());
        assert!(decode_pseudo_gradient(&[1, 2, 3], 3).is_err());
    }

    fn wave(n: usize, phase: f32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32) * 0.37 + phase).sin() * (1.0 + (i % 7) as f32))
            .collect()
    }

    #[test]
    fn pseudo_gradients_round_trip_through_every_codec() {
        let x = wave(1000, 0.3);
        let norm = x.iter().map(|v| v * v).sum::<f32>().sqrt();
        for (codec, tolerance) in [
            (Codec::None, 0.0),
            (Codec::Bf16, 1e-2),
            (Codec::Int8 { block: 256 }, 1e-2),
        ] {
            let mut enc = PseudoGradientEncoder::new(codec, 1);
            let got = decode_pseudo_gradient(&enc.encode(0, &x), x.len()).expect("decodes");
            let err = got
                .iter()
                .zip(&x)
                .map(|(a, b)| (a - b) * (a - b))
                .sum::<f32>()
                .sqrt();
            assert!(err <= tolerance * norm, "{codec}: error {err} of {norm}");
        }
    }

    #[test]
    fn top_k_error_feedback_delivers_what_it_held_back() {
        // Over many rounds of the same pseudo-gradient, top-k with error feedback delivers about
        // the sum of what was sent: what it leaves out waits for later rounds (the error is the
        // last residual, bounded), where plain top-k loses the same 95% every round.
        let x = wave(400, 1.1);
        let rounds = 60;
        let relative_error = |feedback: bool| {
            let mut enc = PseudoGradientEncoder::new(Codec::TopK { density: 0.05 }, 1);
            let mut plain = compressor(
                Codec::TopK { density: 0.05 },
                ValueType::F16,
                Selection::Exact,
                1,
            );
            let mut got = vec![0.0f32; x.len()];
            for _ in 0..rounds {
                let msg = if feedback {
                    enc.encode(3, &x)
                } else {
                    plain.compress(&x)
                };
                let d = decode_pseudo_gradient(&msg, x.len()).expect("decodes");
                got.iter_mut().zip(d).for_each(|(g, v)| *g += v);
            }
            let (mut err, mut norm) = (0.0f32, 0.0f32);
            for (g, v) in got.iter().zip(&x) {
                err += (g - v * rounds as f32).powi(2);
                norm += (v * rounds as f32).powi(2);
            }
            err.sqrt() / norm.sqrt()
        };
        let (with, without) = (relative_error(true), relative_error(false));
        assert!(
            with < 0.25 && without > 0.7,
            "{with} with feedback, {without} without"
        );
        // The message is sparse: about 5% of the values and their indices.
        let msg = PseudoGradientEncoder::new(Codec::TopK { density: 0.05 }, 1).encode(3, &x);
        assert!(msg.len() < x.len() * 4 / 5, "{} bytes", msg.len());
    }

    #[test]
    fn fragments_are_contiguous_balanced_bands() {
        // A large embedding first, then equal layers: the embedding (with the small tensor whose
        // middle falls in the first half) is a fragment of its own.
        let sizes = [400, 10, 100, 100, 100, 100, 10];
        assert_eq!(fragment_of(&sizes, 2), [0, 0, 1, 1, 1, 1, 1]);
        assert_eq!(fragment_of(&sizes, 4), [0, 1, 2, 2, 3, 3, 3]);
        assert_eq!(fragment_of(&sizes, 1), [0; 7]);
        // Every fragment gets a tensor while there are enough, even when sizes say otherwise.
        assert_eq!(fragment_of(&[1000, 1, 1, 1], 4), [0, 1, 2, 3]);
        assert_eq!(fragment_of(&[1, 1, 1, 1000], 4), [0, 1, 2, 3]);
        assert_eq!(fragment_of(&[0, 0, 0], 2), [0, 0, 1]);
        for f in 1..=6u32 {
            let sizes: Vec<usize> = (0..11).map(|i| 1 + (i * 37) % 50).collect();
            let got = fragment_of(&sizes, f);
            assert_eq!(got[0], 0);
            assert_eq!(*got.last().expect("tensors"), f - 1);
            assert!(
                got.windows(2).all(|w| w[1] == w[0] || w[1] == w[0] + 1),
                "{got:?}"
            );
        }
    }

    #[test]
    fn fragments_take_turns_every_h_over_f_steps() {
        let cfg = OuterConfig {
            fragments: 4,
            ..OuterConfig::averaging(8)
        };
        let due: Vec<Option<u32>> = (0..=10).map(|d| fragment_due(d, &cfg)).collect();
        let want = [
            None,
            None,
            Some(1),
            None,
            Some(2),
            None,
            Some(3),
            None,
            Some(0),
            None,
        ];
        assert_eq!(&due[..10], &want);
        assert_eq!(due[10], Some(1));
        let whole = OuterConfig::averaging(3);
        let due: Vec<bool> = (0..=6).map(|d| fragment_due(d, &whole).is_some()).collect();
        assert_eq!(due, [false, false, false, true, false, false, true]);
        assert!(OuterConfig {
            fragments: 3,
            ..OuterConfig::averaging(8)
        }
        .validate()
        .is_err());
    }

    #[test]
    fn configs_are_checked() {
        assert!(OuterConfig::default().validate().is_ok());
        for bad in [
            OuterConfig {
                every: 0,
                ..Default::default()
            },
            OuterConfig {
                lr: f32::NAN,
                ..Default::default()
            },
            OuterConfig {
                momentum: 1.0,
                ..Default::default()
            },
            OuterConfig {
                codec: Codec::AdaTopK,
                ..Default::default()
            },
            OuterConfig {
                fragments: 0,
                ..Default::default()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }
}

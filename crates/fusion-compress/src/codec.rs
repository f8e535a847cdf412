//! Compressors: one trait, one self-describing message format (`wire`), so a receiver decodes
//! whatever a sender chose without negotiating.

use crate::select::{top_k_with_values, Selection};
use crate::wire::{
    decode, encode_dense, encode_int8, encode_sparse, encode_sparse_values, ValueType,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// Turns a tensor into the bytes sent for it.
pub trait Compressor: Send {
    /// Short description for logs and reports, e.g. `topk(1.0%)`.
    fn name(&self) -> String;
    /// The message for `x` (decode with [`crate::decode`]).
    fn compress(&mut self, x: &[f32]) -> Vec<u8>;
}

/// Which compressor a direction of a link uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Codec {
    /// Dense f32.
    #[default]
    None,
    Fp16,
    Bf16,
    /// Int8 with one scale per `block` values.
    Int8 {
        block: usize,
    },
    /// The `density` share of values with the largest magnitude.
    TopK {
        density: f64,
    },
    /// A uniformly random `density` share of values, rescaled by 1 / density (unbiased).
    RandomK {
        density: f64,
    },
    /// Top-k whose density the AdaTopK rule sets per link from its bandwidth (1: dense).
    AdaTopK,
}

impl std::fmt::Display for Codec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Codec::None => write!(f, "dense"),
            Codec::Fp16 => write!(f, "fp16"),
            Codec::Bf16 => write!(f, "bf16"),
            Codec::Int8 { block } => write!(f, "int8/{block}"),
            Codec::TopK { density } => write!(f, "top-k {:.2}%", 100.0 * density),
            Codec::RandomK { density } => write!(f, "random-k {:.2}%", 100.0 * density),
            Codec::AdaTopK => write!(f, "adatopk"),
        }
    }
}

impl Codec {
    /// Parses `none`, `fp16`, `bf16`, `int8`, `topk:0.01`, `randomk:0.01`, `adatopk`.
    pub fn parse(s: &str) -> Result<Codec, String> {
        let (name, arg) = match s.split_once(':') {
            Some((n, a)) => (n, Some(a)),
            None => (s, None),
        };
        let density = |a: Option<&str>| -> Result<f64, String> {
            let d: f64 = a
                .ok_or_else(|| format!("'{name}' needs a density, e.g. {name}:0.01"))?
                .parse()
                .map_err(|_| format!("bad density in '{s}'"))?;
            if d > 0.0 && d <= 1.0 {
                Ok(d)
            } else {
                Err(format!("density must be in (0, 1], got {d}"))
            }
        };
        match name {
            "none" | "dense" => Ok(Codec::None),
            "fp16" => Ok(Codec::Fp16),
            "bf16" => Ok(Codec::Bf16),
            "int8" => Ok(Codec::Int8 {
                block: match arg {
                    Some(b) => b
                        .parse::<usize>()
                        .ok()
                        .filter(|&b| b > 0)
                        .ok_or_else(|| format!("bad int8 block size in '{s}'"))?,
                    None => 256,
                },
            }),
            "topk" => Ok(Codec::TopK {
                density: density(arg)?,
            }),
            "randomk" => Ok(Codec::RandomK {
                density: density(arg)?,
            }),
            "adatopk" => Ok(Codec::AdaTopK),
            _ => Err(format!(
                "unknown codec '{s}' (none, fp16, bf16, int8[:block], topk:D, randomk:D, adatopk)"
            )),
        }
    }
}

/// A sparse message, or the dense one when that is no bigger (high densities).
fn smaller(sparse: Vec<u8>, x: &[f32], values: ValueType) -> Vec<u8> {
    if sparse.len() < 12 + values.bytes(x.len()) {
        sparse
    } else {
        encode_dense(x, values)
    }
}

/// Dense f32, f16 or bf16.
pub struct Dense(pub ValueType);

impl Compressor for Dense {
    fn name(&self) -> String {
        format!("dense-{:?}", self.0).to_lowercase()
    }
    fn compress(&mut self, x: &[f32]) -> Vec<u8> {
        encode_dense(x, self.0)
    }
}

pub struct Int8 {
    pub block: usize,
}

impl Compressor for Int8 {
    fn name(&self) -> String {
        format!("int8/{}", self.block)
    }
    fn compress(&mut self, x: &[f32]) -> Vec<u8> {
        encode_int8(x, self.block)
    }
}

fn kept(n: usize, density: f64) -> usize {
    ((density * n as f64).ceil() as usize).clamp(1.min(n), n)
}

/// Top-k by magnitude; density 1 sends the tensor dense.
pub struct TopK {
    pub density: f64,
    pub values: ValueType,
    pub selection: Selection,
    seed: u64,
}

impl TopK {
    pub fn new(density: f64, values: ValueType, selection: Selection) -> Self {
        TopK {
            density: density.clamp(0.0, 1.0),
            values,
            selection,
            seed: 0,
        }
    }
}

impl Compressor for TopK {
    fn name(&self) -> String {
        format!("topk({:.2}%)", 100.0 * self.density)
    }
    fn compress(&mut self, x: &[f32]) -> Vec<u8> {
        if self.density >= 1.0 {
            return encode_dense(x, self.values);
        }
        self.seed = self.seed.wrapping_add(1);
        let (idx, vals) =
            top_k_with_values(x, kept(x.len(), self.density), self.selection, self.seed);
        let sparse = encode_sparse_values(x.len(), &idx, &vals, self.values);
        smaller(sparse, x, self.values)
    }
}

/// Random-k: a fresh uniform sample of positions per message, values scaled by n / k so the
/// expected decoded tensor equals the original.
pub struct RandomK {
    pub density: f64,
    pub values: ValueType,
    rng: ChaCha8Rng,
}

impl RandomK {
    pub fn new(density: f64, values: ValueType, seed: u64) -> Self {
        RandomK {
            density: density.clamp(0.0, 1.0),
            values,
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }
}

impl Compressor for RandomK {
    fn name(&self) -> String {
        format!("randomk({:.2}%)", 100.0 * self.density)
    }
    fn compress(&mut self, x: &[f32]) -> Vec<u8> {
        let n = x.len();
        let k = kept(n, self.density);
        if k >= n {
            return encode_dense(x, self.values);
        }
        // Floyd's algorithm: k distinct positions in O(k).
        let mut chosen = std::collections::HashSet::with_capacity(k);
        for j in n - k..n {
            let t = self.rng.random_range(0..=j);
            if !chosen.insert(t as u32) {
                chosen.insert(j as u32);
            }
        }
        let mut idx: Vec<u32> = chosen.into_iter().collect();
        idx.sort_unstable();
        let scale = n as f32 / k as f32;
        let scaled: Vec<f32> = x.iter().map(|v| v * scale).collect();
        smaller(encode_sparse(&scaled, &idx, self.values), x, self.values)
    }
}

/// Builds the compressor for `codec`; AdaTopK starts dense until the rule sets its density.
pub fn compressor(
    codec: Codec,
    values: ValueType,
    selection: Selection,
    seed: u64,
) -> Box<dyn Compressor> {
    match codec {
        Codec::None => Box::new(Dense(ValueType::F32)),
        Codec::Fp16 => Box::new(Dense(ValueType::F16)),
        Codec::Bf16 => Box::new(Dense(ValueType::Bf16)),
        Codec::Int8 { block } => Box::new(Int8 { block }),
        Codec::TopK { density } => Box::new(TopK::new(density, values, selection)),
        Codec::RandomK { density } => Box::new(RandomK::new(density, values, seed)),
        Codec::AdaTopK => Box::new(TopK::new(1.0, values, selection)),
    }
}

/// Error feedback (residual accumulation): what a lossy message left out of a tensor stream is
/// added to the next tensor of the same stream, so nothing is lost for good, only delayed. Used
/// for what travels backward (gradients), where it keeps top-k training close to dense.
#[derive(Default)]
pub struct ErrorFeedback {
    residual: HashMap<u64, Vec<f32>>,
}

impl ErrorFeedback {
    /// Compresses `x` of stream `key` with `c`, carrying the residual forward.
    pub fn compress(&mut self, c: &mut dyn Compressor, key: u64, x: &[f32]) -> Vec<u8> {
        let r = self.residual.entry(key).or_default();
        if r.len() != x.len() {
            *r = vec![0.0; x.len()];
        }
        let corrected: Vec<f32> = x.iter().zip(r.iter()).map(|(a, b)| a + b).collect();
        let msg = c.compress(&corrected);
        match decode(&msg, x.len()) {
            Ok(sent) => {
                for ((res, c), s) in r.iter_mut().zip(&corrected).zip(&sent) {
                    *res = c - s;
                }
            }
            // Our own message always decodes; if it ever did not, forget rather than corrupt.
            Err(_) => r.iter_mut().for_each(|v| *v = 0.0),
        }
        msg
    }

    /// Drops every residual (after a rollback, the streams restart).
    pub fn clear(&mut self) {
        self.residual.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codecs_parse_and_refuse_nonsense() {
        assert_eq!(Codec::parse("topk:0.01"), Ok(Codec::TopK { density: 0.01 }));
        assert_eq!(Codec::parse("int8"), Ok(Codec::Int8 { block: 256 }));
        assert_eq!(Codec::parse("adatopk"), Ok(Codec::AdaTopK));
        for bad in ["topk", "topk:0", "topk:2", "randomk:x", "int8:0", "zip"] {
            assert!(Codec::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn topk_with_k_equal_n_is_exact_and_shrinks_otherwise() {
        let x: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.1).sin()).collect();
        let mut full = TopK::new(1.0, ValueType::F32, Selection::Exact);
        assert_eq!(decode(&full.compress(&x), 1000), Ok(x.clone()));
        let mut t = TopK::new(0.01, ValueType::F32, Selection::Exact);
        let m = t.compress(&x);
        assert!(m.len() < 4000 / 20, "{} bytes", m.len());
        let d = decode(&m, 1000).expect("valid");
        assert_eq!(d.iter().filter(|v| **v != 0.0).count(), 10);
    }

    #[test]
    fn randomk_is_unbiased_on_average() {
        let x: Vec<f32> = (0..200).map(|i| i as f32 / 200.0).collect();
        let mut r = RandomK::new(0.1, ValueType::F32, 5);
        let mut mean = vec![0.0f64; 200];
        let trials = 2000;
        for _ in 0..trials {
            let d = decode(&r.compress(&x), 200).expect("valid");
            for (m, v) in mean.iter_mut().zip(d) {
                *m += v as f64 / trials as f64;
            }
        }
        let err: f64 = mean
            .iter()
            .zip(&x)
            .map(|(m, v)| (m - *v as f64).abs())
            .sum::<f64>()
            / 200.0;
        assert!(err < 0.05, "mean absolute bias {err}");
    }

    #[test]
    fn error_feedback_delivers_everything_eventually() {
        // A constant stream through 10% top-k: with feedback every entry arrives, at most about
        // fifteen messages late; without, the small entries never arrive.
        let x: Vec<f32> = (0..100).map(|i| 1.0 + i as f32 / 100.0).collect();
        let mut t = TopK::new(0.1, ValueType::F32, Selection::Exact);
        let mut ef = ErrorFeedback::default();
        let rounds = 50;
        let mut got = vec![0.0f32; 100];
        for _ in 0..rounds {
            let d = decode(&ef.compress(&mut t, 7, &x), 100).expect("valid");
            got.iter_mut().zip(d).for_each(|(g, v)| *g += v);
        }
        for (g, v) in got.iter().zip(&x) {
            let want = v * rounds as f32;
            assert!((g - want).abs() <= 15.0 * v, "{g} vs {want}");
        }
        let mut plain = vec![0.0f32; 100];
        for _ in 0..rounds {
            let d = decode(&t.compress(&x), 100).expect("valid");
            plain.iter_mut().zip(d).for_each(|(g, v)| *g += v);
        }
        assert_eq!(
            plain[0], 0.0,
            "without feedback the smallest entry never travels"
        );
    }
}

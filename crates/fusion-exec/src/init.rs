//! Deterministic parameter initialisation. Each parameter's values depend only on the run seed and
//! the parameter's name, so a node that owns part of a model initialises exactly the values a
//! single process would.

use fusion_graph::{Graph, Init, ParamSpec};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};
use sha2::{Digest, Sha256};

fn seed_for(seed: u64, name: &str) -> u64 {
    let mut h = Sha256::new();
    h.update(seed.to_le_bytes());
    h.update(name.as_bytes());
    let d = h.finalize();
    let mut b = [0u8; 8];
    b.copy_from_slice(&d[..8]);
    u64::from_le_bytes(b)
}

fn normal(n: usize, std: f32, rng: &mut ChaCha8Rng) -> Vec<f32> {
    match Normal::new(0.0f32, std) {
        Ok(d) => (0..n).map(|_| d.sample(rng)).collect(),
        Err(_) => vec![0.0; n],
    }
}

pub fn init_param(spec: &ParamSpec, seed: u64) -> Vec<f32> {
    let n = spec.numel();
    let mut rng = ChaCha8Rng::seed_from_u64(seed_for(seed, &spec.name));
    match &spec.init {
        Init::Zeros => vec![0.0; n],
        Init::Ones => vec![1.0; n],
        Init::Normal { std } => normal(n, *std, &mut rng),
        Init::KaimingNormal { fan_in } => {
            normal(n, (2.0 / (*fan_in).max(1) as f32).sqrt(), &mut rng)
        }
    }
}

/// Initial values of every parameter of `graph`, in parameter order.
pub fn init_params(graph: &Graph, seed: u64) -> Vec<Vec<f32>> {
    graph.params.iter().map(|p| init_param(p, seed)).collect()
}

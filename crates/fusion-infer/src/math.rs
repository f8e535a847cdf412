//! The few kernels a decoder needs for one position, on host `f32`: matrix-vector products (rows
//! in parallel), normalisations, activations, rotary positions and attention over a cache.

use rayon::prelude::*;

/// `w [out, in] · x [in] (+ b)`.
pub fn matvec(w: &[f32], x: &[f32], b: Option<&[f32]>) -> Vec<f32> {
    let n = x.len();
    let mut y: Vec<f32> = w
        .par_chunks(n.max(1))
        .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
        .collect();
    if let Some(b) = b {
        y.iter_mut().zip(b).for_each(|(y, b)| *y += b);
    }
    y
}

pub fn layer_norm(x: &[f32], gamma: &[f32], beta: &[f32], eps: f32) -> Vec<f32> {
    let n = x.len() as f32;
    let mean = x.iter().sum::<f32>() / n;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    let inv = 1.0 / (var + eps).sqrt();
    x.iter()
        .zip(gamma.iter().zip(beta))
        .map(|(v, (g, b))| (v - mean) * inv * g + b)
        .collect()
}

pub fn rms_norm(x: &[f32], gamma: &[f32], eps: f32) -> Vec<f32> {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (ms + eps).sqrt();
    x.iter().zip(gamma).map(|(v, g)| v * inv * g).collect()
}

/// GELU, tanh approximation (GPT-2's).
pub fn gelu(x: f32) -> f32 {
    let c = (2.0 / std::f32::consts::PI).sqrt();
    0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Rotates each `dim`-wide head of `x` to position `pos` (rotate-half pairing, as Hugging
/// Face's Llama: element i pairs with i + dim/2).
pub fn rope(x: &mut [f32], dim: usize, pos: usize, theta: f32) {
    let half = dim / 2;
    for head in x.chunks_mut(dim) {
        for i in 0..half {
            let freq = (theta as f64).powf(-2.0 * i as f64 / dim as f64);
            let (sin, cos) = (pos as f64 * freq).sin_cos();
            let (a, b) = (head[i] as f64, head[i + half] as f64);
            head[i] = (a * cos - b * sin) as f32;
            head[i + half] = (b * cos + a * sin) as f32;
        }
    }
}

/// Causal attention of one query head `q` over the cached keys and values of its key/value head
/// (`keys[t]`, `values[t]` for every position so far).
pub fn attend(q: &[f32], keys: &[&[f32]], values: &[&[f32]]) -> Vec<f32> {
    let scale = 1.0 / (q.len() as f32).sqrt();
    let scores: Vec<f32> = keys
        .iter()
        .map(|k| k.iter().zip(q).map(|(a, b)| a * b).sum::<f32>() * scale)
        .collect();
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let weights: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
    let total: f32 = weights.iter().sum();
    let mut out = vec![0.0; q.len()];
    for (w, v) in weights.iter().zip(values) {
        out.iter_mut()
            .zip(*v)
            .for_each(|(o, v)| *o += w / total * v);
    }
    out
}

pub fn add_into(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matvec_multiplies_rows_and_adds_the_bias() {
        let w = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        assert_eq!(matvec(&w, &[1.0, 0.0, -1.0], None), vec![-2.0, -2.0]);
        assert_eq!(
            matvec(&w, &[1.0, 1.0, 1.0], Some(&[0.5, -1.0])),
            vec![6.5, 14.0]
        );
    }

    #[test]
    fn rope_at_position_zero_is_the_identity_and_keeps_the_norm() {
        let x = vec![0.3, -1.2, 0.7, 2.0, 0.1, -0.4, 1.5, 0.9];
        let mut y = x.clone();
        rope(&mut y, 4, 0, 10000.0);
        assert_eq!(x, y);
        rope(&mut y, 4, 17, 10000.0);
        let norm = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
        assert!((norm(&x[..4]) - norm(&y[..4])).abs() < 1e-5);
        assert!((norm(&x[4..]) - norm(&y[4..])).abs() < 1e-5);
        assert_ne!(x, y);
    }

    #[test]
    fn attention_over_one_position_returns_its_value() {
        let k: &[f32] = &[1.0, 2.0];
        let v: &[f32] = &[3.0, -4.0];
        assert_eq!(attend(&[0.5, 0.5], &[k], &[v]), vec![3.0, -4.0]);
        // Two equal keys: the mean of the values.
        let v2: &[f32] = &[1.0, 0.0];
        assert_eq!(attend(&[0.5, 0.5], &[k, k], &[v, v2]), vec![2.0, -2.0]);
    }
}

//! `fusionllm bench --compress`: how fast top-k selection and encoding run on f32 tensors of 1 MB
//! to 256 MB, against a plain memory copy of the same tensor on this machine; how much each codec
//! shrinks a tensor; and how far sampled (approximate) top-k selection is from the exact one.

use anyhow::{Context, Result};
use fusion_compress::{compressor, decode, select, wire, Codec, Selection, ValueType};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};
use serde::Serialize;
use std::path::Path;
use std::time::Instant;

/// Density of the top-k rows of the throughput table.
const DENSITY: f64 = 0.01;

#[derive(Serialize)]
struct SpeedRow {
    megabytes: usize,
    memcpy_gbs: f64,
    approx_topk_encode_gbs: f64,
    approx_ratio_to_memcpy: f64,
    exact_topk_encode_gbs: f64,
    exact_ratio_to_memcpy: f64,
    decode_gbs: f64,
}

#[derive(Serialize)]
struct SizeRow {
    codec: String,
    bytes: usize,
    ratio_to_dense: f64,
    relative_error: f64,
    /// Dense f32 bytes compressed per second (selection included), best of 5.
    encode_gbs: f64,
    /// Dense f32 bytes restored per second, best of 5.
    decode_gbs: f64,
}

#[derive(Serialize)]
struct SelectionRow {
    density: f64,
    kept_over_k: f64,
    recall: f64,
    energy_over_exact: f64,
}

#[derive(Serialize)]
struct Report {
    density: f64,
    speed: Vec<SpeedRow>,
    sizes: Vec<SizeRow>,
    selection: Vec<SelectionRow>,
}

/// Gaussian values with a few large outliers, like activations and gradients.
fn tensor(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let normal = Normal::new(0.0f32, 1.0).unwrap_or_else(|_| unreachable!("valid parameters"));
    (0..n)
        .map(|i| {
            let v = normal.sample(&mut rng);
            if i % 997 == 0 {
                8.0 * v
            } else {
                v
            }
        })
        .collect()
}

/// Best of `reps` runs of `f` (given the run's number), in seconds.
fn best<T>(reps: usize, mut f: impl FnMut(usize) -> T) -> (f64, T) {
    let mut out = None;
    let mut t = f64::INFINITY;
    for rep in 0..reps.max(1) {
        let t0 = Instant::now();
        let r = f(rep);
        t = t.min(t0.elapsed().as_secs_f64());
        out = Some(r);
    }
    (t, out.unwrap_or_else(|| unreachable!("at least one run")))
}

fn gbs(bytes: usize, s: f64) -> f64 {
    bytes as f64 / s / 1e9
}

/// Distinct tensors the repetitions of a small size cycle through. Repeating one small tensor
/// lets the branch predictor learn where its largest values lie, which no real stream of
/// activations allows (it nearly doubled the 1 MB speed of a pass with a branch per run of 64 values).
fn copies(mb: usize) -> usize {
    if mb <= 16 {
        4
    } else {
        1
    }
}

fn speed(mb: usize, reps: usize) -> Result<SpeedRow> {
    let n = mb * (1 << 20) / 4;
    let xs: Vec<Vec<f32>> = (0..copies(mb))
        .map(|c| tensor(n, (mb * 16 + c) as u64))
        .collect();
    let x = |rep: usize| &xs[rep % xs.len()];
    let bytes = 4 * n;
    let mut dst = vec![0.0f32; n];
    let (copy, _) = best(reps, |r| dst.copy_from_slice(x(r)));
    std::hint::black_box(&dst);
    drop(dst);
    let k = (DENSITY * n as f64) as usize;
    // What the top-k compressor does: sampled selection that picks the values up as it goes.
    let (approx, msg) = best(reps, |r| {
        let (idx, vals) = select::top_k_with_values(x(r), k, Selection::Approx, r as u64);
        wire::encode_sparse_values(n, &idx, &vals, ValueType::F32)
    });
    let (exact, _) = best(reps, |r| {
        let idx = select::exact(x(r), k);
        wire::encode_sparse(x(r), &idx, ValueType::F32)
    });
    let (dec, d) = best(reps, |_| decode(&msg, n));
    d.context("decoding our own message")?;
    Ok(SpeedRow {
        megabytes: mb,
        memcpy_gbs: gbs(bytes, copy),
        approx_topk_encode_gbs: gbs(bytes, approx),
        approx_ratio_to_memcpy: copy / approx,
        exact_topk_encode_gbs: gbs(bytes, exact),
        exact_ratio_to_memcpy: copy / exact,
        decode_gbs: gbs(bytes, dec),
    })
}

fn sizes() -> Result<Vec<SizeRow>> {
    let n = 4 << 20; // 16 MB
    let x = tensor(n, 99);
    let norm = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
    let codecs = [
        ("none", Codec::None, ValueType::F32),
        ("fp16", Codec::Fp16, ValueType::F32),
        ("bf16", Codec::Bf16, ValueType::F32),
        ("int8/256", Codec::Int8 { block: 256 }, ValueType::F32),
        ("topk 10%", Codec::TopK { density: 0.1 }, ValueType::F32),
        ("topk 1%", Codec::TopK { density: 0.01 }, ValueType::F32),
        (
            "topk 1%, f16 values",
            Codec::TopK { density: 0.01 },
            ValueType::F16,
        ),
        (
            "topk 1%, i8 values",
            Codec::TopK { density: 0.01 },
            ValueType::I8,
        ),
        (
            "topk 50%, f16 values",
            Codec::TopK { density: 0.5 },
            ValueType::F16,
        ),
        ("topk 0.1%", Codec::TopK { density: 0.001 }, ValueType::F32),
        (
            "randomk 1%",
            Codec::RandomK { density: 0.01 },
            ValueType::F32,
        ),
    ];
    let mut rows = Vec::new();
    for (name, codec, values) in codecs {
        let mut c = compressor(codec, values, Selection::Approx, 7);
        let (enc, m) = best(5, |_| c.compress(&x));
        let (dec, d) = best(5, |_| decode(&m, n));
        let d = d.context("decoding our own message")?;
        let err = x
            .iter()
            .zip(&d)
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum::<f64>()
            .sqrt()
            / norm;
        rows.push(SizeRow {
            codec: name.into(),
            bytes: m.len(),
            ratio_to_dense: m.len() as f64 / (4 * n) as f64,
            relative_error: err,
            encode_gbs: gbs(4 * n, enc),
            decode_gbs: gbs(4 * n, dec),
        });
    }
    Ok(rows)
}

fn selection() -> Vec<SelectionRow> {
    let n = 16 << 20;
    let x = tensor(n, 5);
    [0.001, 0.01, 0.1]
        .into_iter()
        .map(|density| {
            let k = (density * n as f64) as usize;
            let e = select::exact(&x, k);
            let mut trials = Vec::new();
            for seed in 0..5 {
                trials.push(select::approx(&x, k, seed));
            }
            let energy = |idx: &[u32]| -> f64 {
                idx.iter()
                    .map(|&i| (x[i as usize] as f64).powi(2))
                    .sum::<f64>()
            };
            let exact_set: std::collections::HashSet<u32> = e.iter().copied().collect();
            let t = trials.len() as f64;
            SelectionRow {
                density,
                kept_over_k: trials
                    .iter()
                    .map(|a| a.len() as f64 / k as f64)
                    .sum::<f64>()
                    / t,
                recall: trials
                    .iter()
                    .map(|a| a.iter().filter(|i| exact_set.contains(i)).count() as f64 / k as f64)
                    .sum::<f64>()
                    / t,
                energy_over_exact: trials.iter().map(|a| energy(a)).sum::<f64>() / t / energy(&e),
            }
        })
        .collect()
}

pub fn run(reps: usize, json: Option<&Path>) -> Result<()> {
    let mut speed_rows = Vec::new();
    println!(
        "top-k ({}%) selection + encoding on f32 tensors, best of {reps} (of 256 MB / size for \
         smaller tensors, whose sub-millisecond timings are noisy; up to 16 MB the runs cycle \
         through 4 tensors), one thread:",
        100.0 * DENSITY
    );
    println!(
        "{:>7} {:>11} {:>16} {:>8} {:>16} {:>8} {:>11}",
        "MB", "memcpy", "approx+encode", "ratio", "exact+encode", "ratio", "decode"
    );
    for mb in [1, 4, 16, 64, 256] {
        let r = speed(mb, reps.max(256 / mb))?;
        println!(
            "{:>7} {:>7.2} GB/s {:>11.2} GB/s {:>7.0}% {:>11.2} GB/s {:>7.0}% {:>6.2} GB/s",
            r.megabytes,
            r.memcpy_gbs,
            r.approx_topk_encode_gbs,
            100.0 * r.approx_ratio_to_memcpy,
            r.exact_topk_encode_gbs,
            100.0 * r.exact_ratio_to_memcpy,
            r.decode_gbs
        );
        speed_rows.push(r);
    }
    let size_rows = sizes()?;
    println!("\nmessage size, error and speed per codec (16 MB tensor, one thread):");
    for r in &size_rows {
        println!(
            "{:<22} {:>10} bytes {:>8.4} of dense  relative L2 error {:.4}  \
             encode {:>6.2} GB/s  decode {:>6.2} GB/s",
            r.codec, r.bytes, r.ratio_to_dense, r.relative_error, r.encode_gbs, r.decode_gbs
        );
    }
    let sel = selection();
    println!("\nsampled top-k against the exact one (64 MB tensor, 5 seeds):");
    for r in &sel {
        println!(
            "density {:>6.3}: kept {:.4} of k, recall {:.4}, energy {:.4} of the exact set's",
            r.density, r.kept_over_k, r.recall, r.energy_over_exact
        );
    }
    if let Some(path) = json {
        let report = Report {
            density: DENSITY,
            speed: speed_rows,
            sizes: size_rows,
            selection: sel,
        };
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

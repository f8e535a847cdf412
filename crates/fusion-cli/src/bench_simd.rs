//! `fusionllm bench --simd`: the element-wise kernels (softmax cross-entropy over GPT-2's
//! vocabulary, GELU and its gradient, a broadcast add, the fused attention kernel, AdamW) at
//! gpt2-small's sizes, at every instruction-set level this processor has. The levels take
//! turns within each repetition, so a shared machine's drift touches them alike; the best time
//! per level is reported, and every level's output is checked to be the same bits as the
//! baseline's.

use anyhow::{ensure, Context, Result};
use fusion_backend::simd::{self, Level};
use fusion_backend::{Backend, BinaryOp, CandleBackend, UnaryOp};
use fusion_train::{OptimizerConfig, OptimizerState};
use serde::Serialize;
use std::path::Path;
use std::time::Instant;

type T = <CandleBackend as Backend>::Tensor;

#[derive(Serialize)]
struct LevelTime {
    level: &'static str,
    ms: f64,
    speedup: f64,
}

#[derive(Serialize)]
struct KernelRow {
    kernel: String,
    shape: String,
    times: Vec<LevelTime>,
    same_bits: bool,
}

#[derive(Serialize)]
struct SimdReport {
    supported: &'static str,
    threads: usize,
    reps: usize,
    kernels: Vec<KernelRow>,
}

/// A kernel: runs once for the level in slot `i` of the levels measured and returns its outputs
/// (timed); their values are read afterwards (untimed) and, from the warm-up round, compared
/// across levels.
type Kernel<'a> = Box<dyn FnMut(usize) -> Result<Outputs> + 'a>;

/// What a kernel produced: tensors, or host values already.
enum Outputs {
    Tensors(Vec<T>),
    Host(Vec<f32>),
}

impl Outputs {
    fn values(self, b: &CandleBackend) -> Result<Vec<f32>> {
        match self {
            Outputs::Tensors(ts) => {
                let mut out = Vec::new();
                for t in &ts {
                    out.extend(b.to_vec(t)?);
                }
                Ok(out)
            }
            Outputs::Host(v) => Ok(v),
        }
    }
}

fn tensor(b: &CandleBackend, shape: &[usize], seed: usize) -> Result<T> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| (((i + seed) * 2_654_435_761) % 1000) as f32 / 250.0 - 2.0)
        .collect();
    Ok(b.upload(v, shape)?)
}

/// Times `kernel` at every level in `levels`, the levels taking turns in each of `reps` rounds
/// after a warm-up round; the best time per level, and whether every level's output has the
/// first level's bits.
fn measure(
    b: &CandleBackend,
    levels: &[Level],
    reps: usize,
    kernel: &mut Kernel,
) -> Result<(Vec<f64>, bool)> {
    let mut best = vec![f64::MAX; levels.len()];
    let mut first: Option<Vec<u32>> = None;
    let mut same = true;
    for round in 0..=reps {
        for (i, &l) in levels.iter().enumerate() {
            simd::force(Some(l));
            let t0 = Instant::now();
            let out = kernel(i);
            let secs = t0.elapsed().as_secs_f64();
            simd::force(None);
            let out = out?;
            if round > 0 {
                best[i] = best[i].min(secs);
                continue;
            }
            let bits: Vec<u32> = out.values(b)?.iter().map(|x| x.to_bits()).collect();
            match &first {
                None => first = Some(bits),
                Some(f) => same &= *f == bits,
            }
        }
    }
    Ok((best, same))
}

fn kernels(b: &CandleBackend) -> Result<Vec<(&'static str, String, Kernel<'_>)>> {
    let (rows, vocab, hidden) = (1024usize, 50257usize, 3072usize);
    let logits = tensor(b, &[rows, vocab], 1)?;
    let targets: Vec<u32> = (0..rows as u32)
        .map(|i| (i * 7919) % vocab as u32)
        .collect();
    let act = tensor(b, &[4, 256, hidden], 2)?;
    let (x, bias) = (tensor(b, &[4, 256, 768], 3)?, tensor(b, &[1, 1, 768], 4)?);
    let heads = [48usize, 256, 64];
    let (q, k, v, dy) = (
        tensor(b, &heads, 5)?,
        tensor(b, &heads, 6)?,
        tensor(b, &heads, 7)?,
        tensor(b, &heads, 8)?,
    );
    let xent: Kernel = Box::new(move |_| {
        let none = || anyhow::anyhow!("the candle backend has a fused cross-entropy");
        let loss = b.cross_entropy_rows(&logits, &targets)?.ok_or_else(none)?;
        let g = b.cross_entropy_rows_backward(&logits, &targets, 1.0 / rows as f64)?;
        Ok(Outputs::Tensors(vec![loss, g.ok_or_else(none)?]))
    });
    let gelu: Kernel = Box::new(move |_| {
        let (y, d) = (
            b.unary(UnaryOp::Gelu, &act)?,
            b.unary(UnaryOp::GeluGrad, &act)?,
        );
        Ok(Outputs::Tensors(vec![y, d]))
    });
    let add: Kernel = Box::new(move |_| {
        Ok(Outputs::Tensors(vec![b.binary(
            BinaryOp::Add,
            &x,
            &bias,
        )?]))
    });
    let attention: Kernel = Box::new(move |_| {
        let none = || anyhow::anyhow!("the candle backend has a fused attention kernel");
        let (y, lse) = b.causal_attention(&q, &k, &v, 0.125)?.ok_or_else(none)?;
        let g = b.causal_attention_backward(&q, &k, &v, &y, &lse, &dy, 0.125)?;
        let [dq, dk, dv] = g.ok_or_else(none)?;
        Ok(Outputs::Tensors(vec![y, dq, dk, dv]))
    });
    Ok(vec![
        ("cross-entropy fwd+bwd", format!("[{rows}, {vocab}]"), xent),
        ("GELU and its gradient", format!("[4, 256, {hidden}]"), gelu),
        ("add, row broadcast", "[4, 256, 768] + [768]".into(), add),
        ("fused attention fwd+bwd", format!("{heads:?}"), attention),
        (
            "AdamW update",
            "124.4 M parameters".into(),
            adamw(124_439_808),
        ),
        (
            "gradient norm (sum of squares)",
            "124.4 M parameters".into(),
            square_sums(124_439_808),
        ),
    ])
}

/// The sum of squares the global gradient norm takes over `n` values in tensors of 2.36 M;
/// its `f64` bits are compared as two `f32` words.
fn square_sums(n: usize) -> Kernel<'static> {
    let piece = 2_359_296usize;
    let grads: Vec<Vec<f32>> = (0..n.div_ceil(piece))
        .map(|i| {
            let s = piece.min(n - i * piece);
            (0..s).map(|j| ((i + j) % 97) as f32 * 1e-3).collect()
        })
        .collect();
    Box::new(move |_| {
        let sum = grads
            .iter()
            .fold(0.0, |a, g| a + fusion_train::square_sum(g));
        let bits = sum.to_bits();
        let words = [bits as u32, (bits >> 32) as u32];
        Ok(Outputs::Host(
            words.iter().map(|&w| f32::from_bits(w)).collect(),
        ))
    })
}

/// AdamW updates of `n` parameters in tensors of 2.36 M (an MLP matrix of gpt2-small); each
/// level keeps its own state (about 1.5 GB at gpt2-small's size), whose first update, from the
/// same initial state at every level, is the one compared.
fn adamw(n: usize) -> Kernel<'static> {
    let piece = 2_359_296usize;
    let pieces: Vec<usize> = (0..n.div_ceil(piece))
        .map(|i| piece.min(n - i * piece))
        .collect();
    let init = |seed: usize| -> Vec<Vec<f32>> {
        pieces
            .iter()
            .map(|&s| (0..s).map(|i| ((i + seed) % 97) as f32 * 1e-3).collect())
            .collect()
    };
    let (params0, grads) = (init(1), init(2));
    let grads: Vec<Option<Vec<f32>>> = grads.into_iter().map(Some).collect();
    let cfg = OptimizerConfig::default();
    let decay = vec![true; pieces.len()];
    let sizes: Vec<Option<usize>> = pieces.iter().map(|&s| Some(s)).collect();
    // One state per level: each level's first update (the warm-up round) starts from the same
    // state, and those are compared; later ones go on from there.
    let mut states: Vec<Option<(Vec<Vec<f32>>, OptimizerState)>> = Vec::new();
    Box::new(move |slot| {
        if states.len() <= slot {
            states.resize_with(slot + 1, || None);
        }
        let (params, state) = states[slot]
            .get_or_insert_with(|| (params0.clone(), OptimizerState::new(&cfg, &sizes)));
        state.update(&cfg, params, &grads, &decay, 1e-3);
        let first = state.step == 1;
        Ok(Outputs::Host(if first {
            params.iter().flatten().copied().collect()
        } else {
            Vec::new()
        }))
    })
}

pub fn run(reps: usize, json: Option<&Path>) -> Result<()> {
    let reps = reps.max(1);
    let b = CandleBackend::cpu();
    let best = simd::supported();
    let levels: Vec<Level> = Level::ALL.into_iter().filter(|&l| l <= best).collect();
    let threads = rayon::current_num_threads();
    println!(
        "element-wise kernels per instruction-set level ({} supported, {threads} threads, best of {reps})",
        best.name()
    );
    print!("{:<26} {:>24}", "kernel", "shape");
    for l in &levels {
        print!(" {:>10}", format!("{} ms", l.name()));
    }
    println!(" {:>9} {:>9}", "top/base", "same bits");
    let mut rows = Vec::new();
    for (name, shape, mut kernel) in kernels(&b)? {
        let measured = measure(&b, &levels, reps, &mut kernel);
        let (ms, same) = measured.with_context(|| name.to_string())?;
        let base = ms[0];
        print!("{name:<26} {shape:>24}");
        for t in &ms {
            print!(" {:>10.2}", t * 1e3);
        }
        let top = base / ms[ms.len() - 1];
        println!(" {:>8.2}x {:>9}", top, if same { "yes" } else { "NO" });
        let times = levels
            .iter()
            .zip(&ms)
            .map(|(l, &t)| LevelTime {
                level: l.name(),
                ms: t * 1e3,
                speedup: base / t,
            })
            .collect();
        rows.push(KernelRow {
            kernel: name.into(),
            shape,
            times,
            same_bits: same,
        });
    }
    let report = SimdReport {
        supported: best.name(),
        threads,
        reps,
        kernels: rows,
    };
    if let Some(path) = json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("results written to {}", path.display());
    }
    ensure!(
        report.kernels.iter().all(|k| k.same_bits),
        "an instruction-set level changed a kernel's results"
    );
    Ok(())
}

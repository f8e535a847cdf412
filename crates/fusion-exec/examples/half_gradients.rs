//! Diagnostic: how far each parameter's gradient computed in bf16 or f16 lies from the f32 one,
//! on the CPU and (with `cuda`, built with `--features fusion-backend/cuda`) on GPU 0. Finds
//! which operator loses precision on which device.
//!
//!     cargo run --release -p fusion-exec --example half_gradients -- [MODEL] [BATCH] [SEQ] [cuda]
//!
//! It takes gradients of one batch of random tokens at the seed's initial weights and again
//! after a sign step of 3e-4 (what AdamW's first step does), and prints, per configuration, the
//! global gradient norm and the parameters whose gradient is furthest from the CPU's f32 one
//! (relative L2 distance).

use fusion_backend::{Backend, CandleBackend, Precision};
use fusion_exec::{init_params, Executor, IdTensor, Mode, Value};
use fusion_graph::Graph;
use fusion_models::ModelSpec;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::Arc;

type Grads = Vec<Option<Vec<f32>>>;

/// Backward's seed in f16, divided out again: the loss scale f16 training starts from.
const F16_SCALE: f32 = 32768.0;

fn gradients<B: Backend>(
    b: B,
    g: &Arc<Graph>,
    w: &[Vec<f32>],
    ids: &[u32],
    shape: &[usize],
) -> Grads {
    let exec = Executor::new(b.clone(), g.clone()).expect("executor");
    let params = exec.upload_params(w).expect("upload");
    let (x, y) = (&ids[..ids.len() / 2], &ids[ids.len() / 2..]);
    let feeds = HashMap::from([
        (
            g.inputs[0],
            Value::Ids(IdTensor::new(x.to_vec(), shape.to_vec()).expect("ids")),
        ),
        (
            g.inputs[1],
            Value::Ids(IdTensor::new(y.to_vec(), shape.to_vec()).expect("ids")),
        ),
    ]);
    let pass = exec
        .forward(&params, feeds, Mode::Train, true)
        .expect("forward");
    let scale = match b.precision() {
        Precision::F16 => F16_SCALE,
        _ => 1.0,
    };
    let seed = b.upload(vec![scale], &[1]).expect("seed");
    let grads = exec
        .backward(pass, &params, HashMap::from([(g.outputs[0], seed)]))
        .expect("backward");
    grads
        .params
        .iter()
        .map(|t| {
            let v = b.to_vec(t.as_ref()?).expect("download");
            Some(v.into_iter().map(|x| x / scale).collect())
        })
        .collect()
}

fn norm(v: &[f32]) -> f64 {
    v.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt()
}

fn report(name: &str, g: &Graph, got: &Grads, want: &Grads) {
    let total: f64 = got
        .iter()
        .flatten()
        .map(|v| norm(v).powi(2))
        .sum::<f64>()
        .sqrt();
    let mut rows: Vec<(f64, &str)> = got
        .iter()
        .zip(want)
        .zip(&g.params)
        .filter_map(|((a, b), spec)| {
            let (a, b) = (a.as_ref()?, b.as_ref()?);
            let d: Vec<f32> = a.iter().zip(b).map(|(x, y)| x - y).collect();
            Some((norm(&d) / norm(b).max(1e-30), spec.name.as_str()))
        })
        .collect();
    rows.sort_by(|x, y| y.0.total_cmp(&x.0));
    println!("{name}: gradient norm {total:.5}");
    for (err, p) in rows.iter().take(8) {
        println!("    {err:10.3e}  {p}");
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let model = args.first().map_or("gpt2-small", String::as_str);
    let batch: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(4);
    let seq: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(256);
    let cuda = args.iter().any(|a| a == "cuda");
    let spec = ModelSpec::preset(model).expect("model");
    let g = Arc::new(spec.graph(batch, seq).expect("graph"));
    let vocab = spec.vocab().unwrap_or(256) as u32;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let ids: Vec<u32> = (0..2 * batch * seq)
        .map(|_| rng.random_range(0..vocab))
        .collect();
    let shape = [batch, seq];
    let mut w = init_params(&g, 0);
    for state in ["initial weights", "after a sign step"] {
        println!("== {model}, batch {batch} x {seq}, {state}");
        let want = gradients(CandleBackend::cpu(), &g, &w, &ids, &shape);
        let total: f64 = want.iter().flatten().map(|v| norm(v).powi(2)).sum::<f64>();
        println!("cpu f32: gradient norm {:.5}", total.sqrt());
        let mut configs = vec![("cpu", Precision::Bf16), ("cpu", Precision::F16)];
        if cuda {
            configs.extend([
                ("cuda", Precision::F32),
                ("cuda", Precision::Bf16),
                ("cuda", Precision::F16),
            ]);
        }
        for (dev, p) in configs {
            let b = match dev {
                "cuda" => CandleBackend::cuda(0).expect("GPU 0"),
                _ => CandleBackend::cpu(),
            };
            let b = b.with_precision(p).expect("precision");
            let got = gradients(b, &g, &w, &ids, &shape);
            report(&format!("{dev} {}", p.as_str()), &g, &got, &want);
        }
        for (p, gr) in w.iter_mut().zip(&want) {
            if let Some(gr) = gr {
                p.iter_mut()
                    .zip(gr)
                    .for_each(|(x, d)| *x -= 3e-4 * d.signum());
            }
        }
    }
}

//! Shared harness: random cases, a scalar objective, finite differences.

use fusion_backend::Backend;
use fusion_graph::Op;
use fusion_ops::{backward, forward, IdTensor, Mode, Value};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub enum Input {
    Float(Vec<usize>),
    /// Integer ids below the bound.
    Ids(Vec<usize>, u32),
}

/// One operator instance with its input and parameter shapes; `positive` marks parameters that
/// must stay positive (variances).
pub struct Case {
    pub op: Op,
    pub inputs: Vec<Input>,
    pub params: Vec<Vec<usize>>,
    pub frozen: Vec<usize>,
    pub positive: Vec<usize>,
}

impl Case {
    pub fn new(op: Op, inputs: Vec<Input>, params: Vec<Vec<usize>>) -> Self {
        Case {
            op,
            inputs,
            params,
            frozen: vec![],
            positive: vec![],
        }
    }
}

pub struct Data {
    pub floats: Vec<Option<Vec<f64>>>,
    pub ids: Vec<Option<IdTensor>>,
    pub params: Vec<Vec<f64>>,
}

pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

pub fn random_data(case: &Case, rng: &mut ChaCha8Rng) -> Data {
    let mut floats = Vec::new();
    let mut ids = Vec::new();
    for i in &case.inputs {
        match i {
            Input::Float(s) => {
                floats.push(Some(
                    (0..s.iter().product::<usize>())
                        .map(|_| rng.random_range(-1.0..1.0))
                        .collect(),
                ));
                ids.push(None);
            }
            Input::Ids(s, bound) => {
                floats.push(None);
                let v = (0..s.iter().product::<usize>())
                    .map(|_| rng.random_range(0..*bound))
                    .collect();
                ids.push(Some(IdTensor::new(v, s.clone()).unwrap()));
            }
        }
    }
    let params = case
        .params
        .iter()
        .enumerate()
        .map(|(pi, s)| {
            let n = s.iter().product::<usize>();
            if case.positive.contains(&pi) {
                (0..n).map(|_| rng.random_range(0.5..1.5)).collect()
            } else {
                (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
            }
        })
        .collect();
    Data {
        floats,
        ids,
        params,
    }
}

pub struct Run {
    pub output: Vec<f64>,
    pub out_shape: Vec<usize>,
    pub input_grads: Vec<Option<Vec<f64>>>,
    pub param_grads: Vec<Option<Vec<f64>>>,
}

fn values<B: Backend>(b: &B, case: &Case, d: &Data) -> (Vec<Value<B>>, Vec<B::Tensor>) {
    let vals = case
        .inputs
        .iter()
        .enumerate()
        .map(|(i, inp)| match inp {
            Input::Float(s) => Value::Float(b.upload_f64(d.floats[i].clone().unwrap(), s).unwrap()),
            Input::Ids(..) => Value::Ids(d.ids[i].clone().unwrap()),
        })
        .collect();
    let params = case
        .params
        .iter()
        .zip(&d.params)
        .map(|(s, v)| b.upload_f64(v.clone(), s).unwrap())
        .collect();
    (vals, params)
}

/// Forward, then backward with `dy = r` (the gradient of `sum(output * r)`).
pub fn run<B: Backend>(b: &B, case: &Case, d: &Data, r: Option<&[f64]>) -> Run {
    let (vals, params) = values(b, case, d);
    let vrefs: Vec<&Value<B>> = vals.iter().collect();
    let prefs: Vec<&B::Tensor> = params.iter().collect();
    let f = forward(b, &case.op, &vrefs, &prefs, Mode::Train).unwrap();
    let out_shape = b.shape(&f.output);
    let output = b.to_f64(&f.output).unwrap();
    let (mut input_grads, mut param_grads) = (vec![], vec![]);
    if let Some(r) = r {
        let dy = b.upload_f64(r.to_vec(), &out_shape).unwrap();
        let g = backward(b, &case.op, &vrefs, &prefs, &f.saved, &dy, Mode::Train).unwrap();
        input_grads = g
            .inputs
            .iter()
            .map(|t| t.as_ref().map(|t| b.to_f64(t).unwrap()))
            .collect();
        param_grads = g
            .params
            .iter()
            .map(|t| t.as_ref().map(|t| b.to_f64(t).unwrap()))
            .collect();
    }
    Run {
        output,
        out_shape,
        input_grads,
        param_grads,
    }
}

fn objective<B: Backend>(b: &B, case: &Case, d: &Data, r: &[f64]) -> f64 {
    run(b, case, d, None)
        .output
        .iter()
        .zip(r)
        .map(|(o, r)| o * r)
        .sum()
}

/// Compares the analytic gradient with central differences at up to `samples` random elements of
/// every float input and trainable parameter. Returns the number of elements checked.
pub fn gradcheck<B: Backend>(b: &B, case: &Case, seed: u64) -> usize {
    let mut rng = rng(seed);
    let data = random_data(case, &mut rng);
    let probe = run(b, case, &data, None);
    let r: Vec<f64> = (0..probe.output.len())
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let analytic = run(b, case, &data, Some(&r));
    assert_eq!(analytic.output.len(), probe.output.len());
    let h = 1e-5;
    let samples = 12;
    let mut checked = 0;
    let mut check = |name: String, a: f64, num: f64| {
        let tol = 1e-6 * a.abs().max(num.abs()).max(1.0);
        assert!(
            (a - num).abs() <= tol,
            "{} on {}: {name}: analytic {a} vs numeric {num}",
            case.op.name(),
            b.name()
        );
        checked += 1;
    };
    for i in 0..case.inputs.len() {
        let Some(x) = data.floats[i].clone() else {
            continue;
        };
        let grad = analytic.input_grads[i]
            .clone()
            .expect("float input has a gradient");
        for _ in 0..samples.min(x.len()) {
            let j = rng.random_range(0..x.len());
            let mut dp = Data {
                floats: data.floats.clone(),
                ids: data.ids.clone(),
                params: data.params.clone(),
            };
            dp.floats[i].as_mut().unwrap()[j] = x[j] + h;
            let up = objective(b, case, &dp, &r);
            dp.floats[i].as_mut().unwrap()[j] = x[j] - h;
            let down = objective(b, case, &dp, &r);
            check(format!("input {i}[{j}]"), grad[j], (up - down) / (2.0 * h));
        }
    }
    for p in 0..case.params.len() {
        if case.frozen.contains(&p) {
            continue;
        }
        let x = data.params[p].clone();
        let grad = analytic.param_grads[p]
            .clone()
            .expect("trainable parameter has a gradient");
        for _ in 0..samples.min(x.len()) {
            let j = rng.random_range(0..x.len());
            let mut dp = Data {
                floats: data.floats.clone(),
                ids: data.ids.clone(),
                params: data.params.clone(),
            };
            dp.params[p][j] = x[j] + h;
            let up = objective(b, case, &dp, &r);
            dp.params[p][j] = x[j] - h;
            let down = objective(b, case, &dp, &r);
            check(format!("param {p}[{j}]"), grad[j], (up - down) / (2.0 * h));
        }
    }
    checked
}

/// Runs the case on two backends (the second in f32) and compares outputs and gradients.
pub fn agree<B1: Backend, B2: Backend>(a: &B1, b: &B2, case: &Case, seed: u64, rel: f64) {
    let mut rng = rng(seed);
    let mut data = random_data(case, &mut rng);
    // Round inputs to the second backend's precision so both backends see the same numbers.
    let round = |v: &mut Vec<f64>| {
        let t = b.upload_f64(v.clone(), &[v.len()]).unwrap();
        *v = b.to_f64(&t).unwrap();
    };
    data.floats.iter_mut().flatten().for_each(round);
    data.params.iter_mut().for_each(round);
    let probe = run(a, case, &data, None);
    let mut r: Vec<f64> = (0..probe.output.len())
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    round(&mut r);
    let ra = run(a, case, &data, Some(&r));
    let rb = run(b, case, &data, Some(&r));
    assert_eq!(ra.out_shape, rb.out_shape);
    let close = |what: &str, x: &[f64], y: &[f64]| {
        let scale = x.iter().fold(1.0f64, |m, v| m.max(v.abs()));
        let diff = x
            .iter()
            .zip(y)
            .fold(0.0f64, |m, (p, q)| m.max((p - q).abs()));
        assert!(
            diff <= rel * scale,
            "{}: {what} differs between {} and {}: max diff {diff}, scale {scale}",
            case.op.name(),
            a.name(),
            b.name()
        );
    };
    close("output", &ra.output, &rb.output);
    for (i, (x, y)) in ra.input_grads.iter().zip(&rb.input_grads).enumerate() {
        if let (Some(x), Some(y)) = (x, y) {
            close(&format!("input {i} gradient"), x, y);
        }
    }
    for (i, (x, y)) in ra.param_grads.iter().zip(&rb.param_grads).enumerate() {
        if let (Some(x), Some(y)) = (x, y) {
            close(&format!("param {i} gradient"), x, y);
        }
    }
}

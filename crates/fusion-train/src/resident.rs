//! The optimizer on the compute device: parameters and moments held as backend tensors between
//! steps, so that a step on a GPU moves no weights between host and device. Gradients stay where
//! backward computed them, the global norm crosses to the host as one number per tensor (in one
//! copy), and the clipped AdamW or SGD update runs as the backend's element-wise kernels.
//!
//! It computes the host optimizer's update (`optim.rs`) in the device's arithmetic: the same
//! formulas, with the clipping scale folded into the moment updates, so results agree to the
//! rounding of `f32` kernels rather than bit for bit.
//!
//! A backend that computes in bf16 or f16 gets `f32` master weights beside its 16-bit compute
//! copies: the update runs on the masters (with the gradients, which the backend sums in `f32`)
//! and each updated parameter is cast once to the compute precision for the next step. In f16
//! the loss scale is divided out in the same folded factor as clipping, and a step whose
//! gradients overflowed is skipped without touching the state, as on the host.

use crate::config::OptimizerConfig;
use crate::error::{Result, TrainError};
use crate::optim::OptimizerState;
use crate::scaler::{LossScaler, Verdict};
use fusion_backend::{Backend, BinaryOp, UnaryOp};
use fusion_graph::Graph;

/// Parameters (and buffers) in graph order with their optimizer moments, on the device.
pub(crate) struct Resident<B: Backend> {
    /// What the executor computes with: the parameters in the compute precision.
    pub params: Vec<B::Tensor>,
    /// `f32` master copies where the compute precision is 16-bit (None in `f32`, where `params`
    /// are the masters). Only parameters with moments are read from here; buffers stay in
    /// `params`, where the forward pass updates them.
    master: Option<Vec<B::Tensor>>,
    first: Vec<Option<B::Tensor>>,
    second: Vec<Option<B::Tensor>>,
    step: u64,
}

/// A moment vector of the host state as a device tensor (at `f32` or better whatever the compute
/// precision), or None where the parameter has none.
fn upload_moment<B: Backend>(b: &B, host: &[f32], shape: &[usize]) -> Result<Option<B::Tensor>> {
    if host.is_empty() {
        return Ok(None);
    }
    Ok(Some(b.upload_wide(host.to_vec(), shape)?))
}

fn download_moment<B: Backend>(b: &B, t: &Option<B::Tensor>) -> Result<Vec<f32>> {
    match t {
        Some(t) => Ok(b.to_vec(t)?),
        None => Ok(Vec::new()),
    }
}

impl<B: Backend> Resident<B> {
    /// Uploads the host master state: `params` are `host` uploaded by the executor, which
    /// checked them against the graph; a 16-bit backend also gets `host` at `f32`.
    pub fn upload(
        b: &B,
        graph: &Graph,
        host: &[Vec<f32>],
        params: Vec<B::Tensor>,
        opt: &OptimizerState,
    ) -> Result<Self> {
        let n = graph.params.len();
        if opt.first.len() != n || opt.second.len() != n {
            return Err(TrainError::Config(format!(
                "optimizer state covers {} of the graph's {n} parameters",
                opt.first.len()
            )));
        }
        let mut first = Vec::with_capacity(n);
        let mut second = Vec::with_capacity(n);
        for (i, spec) in graph.params.iter().enumerate() {
            first.push(upload_moment(b, &opt.first[i], &spec.shape)?);
            second.push(upload_moment(b, &opt.second[i], &spec.shape)?);
        }
        // Buffers (no moments) are read from `params`: their slot holds the same tensor.
        let master = b
            .precision()
            .is_half()
            .then(|| {
                (0..n)
                    .map(|i| match &first[i] {
                        Some(_) => b.upload_wide(host[i].clone(), &graph.params[i].shape),
                        None => Ok(params[i].clone()),
                    })
                    .collect::<std::result::Result<Vec<_>, _>>()
            })
            .transpose()?;
        Ok(Resident {
            params,
            master,
            first,
            second,
            step: opt.step,
        })
    }

    /// The master copy of parameter `i`: where the update reads and writes it.
    fn master(&self, i: usize) -> &B::Tensor {
        self.master.as_ref().map_or(&self.params[i], |m| &m[i])
    }

    /// Parameter `i` as the host keeps it: the master of a trained parameter, and the compute
    /// copy of a buffer (which the forward pass updates there).
    fn kept(&self, i: usize) -> &B::Tensor {
        match self.first.get(i) {
            Some(Some(_)) => self.master(i),
            _ => &self.params[i],
        }
    }

    /// Stores an updated master, and its compute copy where they differ.
    fn set_master(&mut self, b: &B, i: usize, p: B::Tensor) -> Result<()> {
        match &mut self.master {
            Some(m) => {
                self.params[i] = b.to_compute(&p)?;
                m[i] = p;
            }
            None => self.params[i] = p,
        }
        Ok(())
    }

    /// Copies the state to the host: the parameters and the optimizer state.
    pub fn download(&self, b: &B) -> Result<(Vec<Vec<f32>>, OptimizerState)> {
        let params = (0..self.params.len())
            .map(|i| b.to_vec(self.kept(i)))
            .collect::<std::result::Result<_, _>>()?;
        let first = self
            .first
            .iter()
            .map(|t| download_moment(b, t))
            .collect::<Result<_>>()?;
        let second = self
            .second
            .iter()
            .map(|t| download_moment(b, t))
            .collect::<Result<_>>()?;
        let opt = OptimizerState {
            step: self.step,
            first,
            second,
        };
        Ok((params, opt))
    }

    /// Clips `grads` to `clip` in global L2 norm and applies one update at learning rate `lr`.
    /// Returns the norm before clipping. Parameters without a gradient or moments are left as
    /// they are, as on the host.
    ///
    /// With a `scaler` (f16) the gradients are loss-scaled: the scaler judges them by whether
    /// their norm is finite, and an overflowed step returns `None` with nothing changed.
    ///
    /// An error before the first parameter changes (the norm) leaves the state as it was; one
    /// after (the device out of memory) leaves it part updated, which the caller must drop.
    #[allow(clippy::too_many_arguments)]
    pub fn update(
        &mut self,
        b: &B,
        cfg: &OptimizerConfig,
        grads: Vec<Option<B::Tensor>>,
        decay: &[bool],
        lr: f32,
        clip: Option<f32>,
        scaler: Option<&mut LossScaler>,
    ) -> std::result::Result<Option<f32>, UpdateError> {
        let grads = widened(b, grads).map_err(UpdateError::Untouched)?;
        let scaled = global_norm(b, &grads).map_err(UpdateError::Untouched)?;
        let loss_scale = match scaler.map(|s| s.judge(scaled.is_finite())) {
            Some(Verdict::Skip) => return Ok(None),
            Some(Verdict::Apply { scale }) => scale as f64,
            None => 1.0,
        };
        let norm = (scaled as f64 / loss_scale) as f32;
        let clip_scale = match clip {
            Some(max) if norm > max && norm.is_finite() => max as f64 / (norm as f64 + 1e-6),
            _ => 1.0,
        };
        self.step += 1;
        let hyper = Step {
            lr: lr as f64,
            scale: clip_scale / loss_scale,
            t: self.step as i32,
        };
        self.apply(b, cfg, grads, decay, &hyper)
            .map_err(UpdateError::PartlyApplied)?;
        Ok(Some(norm))
    }

    fn apply(
        &mut self,
        b: &B,
        cfg: &OptimizerConfig,
        grads: Vec<Option<B::Tensor>>,
        decay: &[bool],
        hyper: &Step,
    ) -> Result<()> {
        for (i, g) in grads.into_iter().enumerate() {
            let Some(g) = g else { continue };
            if self.first.get(i).is_none_or(Option::is_none) {
                continue;
            }
            let adam = matches!(cfg, OptimizerConfig::AdamW { .. });
            if adam && self.second.get(i).is_none_or(Option::is_none) {
                return Err(missing(i));
            }
            let Some(m) = self.first[i].take() else {
                continue;
            };
            let wd_on = decay.get(i).copied().unwrap_or(false);
            let v = if adam {
                Some(self.second[i].take().ok_or_else(|| missing(i))?)
            } else {
                None
            };
            let p = self.master(i);
            let (p, m, v) = match (cfg, v) {
                (OptimizerConfig::AdamW { .. }, Some(v)) => {
                    let (p, m, v) = adamw(b, cfg, wd_on, hyper, p, m, v, &g)?;
                    (p, m, Some(v))
                }
                _ => {
                    let (p, m) = sgd(b, cfg, wd_on, hyper, p, &m, &g)?;
                    (p, m, None)
                }
            };
            self.set_master(b, i, p)?;
            self.first[i] = Some(m);
            self.second[i] = v;
        }
        Ok(())
    }
}

/// How an update failed: before anything changed, or part way through.
pub(crate) enum UpdateError {
    Untouched(TrainError),
    PartlyApplied(TrainError),
}

fn missing(i: usize) -> TrainError {
    TrainError::Config(format!("parameter {i} has no second moment on the device"))
}

/// The step's learning rate, clipping scale and (1-based) step count.
struct Step {
    lr: f64,
    scale: f64,
    t: i32,
}

/// The gradients at `f32` or better (a 16-bit backend's sums already are).
fn widened<B: Backend>(b: &B, grads: Vec<Option<B::Tensor>>) -> Result<Vec<Option<B::Tensor>>> {
    grads
        .into_iter()
        .map(|g| g.map(|g| b.widen(&g)).transpose().map_err(Into::into))
        .collect()
}

/// The global L2 norm of the gradients: each tensor's sum of squares on the device, the sums
/// copied to the host together and added in `f64`.
fn global_norm<B: Backend>(b: &B, grads: &[Option<B::Tensor>]) -> Result<f32> {
    let mut sums = Vec::new();
    for g in grads.iter().flatten() {
        let rank = b.shape(g).len();
        let sq = b.unary(UnaryOp::Square, g)?;
        let all: Vec<usize> = (0..rank).collect();
        let s = b.sum_keepdim(&sq, &all)?;
        sums.push(b.reshape(&s, &[1])?);
    }
    if sums.is_empty() {
        return Ok(0.0);
    }
    let refs: Vec<&B::Tensor> = sums.iter().collect();
    let host = b.to_vec(&b.cat(&refs, 0)?)?;
    Ok(host.iter().map(|&x| x as f64).sum::<f64>().sqrt() as f32)
}

fn sum<B: Backend>(b: &B, x: &B::Tensor, y: &B::Tensor) -> Result<B::Tensor> {
    Ok(b.binary(BinaryOp::Add, x, y)?)
}

/// AdamW with decoupled weight decay: `m ← β1·m + (1-β1)·s·g`, `v ← β2·v + (1-β2)·(s·g)²`,
/// `p ← p·(1 - lr·wd) - lr·(m/c1) / (√(v/c2) + ε)`, with bias corrections `c = 1 - β^t`.
#[allow(clippy::too_many_arguments)]
fn adamw<B: Backend>(
    b: &B,
    cfg: &OptimizerConfig,
    decay: bool,
    h: &Step,
    p: &B::Tensor,
    m: B::Tensor,
    v: B::Tensor,
    g: &B::Tensor,
) -> Result<(B::Tensor, B::Tensor, B::Tensor)> {
    let OptimizerConfig::AdamW {
        beta1,
        beta2,
        eps,
        weight_decay,
    } = *cfg
    else {
        return Err(TrainError::Config(
            "AdamW update for another optimizer".into(),
        ));
    };
    let (b1, b2) = (beta1 as f64, beta2 as f64);
    // Each temporary is the size of the parameter: the blocks free them as soon as they are
    // used, so that at most three live beside the new moments (the largest, the GPT-2 token
    // embedding, is 154 MB).
    let m = {
        let old = b.affine(&m, b1, 0.0)?;
        drop(m);
        sum(b, &old, &b.affine(g, (1.0 - b1) * h.scale, 0.0)?)?
    };
    let v = {
        let g2 = b.unary(UnaryOp::Square, g)?;
        let new = b.affine(&g2, (1.0 - b2) * h.scale * h.scale, 0.0)?;
        drop(g2);
        let old = b.affine(&v, b2, 0.0)?;
        drop(v);
        sum(b, &old, &new)?
    };
    let c1 = 1.0 - b1.powi(h.t);
    let c2 = 1.0 - b2.powi(h.t);
    let step = {
        let denom = b.affine(&b.unary(UnaryOp::Sqrt, &v)?, 1.0 / c2.sqrt(), eps as f64)?;
        let ratio = b.binary(BinaryOp::Div, &m, &denom)?;
        drop(denom);
        b.affine(&ratio, h.lr / c1, 0.0)?
    };
    let wd = if decay { weight_decay as f64 } else { 0.0 };
    let kept = b.affine(p, 1.0 - h.lr * wd, 0.0)?;
    let p = b.binary(BinaryOp::Sub, &kept, &step)?;
    Ok((p, m, v))
}

/// SGD with heavy-ball momentum and L2 weight decay: `m ← μ·m + s·g + wd·p`, `p ← p - lr·m`.
fn sgd<B: Backend>(
    b: &B,
    cfg: &OptimizerConfig,
    decay: bool,
    h: &Step,
    p: &B::Tensor,
    m: &B::Tensor,
    g: &B::Tensor,
) -> Result<(B::Tensor, B::Tensor)> {
    let OptimizerConfig::Sgd {
        momentum,
        weight_decay,
    } = *cfg
    else {
        return Err(TrainError::Config(
            "SGD update for another optimizer".into(),
        ));
    };
    let mut m = sum(
        b,
        &b.affine(m, momentum as f64, 0.0)?,
        &b.affine(g, h.scale, 0.0)?,
    )?;
    if decay && weight_decay > 0.0 {
        m = sum(b, &m, &b.affine(p, weight_decay as f64, 0.0)?)?;
    }
    let p = b.binary(BinaryOp::Sub, p, &b.affine(&m, h.lr, 0.0)?)?;
    Ok((p, m))
}

#[cfg(test)]
mod tests {
    use super::*;
    use fusion_backend::{CandleBackend, Precision};

    /// Three parameters: a matrix with weight decay, a vector without, and one with no gradient
    /// this step; plus a buffer without moments.
    /// Host parameters, optimizer state and gradients.
    type HostState = (Vec<Vec<f32>>, OptimizerState, Vec<Option<Vec<f32>>>);

    fn state(cfg: &OptimizerConfig) -> HostState {
        let params = vec![
            vec![0.5, -1.0, 2.0, 0.25],
            vec![1.5, -0.5],
            vec![3.0],
            vec![7.0, 8.0],
        ];
        let sizes = [Some(4), Some(2), Some(1), None];
        let mut opt = OptimizerState::new(cfg, &sizes);
        opt.first[0] = vec![0.1, -0.2, 0.05, 0.0];
        if !opt.second[0].is_empty() {
            opt.second[0] = vec![0.01, 0.04, 0.002, 0.0];
        }
        opt.step = 3;
        let grads = vec![
            Some(vec![4.0, -3.0, 0.5, 1e-4]),
            Some(vec![-2.0, 6.0]),
            None,
            None,
        ];
        (params, opt, grads)
    }

    fn compare(cfg: OptimizerConfig) {
        compare_in(cfg, Precision::F32);
    }

    /// The device update of a backend computing in `precision` against the host's: in f16 the
    /// gradients come loss-scaled and the scaler's factor is divided out.
    fn compare_in(cfg: OptimizerConfig, precision: Precision) {
        let b = CandleBackend::cpu()
            .with_precision(precision)
            .expect("backend");
        let loss_scale = match precision {
            Precision::F16 => 1024.0,
            _ => 1.0,
        };
        let shapes: [&[usize]; 4] = [&[2, 2], &[2], &[1], &[2]];
        let decay = [true, false, true, false];
        let (mut host, mut host_opt, grads) = state(&cfg);
        let mut clipped = grads.clone();
        let norm = crate::optim::clip_global_norm(&mut clipped, Some(1.0));
        assert!(norm > 1.0, "the step must clip");
        host_opt.update(&cfg, &mut host, &clipped, &decay, 0.1);

        let (params, opt, grads) = state(&cfg);
        let masters: Vec<B2> = params
            .iter()
            .zip(shapes)
            .map(|(p, s)| b.upload_wide(p.clone(), s).expect("upload"))
            .collect();
        let compute = masters
            .iter()
            .map(|t| b.to_compute(t).expect("cast"))
            .collect();
        let mut first = Vec::new();
        let mut second = Vec::new();
        for (i, s) in shapes.iter().enumerate() {
            first.push(upload_moment(&b, &opt.first[i], s).expect("m"));
            second.push(upload_moment(&b, &opt.second[i], s).expect("v"));
        }
        let mut r = Resident {
            params: compute,
            master: precision.is_half().then_some(masters),
            first,
            second,
            step: opt.step,
        };
        // A 16-bit backend sums its gradients in f32.
        let g = grads
            .iter()
            .zip(shapes)
            .map(|(g, s)| {
                let scaled = g.as_ref()?.iter().map(|x| x * loss_scale).collect();
                Some(b.upload_wide(scaled, s).expect("g"))
            })
            .collect();
        let mut scaler = LossScaler {
            scale: loss_scale,
            ..LossScaler::default()
        };
        let scaler = (precision == Precision::F16).then_some(&mut scaler);
        let Ok(Some(device_norm)) = r.update(&b, &cfg, g, &decay, 0.1, Some(1.0), scaler) else {
            panic!("the device update failed");
        };
        assert!((device_norm - norm).abs() < 1e-5 * norm);
        let (device, device_opt) = r.download(&b).expect("download");
        assert_eq!(device_opt.step, host_opt.step);
        for (i, (d, h)) in device.iter().zip(&host).enumerate() {
            for (x, y) in d.iter().zip(h) {
                assert!(
                    (x - y).abs() <= 1e-6 * y.abs().max(1.0),
                    "param {i}: {d:?} vs {h:?}"
                );
            }
        }
        for (d, h) in device_opt.first.iter().zip(&host_opt.first) {
            for (x, y) in d.iter().zip(h) {
                assert!((x - y).abs() <= 1e-6 * y.abs().max(1.0), "{d:?} vs {h:?}");
            }
        }
        assert_eq!(device[2], vec![3.0], "a parameter without a gradient stays");
        assert_eq!(device[3], vec![7.0, 8.0], "a buffer stays");
        // The compute copies are the new masters, rounded once to the compute precision.
        for (i, p) in device.iter().enumerate() {
            let rounded = b.to_vec(&b.upload(p.clone(), shapes[i]).expect("up"));
            assert_eq!(
                b.to_vec(&r.params[i]).expect("down"),
                rounded.expect("down")
            );
        }
    }

    #[test]
    fn the_device_update_keeps_f32_masters_beside_16_bit_copies() {
        for p in [Precision::Bf16, Precision::F16] {
            compare_in(
                OptimizerConfig::AdamW {
                    beta1: 0.9,
                    beta2: 0.95,
                    eps: 1e-8,
                    weight_decay: 0.5,
                },
                p,
            );
            compare_in(
                OptimizerConfig::Sgd {
                    momentum: 0.9,
                    weight_decay: 0.5,
                },
                p,
            );
        }
    }

    type B2 = <CandleBackend as Backend>::Tensor;

    #[test]
    fn the_device_adamw_update_is_the_host_one() {
        compare(OptimizerConfig::AdamW {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.5,
        });
    }

    #[test]
    fn the_device_sgd_update_is_the_host_one() {
        compare(OptimizerConfig::Sgd {
            momentum: 0.9,
            weight_decay: 0.5,
        });
    }
}

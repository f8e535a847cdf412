//! The candle backend: `candle-core` tensors on CPU (or CUDA when built with the `cuda`
//! feature). Pooling runs as host loops (it is a negligible share of any model here).

use crate::candle_fused;
use crate::error::{BackendError, Result};
use crate::im2col::{col2im, im2col, ConvGeom};
use crate::pool;
use crate::scalar::{GELU_A, GELU_C};
use crate::shape::{check_broadcast, check_ids, check_row_ids, matmul_shape, numel};
use crate::{candle_fast, candle_gemm};
use crate::{Backend, BinaryOp, Precision, UnaryOp, Window};
use candle_core::{DType, Device, Tensor};

#[derive(Clone, Debug)]
pub struct CandleBackend {
    device: Device,
    dtype: DType,
}

impl CandleBackend {
    /// `f32` on the CPU: the training configuration.
    pub fn cpu() -> Self {
        CandleBackend {
            device: Device::Cpu,
            dtype: DType::F32,
        }
    }

    /// `f64` on the CPU: the same code paths with enough precision for gradient checks.
    pub fn cpu_f64() -> Self {
        CandleBackend {
            device: Device::Cpu,
            dtype: DType::F64,
        }
    }

    /// `f32` on CUDA device `ordinal`; fails unless built with the `cuda` feature.
    pub fn cuda(ordinal: usize) -> Result<Self> {
        let device = Device::new_cuda(ordinal)?;
        exact_half_reductions(&device)?;
        Ok(CandleBackend {
            device,
            dtype: DType::F32,
        })
    }

    /// Lets this process's `f32` matrix products on a GPU run on TF32 tensor cores (inputs
    /// rounded to 10 mantissa bits, accumulation in `f32`), as PyTorch's `allow_tf32`. The
    /// switch is process-wide (cuBLAS's math mode); refused on the CPU, where there is none.
    pub fn with_tf32(self) -> Result<Self> {
        if !self.device.is_cuda() || self.dtype != DType::F32 {
            return Err(BackendError::Device(format!(
                "TF32 matrix products need f32 on a CUDA device, not {}",
                self.name()
            )));
        }
        candle_core::cuda::set_gemm_reduced_precision_f32(true);
        Ok(self)
    }

    /// Computes in `precision` instead of `f32`: tensors are stored in it, matrix products and
    /// reductions accumulate in `f32`. Refused for an `f64` backend (gradient checks). TF32,
    /// a process-wide mode of `f32` products, does not touch 16-bit ones.
    pub fn with_precision(self, precision: Precision) -> Result<Self> {
        let dtype = match precision {
            Precision::F32 => DType::F32,
            Precision::Bf16 => DType::BF16,
            Precision::F16 => DType::F16,
        };
        if self.dtype == DType::F64 {
            return Err(BackendError::Device(format!(
                "{} cannot compute in {}",
                self.name(),
                precision.as_str()
            )));
        }
        Ok(CandleBackend { dtype, ..self })
    }

    /// `f64` on CUDA device `ordinal`: gradient checks of the GPU kernels.
    pub fn cuda_f64(ordinal: usize) -> Result<Self> {
        Ok(CandleBackend {
            device: Device::new_cuda(ordinal)?,
            dtype: DType::F64,
        })
    }

    /// Where the test suites run candle: the CPU, or the CUDA device that
    /// `FUSION_TEST_DEVICE=cuda[:N]` names (in `f64` for gradient checks when `f64`). A
    /// device that cannot be opened (no GPU, or built without the `cuda` feature) is an error,
    /// so a GPU run never quietly falls back to the CPU.
    pub fn for_tests(f64: bool) -> Result<Self> {
        let wanted = std::env::var("FUSION_TEST_DEVICE").unwrap_or_default();
        let ordinal = match wanted.as_str() {
            "" | "cpu" => return Ok(if f64 { Self::cpu_f64() } else { Self::cpu() }),
            "cuda" => 0,
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .ok_or_else(|| {
                    BackendError::Device(format!(
                        "FUSION_TEST_DEVICE={other}: expected cpu, cuda or cuda:N"
                    ))
                })?,
        };
        if f64 {
            Self::cuda_f64(ordinal)
        } else {
            Self::cuda(ordinal)
        }
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    fn half(&self) -> bool {
        is_half(self.dtype)
    }

    /// `data` as an `f32` tensor on the device, its size checked against `shape`.
    fn upload_f32(&self, data: Vec<f32>, shape: &[usize]) -> Result<Tensor> {
        if data.len() != numel(shape) {
            return Err(BackendError::Shape(format!(
                "{} values do not fill shape {shape:?}",
                data.len()
            )));
        }
        Ok(Tensor::from_vec(data, shape, &self.device)?)
    }

    /// Whether the threaded host kernels apply (CPU, f32).
    fn fast(&self) -> Option<()> {
        (self.device.is_cpu() && self.dtype == DType::F32).then_some(())
    }

    fn ids(&self, ids: &[u32]) -> Result<Tensor> {
        Ok(Tensor::from_slice(ids, ids.len(), &self.device)?)
    }

    fn host(&self, t: &Tensor) -> Result<Vec<f64>> {
        Ok(t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?)
    }

    fn upload_host(&self, data: Vec<f64>, shape: &[usize]) -> Result<Tensor> {
        Ok(Tensor::from_vec(data, shape, &self.device)?.to_dtype(self.dtype)?)
    }
}

impl CandleBackend {
    /// Input gradient with candle's transposed convolution (device-resident path).
    fn conv_transpose_input(
        &self,
        dy: &Tensor,
        w: &Tensor,
        input_shape: &[usize],
        win: Window,
    ) -> Result<Tensor> {
        let (h, wd) = (input_shape[2], input_shape[3]);
        let (oh, ow) = (win.out_size(h)?, win.out_size(wd)?);
        // The transposed convolution covers (o - 1) * s + k - 2p; the rest of the input (rows no
        // window reached) gets zero gradient through output padding, then is cut to size.
        let covered =
            |o: usize| ((o - 1) * win.stride + win.kernel).saturating_sub(2 * win.padding);
        let pad = (h - covered(oh)).max(wd - covered(ow));
        let dx =
            dy.contiguous()?
                .conv_transpose2d(&w.contiguous()?, win.padding, pad, win.stride, 1)?;
        Ok(dx.narrow(2, 0, h)?.narrow(3, 0, wd)?.contiguous()?)
    }

    /// Weight gradient as a convolution with batch and channel axes swapped, dilated by the
    /// stride (device-resident path).
    fn conv_weight_by_correlation(&self, x: &Tensor, dy: &Tensor, win: Window) -> Result<Tensor> {
        let xt = x.transpose(0, 1)?.contiguous()?;
        let dyt = dy.transpose(0, 1)?.contiguous()?;
        let g = xt.conv2d(&dyt, win.padding, 1, win.stride, 1)?;
        let g = g
            .transpose(0, 1)?
            .narrow(2, 0, win.kernel)?
            .narrow(3, 0, win.kernel)?;
        Ok(g.contiguous()?)
    }

    /// Applies a host-side transformation to the tensor's elements at the backend's precision.
    fn host_map(
        &self,
        t: &Tensor,
        shape: &[usize],
        f32_fn: impl Fn(&[f32]) -> Vec<f32>,
        f64_fn: impl Fn(&[f64]) -> Vec<f64>,
    ) -> Result<Tensor> {
        Ok(match self.dtype {
            DType::F64 => Tensor::from_vec(
                f64_fn(&t.flatten_all()?.to_vec1::<f64>()?),
                shape,
                &self.device,
            )?,
            _ => Tensor::from_vec(
                f32_fn(&t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?),
                shape,
                &self.device,
            )?
            .to_dtype(self.dtype)?,
        })
    }

    /// The unrolled receptive fields of `x`: `[c * k * k, n * oh * ow]`.
    fn unroll(&self, x: &Tensor, g: &ConvGeom) -> Result<Tensor> {
        self.host_map(x, &[g.cols(), g.rows()], |v| im2col(v, g), |v| im2col(v, g))
    }

    /// `dy [n, o, oh, ow]` as a matrix `[o, n * oh * ow]` matching the unrolled columns.
    fn out_matrix(&self, dy: &Tensor, g: &ConvGeom) -> Result<Tensor> {
        Ok(dy.transpose(0, 1)?.contiguous()?.reshape((g.o, g.rows()))?)
    }
}

/// Whether `dt` is a 16-bit float.
fn is_half(dt: DType) -> bool {
    matches!(dt, DType::BF16 | DType::F16)
}

fn gelu_grad(x: &Tensor) -> candle_core::Result<Tensor> {
    let x2 = x.sqr()?;
    let inner = ((x * &x2)?.affine(GELU_A, 0.0)? + x)?.affine(GELU_C, 0.0)?;
    let t = inner.tanh()?;
    let left = t.affine(0.5, 0.5)?;
    let sech2 = t.sqr()?.affine(-1.0, 1.0)?;
    let du = x2.affine(3.0 * GELU_A * GELU_C, GELU_C)?;
    let right = ((x * sech2)? * du)?.affine(0.5, 0.0)?;
    left + right
}

/// Makes cuBLAS sum the split parts of a 16-bit matrix product in `f32` (its accumulator), not
/// in the 16-bit output type, which it may do by default: a product over many terms that cancel
/// (a gradient through the 50,257-way output layer, whose softmax gradient sums to zero) then
/// keeps the rounding errors of large partial sums. Measured on an H200 with gpt2-small in bf16,
/// the output layer norm's gradients were 9-12% off the f32 ones without it.
#[cfg(feature = "cuda")]
fn exact_half_reductions(device: &Device) -> Result<()> {
    use candle_core::cuda::cudarc::cublas::sys;
    let blas = device.as_cuda_device()?.cublas_handle();
    let mode = sys::cublasMath_t::CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION;
    // SAFETY: `blas` holds the handle alive for the call; cuBLAS only records the mode.
    let status = unsafe { sys::cublasSetMathMode(*blas.handle(), mode) };
    match status {
        sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS => Ok(()),
        other => Err(BackendError::Device(format!(
            "cuBLAS refused f32 reductions for 16-bit products: {other:?}"
        ))),
    }
}

/// Without the `cuda` feature there is no CUDA device to open ([`Device::new_cuda`] fails first).
#[cfg(not(feature = "cuda"))]
fn exact_half_reductions(_device: &Device) -> Result<()> {
    Ok(())
}

impl Backend for CandleBackend {
    type Tensor = Tensor;

    fn name(&self) -> String {
        let dev = if self.device.is_cuda() { "cuda" } else { "cpu" };
        let tf32 = self.device.is_cuda()
            && self.dtype == DType::F32
            && candle_core::cuda::gemm_reduced_precision_f32();
        let precision = if tf32 { "tf32" } else { self.dtype.as_str() };
        format!("candle-{dev}-{precision}")
    }

    fn is_f64(&self) -> bool {
        self.dtype == DType::F64
    }

    fn precision(&self) -> Precision {
        match self.dtype {
            DType::BF16 => Precision::Bf16,
            DType::F16 => Precision::F16,
            _ => Precision::F32,
        }
    }

    fn widen(&self, t: &Tensor) -> Result<Tensor> {
        Ok(if is_half(t.dtype()) {
            t.to_dtype(DType::F32)?
        } else {
            t.clone()
        })
    }

    fn to_compute(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.to_dtype(self.dtype)?)
    }

    fn cast_like(&self, t: &Tensor, like: &Tensor) -> Result<Tensor> {
        Ok(t.to_dtype(like.dtype())?)
    }

    fn accumulate(&self, sum: Option<Tensor>, g: Tensor) -> Result<Tensor> {
        if !self.half() {
            return match sum {
                Some(s) => self.binary(BinaryOp::Add, &s, &g),
                None => Ok(g),
            };
        }
        let g = g.to_dtype(DType::F32)?;
        Ok(match sum {
            Some(s) => s.add(&g)?,
            None => g,
        })
    }

    fn upload(&self, data: Vec<f32>, shape: &[usize]) -> Result<Tensor> {
        Ok(self.upload_f32(data, shape)?.to_dtype(self.dtype)?)
    }

    fn upload_wide(&self, data: Vec<f32>, shape: &[usize]) -> Result<Tensor> {
        if self.half() {
            self.upload_f32(data, shape)
        } else {
            self.upload(data, shape)
        }
    }

    fn in_host_memory(&self) -> bool {
        self.device.is_cpu()
    }

    fn to_vec(&self, t: &Tensor) -> Result<Vec<f32>> {
        Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
    }

    fn host_resident(&self) -> bool {
        self.in_host_memory() && !self.half()
    }

    fn upload_f64(&self, data: Vec<f64>, shape: &[usize]) -> Result<Tensor> {
        if data.len() != numel(shape) {
            return Err(BackendError::Shape(format!(
                "{} values do not fill shape {shape:?}",
                data.len()
            )));
        }
        self.upload_host(data, shape)
    }

    fn to_f64(&self, t: &Tensor) -> Result<Vec<f64>> {
        self.host(t)
    }

    fn shape(&self, t: &Tensor) -> Vec<usize> {
        t.dims().to_vec()
    }

    fn zeros(&self, shape: &[usize]) -> Result<Tensor> {
        Ok(Tensor::zeros(shape, self.dtype, &self.device)?)
    }

    fn reshape(&self, t: &Tensor, shape: &[usize]) -> Result<Tensor> {
        if numel(shape) != t.elem_count() {
            return Err(BackendError::Shape(format!(
                "cannot reshape {:?} to {shape:?}",
                t.dims()
            )));
        }
        Ok(t.reshape(shape)?)
    }

    fn permute(&self, t: &Tensor, dims: &[usize]) -> Result<Tensor> {
        Ok(t.permute(dims.to_vec())?.contiguous()?)
    }

    fn narrow(&self, t: &Tensor, dim: usize, start: usize, len: usize) -> Result<Tensor> {
        Ok(t.narrow(dim, start, len)?.contiguous()?)
    }

    fn cat(&self, ts: &[&Tensor], dim: usize) -> Result<Tensor> {
        if ts.windows(2).any(|w| w[0].dtype() != w[1].dtype()) {
            // A 16-bit run's wide values (the residual stream) beside narrow ones: all widened.
            let wide = ts
                .iter()
                .map(|t| self.widen(t))
                .collect::<Result<Vec<_>>>()?;
            return Ok(Tensor::cat(&wide, dim)?);
        }
        Ok(Tensor::cat(ts, dim)?)
    }

    fn binary(&self, op: BinaryOp, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        check_broadcast(a.dims(), b.dims())?;
        if a.dtype() != b.dtype() {
            // A wide and a narrow operand (the residual stream and a block's output in a 16-bit
            // run): computed wide, as type promotion would.
            let (wa, wb) = (self.widen(a)?, self.widen(b)?);
            if wa.dtype() != wb.dtype() {
                return Err(BackendError::MixedFormats {
                    op: format!("{op:?}"),
                    a: a.dtype().as_str().into(),
                    b: b.dtype().as_str().into(),
                });
            }
            return self.binary(op, &wa, &wb);
        }
        if let Some(t) = self.fast().and_then(|_| candle_fast::binary(op, a, b)) {
            return Ok(t);
        }
        let same = a.dims() == b.dims();
        Ok(match (op, same) {
            (BinaryOp::Add, true) => a.add(b)?,
            (BinaryOp::Sub, true) => a.sub(b)?,
            (BinaryOp::Mul, true) => a.mul(b)?,
            (BinaryOp::Div, true) => a.div(b)?,
            (BinaryOp::Add, false) => a.broadcast_add(b)?,
            (BinaryOp::Sub, false) => a.broadcast_sub(b)?,
            (BinaryOp::Mul, false) => a.broadcast_mul(b)?,
            (BinaryOp::Div, false) => a.broadcast_div(b)?,
        })
    }

    fn unary(&self, op: UnaryOp, a: &Tensor) -> Result<Tensor> {
        if let Some(t) = self.fast().and_then(|_| candle_fast::unary(op, a)) {
            return Ok(t);
        }
        if is_half(a.dtype()) && matches!(op, UnaryOp::Gelu | UnaryOp::GeluGrad) {
            // GELU's cubic term overflows f16 from |x| > 40 (and its derivative's square from
            // 256): computed in f32, rounded once.
            let wide = self.unary(op, &self.widen(a)?)?;
            return Ok(wide.to_dtype(a.dtype())?);
        }
        Ok(match op {
            UnaryOp::Neg => a.neg()?,
            UnaryOp::Exp => a.exp()?,
            UnaryOp::Log => a.log()?,
            UnaryOp::Sqrt => a.sqrt()?,
            UnaryOp::Recip => a.recip()?,
            UnaryOp::Square => a.sqr()?,
            UnaryOp::Relu => a.relu()?,
            UnaryOp::ReluMask => a.sign()?.relu()?,
            UnaryOp::Gelu => a.gelu()?,
            UnaryOp::GeluGrad => gelu_grad(a)?,
        })
    }

    fn affine(&self, a: &Tensor, mul: f64, add: f64) -> Result<Tensor> {
        if let Some(t) = self.fast().and_then(|_| candle_fast::affine(a, mul, add)) {
            return Ok(t);
        }
        Ok(a.affine(mul, add)?)
    }

    fn sum_keepdim(&self, a: &Tensor, dims: &[usize]) -> Result<Tensor> {
        let rank = a.rank();
        if dims.iter().any(|&d| d >= rank) {
            return Err(BackendError::Shape(format!(
                "sum over {dims:?} of {:?}",
                a.dims()
            )));
        }
        if is_half(a.dtype()) {
            // Sums of 16-bit values accumulate in f32 and are rounded once.
            let wide = self.sum_keepdim(&self.widen(a)?, dims)?;
            return Ok(wide.to_dtype(a.dtype())?);
        }
        if let Some(t) = self.fast().and_then(|_| candle_fast::leading_sum(a, dims)) {
            return Ok(t);
        }
        // candle reduces strided (non-trailing) dims slowly, so reduce the trailing run of summed
        // dims as one contiguous row sum, then move any remaining summed dims to the end.
        let mut out_shape = a.dims().to_vec();
        dims.iter().for_each(|&d| out_shape[d] = 1);
        let mut x = a.contiguous()?;
        let mut tail = rank;
        while tail > 0 && dims.contains(&(tail - 1)) {
            tail -= 1;
        }
        if tail < rank {
            let outer: usize = a.dims()[..tail].iter().product();
            x = x
                .reshape((outer, a.dims()[tail..].iter().product::<usize>()))?
                .sum_keepdim(1)?;
            x = x.reshape(&a.dims()[..tail])?;
        }
        let rest: Vec<usize> = dims.iter().copied().filter(|&d| d < tail).collect();
        if !rest.is_empty() {
            let kept: Vec<usize> = (0..tail).filter(|d| !rest.contains(d)).collect();
            let perm: Vec<usize> = kept.iter().chain(&rest).copied().collect();
            let inner: usize = rest.iter().map(|&d| a.dims()[d]).product();
            let outer: usize = kept.iter().map(|&d| a.dims()[d]).product();
            x = x
                .permute(perm)?
                .contiguous()?
                .reshape((outer, inner))?
                .sum_keepdim(1)?;
        }
        Ok(x.reshape(out_shape)?)
    }

    fn max_keepdim(&self, a: &Tensor, dim: usize) -> Result<Tensor> {
        if dim >= a.rank() {
            return Err(BackendError::Shape(format!(
                "max over {dim} of {:?}",
                a.dims()
            )));
        }
        Ok(a.max_keepdim(dim)?)
    }

    fn matmul(&self, a: &Tensor, b: &Tensor, ta: bool, tb: bool) -> Result<Tensor> {
        matmul_shape(a.dims(), b.dims(), ta, tb)?;
        let a = if ta { a.t()? } else { a.clone() };
        let b = if tb { b.t()? } else { b.clone() };
        if let Some(t) = self.fast().and_then(|_| candle_gemm::matmul(&a, &b)) {
            return Ok(t);
        }
        Ok(a.matmul(&b)?)
    }

    fn linear_bias(&self, x: &Tensor, w: &Tensor, bias: &Tensor) -> Result<Option<Tensor>> {
        matmul_shape(x.dims(), w.dims(), false, true)?;
        Ok(self
            .fast()
            .and_then(|_| candle_gemm::matmul_bias(x, &w.t().ok()?, bias)))
    }

    fn gather_rows(&self, table: &Tensor, ids: &[u32]) -> Result<Tensor> {
        if table.rank() != 2 {
            return Err(BackendError::Shape(format!(
                "gather_rows needs [V, D], got {:?}",
                table.dims()
            )));
        }
        check_ids(ids, table.dims()[0])?;
        Ok(table.index_select(&self.ids(ids)?, 0)?)
    }

    fn scatter_add_rows(&self, src: &Tensor, ids: &[u32], rows: usize) -> Result<Tensor> {
        if src.rank() != 2 || src.dims()[0] != ids.len() {
            return Err(BackendError::Shape(format!(
                "scatter_add_rows: {:?} rows vs {} ids",
                src.dims(),
                ids.len()
            )));
        }
        check_ids(ids, rows)?;
        // Rows that many ids share are summed in f32 at least, and rounded once.
        let acc = if self.half() { DType::F32 } else { self.dtype };
        let zeros = Tensor::zeros((rows, src.dims()[1]), acc, &self.device)?;
        let sum = zeros.index_add(&self.ids(ids)?, &src.to_dtype(acc)?, 0)?;
        Ok(sum.to_dtype(self.dtype)?)
    }

    fn pick_last(&self, x: &Tensor, ids: &[u32]) -> Result<Tensor> {
        check_row_ids("pick_last", x.dims(), ids)?;
        Ok(x.contiguous()?
            .gather(&self.ids(ids)?.reshape((ids.len(), 1))?, 1)?)
    }

    fn add_at_last(&self, x: &Tensor, ids: &[u32], value: f64) -> Result<Tensor> {
        check_row_ids("add_at_last", x.dims(), ids)?;
        if let Some(t) = self
            .fast()
            .and_then(|_| candle_fast::add_at_last(x, ids, value))
        {
            return Ok(t);
        }
        let idx = self.ids(ids)?.reshape((ids.len(), 1))?;
        let vals = Tensor::full(value, (ids.len(), 1), &self.device)?.to_dtype(self.dtype)?;
        Ok(x.contiguous()?.scatter_add(&idx, &vals, 1)?)
    }

    fn causal_fill(&self, x: &Tensor, fill: f64) -> Result<Tensor> {
        let dims = x.dims();
        let r = dims.len();
        if r < 2 || dims[r - 1] != dims[r - 2] {
            return Err(BackendError::Shape(format!(
                "causal_fill needs [.., T, T], got {dims:?}"
            )));
        }
        if let Some(t) = self.fast().and_then(|_| candle_fast::causal_fill(x, fill)) {
            return Ok(t);
        }
        let t = dims[r - 1];
        let mask: Vec<u8> = (0..t * t).map(|i| u8::from(i % t > i / t)).collect();
        let mask = Tensor::from_vec(mask, (t, t), &self.device)?.broadcast_as(dims)?;
        let fill = Tensor::full(fill, (), &self.device)?
            .to_dtype(x.dtype())?
            .broadcast_as(dims)?;
        Ok(mask.where_cond(&fill, x)?)
    }

    fn cross_entropy_rows(&self, x: &Tensor, targets: &[u32]) -> Result<Option<Tensor>> {
        candle_fused::cross_entropy(x, targets)
    }

    fn cross_entropy_rows_backward(
        &self,
        x: &Tensor,
        targets: &[u32],
        scale: f64,
    ) -> Result<Option<Tensor>> {
        candle_fused::cross_entropy_backward(x, targets, scale)
    }

    fn gelu_backward(&self, x: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        Ok(self.fast().and_then(|_| candle_fast::gelu_backward(x, dy)))
    }

    fn layer_norm_rows(
        &self,
        x: &Tensor,
        gamma: &Tensor,
        beta: &Tensor,
        eps: f64,
    ) -> Result<Option<[Tensor; 3]>> {
        candle_fused::layer_norm(x, gamma, beta, eps)
    }

    fn layer_norm_rows_backward(
        &self,
        dy: &Tensor,
        xhat: &Tensor,
        rstd: &Tensor,
        gamma: &Tensor,
    ) -> Result<Option<[Tensor; 3]>> {
        candle_fused::layer_norm_backward(dy, xhat, rstd, gamma)
    }

    fn causal_attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        scale: f64,
    ) -> Result<Option<(Tensor, Tensor)>> {
        candle_fused::forward(q, k, v, scale)
    }

    fn causal_attention_backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        y: &Tensor,
        lse: &Tensor,
        dy: &Tensor,
        scale: f64,
    ) -> Result<Option<[Tensor; 3]>> {
        let saved = candle_fused::Saved {
            q,
            k,
            v,
            y,
            lse,
            dy,
        };
        candle_fused::backward(&saved, scale)
    }

    fn conv2d(&self, x: &Tensor, w: &Tensor, win: Window) -> Result<Tensor> {
        let g = ConvGeom::new(x.dims(), w.dims(), win)?;
        if self.device.is_cuda() {
            return Ok(x.conv2d(w, win.padding, win.stride, 1, 1)?);
        }
        // One GEMM: [o, c*k*k] x [c*k*k, n*oh*ow].
        let y = w.reshape((g.o, g.cols()))?.matmul(&self.unroll(x, &g)?)?;
        Ok(y.reshape((g.o, g.n, g.oh, g.ow))?
            .transpose(0, 1)?
            .contiguous()?)
    }

    fn conv2d_backward_input(
        &self,
        dy: &Tensor,
        w: &Tensor,
        input_shape: &[usize],
        win: Window,
    ) -> Result<Tensor> {
        let g = ConvGeom::new(input_shape, w.dims(), win)?;
        if dy.dims() != [g.n, g.o, g.oh, g.ow] {
            return Err(BackendError::Shape(format!(
                "conv2d gradient {:?} does not match output",
                dy.dims()
            )));
        }
        if self.device.is_cuda() {
            return self.conv_transpose_input(dy, w, input_shape, win);
        }
        // dcols = Wᵀ · dY, then fold the receptive fields back, summing overlaps.
        let dcols = w
            .reshape((g.o, g.cols()))?
            .t()?
            .matmul(&self.out_matrix(dy, &g)?)?;
        self.host_map(&dcols, input_shape, |v| col2im(v, &g), |v| col2im(v, &g))
    }

    fn conv2d_backward_weight(&self, x: &Tensor, dy: &Tensor, win: Window) -> Result<Tensor> {
        if x.rank() != 4 || dy.rank() != 4 {
            return Err(BackendError::Shape(format!(
                "conv2d weight gradient: {:?}, {:?}",
                x.dims(),
                dy.dims()
            )));
        }
        let (o, c) = (dy.dims()[1], x.dims()[1]);
        let g = ConvGeom::new(x.dims(), &[o, c, win.kernel, win.kernel], win)?;
        if dy.dims() != [g.n, g.o, g.oh, g.ow] {
            return Err(BackendError::Shape(format!(
                "conv2d gradient {:?} does not match output",
                dy.dims()
            )));
        }
        if self.device.is_cuda() {
            return self.conv_weight_by_correlation(x, dy, win);
        }
        // dW = dY · colsᵀ: [o, n*oh*ow] x [n*oh*ow, c*k*k].
        let dw = self.out_matrix(dy, &g)?.matmul(&self.unroll(x, &g)?.t()?)?;
        Ok(dw.reshape((o, c, win.kernel, win.kernel))?)
    }

    fn max_pool2d(&self, x: &Tensor, win: Window) -> Result<Tensor> {
        let (out, shape) = pool::max_pool(&self.host(x)?, x.dims(), win)?;
        self.upload_host(out, &shape)
    }

    fn max_pool2d_backward(&self, x: &Tensor, dy: &Tensor, win: Window) -> Result<Tensor> {
        let dx = pool::max_pool_backward(&self.host(x)?, x.dims(), &self.host(dy)?, win)?;
        self.upload_host(dx, x.dims())
    }

    fn avg_pool2d(&self, x: &Tensor, win: Window) -> Result<Tensor> {
        let (out, shape) = pool::avg_pool(&self.host(x)?, x.dims(), win)?;
        self.upload_host(out, &shape)
    }

    fn avg_pool2d_backward(
        &self,
        dy: &Tensor,
        input_shape: &[usize],
        win: Window,
    ) -> Result<Tensor> {
        let dx = pool::avg_pool_backward(&self.host(dy)?, input_shape, win)?;
        self.upload_host(dx, input_shape)
    }
}

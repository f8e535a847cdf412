//! Tensor primitives behind one trait, so operators are written once and run on any backend.
//!
//! * [`ReferenceBackend`]: plain Rust loops over `f64` storage. Obviously correct and exact
//!   enough for finite-difference gradient checks; the test oracle.
//! * [`CandleBackend`]: `candle-core` tensors (CPU today, CUDA behind the `cuda` feature), in
//!   `f32` for training or `f64` for gradient checks of the same code paths.
//!
//! The primitive set is deliberately small: element-wise maps, broadcasting binary ops,
//! reductions, batched matmul, row gather/scatter, convolution and pooling. Operators' forward
//! and backward passes are compositions of these, written once in `fusion-ops`.

mod attention;
mod candle_backend;
mod candle_fast;
mod candle_fused;
mod candle_gemm;
mod error;
mod im2col;
mod layernorm;
mod pool;
mod reference;
mod scalar;
mod shape;
pub mod simd;
mod xent;

pub use candle_backend::CandleBackend;
pub use error::{BackendError, Result};
pub use reference::{RefTensor, ReferenceBackend};

pub use shape::{broadcast_compatible, numel};

/// Element-wise binary operations; the right operand broadcasts to the left one's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
}

/// Element-wise unary operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnaryOp {
    Neg,
    Exp,
    Log,
    Sqrt,
    Recip,
    Square,
    Relu,
    /// 1 where the input is positive, else 0 (the derivative of ReLU).
    ReluMask,
    /// GELU, tanh approximation (GPT-2's).
    Gelu,
    /// Derivative of [`UnaryOp::Gelu`] with respect to its input.
    GeluGrad,
}

/// The floating-point format a backend computes in. Master weights and optimizer state stay
/// `f32` whatever it is; `bf16` and `f16` halve activations and gradients, with reductions
/// accumulated in `f32`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Precision {
    #[default]
    F32,
    Bf16,
    F16,
}

impl Precision {
    /// Whether values are stored in 16 bits.
    pub fn is_half(self) -> bool {
        self != Precision::F32
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::F16 => "f16",
        }
    }
}

impl std::str::FromStr for Precision {
    type Err = String;

    /// `f32`, `bf16` or `f16`.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        [Precision::F32, Precision::Bf16, Precision::F16]
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| format!("unknown precision '{s}' (f32, bf16 or f16)"))
    }
}

/// Geometry of a 2-D convolution or pooling window (square kernel).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    pub kernel: usize,
    pub stride: usize,
    pub padding: usize,
}

impl Window {
    pub fn out_size(&self, size: usize) -> Result<usize> {
        let padded = size + 2 * self.padding;
        if self.stride == 0 || self.kernel == 0 || padded < self.kernel {
            return Err(BackendError::Shape(format!(
                "window {self:?} does not fit size {size}"
            )));
        }
        Ok((padded - self.kernel) / self.stride + 1)
    }
}

/// The primitives every backend provides. Tensors are immutable values; every method returns a
/// new tensor. Shapes are checked and violations return [`BackendError`], never panic.
pub trait Backend: Clone + Send + Sync + 'static {
    type Tensor: Clone + Send + Sync + std::fmt::Debug;

    /// A short name recorded in reports and announced to peers ("reference", "candle-cpu-f32").
    fn name(&self) -> String;

    /// Whether tensors hold f64 values (then boundary tensors travel as f64 between nodes).
    fn is_f64(&self) -> bool {
        false
    }

    /// The format tensors compute in (`f32` for the `f64` backends too: they are checked
    /// against it).
    fn precision(&self) -> Precision {
        Precision::F32
    }

    /// `sum + g` for a running sum of gradients over micro-batches, kept at `f32` or better
    /// whatever the compute precision (a half-precision `g` is widened), so that accumulating
    /// many micro-batches does not round at 16 bits each time. `None` starts a sum.
    fn accumulate(&self, sum: Option<Self::Tensor>, g: Self::Tensor) -> Result<Self::Tensor> {
        match sum {
            Some(s) => self.binary(BinaryOp::Add, &s, &g),
            None => Ok(g),
        }
    }

    /// `t` at `f32` or better, for a computation that rounding at 16 bits would spoil (the
    /// statistics of a normalisation and their gradient): a half-precision tensor is widened,
    /// any other returned as it is. The element-wise, reduction and matrix primitives and
    /// `causal_fill` take widened tensors; `add_at_last` and the row scatters expect the compute
    /// precision.
    fn widen(&self, t: &Self::Tensor) -> Result<Self::Tensor> {
        Ok(t.clone())
    }

    /// A [`Backend::widen`]ed result back in the compute precision.
    fn to_compute(&self, t: &Self::Tensor) -> Result<Self::Tensor> {
        Ok(t.clone())
    }

    /// `t` in the format `like` is stored in (a gradient in its value's format: a value of the
    /// residual stream is kept wide in a 16-bit run, and so is its gradient).
    fn cast_like(&self, t: &Self::Tensor, _like: &Self::Tensor) -> Result<Self::Tensor> {
        Ok(t.clone())
    }

    fn upload(&self, data: Vec<f32>, shape: &[usize]) -> Result<Self::Tensor>;
    /// Like `upload`, at `f32` or better whatever the compute precision: master weights kept
    /// beside their 16-bit compute copies on the device (see [`Backend::to_compute`]).
    fn upload_wide(&self, data: Vec<f32>, shape: &[usize]) -> Result<Self::Tensor> {
        self.upload(data, shape)
    }
    /// Whether tensors live in host memory (at any precision): where they do, an optimizer kept
    /// "on the device" would gain nothing over the host's.
    fn in_host_memory(&self) -> bool {
        true
    }
    /// Whether tensors live in host memory at `f32` or better, so that a caller may hand its
    /// host vectors over (`upload` of a correctly sized vector cannot fail, and `to_vec` gives
    /// the same values back) instead of keeping a second copy.
    fn host_resident(&self) -> bool {
        false
    }
    fn to_vec(&self, t: &Self::Tensor) -> Result<Vec<f32>>;
    /// Like `from_vec`, without rounding through `f32` (for gradient checks on `f64` backends).
    fn upload_f64(&self, data: Vec<f64>, shape: &[usize]) -> Result<Self::Tensor>;
    /// Like `to_vec`, at the backend's full precision.
    fn to_f64(&self, t: &Self::Tensor) -> Result<Vec<f64>>;
    fn shape(&self, t: &Self::Tensor) -> Vec<usize>;
    fn zeros(&self, shape: &[usize]) -> Result<Self::Tensor>;

    fn reshape(&self, t: &Self::Tensor, shape: &[usize]) -> Result<Self::Tensor>;
    /// Reorders dimensions (materialised, contiguous).
    fn permute(&self, t: &Self::Tensor, dims: &[usize]) -> Result<Self::Tensor>;
    fn narrow(
        &self,
        t: &Self::Tensor,
        dim: usize,
        start: usize,
        len: usize,
    ) -> Result<Self::Tensor>;
    fn cat(&self, ts: &[&Self::Tensor], dim: usize) -> Result<Self::Tensor>;

    /// `a op b`, where `b` has the same rank as `a` and each of its dims equals `a`'s or is 1.
    fn binary(&self, op: BinaryOp, a: &Self::Tensor, b: &Self::Tensor) -> Result<Self::Tensor>;
    fn unary(&self, op: UnaryOp, a: &Self::Tensor) -> Result<Self::Tensor>;
    /// `a * mul + add`.
    fn affine(&self, a: &Self::Tensor, mul: f64, add: f64) -> Result<Self::Tensor>;

    /// Sums over `dims`, keeping them with size 1.
    fn sum_keepdim(&self, a: &Self::Tensor, dims: &[usize]) -> Result<Self::Tensor>;
    /// Maximum over one dim, kept with size 1.
    fn max_keepdim(&self, a: &Self::Tensor, dim: usize) -> Result<Self::Tensor>;

    /// Batched matrix product of rank-2 or rank-3 tensors with equal batch size; `ta`/`tb`
    /// transpose the last two dims of `a`/`b` first.
    fn matmul(
        &self,
        a: &Self::Tensor,
        b: &Self::Tensor,
        ta: bool,
        tb: bool,
    ) -> Result<Self::Tensor>;

    /// Rows of `table [V, D]` at `ids`: `[ids.len(), D]`.
    fn gather_rows(&self, table: &Self::Tensor, ids: &[u32]) -> Result<Self::Tensor>;
    /// Sums the rows of `src [n, D]` into a `[rows, D]` zero tensor at `ids` (embedding backward).
    fn scatter_add_rows(
        &self,
        src: &Self::Tensor,
        ids: &[u32],
        rows: usize,
    ) -> Result<Self::Tensor>;
    /// `x[n, ids[n]]` for `x [N, V]`: `[N, 1]`.
    fn pick_last(&self, x: &Self::Tensor, ids: &[u32]) -> Result<Self::Tensor>;
    /// `x` with `value` added at `x[n, ids[n]]`.
    fn add_at_last(&self, x: &Self::Tensor, ids: &[u32], value: f64) -> Result<Self::Tensor>;
    /// Sets entries above the diagonal of the last two dims (`[.., T, T]`) to `fill`.
    fn causal_fill(&self, x: &Self::Tensor, fill: f64) -> Result<Self::Tensor>;

    /// Fused softmax cross-entropy: each row's `-log softmax(x)[target]` for logits `x [N, V]`
    /// as `[N]`, or `None` where the backend has no fused kernel (the operator then composes it
    /// and keeps the probabilities).
    fn cross_entropy_rows(
        &self,
        _x: &Self::Tensor,
        _targets: &[u32],
    ) -> Result<Option<Self::Tensor>> {
        Ok(None)
    }

    /// The gradient of `scale` times the sum of [`Backend::cross_entropy_rows`]:
    /// `(softmax(x) - onehot(targets)) * scale`, or `None` without a fused kernel.
    fn cross_entropy_rows_backward(
        &self,
        _x: &Self::Tensor,
        _targets: &[u32],
        _scale: f64,
    ) -> Result<Option<Self::Tensor>> {
        Ok(None)
    }

    /// The tanh-approximated GELU's VJP `dy * gelu'(x)` in one pass, or `None` where the backend
    /// has no such kernel (the operator then multiplies by the derivative's tensor).
    fn gelu_backward(&self, _x: &Self::Tensor, _dy: &Self::Tensor) -> Result<Option<Self::Tensor>> {
        Ok(None)
    }

    /// Fused layer normalisation of rows `x [N, D]` with gain and bias `[D]`:
    /// `[y, xhat, rstd [N, 1]]` (the output, the normalised rows and their reciprocal
    /// deviations, what backward reads), or `None` where the backend has no such kernel.
    fn layer_norm_rows(
        &self,
        _x: &Self::Tensor,
        _gamma: &Self::Tensor,
        _beta: &Self::Tensor,
        _eps: f64,
    ) -> Result<Option<[Self::Tensor; 3]>> {
        Ok(None)
    }

    /// The VJP of [`Backend::layer_norm_rows`]: `[dx, dgamma, dbeta]` from the output's gradient
    /// `dy [N, D]`, `xhat`, `rstd` and the gain; `None` without a fused kernel.
    fn layer_norm_rows_backward(
        &self,
        _dy: &Self::Tensor,
        _xhat: &Self::Tensor,
        _rstd: &Self::Tensor,
        _gamma: &Self::Tensor,
    ) -> Result<Option<[Self::Tensor; 3]>> {
        Ok(None)
    }

    /// `x [rows, in] · wᵀ + bias` for `w [out, in]` and `bias [out]` in one pass (the product
    /// adds into rows that start as the bias), or `None` where the backend has no such kernel
    /// (the operator then adds the bias after the product).
    fn linear_bias(
        &self,
        _x: &Self::Tensor,
        _w: &Self::Tensor,
        _bias: &Self::Tensor,
    ) -> Result<Option<Self::Tensor>> {
        Ok(None)
    }

    /// Fused causal attention over stacks of heads `q, k, v [N, T, D]` with scores scaled by
    /// `scale`: the output `[N, T, D]` and each row's log-sum-exp `[N, T]`, or `None` where the
    /// backend has no fused kernel (the operator then composes attention from the primitives
    /// above and keeps the `[N, T, T]` probabilities instead).
    fn causal_attention(
        &self,
        _q: &Self::Tensor,
        _k: &Self::Tensor,
        _v: &Self::Tensor,
        _scale: f64,
    ) -> Result<Option<(Self::Tensor, Self::Tensor)>> {
        Ok(None)
    }

    /// The VJP of [`Backend::causal_attention`]: `[dq, dk, dv]` from the inputs, the output
    /// `y`, the log-sum-exp and the output's gradient `dy`; `None` without a fused kernel.
    #[allow(clippy::too_many_arguments)]
    fn causal_attention_backward(
        &self,
        _q: &Self::Tensor,
        _k: &Self::Tensor,
        _v: &Self::Tensor,
        _y: &Self::Tensor,
        _lse: &Self::Tensor,
        _dy: &Self::Tensor,
        _scale: f64,
    ) -> Result<Option<[Self::Tensor; 3]>> {
        Ok(None)
    }

    /// `x [N, C, H, W]` convolved with `w [O, C, k, k]`.
    fn conv2d(&self, x: &Self::Tensor, w: &Self::Tensor, win: Window) -> Result<Self::Tensor>;
    /// Gradient of `conv2d` with respect to its input of shape `input_shape`.
    fn conv2d_backward_input(
        &self,
        dy: &Self::Tensor,
        w: &Self::Tensor,
        input_shape: &[usize],
        win: Window,
    ) -> Result<Self::Tensor>;
    /// Gradient of `conv2d` with respect to its weight.
    fn conv2d_backward_weight(
        &self,
        x: &Self::Tensor,
        dy: &Self::Tensor,
        win: Window,
    ) -> Result<Self::Tensor>;
    /// Max pooling with implicit `-inf` padding.
    fn max_pool2d(&self, x: &Self::Tensor, win: Window) -> Result<Self::Tensor>;
    /// Routes each output gradient to the first maximal input of its window.
    fn max_pool2d_backward(
        &self,
        x: &Self::Tensor,
        dy: &Self::Tensor,
        win: Window,
    ) -> Result<Self::Tensor>;
    /// Average pooling without padding.
    fn avg_pool2d(&self, x: &Self::Tensor, win: Window) -> Result<Self::Tensor>;
    fn avg_pool2d_backward(
        &self,
        dy: &Self::Tensor,
        input_shape: &[usize],
        win: Window,
    ) -> Result<Self::Tensor>;
}

//! Element-wise functions shared by the reference backend (f64) and the threaded host kernels
//! (f32), so both compute the same formula.

use crate::UnaryOp;
use num_traits::Float;

fn c<T: Float>(v: f64) -> T {
    T::from(v).unwrap_or_else(T::nan)
}

/// sqrt(2 / pi) and the cubic coefficient of GPT-2's tanh-approximated GELU.
pub(crate) const GELU_C: f64 = 0.797_884_560_802_865_4;
pub(crate) const GELU_A: f64 = 0.044715;

pub(crate) fn unary<T: Float>(op: UnaryOp, x: T) -> T {
    match op {
        UnaryOp::Neg => -x,
        UnaryOp::Exp => x.exp(),
        UnaryOp::Log => x.ln(),
        UnaryOp::Sqrt => x.sqrt(),
        UnaryOp::Recip => x.recip(),
        UnaryOp::Square => x * x,
        UnaryOp::Relu => x.max(T::zero()),
        UnaryOp::ReluMask => {
            if x > T::zero() {
                T::one()
            } else {
                T::zero()
            }
        }
        UnaryOp::Gelu => {
            let inner = c::<T>(GELU_C) * (x + c::<T>(GELU_A) * x * x * x);
            c::<T>(0.5) * x * (T::one() + inner.tanh())
        }
        UnaryOp::GeluGrad => {
            let t = (c::<T>(GELU_C) * (x + c::<T>(GELU_A) * x * x * x)).tanh();
            let du = c::<T>(GELU_C) * (T::one() + c::<T>(3.0 * GELU_A) * x * x);
            c::<T>(0.5) * (T::one() + t) + c::<T>(0.5) * x * (T::one() - t * t) * du
        }
    }
}

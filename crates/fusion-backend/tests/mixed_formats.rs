//! A 16-bit candle backend holds f32 values beside 16-bit ones (the residual stream): element-wise
//! sums and concatenations of the two compute in f32, and operands with no common wider format
//! are refused by name instead of recursing.

use candle_core::{DType, Tensor};
use fusion_backend::{Backend, BackendError, BinaryOp, CandleBackend, Precision};

#[test]
fn a_wide_and_a_narrow_operand_compute_wide() {
    let b = CandleBackend::cpu()
        .with_precision(Precision::Bf16)
        .unwrap();
    let wide = b.upload_wide(vec![1.0, 2.0, 3.0], &[3]).unwrap();
    let narrow = b.upload(vec![1.0 / 256.0; 3], &[3]).unwrap();
    assert_eq!((wide.dtype(), narrow.dtype()), (DType::F32, DType::BF16));
    let sum = b.binary(BinaryOp::Add, &wide, &narrow).unwrap();
    assert_eq!(sum.dtype(), DType::F32);
    // 1 + 2^-8 is not a bf16 value: kept only because the sum is wide.
    let step = 1.0 / 256.0;
    assert_eq!(
        b.to_vec(&sum).unwrap(),
        vec![1.0 + step, 2.0 + step, 3.0 + step]
    );
    let both = b.cat(&[&narrow, &wide], 0).unwrap();
    assert_eq!(both.dtype(), DType::F32);
    assert_eq!(b.to_vec(&both).unwrap()[3..], [1.0, 2.0, 3.0]);
    assert_eq!(b.cast_like(&sum, &narrow).unwrap().dtype(), DType::BF16);
}

#[test]
fn operands_without_a_common_format_are_refused() {
    let b = CandleBackend::for_tests(true).unwrap();
    let f64s = b.upload_f64(vec![1.0, 2.0], &[2]).unwrap();
    let f32s = Tensor::new(&[1f32, 2.0], &candle_core::Device::Cpu).unwrap();
    let err = b.binary(BinaryOp::Mul, &f64s, &f32s).unwrap_err();
    assert!(
        matches!(&err, BackendError::MixedFormats { a, b, .. } if a == "f64" && b == "f32"),
        "{err}"
    );
}

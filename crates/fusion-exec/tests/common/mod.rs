//! Deterministic feeds shared by the executor tests.

use fusion_backend::Backend;
use fusion_exec::{IdTensor, Value};
use fusion_graph::{Graph, TensorId};
use std::collections::HashMap;

/// A value for every graph input: floats in [-1, 1), integer ids below `classes`.
pub fn feeds<B: Backend>(b: &B, g: &Graph, classes: u32) -> HashMap<TensorId, Value<B>> {
    g.inputs
        .iter()
        .enumerate()
        .map(|(k, t)| {
            let info = g.tensor(*t);
            let n = info.numel();
            let v = if info.dtype.is_float() {
                Value::Float(
                    b.upload_f64(
                        (0..n)
                            .map(|i| ((i * 37 + k) % 17) as f64 / 8.5 - 1.0)
                            .collect(),
                        &info.shape,
                    )
                    .unwrap(),
                )
            } else {
                Value::Ids(
                    IdTensor::new(
                        (0..n).map(|i| ((i * 7 + 3 * k) as u32) % classes).collect(),
                        info.shape.clone(),
                    )
                    .unwrap(),
                )
            };
            (*t, v)
        })
        .collect()
}

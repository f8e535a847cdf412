use serde::{Deserialize, Serialize};

/// Element type of a tensor edge. Floating tensors carry activations and gradients; integer
/// tensors carry token ids and class labels, which have no gradient.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    I32,
}

impl DType {
    pub fn size_bytes(self) -> usize {
        4
    }
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32)
    }
}

/// Number of elements of a shape (the empty shape is a scalar with one element).
pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

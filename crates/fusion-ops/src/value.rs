use crate::error::{OpError, Result};
use fusion_backend::Backend;
use std::sync::Arc;

/// Integer tensor (token ids, class labels) kept on the host: operators use it only to index.
#[derive(Clone, Debug, PartialEq)]
pub struct IdTensor {
    pub shape: Vec<usize>,
    pub data: Arc<Vec<u32>>,
}

impl IdTensor {
    pub fn new(data: Vec<u32>, shape: Vec<usize>) -> Result<Self> {
        if data.len() != shape.iter().product::<usize>() {
            return Err(OpError::Shape(format!(
                "{} ids do not fill shape {shape:?}",
                data.len()
            )));
        }
        Ok(IdTensor {
            shape,
            data: Arc::new(data),
        })
    }
}

/// A value flowing along an edge of the DAG.
#[derive(Clone, Debug)]
pub enum Value<B: Backend> {
    Float(B::Tensor),
    Ids(IdTensor),
}

impl<B: Backend> Value<B> {
    pub fn float(&self) -> Result<&B::Tensor> {
        match self {
            Value::Float(t) => Ok(t),
            Value::Ids(_) => Err(OpError::Kind {
                expected: "float",
                found: "integer",
            }),
        }
    }
    pub fn ids(&self) -> Result<&IdTensor> {
        match self {
            Value::Ids(t) => Ok(t),
            Value::Float(_) => Err(OpError::Kind {
                expected: "integer",
                found: "float",
            }),
        }
    }
    pub fn shape(&self, b: &B) -> Vec<usize> {
        match self {
            Value::Float(t) => b.shape(t),
            Value::Ids(t) => t.shape.clone(),
        }
    }
}

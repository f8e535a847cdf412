use thiserror::Error;

#[derive(Debug, Error)]
pub enum OpError {
    #[error("{op} expects {expected} inputs, got {found}")]
    Arity {
        op: &'static str,
        expected: usize,
        found: usize,
    },
    #[error("{op}: missing parameter '{role}'")]
    MissingParam {
        op: &'static str,
        role: &'static str,
    },
    #[error("{op}: missing saved tensor from the forward pass")]
    MissingSaved { op: &'static str },
    #[error("expected a {expected} tensor, got a {found} tensor")]
    Kind {
        expected: &'static str,
        found: &'static str,
    },
    #[error("{0}")]
    Shape(String),
    #[error(transparent)]
    Backend(#[from] fusion_backend::BackendError),
}

pub type Result<T> = std::result::Result<T, OpError>;

/// The parameter at `i`, or an error naming the role the operator expected there.
pub(crate) fn param<'a, T>(
    params: &[&'a T],
    i: usize,
    op: &'static str,
    role: &'static str,
) -> Result<&'a T> {
    params
        .get(i)
        .copied()
        .ok_or(OpError::MissingParam { op, role })
}

pub(crate) fn saved<'a, T>(saved: &'a [T], i: usize, op: &'static str) -> Result<&'a T> {
    saved.get(i).ok_or(OpError::MissingSaved { op })
}

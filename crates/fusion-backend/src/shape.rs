use crate::error::{BackendError, Result};

pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// Row-major strides of a shape.
pub(crate) fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// Whether `b` broadcasts to `a` under the rule of [`crate::Backend::binary`].
pub fn broadcast_compatible(a: &[usize], b: &[usize]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x == y || *y == 1)
}

pub(crate) fn check_broadcast(a: &[usize], b: &[usize]) -> Result<()> {
    if broadcast_compatible(a, b) {
        Ok(())
    } else {
        Err(BackendError::Shape(format!(
            "{b:?} does not broadcast to {a:?}"
        )))
    }
}

pub(crate) fn check_ids(ids: &[u32], size: usize) -> Result<()> {
    match ids.iter().find(|&&i| i as usize >= size) {
        Some(&i) => Err(BackendError::Index {
            index: i as usize,
            size,
        }),
        None => Ok(()),
    }
}

/// Output shape of a matmul, validating ranks and inner dimensions.
pub(crate) fn matmul_shape(
    a: &[usize],
    b: &[usize],
    ta: bool,
    tb: bool,
) -> Result<(usize, usize, usize, usize)> {
    if a.len() != b.len() || !(a.len() == 2 || a.len() == 3) {
        return Err(BackendError::Shape(format!(
            "matmul needs equal rank 2 or 3, got {a:?} x {b:?}"
        )));
    }
    let r = a.len();
    let batch = if r == 3 { a[0] } else { 1 };
    if r == 3 && b[0] != batch {
        return Err(BackendError::Shape(format!(
            "matmul batch mismatch {a:?} x {b:?}"
        )));
    }
    let (m, k) = if ta {
        (a[r - 1], a[r - 2])
    } else {
        (a[r - 2], a[r - 1])
    };
    let (k2, n) = if tb {
        (b[r - 1], b[r - 2])
    } else {
        (b[r - 2], b[r - 1])
    };
    if k != k2 {
        return Err(BackendError::Shape(format!(
            "matmul inner dims differ: {a:?}{} x {b:?}{}",
            if ta { "^T" } else { "" },
            if tb { "^T" } else { "" }
        )));
    }
    Ok((batch, m, k, n))
}

/// Validates `x [N, V]` against one id per row, each below `V`; returns `V`.
pub(crate) fn check_row_ids(what: &str, shape: &[usize], ids: &[u32]) -> Result<usize> {
    if shape.len() != 2 || shape[0] != ids.len() {
        return Err(BackendError::Shape(format!(
            "{what}: {shape:?} vs {} ids",
            ids.len()
        )));
    }
    check_ids(ids, shape[1])?;
    Ok(shape[1])
}

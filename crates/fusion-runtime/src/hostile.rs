//! The lies a hostile node tells, for the hostile-peer tests: each is a test hook of a real node
//! (`TestHooks::bad_result_at_step`), so the receivers' and the broker's real checks meet them.

use crate::outgoing::Outgoing;
use fusion_proto::{DType, ParamData, TensorHeader};

/// How a hostile node lies at one step (a test hook).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BadResult {
    /// Its step result carries one loss more than its micro-batches.
    ExtraLoss,
    /// Its step result carries infinite losses and a gradient norm that is not a number.
    NonFinite,
    /// Its tensors of that step are int8 messages whose scale overflows to infinity.
    Int8Overflow,
    /// With each tensor of that step it sends a flood of tensors for two steps later.
    FutureFlood,
    /// When the broker gathers the state after that step, it sends the state of a parameter
    /// its stage does not hold.
    ForeignState,
}

/// Tensors of a later step a [`BadResult::FutureFlood`] adds to each honest one.
pub const FLOOD: u64 = 256;

impl BadResult {
    /// Whether the lie is told on the data plane (else in a control message).
    pub fn on_data_plane(self) -> bool {
        matches!(self, BadResult::Int8Overflow | BadResult::FutureFlood)
    }

    /// Applies a step-result lie to a training step's losses and squared gradient norm.
    pub fn tamper_result(self, losses: &mut Vec<f32>, grad_square_sum: &mut f64) {
        match self {
            BadResult::ExtraLoss => losses.push(1.0),
            BadResult::NonFinite => {
                losses.iter_mut().for_each(|l| *l = f32::INFINITY);
                *grad_square_sum = f64::NAN;
            }
            _ => {}
        }
    }
}

/// What a lying node sends instead of `out`.
pub fn lie(bad: BadResult, out: Outgoing) -> Vec<Outgoing> {
    match bad {
        BadResult::Int8Overflow => {
            let n = out.header.shape.iter().product::<u64>() as usize;
            vec![Outgoing {
                header: TensorHeader {
                    dtype: DType::Compressed as i32,
                    ..out.header
                },
                data: overflowing_int8(n),
            }]
        }
        BadResult::FutureFlood => {
            let flood = (0..FLOOD).map(|i| Outgoing {
                header: TensorHeader {
                    step: out.header.step + 2,
                    micro_batch: i as u32,
                    ..out.header.clone()
                },
                data: out.data.clone(),
            });
            let mut all: Vec<Outgoing> = flood.collect();
            all.insert(0, out);
            all
        }
        _ => vec![out],
    }
}

/// A dense int8 compressed message of `n` values, every one 127 times a scale of f32::MAX.
fn overflowing_int8(n: usize) -> Vec<u8> {
    let mut m = vec![
        fusion_compress::wire::MAGIC,
        fusion_compress::wire::FORMAT_VERSION,
        0,
        3,
    ];
    m.extend_from_slice(&(n as u64).to_le_bytes());
    for _ in 0..n.div_ceil(fusion_compress::wire::I8_RUN) {
        m.extend_from_slice(&f32::MAX.to_le_bytes());
    }
    m.extend(std::iter::repeat_n(127u8, n));
    m
}

/// A piece of state for a parameter that is not among `held`: parameter `held[0]`'s piece
/// renamed to the first id the stage does not hold.
pub fn foreign_piece(held: &[usize], mut piece: ParamData) -> ParamData {
    let foreign = (0..).find(|i| !held.contains(i)).unwrap_or(0);
    piece.param = foreign as u64;
    piece
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_overflowing_int8_message_is_well_formed_and_refused_only_for_its_scale() {
        let err = fusion_compress::decode(&overflowing_int8(300), 300).unwrap_err();
        assert!(err.to_string().contains("scale"), "{err}");
        // The same message with a modest scale decodes.
        let mut m = overflowing_int8(300);
        m[12..16].copy_from_slice(&1.0f32.to_le_bytes());
        m[16..20].copy_from_slice(&1.0f32.to_le_bytes());
        assert_eq!(fusion_compress::decode(&m, 300).expect("decodes")[0], 127.0);
    }
}

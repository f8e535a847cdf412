//! Conversions between the control plane's messages and host values.

use crate::error::{Result, RuntimeError};
use fusion_exec::Schedule;
use fusion_proto::{ParamData, ParamPart, PipelineSchedule};

/// Parameters travel in pieces of this many bytes, far below the message limit.
pub const PARAM_PIECE_BYTES: usize = 1 << 20;

pub fn bytes_to_f32(b: &[u8]) -> Vec<f32> {
    fusion_transport::le_bytes_to_f32(b)
}

pub fn f32_to_bytes(v: &[f32]) -> Vec<u8> {
    fusion_transport::f32_le_bytes(v)
}

/// `values` of parameter `param` as in-order pieces (none for an empty moment buffer), made one
/// at a time as they are taken.
pub fn param_messages(
    param: usize,
    part: ParamPart,
    values: &[f32],
) -> impl Iterator<Item = ParamData> + '_ {
    window_messages(param, part, values, 0, values.len())
}

/// `values`, elements `start..` of parameter `param` of `total` elements (a sharded replica's
/// piece), as in-order pieces.
pub fn window_messages(
    param: usize,
    part: ParamPart,
    values: &[f32],
    start: usize,
    total: usize,
) -> impl Iterator<Item = ParamData> + '_ {
    let per = PARAM_PIECE_BYTES / 4;
    values.chunks(per).enumerate().map(move |(i, c)| ParamData {
        param: param as u64,
        part: part as i32,
        offset: (start + i * per) as u64,
        total_elements: total as u64,
        data: f32_to_bytes(c).into(),
    })
}

/// Writes one piece into `target`, refusing a piece that does not fit the parameter's size.
pub fn write_piece(target: &mut [f32], p: &ParamData) -> Result<()> {
    let off = usize::try_from(p.offset).unwrap_or(usize::MAX);
    let n = p.data.len() / 4;
    if p.total_elements as usize != target.len()
        || !p.data.len().is_multiple_of(4)
        || off.checked_add(n).is_none_or(|end| end > target.len())
    {
        return Err(RuntimeError::Protocol(format!(
            "piece of parameter #{} ({} bytes at element {}, total {}) does not fit its {} elements",
            p.param,
            p.data.len(),
            p.offset,
            p.total_elements,
            target.len()
        )));
    }
    for (dst, c) in target[off..off + n].iter_mut().zip(p.data.chunks_exact(4)) {
        *dst = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
    Ok(())
}

pub fn schedule_to_wire(s: Schedule) -> PipelineSchedule {
    match s {
        Schedule::GPipe => PipelineSchedule::Gpipe,
        Schedule::OneFOneB => PipelineSchedule::OneFOneB,
    }
}

pub fn schedule_from_wire(s: PipelineSchedule) -> Result<Schedule> {
    match s {
        PipelineSchedule::Gpipe => Ok(Schedule::GPipe),
        PipelineSchedule::OneFOneB => Ok(Schedule::OneFOneB),
        PipelineSchedule::Unspecified => Err(RuntimeError::Protocol(
            "pipeline schedule unspecified".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_round_trip_and_misfits_are_refused() {
        let v: Vec<f32> = (0..700_000).map(|i| i as f32).collect();
        let msgs: Vec<ParamData> = param_messages(3, ParamPart::Value, &v).collect();
        assert_eq!(msgs.len(), 3);
        let mut back = vec![0.0; v.len()];
        for m in &msgs {
            write_piece(&mut back, m).expect("fits");
        }
        assert_eq!(back, v);
        let mut small = vec![0.0; 10];
        assert!(write_piece(&mut small, &msgs[0]).is_err());
        let mut bad = msgs[2].clone();
        bad.offset = u64::MAX;
        assert!(write_piece(&mut back, &bad).is_err());
    }
}

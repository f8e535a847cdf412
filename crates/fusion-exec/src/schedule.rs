//! Pipeline schedules: the order in which a stage runs the forward and backward passes of a
//! step's micro-batches. The distributed runtime executes these orders; the simulator predicts
//! their timing.

/// Order of forward and backward passes over micro-batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// All forwards, then all backwards (GPipe).
    GPipe,
    /// Warm-up forwards, then one forward / one backward, then the remaining backwards; a stage
    /// holds at most (stages - stage) micro-batches' activations.
    OneFOneB,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    Forward(usize),
    Backward(usize),
}

/// The passes stage `stage` of `stages` runs for `m` micro-batches. Both orders are deadlock-free
/// on any DAG cut: a stage's forward of a micro-batch needs only earlier stages' forwards of the
/// same one, and its backward only later stages' backwards of it, which never wait for it.
pub fn passes(schedule: Schedule, stage: usize, stages: usize, m: usize) -> Vec<Pass> {
    match schedule {
        Schedule::GPipe => (0..m)
            .map(Pass::Forward)
            .chain((0..m).map(Pass::Backward))
            .collect(),
        Schedule::OneFOneB => {
            let warm = (stages - stage - 1).min(m);
            let mut v: Vec<Pass> = (0..warm).map(Pass::Forward).collect();
            for i in 0..m - warm {
                v.push(Pass::Forward(warm + i));
                v.push(Pass::Backward(i));
            }
            v.extend((m - warm..m).map(Pass::Backward));
            v
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedules_run_every_pass_once_with_forward_first() {
        for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
            for stages in 1..5 {
                for stage in 0..stages {
                    for m in 1..6 {
                        let p = passes(schedule, stage, stages, m);
                        assert_eq!(p.len(), 2 * m);
                        for mb in 0..m {
                            let f = p.iter().position(|x| *x == Pass::Forward(mb));
                            let bw = p.iter().position(|x| *x == Pass::Backward(mb));
                            assert!(f.is_some() && bw.is_some() && f < bw);
                        }
                    }
                }
            }
        }
        // 1F1B on the first of 4 stages with 6 micro-batches: 3 warm-up forwards.
        let p = passes(Schedule::OneFOneB, 0, 4, 6);
        assert_eq!(
            &p[..5],
            &[
                Pass::Forward(0),
                Pass::Forward(1),
                Pass::Forward(2),
                Pass::Forward(3),
                Pass::Backward(0)
            ]
        );
        // The last stage alternates from the start.
        let p = passes(Schedule::OneFOneB, 3, 4, 2);
        assert_eq!(
            p,
            vec![
                Pass::Forward(0),
                Pass::Backward(0),
                Pass::Forward(1),
                Pass::Backward(1)
            ]
        );
    }
}

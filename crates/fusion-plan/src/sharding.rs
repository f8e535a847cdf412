//! When the data-parallel replicas of a plan shard their optimizer state (ZeRO stage 1): only
//! where memory binds. Sharding frees memory and divides the update among the replicas, but it
//! is not free in the runtime (snapshots gather pieces replica by replica, a lost replica's
//! piece must be rebuilt from a snapshot, and a node must implement it), so a plan shards only
//! when the plan chosen with sharding needs the memory it frees.

use crate::{plan, Evaluation, PlanError, PlanOptions, Planned, Problem, Scheduler};

/// A plan with the sharding decision and, when it shards, why.
#[derive(Clone, Debug)]
pub struct ShardingChoice {
    pub planned: Planned,
    /// The plan's replicas shard their optimizer state.
    pub sharded: bool,
    /// One line for the plan's explanation when it shards.
    pub why: Option<String>,
}

/// Whether the best plan found with sharded optimizer state (`sharded`) should run sharded:
/// it fits, it needs the memory sharding frees (`unsharded`: the same plan judged without
/// sharding, None when it cannot be judged so, does not fit or recomputes more stages), and it
/// is faster than the best plan without sharding (`plain`, None when there is none).
pub fn sharding_pays(
    plain: Option<&Evaluation>,
    sharded: &Evaluation,
    unsharded: Option<&Evaluation>,
) -> bool {
    if !sharded.fits() {
        return false;
    }
    let needs = match unsharded {
        None => true,
        Some(u) => !u.fits() || recomputing(u) > recomputing(sharded),
    };
    needs && plain.is_none_or(|u| !u.fits() || sharded.objective < u.objective)
}

/// Stages of a plan that recompute their activations.
fn recomputing(e: &Evaluation) -> usize {
    e.recompute.iter().filter(|&&r| r).count()
}

/// The explanation's line when [`sharding_pays`], else None: the one decision the planner and
/// the broker's placements take.
pub fn sharding_verdict(
    plain: Option<&Evaluation>,
    sharded: &Evaluation,
    unsharded: Option<&Evaluation>,
) -> Option<String> {
    sharding_pays(plain, sharded, unsharded).then(|| sharding_reason(plain, sharded, unsharded))
}

/// Plans `p` with `scheduler` twice, with and without sharded optimizer state, and keeps the
/// sharded plan where [`sharding_pays`]. A problem that already shards is planned once.
pub fn plan_sharding_where_memory_binds(
    p: &Problem,
    scheduler: Scheduler,
    o: &PlanOptions,
) -> Result<ShardingChoice, PlanError> {
    let plain = plan(p, scheduler, o);
    let unchosen = |planned: Planned, sharded: bool| ShardingChoice {
        planned,
        sharded,
        why: None,
    };
    if p.shard_optimizer {
        return plain.map(|x| {
            let replicated = x.plan.replicas() > 1;
            unchosen(x, replicated)
        });
    }
    let twin = p.with_sharding(true)?;
    let Ok(sharded) = plan(&twin, scheduler, o) else {
        return plain.map(|x| unchosen(x, false));
    };
    let unsharded = p.evaluate(&sharded.plan).ok();
    let best = plain.as_ref().ok().map(|x| &x.evaluation);
    let Some(why) = sharding_verdict(best, &sharded.evaluation, unsharded.as_ref()) else {
        return plain.map(|x| unchosen(x, false));
    };
    Ok(ShardingChoice {
        planned: sharded,
        sharded: true,
        why: Some(why),
    })
}

/// The explanation's line for a plan that shards.
fn sharding_reason(
    plain: Option<&Evaluation>,
    sharded: &Evaluation,
    unsharded: Option<&Evaluation>,
) -> String {
    let same_plan = match unsharded {
        Some(u) if !u.fits() => format!(
            "without sharding this plan would need {:.0}% of a device's memory",
            100.0 * u.memory_use
        ),
        Some(u) => format!(
            "without sharding this plan would recompute {} stage(s) instead of {}",
            recomputing(u),
            recomputing(sharded)
        ),
        None => "this plan cannot be judged without sharding".to_string(),
    };
    let best = match plain {
        None => "no plan fits without sharding".to_string(),
        Some(u) if !u.fits() => format!(
            "the best plan without it needs {:.0}% of a device's memory",
            100.0 * u.memory_use
        ),
        Some(u) => format!(
            "the best plan without it takes {:.1} ms per step and replica against {:.1} ms",
            u.objective * 1e3,
            sharded.objective * 1e3
        ),
    };
    format!(
        "replicas shard their optimizer state because memory binds: {same_plan}, and {best} \
         (peak {:.0}% with sharding)",
        100.0 * sharded.memory_use
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Resource;

    fn eval(objective: f64, memory_use: f64, recompute: &[bool]) -> Evaluation {
        Evaluation {
            step_s: objective,
            objective,
            bottleneck_s: 0.0,
            bottleneck: Resource::Stage(0),
            fill_s: 0.0,
            allreduce_s: 0.0,
            exchange_s: 0.0,
            update_s: 0.0,
            stage_s: vec![0.0; recompute.len()],
            links: Vec::new(),
            memory_use,
            recompute: recompute.to_vec(),
        }
    }

    #[test]
    fn a_plan_that_fits_without_sharding_does_not_shard() {
        let sharded = eval(1.0, 0.6, &[false, false]);
        let unsharded = eval(1.05, 0.8, &[false, false]);
        // Faster sharded (the update is divided), but memory does not bind.
        assert!(!sharding_pays(Some(&unsharded), &sharded, Some(&unsharded)));
    }

    #[test]
    fn a_plan_that_fits_only_sharded_shards_when_it_beats_the_best_unsharded_plan() {
        let sharded = eval(1.0, 0.9, &[false, false]);
        let unsharded = eval(1.0, 1.2, &[false, false]);
        let slower_plain = eval(1.5, 0.7, &[false, false, false]);
        let faster_plain = eval(0.9, 0.7, &[false]);
        assert!(sharding_pays(
            Some(&slower_plain),
            &sharded,
            Some(&unsharded)
        ));
        assert!(!sharding_pays(
            Some(&faster_plain),
            &sharded,
            Some(&unsharded)
        ));
        // Nothing fits without sharding.
        assert!(sharding_pays(None, &sharded, Some(&unsharded)));
        let nothing_fits = eval(f64::INFINITY, 1.3, &[false]);
        assert!(sharding_pays(
            Some(&nothing_fits),
            &sharded,
            Some(&unsharded)
        ));
    }

    #[test]
    fn sharding_that_saves_recomputation_pays_and_a_sharded_plan_that_does_not_fit_never_does() {
        let sharded = eval(1.0, 0.9, &[false, false]);
        let recomputing = eval(1.3, 0.95, &[true, false]);
        assert!(sharding_pays(
            Some(&recomputing),
            &sharded,
            Some(&recomputing)
        ));
        let too_big = eval(f64::INFINITY, 1.1, &[false]);
        assert!(!sharding_pays(None, &too_big, None));
        let line = sharding_reason(Some(&recomputing), &sharded, Some(&recomputing));
        assert!(line.contains("recompute 1 stage(s) instead of 0"), "{line}");
    }
}

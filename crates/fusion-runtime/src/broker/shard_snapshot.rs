//! Taking a sharded snapshot while training goes on. The pipeline pauses only while every stage
//! of the first replica copies its state in memory (`SaveShard`, answered by `ShardCaptured`);
//! the nodes then write their shards and the buddies copy them beside the next steps, and the
//! broker follows the answers (`ShardSaved`) as they arrive ([`InFlight`], a state machine with
//! no network in it), asks for the copies once every shard is written and writes the manifest
//! once every copy is made. Until then a recovery goes on from the snapshot before; a change of
//! placement gives the snapshot in flight up.

use super::sharded::{shard_name, Fetch, Shard, ShardedSnap};
use super::*;
use fusion_proto::{SaveShard, ShardSaved};

/// What a snapshot in flight needs next.
#[derive(Debug, PartialEq)]
pub(super) enum Next {
    /// Answers are still to come.
    Wait,
    /// Every shard is written: ask the buddies for their copies.
    Copy,
    /// Every copy is made: write the manifest.
    Commit,
    /// A shard could not be written or copied (by `by`, a writer or a buddy).
    Failed {
        shard: String,
        by: MemberId,
        why: String,
    },
}

/// A sharded snapshot being written and copied.
#[derive(Debug)]
pub(super) struct InFlight {
    pub step: u64,
    pub position: u64,
    pub opt_step: u64,
    /// An f16 job's loss scaler as the snapshot's step left it.
    pub loss_scale: Option<fusion_train::LossScaler>,
    /// The steps whose shards the nodes keep.
    pub keep: Vec<u64>,
    pub started: Instant,
    /// How long the pipeline paused for the in-memory copies.
    pub pause_s: f64,
    /// The writer of each stage's shard (the first replica's nodes), by stage, and the global
    /// ids of the parameters each stage holds.
    writers: Vec<MemberId>,
    stage_params: Vec<Vec<usize>>,
    written: Vec<Option<ShardSaved>>,
    /// Once every shard is written: the copies asked for (buddy, stage) and their answers.
    copies: Vec<(MemberId, usize, Option<ShardSaved>)>,
    copying: bool,
    /// Training steps taken meanwhile: their count and seconds.
    pub busy_steps: (u64, f64),
}

impl InFlight {
    pub fn new(
        step: u64,
        position: u64,
        opt_step: u64,
        keep: Vec<u64>,
        writers: Vec<MemberId>,
        stage_params: Vec<Vec<usize>>,
        loss_scale: Option<fusion_train::LossScaler>,
    ) -> Self {
        InFlight {
            step,
            position,
            opt_step,
            loss_scale,
            keep,
            started: Instant::now(),
            pause_s: 0.0,
            written: vec![None; writers.len()],
            writers,
            stage_params,
            copies: Vec::new(),
            copying: false,
            busy_steps: (0, 0.0),
        }
    }

    /// Takes `r` from member `from` when it is an answer this snapshot waits for (true): the
    /// shard of the sender's stage while shards are written, then a copy the sender was asked
    /// for. Anything else (another step, a shard it was not asked for, a repeat) is not.
    pub fn absorb(&mut self, from: MemberId, r: &ShardSaved) -> bool {
        if r.step != self.step {
            return false;
        }
        let slot = if self.copying {
            self.copies
                .iter_mut()
                .find(|(b, s, got)| *b == from && shard_name(*s) == r.shard && got.is_none())
                .map(|(_, _, got)| got)
        } else {
            self.writers
                .iter()
                .position(|w| *w == from)
                .filter(|&s| shard_name(s) == r.shard)
                .and_then(|s| self.written.get_mut(s))
                .filter(|got| got.is_none())
        };
        match slot {
            Some(got) => {
                *got = Some(r.clone());
                true
            }
            None => false,
        }
    }

    /// What the snapshot needs next; a failure is acted on as soon as it is heard.
    pub fn next(&self) -> Next {
        let failed = |by: MemberId, r: &ShardSaved| Next::Failed {
            shard: r.shard.clone(),
            by,
            why: r.error.clone(),
        };
        if !self.copying {
            let answers = self.writers.iter().zip(&self.written);
            if let Some((&by, Some(r))) = answers
                .clone()
                .find(|(_, r)| r.as_ref().is_some_and(|r| !r.error.is_empty()))
            {
                return failed(by, r);
            }
            return if answers.clone().all(|(_, r)| r.is_some()) {
                Next::Copy
            } else {
                Next::Wait
            };
        }
        for (by, _, got) in &self.copies {
            if let Some(r) = got.as_ref().filter(|r| !r.error.is_empty()) {
                return failed(*by, r);
            }
        }
        if self.copies.iter().all(|(_, _, got)| got.is_some()) {
            Next::Commit
        } else {
            Next::Wait
        }
    }

    /// The members whose answer is still to come.
    pub fn awaited(&self) -> Vec<MemberId> {
        let mut out: Vec<MemberId> = if self.copying {
            self.copies
                .iter()
                .filter(|(_, _, got)| got.is_none())
                .map(|(b, _, _)| *b)
                .collect()
        } else {
            self.writers
                .iter()
                .zip(&self.written)
                .filter(|(_, r)| r.is_none())
                .map(|(w, _)| *w)
                .collect()
        };
        out.sort_unstable();
        out.dedup();
        out
    }

    /// The global ids of the parameters of stage `s`.
    pub fn params_of(&self, s: usize) -> Vec<usize> {
        self.stage_params.get(s).cloned().unwrap_or_default()
    }

    /// How many stages write a shard.
    pub fn stages(&self) -> usize {
        self.writers.len()
    }

    /// The shards as written, by stage (every one, once [`Next::Copy`] was reached).
    pub fn written(&self) -> impl Iterator<Item = (usize, MemberId, &ShardSaved)> {
        self.writers
            .iter()
            .zip(&self.written)
            .enumerate()
            .filter_map(|(s, (w, r))| r.as_ref().map(|r| (s, *w, r)))
    }

    /// Moves on to the copies: buddy `b` copies stage `s`'s shard for each (b, s).
    pub fn begin_copies(&mut self, copies: &[(MemberId, usize)]) {
        self.copies = copies.iter().map(|&(b, s)| (b, s, None)).collect();
        self.copying = true;
    }

    /// The copies made, as (buddy, stage, where the buddy keeps it).
    pub fn copies(&self) -> impl Iterator<Item = (MemberId, usize, &ShardSaved)> {
        self.copies
            .iter()
            .filter_map(|(b, s, got)| got.as_ref().map(|r| (*b, *s, r)))
    }
}

/// What a snapshot taken beside training cost it: the pause, plus how much slower the steps
/// taken meanwhile (`busy`: count, seconds) were than steps without one (`quiet_mean_s`).
/// Without a quiet step to compare with, the whole time the snapshot was in flight counts.
pub(super) fn background_cost(
    pause_s: f64,
    busy: (u64, f64),
    quiet_mean_s: Option<f64>,
    in_flight_s: f64,
) -> f64 {
    let extra = match quiet_mean_s {
        Some(q) if q.is_finite() => (busy.1 - busy.0 as f64 * q).max(0.0),
        _ => in_flight_s,
    };
    pause_s + extra
}

impl Coordinator<'_> {
    /// Begins a sharded snapshot after `step`: every stage of the first replica copies its state
    /// in memory (the pipeline's only pause); the shards are written and copied beside the next
    /// steps. false: not begun (a stage could not copy its state).
    pub(super) async fn begin_sharded(
        &mut self,
        plan: &Plan,
        layout: &Layout,
        step: u64,
        position: u64,
    ) -> Flow<bool> {
        let t0 = Instant::now();
        let first = layout.replicas[0].clone();
        let keep: Vec<u64> = self.sharded.iter().map(|s| s.step).chain([step]).collect();
        let writers = first.iter().map(|&m| self.members[m].serial).collect();
        let since = self.latest();
        let opt_step = since.opt_step + self.updates_between(since.step, step);
        // In flight before anything is asked: a fast writer's answer may come with the copies'.
        let params = plan.stage_params.clone();
        let scale = self.scaler.clone();
        let f = InFlight::new(
            step,
            position,
            opt_step,
            keep.clone(),
            writers,
            params,
            scale,
        );
        self.snapshots.in_flight = Some(f);
        for (s, &m) in first.iter().enumerate() {
            let save = SaveShard {
                step,
                run_id: self.run_id.clone(),
                shard: shard_name(s),
                keep_steps: keep.clone(),
            };
            self.send(m, broker_message::Body::SaveShard(save)).await?;
        }
        let captured = self
            .gather(
                &first,
                "in-memory stage copies",
                Watch::Liveness,
                |_, _, m| {
                    Ok(match m.body {
                        Some(node_message::Body::ShardCaptured(r)) if r.step == step => Some(r),
                        _ => None,
                    })
                },
            )
            .await?;
        if let Some(bad) = captured.iter().find(|r| !r.error.is_empty()) {
            self.snapshots.in_flight = None;
            return Ok(self.sharded_failed(step, &bad.shard, &bad.error));
        }
        if let Some(f) = &mut self.snapshots.in_flight {
            f.pause_s = t0.elapsed().as_secs_f64();
        }
        Ok(true)
    }

    /// Moves the snapshot in flight on: asks the buddies for their copies once every shard is
    /// written, writes the manifest once every copy is made, and gives it up when a shard could
    /// not be written or copied, a writer or buddy is gone, or it takes too long.
    pub(super) async fn advance_sharded(&mut self, layout: &Layout) -> Flow<()> {
        let Some(f) = &self.snapshots.in_flight else {
            return Ok(());
        };
        let step = f.step;
        match f.next() {
            Next::Wait => {
                let limit = self.in_flight_limit();
                let gone = f.awaited().into_iter().find(|s| !self.is_live(*s));
                if let Some(serial) = gone {
                    let why = format!("member {serial} left before answering");
                    self.give_up_sharded(step, "a shard", &why);
                } else if f.started.elapsed() > limit {
                    let why = format!("not written and copied within {} s", limit.as_secs());
                    self.give_up_sharded(step, "a shard", &why);
                }
            }
            Next::Failed { shard, by, why } => {
                let who = self.name_of(by);
                self.give_up_sharded(step, &shard, &format!("{who}: {why}"));
            }
            Next::Copy => self.ask_buddies(layout).await?,
            Next::Commit => self.commit_sharded().await,
        }
        Ok(())
    }

    /// Drives the snapshot in flight to its end (made or given up), listening to the nodes
    /// meanwhile; a member lost while it waits interrupts the run as usual.
    pub(super) async fn finish_sharded(&mut self, layout: &Layout) -> Flow<()> {
        let since = Instant::now();
        loop {
            self.advance_sharded(layout).await?;
            let Some(f) = &self.snapshots.in_flight else {
                return Ok(());
            };
            let awaited: Vec<usize> = f
                .awaited()
                .iter()
                .filter_map(|s| self.members.iter().position(|m| m.serial == *s))
                .collect();
            let done = vec![false; awaited.len()];
            let heard = tokio::time::timeout(
                Duration::from_millis(250),
                self.next_message(&awaited, &done, Watch::Liveness, since, "shard copies"),
            )
            .await;
            if let Ok(Err(interrupt)) = heard {
                return Err(interrupt);
            }
        }
    }

    /// Records a training step of `seconds` for the snapshot's cost: one taken while a snapshot
    /// was in flight, or a quiet one to compare with.
    pub(super) fn note_train_step(&mut self, seconds: f64) {
        let s = &mut self.snapshots;
        match &mut s.in_flight {
            Some(f) => {
                f.busy_steps.0 += 1;
                f.busy_steps.1 += seconds;
            }
            None => {
                s.quiet_steps.0 += 1;
                s.quiet_steps.1 += seconds;
            }
        }
    }

    /// The longest a snapshot may stay in flight: twice what fetching a stage's share of the
    /// state (parameters and two moments in f32) may take, once to write it and once to copy it.
    fn in_flight_limit(&self) -> Duration {
        let numel: usize = self.graph.params.iter().map(|p| p.numel()).sum();
        let stages = self
            .snapshots
            .in_flight
            .as_ref()
            .map_or(1, |f| f.stages().max(1));
        crate::fetch::fetch_deadline(numel as u64 * 12 / stages as u64).saturating_mul(2)
    }

    fn is_live(&self, serial: MemberId) -> bool {
        self.members
            .iter()
            .any(|m| m.serial == serial && m.gone.is_none())
    }

    pub(super) fn name_of(&self, serial: MemberId) -> String {
        self.members
            .iter()
            .find(|m| m.serial == serial)
            .map_or_else(|| format!("member {serial}"), |m| m.id.clone())
    }

    /// Gives the snapshot in flight up: reported, and training goes on from the one before.
    fn give_up_sharded(&mut self, step: u64, shard: &str, why: &str) {
        self.snapshots.in_flight = None;
        self.sharded_failed(step, shard, why);
        // The next try waits from now, not from the step the snapshot began at.
        let now = self.history.steps.last().map_or(step, |s| s.step);
        self.snapshots.failed_at = Some(now.max(step));
    }

    /// Makes the snapshot in flight when every copy of it is made (a recovery about to roll back
    /// goes on from it), then forgets whatever is left in flight.
    pub(super) async fn settle_sharded(&mut self) {
        let copied = self
            .snapshots
            .in_flight
            .as_ref()
            .is_some_and(|f| f.next() == Next::Commit);
        if copied {
            self.commit_sharded().await;
        }
        self.snapshots.in_flight = None;
    }

    /// Every shard is written: each writer's buddy copies it.
    async fn ask_buddies(&mut self, layout: &Layout) -> Flow<()> {
        let Some(f) = &self.snapshots.in_flight else {
            return Ok(());
        };
        let (step, keep) = (f.step, f.keep.clone());
        let first = &layout.replicas[0];
        let all = layout.all();
        // A buddy dials the writer for its copy: a writer that accepts no connections (behind
        // a NAT) has none, and its shard is committed once written.
        let buddies: Vec<Option<usize>> =
            super::sharded::choose_buddies(first, &all, |a, b| self.bandwidth_between(a, b))
                .into_iter()
                .zip(first)
                .map(|(b, &w)| b.filter(|_| self.reachable(w)))
                .collect();
        let alone: Vec<&str> = first
            .iter()
            .filter(|&&w| all.len() > 1 && !self.reachable(w))
            .map(|&w| self.members[w].id.as_str())
            .collect();
        if !alone.is_empty() && !self.snapshots.warned_unbuddied {
            tracing::warn!(
                "{} accept no connections: their shards of the sharded snapshots have no copy on                  another node (losing one of them rolls back to the broker's snapshot)",
                alone.join(", ")
            );
            self.snapshots.warned_unbuddied = true;
        }
        let mut fetches = Vec::new();
        for (s, r) in f
            .written()
            .map(|(s, _, r)| (s, r.clone()))
            .collect::<Vec<_>>()
        {
            if let Some(Some(b)) = buddies.get(s) {
                let fetch = Fetch {
                    fetcher: *b,
                    shard: s,
                    holder: first[s],
                };
                fetches.push((fetch, r));
            }
        }
        let copies: Vec<(MemberId, usize)> = fetches
            .iter()
            .map(|(f, _)| (self.members[f.fetcher].serial, f.shard))
            .collect();
        if let Some(f) = &mut self.snapshots.in_flight {
            f.begin_copies(&copies);
        }
        let asked: Vec<(Fetch, String, u64, String)> = fetches
            .into_iter()
            .map(|(f, r)| (f, r.shard, r.bytes, r.sha256))
            .collect();
        self.ask_fetches(&asked, step, &keep).await
    }

    /// Every copy is made: the manifest is written and the snapshot becomes the one a recovery
    /// goes on from (unless a newer one was taken meanwhile).
    async fn commit_sharded(&mut self) {
        let Some(f) = self.snapshots.in_flight.take() else {
            return;
        };
        if f.step <= self.latest().step {
            return;
        }
        let mut shards: Vec<Shard> = f
            .written()
            .map(|(s, writer, r)| self.shard_of(f.params_of(s), s, writer, r))
            .collect();
        for (buddy, s, r) in f.copies() {
            let Some(m) = self.members.iter().find(|m| m.serial == buddy) else {
                continue;
            };
            if let Some(shard) = shards.get_mut(s) {
                shard.entry.copies.push(fusion_train::ShardCopy {
                    node: m.id.clone(),
                    path: r.path.clone(),
                });
                shard.holders.push(buddy);
            }
        }
        let snap = ShardedSnap {
            step: f.step,
            data_position: f.position,
            opt_step: f.opt_step,
            shards,
            named: false,
            loss_scale: f.loss_scale.clone(),
        };
        if let Err(e) = self.write_manifest(&snap).await {
            self.sharded_failed(f.step, "manifest", &e.to_string());
            return;
        }
        let in_flight_s = f.started.elapsed().as_secs_f64();
        let bytes: u64 = snap.shards.iter().map(|s| s.entry.bytes).sum();
        tracing::info!(
            "sharded snapshot of step {}: {} shards, {:.1} MB, pipeline paused {:.2} s, written \
             and copied to buddies beside {} steps in {in_flight_s:.2} s",
            f.step,
            snap.shards.len(),
            bytes as f64 / 1e6,
            f.pause_s,
            f.busy_steps.0
        );
        self.sharded = Some(snap);
        self.snapshots.count_sharded(&f, in_flight_s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn saved(step: u64, shard: &str, error: &str) -> ShardSaved {
        ShardSaved {
            step,
            shard: shard.into(),
            bytes: 10,
            sha256: "ab".into(),
            path: "/p".into(),
            error: error.into(),
        }
    }

    #[test]
    fn a_snapshot_in_flight_takes_each_answer_it_waits_for_once_and_moves_on() {
        let (a, b): (MemberId, MemberId) = (1, 2);
        let mut f = InFlight::new(10, 40, 10, vec![5, 10], vec![a, b], vec![], None);
        assert_eq!(f.next(), Next::Wait);
        assert_eq!(f.awaited(), vec![a, b]);
        // Another step, another stage's shard name, a stranger: not answers.
        assert!(!f.absorb(a, &saved(9, "stage-000", "")));
        assert!(!f.absorb(a, &saved(10, "stage-001", "")));
        assert!(!f.absorb(7, &saved(10, "stage-000", "")));
        assert!(f.absorb(a, &saved(10, "stage-000", "")));
        assert!(!f.absorb(a, &saved(10, "stage-000", "")), "a repeat");
        assert_eq!(f.awaited(), vec![b]);
        assert!(f.absorb(b, &saved(10, "stage-001", "")));
        assert_eq!(f.next(), Next::Copy);
        // b copies stage 0, a copies stage 1: a write answer now is not a copy's.
        f.begin_copies(&[(b, 0), (a, 1)]);
        assert_eq!(f.next(), Next::Wait);
        assert!(!f.absorb(a, &saved(10, "stage-000", "")));
        assert!(f.absorb(b, &saved(10, "stage-000", "")));
        assert_eq!(f.awaited(), vec![a]);
        assert!(f.absorb(a, &saved(10, "stage-001", "")));
        assert_eq!(f.next(), Next::Commit);
        let copies: Vec<(MemberId, usize)> = f.copies().map(|(m, s, _)| (m, s)).collect();
        assert_eq!(copies, vec![(b, 0), (a, 1)]);
        assert_eq!(f.written().count(), 2);
    }

    #[test]
    fn a_failed_write_or_copy_fails_the_snapshot_as_soon_as_it_is_heard() {
        let (a, b): (MemberId, MemberId) = (1, 2);
        let mut f = InFlight::new(3, 0, 3, vec![3], vec![a, b], vec![], None);
        assert!(f.absorb(b, &saved(3, "stage-001", "disk full")));
        assert_eq!(
            f.next(),
            Next::Failed {
                shard: "stage-001".into(),
                by: b,
                why: "disk full".into()
            }
        );
        let mut f = InFlight::new(3, 0, 3, vec![3], vec![a], vec![], None);
        assert!(f.absorb(a, &saved(3, "stage-000", "")));
        f.begin_copies(&[(b, 0)]);
        assert!(f.absorb(b, &saved(3, "stage-000", "checksum mismatch")));
        assert!(matches!(f.next(), Next::Failed { by, .. } if by == b));
        // No buddy at all (a lone node): committed once written.
        let mut f = InFlight::new(3, 0, 3, vec![3], vec![a], vec![], None);
        assert!(f.absorb(a, &saved(3, "stage-000", "")));
        f.begin_copies(&[]);
        assert_eq!(f.next(), Next::Commit);
    }

    #[test]
    fn a_background_snapshot_costs_its_pause_and_the_slowdown_of_the_steps_beside_it() {
        // Two steps of 1.5 s beside it where quiet steps take 1 s: 1 s slower, plus the pause.
        assert!((background_cost(0.2, (2, 3.0), Some(1.0), 9.0) - 1.2).abs() < 1e-12);
        // Steps no slower: only the pause.
        assert!((background_cost(0.2, (2, 1.8), Some(1.0), 9.0) - 0.2).abs() < 1e-12);
        // Nothing to compare with: the whole time in flight counts.
        assert!((background_cost(0.2, (2, 3.0), None, 9.0) - 9.2).abs() < 1e-12);
    }
}

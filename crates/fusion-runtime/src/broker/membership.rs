//! Membership: admission, liveness, choosing the members a run uses (elastic: fewer than planned
//! after a grace period, more when nodes join), and waiting on the active members' messages.

use super::stall::{blame, Observed};
use super::*;

/// How many of `available` members a run can use: the job's `target`, or, when `shrink` allows
/// it, as many whole replicas as are there, but not fewer than `floor`. None: wait for more.
pub(super) fn usable_nodes(
    available: usize,
    target: usize,
    replicas: usize,
    floor: usize,
    shrink: bool,
) -> Option<usize> {
    if available >= target {
        return Some(target);
    }
    let n = available / replicas.max(1) * replicas.max(1);
    (shrink && n >= floor.max(1)).then_some(n)
}

impl Coordinator<'_> {
    /// Applies a control-plane event to the membership (joins, closed streams, requests to
    /// leave); returns a node's message for whoever waits on it.
    pub(super) fn handle_membership(
        &mut self,
        serial: MemberId,
        ev: Event,
    ) -> Option<(MemberId, NodeMessage)> {
        match ev {
            Event::Joined(join, pin, tx, live) => {
                self.admit(serial, *join, pin, tx, live);
                None
            }
            Event::Closed(reason) => {
                if let Some(m) = self.members.iter_mut().find(|m| m.serial == serial) {
                    tracing::info!("{} left: {reason}", m.id);
                    m.gone = Some(reason);
                    // End the broker's half too, so that a node closing cleanly is not kept
                    // waiting; sends to it now fail as to any lost member.
                    m.tx = tokio::sync::mpsc::channel(1).0;
                }
                None
            }
            Event::Message(m) => {
                self.note_leave(serial, &m);
                // An answer to the sharded snapshot in flight is taken wherever it arrives.
                if let (Some(node_message::Body::ShardSaved(r)), Some(f)) =
                    (&m.body, &mut self.snapshots.in_flight)
                {
                    if f.absorb(serial, r) {
                        return None;
                    }
                }
                Some((serial, m))
            }
        }
    }

    fn admit(
        &mut self,
        serial: MemberId,
        join: fusion_proto::Join,
        certificate: [u8; 32],
        tx: ToNode,
        live: Arc<Liveness>,
    ) {
        if self
            .members
            .iter()
            .any(|m| m.id == join.node_id && m.gone.is_none())
        {
            let _ = tx.try_send(Err(tonic::Status::already_exists(format!(
                "a node named '{}' is already in the job",
                join.node_id
            ))));
            return;
        }
        // Figures no device has are taken as unknown.
        let caps = claims::bounded(&join.capabilities.unwrap_or_default());
        (self.on_event)(BrokerEvent::Joined {
            node: &join.node_id,
            capabilities: &caps,
        });
        tracing::info!(
            "{} joined ({}, {})",
            join.node_id,
            caps.backend,
            caps.device
        );
        // A node that joins again may do so from elsewhere: its reachability is probed afresh.
        self.forget_reachability(&join.node_id);
        self.members.push(Member {
            serial,
            id: join.node_id,
            caps,
            data_address: join.data_address,
            certificate,
            tx,
            live,
            gone: None,
            leaving: None,
            derate: 1.0,
            benched: None,
        });
    }

    pub(super) async fn settle(&mut self, d: Duration) {
        let deadline = tokio::time::Instant::now() + d;
        while let Ok(Some((serial, ev))) =
            tokio::time::timeout_at(deadline, self.events.recv()).await
        {
            self.handle_membership(serial, ev);
        }
    }

    /// Members that can take part in the next run: joined, connected, not leaving and not
    /// benched.
    pub(super) fn available(&self) -> usize {
        self.members.iter().filter(|m| m.can_serve()).count()
    }

    /// Brings benched members back when the job cannot run without them; whether there were any.
    fn unbench(&mut self) -> bool {
        let mut any = false;
        for m in &mut self.members {
            if let Some(why) = m.benched.take() {
                tracing::warn!(
                    "{} trains again (benched: {why}): too few other nodes",
                    m.id
                );
                any = true;
            }
        }
        any
    }

    /// How many of `available` members a run can use (see [`usable_nodes`]).
    pub(super) fn usable_nodes(&self, available: usize, shrink: bool) -> Option<usize> {
        let floor = self.cfg.min_nodes.max(self.job.replicas);
        let shrink = shrink && self.job.cuts.is_none();
        usable_nodes(available, self.job.nodes, self.job.replicas, floor, shrink)
    }

    /// Waits until the job's nodes have joined, or, after `grace`, goes on with fewer (when the
    /// job allows it); gives up after the join timeout. Returns the active members, in name order.
    pub(super) async fn choose_members(&mut self, grace: Duration) -> Result<Vec<usize>> {
        let now = tokio::time::Instant::now();
        let (grace_end, deadline) = (now + grace, now + self.cfg.join_timeout);
        let count = loop {
            let waited_out = tokio::time::Instant::now() >= grace_end;
            if let Some(n) = self.usable_nodes(self.available(), waited_out) {
                break n;
            }
            if waited_out && self.unbench() {
                continue;
            }
            let until = if waited_out { deadline } else { grace_end };
            match tokio::time::timeout_at(until, self.events.recv()).await {
                Ok(Some((serial, ev))) => {
                    self.handle_membership(serial, ev);
                }
                Ok(None) => return Err(RuntimeError::Protocol("the control plane stopped".into())),
                Err(_) if until == deadline => {
                    return Err(RuntimeError::Timeout(format!(
                        "{} of {} nodes joined within {} s",
                        self.available(),
                        self.job.nodes,
                        self.cfg.join_timeout.as_secs()
                    )))
                }
                Err(_) => {}
            }
        };
        // Gone and leaving members are dropped between runs (never during one, so member
        // indices stay valid while a plan uses them).
        self.release_leavers();
        for m in &self.members {
            if let Some(reason) = &m.gone {
                (self.on_event)(BrokerEvent::NodeLost {
                    node: &m.id,
                    reason,
                });
            }
        }
        self.members.retain(|m| m.gone.is_none());
        // Stages go to nodes in the order of their names, so placement is reproducible; benched
        // members come last, outside the run.
        self.members
            .sort_by(|a, b| (a.benched.is_some(), &a.id).cmp(&(b.benched.is_some(), &b.id)));
        // Members left out of this run drop whatever stage they held (an idle one that asked to
        // leave then exits by itself).
        for m in &self.members[count..] {
            let reason = "standing by: not part of the current placement".to_string();
            let _ =
                m.tx.try_send(Ok(msg(broker_message::Body::Reset(Reset { reason }))));
        }
        Ok((0..count).collect())
    }

    /// Members that asked to leave are told to stop and dropped.
    fn release_leavers(&mut self) {
        for m in self.members.iter().filter(|m| m.leaving.is_some()) {
            let reason = "released: the job goes on without this node".to_string();
            let _ = m.tx.try_send(Ok(msg(broker_message::Body::Stop(Stop {
                reason,
                evicted: false,
            }))));
            tracing::info!("{} released", m.id);
        }
        self.members.retain(|m| m.leaving.is_none());
    }

    /// Members that are connected but not part of the run (`active`): spares a run could grow to.
    pub(super) fn spares(&self, active: &[usize]) -> usize {
        (0..self.members.len())
            .filter(|i| !active.contains(i))
            .filter(|&i| self.members[i].can_serve())
            .count()
    }

    /// Records a node's request to leave; it keeps serving until the next step boundary.
    fn note_leave(&mut self, serial: MemberId, m: &NodeMessage) {
        if let Some(node_message::Body::Leave(l)) = &m.body {
            if let Some(mem) = self.members.iter_mut().find(|x| x.serial == serial) {
                tracing::info!("{} asks to leave: {}", mem.id, l.reason);
                mem.leaving.get_or_insert_with(|| l.reason.clone());
            }
        }
    }

    /// Whether the run should change shape at this step boundary: a member asked to leave, or
    /// spares can bring the job back to (towards) its planned size.
    pub(super) fn reshape_due(&self, active: &[usize]) -> Option<String> {
        if let Some(m) = active
            .iter()
            .map(|&i| &self.members[i])
            .find(|m| m.leaving.is_some())
        {
            // Only when the run can go on without it; otherwise it serves until it can.
            if self.usable_nodes(self.available(), true).is_some() {
                return Some(format!("{} leaves", m.id));
            }
        }
        let grown = self.usable_nodes(active.len() + self.spares(active), true)?;
        (grown > active.len())
            .then(|| format!("{} nodes available, {} in use", grown, active.len()))
    }

    /// The silent or disconnected member among `active`, if any.
    fn lost_among(&self, active: &[usize], what: &str) -> Option<Interrupt> {
        for &i in active {
            let m = &self.members[i];
            if let Some(reason) = &m.gone {
                return Some(Interrupt::Lost {
                    serial: m.serial,
                    node: m.id.clone(),
                    reason: reason.clone(),
                });
            }
            let silent = m.live.silent_for();
            if silent > self.cfg.node_timeout {
                return Some(Interrupt::Lost {
                    serial: m.serial,
                    node: m.id.clone(),
                    reason: format!(
                        "no heartbeat for {:.1} s (timeout {} s) while waiting for {what}",
                        silent.as_secs_f64(),
                        self.cfg.node_timeout.as_secs_f64()
                    ),
                });
            }
        }
        None
    }

    /// The next message from an active node, checking liveness meanwhile, and, with `watch`,
    /// whether the members that have not answered yet (`done` false) are stalled (counting
    /// stillness only since `since`, when the broker asked for what it waits for).
    pub(super) async fn next_message(
        &mut self,
        active: &[usize],
        done: &[bool],
        watch: Watch,
        since: Instant,
        what: &str,
    ) -> Flow<(usize, NodeMessage)> {
        loop {
            if let Some(lost) = self.lost_among(active, what) {
                return Err(lost);
            }
            if watch == Watch::Progress {
                let stalled = self
                    .stall_deadline()
                    .and_then(|d| self.stalled_among(active, done, since, d));
                if let Some((pos, reason)) = stalled {
                    return Err(self.eviction(active[pos], reason));
                }
            }
            let got = tokio::time::timeout(Duration::from_millis(200), self.events.recv()).await;
            let Ok(got) = got else { continue };
            let Some((serial, ev)) = got else {
                return Err(Interrupt::from(RuntimeError::Protocol(
                    "the control plane stopped".into(),
                )));
            };
            let Some((serial, m)) = self.handle_membership(serial, ev) else {
                continue;
            };
            if let Some(reply) = self.hear(active, done, since, serial, m)? {
                return Ok(reply);
            }
        }
    }

    /// How long the awaited members may all make no progress before one is blamed: the
    /// configured stall timeout, at least four recent steps, twice the timeout before any step
    /// was timed (below the nodes' default peer timeout, so the broker blames first). None: stall detection is off.
    fn stall_deadline(&self) -> Option<Duration> {
        let t = self.cfg.stall_timeout;
        if t.is_zero() {
            return None;
        }
        Some(match self.history.mean_step_s() {
            Some(step) => t.max(Duration::from_secs_f64(4.0 * step.clamp(0.0, 86_400.0))),
            None => t.saturating_mul(2),
        })
    }

    /// The position in `active` of the member to evict, and why, when every awaited member has
    /// been still for `deadline` since `since` (see [`blame`]).
    fn stalled_among(
        &self,
        active: &[usize],
        done: &[bool],
        since: Instant,
        deadline: Duration,
    ) -> Option<(usize, String)> {
        let observed: Vec<Observed> = active
            .iter()
            .zip(done)
            .map(|(&i, &done)| {
                let m = &self.members[i];
                let seen = m.live.progress();
                let (progress, still_for) = match seen {
                    Some((p, still)) if p.generation == self.generation => {
                        (Some(p), still.min(since.elapsed()))
                    }
                    _ => (None, Duration::ZERO),
                };
                Observed {
                    node: m.id.clone(),
                    progress,
                    still_for,
                    done,
                }
            })
            .collect();
        blame(&observed, deadline)
    }

    /// Evicts member `i`, or, when its stream has already ended, reports it lost.
    pub(super) fn eviction(&self, i: usize, reason: String) -> Interrupt {
        let m = &self.members[i];
        match &m.gone {
            Some(gone) => Interrupt::Lost {
                serial: m.serial,
                node: m.id.clone(),
                reason: gone.clone(),
            },
            None => Interrupt::Evicted {
                serial: m.serial,
                node: m.id.clone(),
                reason,
            },
        }
    }

    /// Sorts a member's message: a failure interrupts the run; anything else from an active
    /// member but a leave (noted for the next step boundary) goes to the caller, with the
    /// member's position in `active`.
    fn hear(
        &self,
        active: &[usize],
        done: &[bool],
        since: Instant,
        serial: MemberId,
        m: NodeMessage,
    ) -> Flow<Option<(usize, NodeMessage)>> {
        let Some(pos) = active
            .iter()
            .position(|&i| self.members[i].serial == serial)
        else {
            return Ok(None);
        };
        match &m.body {
            // A failure of an earlier generation is the echo of what was already recovered from.
            Some(node_message::Body::Failure(f))
                if f.generation != 0 && f.generation != self.generation =>
            {
                Ok(None)
            }
            Some(node_message::Body::Failure(f)) => {
                Err(self.attribute(active, done, since, pos, f))
            }
            Some(node_message::Body::Leave(_)) | Some(node_message::Body::Heartbeat(_)) => Ok(None),
            _ => Ok(Some((pos, m))),
        }
    }

    /// A node's failure report. Proof against an active peer (a malformed tensor) evicts that
    /// peer; a suspicion (a timed-out wait, a broken session) evicts whoever the others'
    /// progress blames, the reporter aside; otherwise the run rolls back and retries with the
    /// same nodes.
    fn attribute(
        &self,
        active: &[usize],
        done: &[bool],
        since: Instant,
        pos: usize,
        f: &fusion_proto::Failure,
    ) -> Interrupt {
        let reporter = self.members[active[pos]].id.clone();
        let failed = || Interrupt::Failed {
            node: reporter.clone(),
            reason: f.message.clone(),
        };
        if f.path_failed && !f.blame.is_empty() {
            // The path failed, not a node: the next placement routes the pair another way.
            self.route_around(&reporter, &f.blame, &f.message);
            return failed();
        }
        let blamed = active
            .iter()
            .copied()
            .find(|&i| !f.blame.is_empty() && self.members[i].id == f.blame && i != active[pos]);
        let Some(blamed) = blamed else {
            return failed();
        };
        if f.proven {
            return self.eviction(blamed, format!("blamed by {reporter}: {}", f.message));
        }
        let mut done = done.to_vec();
        done[pos] = true;
        let deadline = self.cfg.stall_timeout;
        match (!deadline.is_zero())
            .then(|| self.stalled_among(active, &done, since, deadline))
            .flatten()
        {
            Some((i, why)) => {
                let reason = format!("{why} (after {reporter}: {})", f.message);
                self.eviction(active[i], reason)
            }
            None => failed(),
        }
    }

    /// Waits for one reply from every member in `active`: `accept` turns a message into the
    /// member's reply (None: not the awaited one, keep waiting). With `watch`, members whose
    /// progress stalls are blamed.
    pub(super) async fn gather<T>(
        &mut self,
        active: &[usize],
        what: &str,
        watch: Watch,
        mut accept: impl FnMut(&mut Self, usize, NodeMessage) -> Flow<Option<T>>,
    ) -> Flow<Vec<T>> {
        let mut replies: Vec<Option<T>> = (0..active.len()).map(|_| None).collect();
        let since = Instant::now();
        while replies.iter().any(Option::is_none) {
            let done: Vec<bool> = replies.iter().map(Option::is_some).collect();
            let (pos, m) = self.next_message(active, &done, watch, since, what).await?;
            if replies[pos].is_none() {
                replies[pos] = accept(self, pos, m)?;
            }
        }
        Ok(replies.into_iter().flatten().collect())
    }

    pub(super) async fn send(&self, member: usize, body: broker_message::Body) -> Flow<()> {
        let m = &self.members[member];
        m.tx.send(Ok(msg(body))).await.map_err(|_| Interrupt::Lost {
            serial: m.serial,
            node: m.id.clone(),
            reason: "its control stream is closed".into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::usable_nodes;

    #[test]
    fn a_run_uses_its_planned_nodes_or_after_the_grace_period_whole_replicas_above_the_floor() {
        // Enough nodes: exactly the planned number, spares stay spares.
        assert_eq!(usable_nodes(5, 4, 1, 1, false), Some(4));
        // Too few: wait, unless shrinking is allowed.
        assert_eq!(usable_nodes(3, 4, 1, 1, false), None);
        assert_eq!(usable_nodes(3, 4, 1, 1, true), Some(3));
        // Never below the floor, never a partial replica.
        assert_eq!(usable_nodes(1, 4, 1, 2, true), None);
        assert_eq!(usable_nodes(5, 6, 2, 2, true), Some(4));
        assert_eq!(usable_nodes(1, 4, 2, 2, true), None);
        assert_eq!(usable_nodes(0, 4, 1, 1, true), None);
    }
}

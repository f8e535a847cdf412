//! The run loop: choose the members, place the stages, train. A lost or failed node rolls the
//! run back to the last snapshot and goes on, with a replacement or with fewer nodes (with
//! islands, when it can, only its island is taken out: `island_loss.rs`); a node leaving or
//! joining changes the placement at a step boundary without a rollback.

use super::island_loss::Current;
use super::*;

/// How the last run of the pipeline ended, for the next one.
enum Then {
    /// The first run: wait for every node.
    Start,
    /// After a recovery: wait for a replacement up to the grace period, then go on with fewer.
    Recover(PendingRecovery),
    /// After a reshape: use whoever is there now.
    Reshape(ReshapeRecord, Instant),
    /// After an island was taken out: the islands left go on, keeping their state.
    IslandOut(PendingRecovery),
}

/// A lost, failed or evicted node, and why.
struct Fault {
    node: String,
    reason: String,
    /// The member to drop (lost or evicted); a failed node stays.
    gone: Option<MemberId>,
    evicted: bool,
}

/// A recovery whose duration is known once the new placement is ready.
struct PendingRecovery {
    record: RecoveryRecord,
    since: Instant,
}

impl Coordinator<'_> {
    pub(super) async fn run(&mut self) -> Result<ClusterReport> {
        self.history.start_step = self.latest().step;
        let mut then = Then::Start;
        loop {
            let (nodes, outcome) = match then {
                Then::IslandOut(_) => {
                    let nodes = self.current.as_ref().map_or(0, |c| c.layout.all().len());
                    (nodes, self.resume_islands(&mut then).await)
                }
                _ => {
                    let grace = match then {
                        Then::Start => self.cfg.join_timeout,
                        Then::Recover(_) => self.cfg.replace_grace,
                        Then::Reshape(..) | Then::IslandOut(_) => Duration::ZERO,
                    };
                    let active = self.choose_members(grace).await?;
                    (active.len(), self.place_and_train(&active, &mut then).await)
                }
            };
            // A change whose new placement never became ready is still recorded.
            self.record_change(std::mem::replace(&mut then, Then::Start), nodes);
            then = match outcome {
                Ok(()) => break,
                Err(Interrupt::Fatal(e)) => {
                    self.finish_checkpoint_write().await;
                    return Err(*e);
                }
                Err(Interrupt::Reshape(why)) => self.reshape(&why, nodes),
                Err(Interrupt::Lost {
                    serial,
                    node,
                    reason,
                }) => {
                    let fault = Fault {
                        node,
                        reason,
                        gone: Some(serial),
                        evicted: false,
                    };
                    self.after_fault(fault, nodes).await?
                }
                Err(Interrupt::Failed { node, reason }) => {
                    let fault = Fault {
                        node,
                        reason,
                        gone: None,
                        evicted: false,
                    };
                    self.after_fault(fault, nodes).await?
                }
                Err(Interrupt::Evicted {
                    serial,
                    node,
                    reason,
                }) => {
                    let fault = Fault {
                        node,
                        reason: format!("evicted: {reason}"),
                        gone: Some(serial),
                        evicted: true,
                    };
                    self.after_fault(fault, nodes).await?
                }
            };
        }
        Ok(self.report())
    }

    /// What follows a lost, failed or evicted node: its island alone is taken out when the loss
    /// can stay local ([`Coordinator::local_loss`]), else every node rolls back.
    async fn after_fault(&mut self, fault: Fault, nodes: usize) -> Result<Then> {
        let Fault {
            node,
            reason,
            gone,
            evicted,
        } = fault;
        // Node ids, not member indices: a lost member is dropped below.
        let local = self
            .local_loss(&node)
            .and_then(|k| self.island_ids().map(|ids| (k, ids)));
        match gone {
            Some(serial) if evicted => self.evict(serial, &reason).await,
            Some(serial) => self.members.retain(|m| m.serial != serial),
            None => {}
        }
        let event = match gone {
            Some(_) => BrokerEvent::NodeLost {
                node: &node,
                reason: &reason,
            },
            None => BrokerEvent::StepFailed {
                node: &node,
                reason: &reason,
            },
        };
        (self.on_event)(event);
        self.note_failure(&node, &reason)?;
        let since = Instant::now();
        if let Some((k, ids)) = local {
            match self.take_island_out(k, &node, &reason, ids, nodes) {
                Ok(mut record) => {
                    record.evicted = evicted;
                    return Ok(Then::IslandOut(PendingRecovery { record, since }));
                }
                Err(e) => tracing::warn!("{e}: rolling every island back instead"),
            }
        }
        let mut pending = self.recover(node, reason, nodes).await?;
        pending.record.evicted = evicted;
        Ok(Then::Recover(pending))
    }

    /// Counts a failure; gives up after too many.
    pub(super) fn note_failure(&mut self, node: &str, reason: &str) -> Result<()> {
        self.failures.push(format!("{node}: {reason}"));
        if self.failures.len() > self.cfg.max_recoveries {
            return Err(RuntimeError::Config(format!(
                "giving up after {} recoveries; last: {node}: {reason}",
                self.cfg.max_recoveries
            )));
        }
        Ok(())
    }

    /// Places the stages on `active`, sets compression and trains; records how long the change
    /// that led here (a recovery, a reshape) took once the new placement is ready.
    async fn place_and_train(&mut self, active: &[usize], then: &mut Then) -> Flow<()> {
        // A sharded snapshot still in flight belongs to the placement that ended; the quiet
        // steps its cost is measured against, too.
        self.snapshots.in_flight = None;
        self.snapshots.quiet_steps = (0, 0.0);
        // Nothing to resume from until the new placement trains.
        self.current = None;
        self.resumable = None;
        self.islands_out = None;
        let (plan, layout, stages) = self.assign(active).await?;
        self.current = Some(Current {
            plan: plan.clone(),
            layout: layout.clone(),
            stages,
        });
        self.record_change(std::mem::replace(then, Then::Start), active.len());
        self.set_compression(&plan, &layout, None).await?;
        self.train(&plan, &layout).await
    }

    /// Goes on with the islands left after one was taken out, keeping their state.
    async fn resume_islands(&mut self, then: &mut Then) -> Flow<()> {
        let (plan, layout) = self.keep_islands().await?;
        self.record_change(std::mem::replace(then, Then::Start), layout.all().len());
        self.set_compression(&plan, &layout, None).await?;
        self.train(&plan, &layout).await
    }

    /// Records how a recovery or reshape ended: on `nodes` nodes, so many seconds after it began.
    fn record_change(&mut self, then: Then, nodes: usize) {
        match then {
            Then::Recover(mut p) | Then::IslandOut(mut p) => {
                p.record.nodes_after = nodes;
                p.record.seconds = p.since.elapsed().as_secs_f64();
                self.recoveries.push(p.record);
            }
            Then::Reshape(mut r, since) => {
                r.nodes_after = nodes;
                r.seconds = since.elapsed().as_secs_f64();
                (self.on_event)(BrokerEvent::Reshaped {
                    step: r.step,
                    why: &r.why,
                });
                self.reshapes.push(r);
            }
            Then::Start => {}
        }
    }

    /// A membership change at a step boundary: the state was just snapshotted, nothing is lost.
    fn reshape(&mut self, why: &str, nodes_before: usize) -> Then {
        let step = self.latest().step;
        tracing::info!("step {step}: re-planning: {why}");
        let record = ReshapeRecord {
            step,
            why: why.to_string(),
            nodes_before,
            nodes_after: 0,
            seconds: 0.0,
        };
        Then::Reshape(record, Instant::now())
    }

    /// Tells an evicted member to stop, and drops it.
    async fn evict(&mut self, serial: MemberId, reason: &str) {
        if let Some(m) = self.members.iter().find(|m| m.serial == serial) {
            let body = broker_message::Body::Stop(Stop {
                reason: reason.to_string(),
                evicted: true,
            });
            let _ = m.tx.try_send(Ok(msg(body)));
        }
        self.members.retain(|m| m.serial != serial);
    }

    /// Rolls every node back after a loss or failure: reset them all, let the consequences
    /// arrive, and go on from the last snapshot.
    async fn recover(
        &mut self,
        node: String,
        reason: String,
        nodes_before: usize,
    ) -> Result<PendingRecovery> {
        let since = Instant::now();
        let reached = self
            .history
            .steps
            .last()
            .map_or(self.latest().step, |s| s.step);
        tracing::warn!("interrupted at step {reached}: {node}: {reason}");
        self.resumable = None;
        self.resume_at = None;
        self.current = None;
        for m in &self.members {
            let body = broker_message::Body::Reset(Reset {
                reason: reason.clone(),
            });
            let _ = m.tx.send(Ok(msg(body))).await;
        }
        // Let the other consequences of the failure (closed streams) arrive before planning.
        self.settle(Duration::from_millis(500)).await;
        self.settle_sharded().await;
        self.check_shards();
        let resumed = self.latest().step;
        self.history.truncate(resumed);
        let lost = reached.saturating_sub(resumed);
        (self.on_event)(BrokerEvent::Recovered {
            step: resumed,
            lost,
        });
        Ok(PendingRecovery {
            record: RecoveryRecord {
                node,
                reason,
                interrupted_at_step: reached,
                resumed_from_step: resumed,
                from_shards: self.sharded.is_some(),
                steps_lost: lost,
                nodes_before,
                nodes_after: 0,
                seconds: 0.0,
                evicted: false,
                island_out: None,
            },
            since,
        })
    }
}

//! Sharded snapshots: the state stays on the nodes. Each stage's node writes its parameters and
//! moments to its own disk (a shard), a buddy (the fastest-linked other node, so inside the same
//! site where there is one) copies it over the data plane, and the broker writes only a manifest:
//! which shard holds which parameter, with checksums and where the copies are. A recovery loads
//! every new stage from the shards that hold its parameters, fetched first from a surviving copy
//! where the node holds none; without a surviving copy of every shard it rolls back to the
//! broker's own (older) snapshot instead.
//!
//! Which node buddies which and who fetches what from whom are pure functions of their inputs
//! ([`choose_buddies`], [`fetch_plan`]), tested without a network.

use super::*;
use fusion_proto::{AllowFetch, FetchShard, LoadShards, ShardSaved};
use fusion_train::{ShardCopy, ShardEntry, ShardManifest};

/// Manifests of sharded snapshots kept in the manifest directory (the newest ones).
const MANIFESTS_KEPT: usize = 2;

/// Rounds of copies a restore makes before it gives up (a failed copy is made again from
/// another holder of the shard).
const FETCH_ROUNDS: usize = 3;

/// One shard of a sharded snapshot, and who holds a verified copy of it now.
#[derive(Clone, Debug)]
pub(super) struct Shard {
    pub entry: ShardEntry,
    /// Global ids of the parameters it holds.
    pub params: Vec<usize>,
    /// Members holding a copy, by the serial they joined with (a node that rejoins under the
    /// same name may have lost its disk).
    pub holders: Vec<MemberId>,
}

/// A snapshot the nodes hold.
#[derive(Clone, Debug)]
pub(super) struct ShardedSnap {
    pub step: u64,
    pub data_position: u64,
    pub opt_step: u64,
    pub shards: Vec<Shard>,
    /// Read from a manifest by a resumed broker: the holders are the members named in each
    /// shard's copies (whose disks a load or fetch then checks), until the first placement.
    pub named: bool,
    /// An f16 job's loss scaler when the snapshot was taken.
    pub loss_scale: Option<fusion_train::LossScaler>,
}

impl ShardedSnap {
    /// Whether member `m` (this broker's) holds a copy of shard `k`.
    pub fn held_by(&self, k: usize, m: &Member) -> bool {
        self.shards.get(k).is_some_and(|s| {
            s.holders.contains(&m.serial)
                || (self.named && s.entry.copies.iter().any(|c| c.node == m.id))
        })
    }
}

/// Why a sharded snapshot cannot be kept, written or restored from.
#[derive(Debug, thiserror::Error)]
pub(super) enum ShardError {
    #[error("{node} could not copy shard '{shard}': {reason}")]
    CopyFailed {
        node: String,
        shard: String,
        reason: String,
    },
    #[error("no node still here holds a copy of shard '{0}'")]
    NoHolder(String),
    #[error("writing the manifest: {0}")]
    Manifest(#[from] fusion_train::TrainError),
    #[error("the manifest writer stopped: {0}")]
    Writer(String),
    #[error("its manifest is of step {manifest}, not {dir}")]
    StepMismatch { manifest: u64, dir: u64 },
    #[error("its model does not match this job's")]
    OtherModel,
    #[error("shard '{shard}' holds '{param}', which the model does not have")]
    UnknownParam { shard: String, param: String },
    #[error("no shard holds '{0}'")]
    Uncovered(String),
}

/// Manifests passed over, and why.
pub(super) type Skipped = Vec<(PathBuf, String)>;

impl ShardedSnap {
    /// Holders by member from now on: a snapshot read from a manifest takes the named nodes
    /// that are here.
    pub fn pin_holders(&mut self, members: &[Member]) {
        if !self.named {
            return;
        }
        for k in 0..self.shards.len() {
            let held: Vec<MemberId> = members
                .iter()
                .filter(|m| m.gone.is_none() && self.held_by(k, m))
                .map(|m| m.serial)
                .collect();
            self.shards[k].holders = held;
        }
        self.named = false;
    }
}

/// The newest sharded snapshot of run `run` under `root` (`CHECKPOINT_DIR/sharded`) newer than
/// step `after` whose manifest fits `graph`, with its directory; and the manifests of the run
/// passed over, with why. Another run's manifests are not looked at.
pub(super) fn newest_manifest(
    root: &std::path::Path,
    run: &str,
    after: u64,
    graph: &Graph,
) -> (Option<(PathBuf, ShardedSnap)>, Skipped) {
    let mut skipped = Vec::new();
    let Ok(dirs) = fusion_train::step_dirs(root) else {
        return (None, skipped);
    };
    for (step, dir) in dirs.into_iter().filter(|(step, _)| *step > after) {
        let m = match ShardManifest::read(&dir) {
            Ok(m) => m,
            Err(e) => {
                skipped.push((dir, e.to_string()));
                continue;
            }
        };
        if m.run_id != run {
            continue;
        }
        match snapshot_of(&m, step, graph) {
            Ok(snap) => return (Some((dir, snap)), skipped),
            Err(why) => skipped.push((dir, why.to_string())),
        }
    }
    (None, skipped)
}

/// The snapshot manifest `m` (of the directory for `step`) describes, its holders named; Err:
/// why it does not fit `graph`.
fn snapshot_of(
    m: &ShardManifest,
    step: u64,
    graph: &Graph,
) -> std::result::Result<ShardedSnap, ShardError> {
    if m.step != step {
        return Err(ShardError::StepMismatch {
            manifest: m.step,
            dir: step,
        });
    }
    if m.model_signature != model_signature(graph) {
        return Err(ShardError::OtherModel);
    }
    let id_of: HashMap<&str, usize> = graph
        .params
        .iter()
        .enumerate()
        .map(|(i, p)| (p.name.as_str(), i))
        .collect();
    let mut covered = vec![false; graph.params.len()];
    let mut shards = Vec::with_capacity(m.shards.len());
    for e in &m.shards {
        let mut params = Vec::with_capacity(e.params.len());
        for name in &e.params {
            let &i = id_of
                .get(name.as_str())
                .ok_or_else(|| ShardError::UnknownParam {
                    shard: e.id.clone(),
                    param: name.clone(),
                })?;
            covered[i] = true;
            params.push(i);
        }
        shards.push(Shard {
            entry: e.clone(),
            params,
            holders: Vec::new(),
        });
    }
    if let Some(i) = covered.iter().position(|c| !c) {
        return Err(ShardError::Uncovered(graph.params[i].name.clone()));
    }
    Ok(ShardedSnap {
        step,
        data_position: m.data_position,
        opt_step: m.optimizer_step,
        shards,
        named: true,
        loss_scale: m.loss_scale.clone(),
    })
}

/// Where training goes on from after a rollback: the newest snapshot, sharded or the broker's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Point {
    pub step: u64,
    pub data_position: u64,
    pub opt_step: u64,
}

/// The buddy of each holder (members, in `holders` order): the candidate other than the holder
/// with the fastest link from it (bandwidths within a factor of two count as equal, so a site's
/// nodes are alike), then the one buddying fewest holders so far, then the next after the holder
/// in `candidates` order. None when the holder is the only candidate.
pub(super) fn choose_buddies(
    holders: &[usize],
    candidates: &[usize],
    bandwidth: impl Fn(usize, usize) -> f64,
) -> Vec<Option<usize>> {
    let mut uses: HashMap<usize, usize> = HashMap::new();
    let n = candidates.len();
    holders
        .iter()
        .map(|&h| {
            let at = candidates.iter().position(|&c| c == h).unwrap_or(0);
            let usable = |bw: f64| bw.is_finite() && bw > 0.0;
            let best_bw = candidates
                .iter()
                .filter(|&&c| c != h)
                .map(|&c| bandwidth(h, c))
                .filter(|&bw| usable(bw))
                .fold(0.0, f64::max);
            // How many halvings below the best link: 0 for the fastest class.
            let class = |c: usize| {
                let bw = bandwidth(h, c);
                if usable(bw) {
                    (best_bw / bw).log2().floor() as i64
                } else {
                    i64::MAX
                }
            };
            let best = (1..=n)
                .map(|k| candidates[(at + k) % n])
                .filter(|&c| c != h)
                .enumerate()
                .min_by_key(|&(k, c)| (class(c), uses.get(&c).copied().unwrap_or(0), k))
                .map(|(_, c)| c);
            if let Some(b) = best {
                *uses.entry(b).or_default() += 1;
            }
            best
        })
        .collect()
}

/// One copy to make: `fetcher` copies shard `shard` from `holder`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Fetch {
    pub fetcher: usize,
    pub shard: usize,
    pub holder: usize,
}

/// The copies that give every member in `needs` (member, shards it must load) the shards it
/// lacks, each from a holder in `holders[shard]` (members) that `serves` (a fetch dials its
/// holder: one behind a NAT cannot serve it), spreading the fetches over the holders;
/// Err(shard) when a needed shard has no holder that serves.
pub(super) fn fetch_plan(
    needs: &[(usize, Vec<usize>)],
    holders: &[Vec<usize>],
    serves: impl Fn(usize) -> bool,
) -> std::result::Result<Vec<Fetch>, usize> {
    let mut load: HashMap<usize, usize> = HashMap::new();
    let mut out = Vec::new();
    for (member, shards) in needs {
        for &k in shards {
            let held = holders.get(k).ok_or(k)?;
            if held.contains(member) {
                continue;
            }
            let holder = held
                .iter()
                .copied()
                .filter(|&h| serves(h))
                .min_by_key(|h| load.get(h).copied().unwrap_or(0))
                .ok_or(k)?;
            *load.entry(holder).or_default() += 1;
            out.push(Fetch {
                fetcher: *member,
                shard: k,
                holder,
            });
        }
    }
    Ok(out)
}

/// The shards holding any of `params` (global ids).
pub(super) fn shards_for(params: &[usize], shards: &[Shard]) -> Vec<usize> {
    (0..shards.len())
        .filter(|&k| shards[k].params.iter().any(|p| params.contains(p)))
        .collect()
}

/// The shard name of stage `s`.
pub(super) fn shard_name(s: usize) -> String {
    format!("stage-{s:03}")
}

impl Coordinator<'_> {
    /// The newest snapshot's step, data position and optimizer step.
    pub(super) fn latest(&self) -> Point {
        match &self.sharded {
            Some(s) => Point {
                step: s.step,
                data_position: s.data_position,
                opt_step: s.opt_step,
            },
            None => Point {
                step: self.saved.step,
                data_position: self.saved.data_position,
                opt_step: self.saved.opt_step,
            },
        }
    }

    /// How member `to` is reached from member `from` on the data plane (paced as the testbed's
    /// link between them when the job paces links), for `from`'s sessions to `to`.
    pub(super) fn peer_link(&self, from: usize, to: usize, stage: u32) -> PeerLink {
        self.routed_link(from, to, stage, (from, to))
    }

    /// `peer_link`, routed for the sessions from `sender` to `receiver` (either way).
    pub(super) fn routed_link(
        &self,
        from: usize,
        to: usize,
        stage: u32,
        direction: (usize, usize),
    ) -> PeerLink {
        let (bw, lat) = if self.job.pace_links {
            self.testbed_path(from, to).unwrap_or((0.0, 0.0))
        } else {
            (0.0, 0.0)
        };
        let m = &self.members[to];
        let mut link = PeerLink {
            node_id: m.id.clone(),
            address: m.data_address.clone(),
            stage,
            bandwidth_mbps: bw,
            latency_ms: lat,
            certificate_sha256: m.certificate.to_vec().into(),
            ..Default::default()
        };
        self.route_peer(from, to, direction, &mut link);
        link
    }

    /// Forgets the sharded snapshot when a shard has no copy on a member still here: a recovery
    /// then rolls back to the broker's own snapshot.
    pub(super) fn check_shards(&mut self) {
        let Some(snap) = &self.sharded else { return };
        let live = |k: usize| {
            self.members
                .iter()
                .any(|m| m.gone.is_none() && snap.held_by(k, m))
        };
        if let Some(k) = (0..snap.shards.len()).find(|&k| !live(k)) {
            let line = format!(
                "every copy of shard '{}' of the sharded snapshot of step {} is gone; going on \
                 from the broker's snapshot of step {}",
                snap.shards[k].entry.id, snap.step, self.saved.step
            );
            tracing::warn!("{line}");
            self.snapshots.failures.push(line);
            self.sharded = None;
        }
    }

    /// Records a sharded snapshot that was not taken; false.
    pub(super) fn sharded_failed(&mut self, step: u64, shard: &str, why: &str) -> bool {
        let line = format!("the sharded snapshot of step {step} was not taken: {shard}: {why}");
        self.not_taken(step, line)
    }

    /// The bandwidth from member `a` to member `b` as probed, else as the testbed says, else
    /// unknown (0).
    pub(super) fn bandwidth_between(&self, a: usize, b: usize) -> f64 {
        self.measured_between(a, b)
            .or_else(|| self.link_between(a, b))
            .map_or(0.0, |(mbps, _)| mbps)
    }

    /// The shard stage `s`'s node `m` reported writing.
    pub(super) fn shard_of(
        &self,
        params: Vec<usize>,
        s: usize,
        writer: MemberId,
        r: &ShardSaved,
    ) -> Shard {
        Shard {
            entry: ShardEntry {
                id: r.shard.clone(),
                stage: s as u32,
                params: params
                    .iter()
                    .filter_map(|&p| self.graph.params.get(p).map(|p| p.name.clone()))
                    .collect(),
                bytes: r.bytes,
                sha256: r.sha256.clone(),
                copies: vec![ShardCopy {
                    node: self.name_of(writer),
                    path: r.path.clone(),
                }],
            },
            params,
            holders: vec![writer],
        }
    }

    /// Makes the copies `fetches` asks for (shards of `step`, indices into `shards`), all at
    /// once, recording each new copy in `shards`; returns the copies that failed, with the
    /// fetcher's reason. A member lost meanwhile interrupts the run as usual.
    async fn fetch_all(
        &mut self,
        fetches: &[Fetch],
        shards: &mut [Shard],
        step: u64,
        keep: &[u64],
    ) -> Flow<Vec<(Fetch, String)>> {
        let asked: Vec<(Fetch, String, u64, String)> = fetches
            .iter()
            .map(|f| {
                let e = &shards[f.shard].entry;
                (*f, e.id.clone(), e.bytes, e.sha256.clone())
            })
            .collect();
        self.ask_fetches(&asked, step, keep).await?;
        // The shards each fetcher was asked for: a reply to an earlier, interrupted round (same
        // step) or a duplicate is not an answer to this one.
        let mut expected: BTreeMap<usize, Vec<String>> = BTreeMap::new();
        for (f, id, _, _) in &asked {
            expected.entry(f.fetcher).or_default().push(id.clone());
        }
        let fetchers: Vec<usize> = expected.keys().copied().collect();
        let mut got: Vec<Vec<ShardSaved>> = vec![Vec::new(); fetchers.len()];
        self.gather(&fetchers, "shard copies", Watch::Liveness, |_, pos, m| {
            let Some(node_message::Body::ShardSaved(r)) = m.body else {
                return Ok(None);
            };
            let asked = &expected[&fetchers[pos]];
            if r.step != step
                || !asked.contains(&r.shard)
                || got[pos].iter().any(|g| g.shard == r.shard)
            {
                return Ok(None);
            }
            got[pos].push(r);
            Ok((got[pos].len() == asked.len()).then_some(()))
        })
        .await?;
        let mut failed = Vec::new();
        for (pos, replies) in got.into_iter().enumerate() {
            let m = fetchers[pos];
            for r in replies {
                if !r.error.is_empty() {
                    let asked = asked
                        .iter()
                        .find(|(f, id, ..)| f.fetcher == m && *id == r.shard);
                    if let Some((f, ..)) = asked {
                        failed.push((*f, r.error));
                    }
                    continue;
                }
                if let Some(s) = shards.iter_mut().find(|s| s.entry.id == r.shard) {
                    s.entry.copies.push(ShardCopy {
                        node: self.members[m].id.clone(),
                        path: r.path,
                    });
                    s.holders.push(self.members[m].serial);
                }
            }
        }
        Ok(failed)
    }

    /// Lets each holder serve its fetchers and asks each fetcher for its copy: (fetch, shard
    /// id, bytes, SHA-256) of shards of `step`; the answers come as `ShardSaved`.
    pub(super) async fn ask_fetches(
        &mut self,
        asked: &[(Fetch, String, u64, String)],
        step: u64,
        keep: &[u64],
    ) -> Flow<()> {
        let mut allowed: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for (f, ..) in asked {
            allowed.entry(f.holder).or_default().push(f.fetcher);
        }
        for (&holder, fetchers) in &allowed {
            let peers = fetchers
                .iter()
                .map(|&f| self.peer_link(holder, f, 0))
                .collect();
            let body = broker_message::Body::AllowFetch(AllowFetch { peers });
            self.send(holder, body).await?;
        }
        for (f, id, bytes, sha256) in asked {
            let fetch = FetchShard {
                step,
                run_id: self.run_id.clone(),
                shard: id.clone(),
                from: Some(self.peer_link(f.fetcher, f.holder, 0)),
                bytes: *bytes,
                sha256: sha256.clone(),
                keep_steps: keep.to_vec(),
            };
            tracing::info!(
                "{} copies shard '{id}' of step {step} from {}",
                self.members[f.fetcher].id,
                self.members[f.holder].id
            );
            self.send(f.fetcher, broker_message::Body::FetchShard(fetch))
                .await?;
        }
        Ok(())
    }

    /// Writes the manifest of `snap` (on a blocking thread) beside the checkpoints, under
    /// `sharded/step-N`, or in the state directory without a checkpoint directory; keeps the
    /// newest few.
    pub(super) async fn write_manifest(
        &self,
        snap: &ShardedSnap,
    ) -> std::result::Result<(), ShardError> {
        let cfg = &self.job.train;
        let root = match &cfg.checkpoint_dir {
            Some(d) => d.join("sharded"),
            None => self.state_dir.path().join("sharded"),
        };
        let manifest = ShardManifest {
            format: fusion_train::SHARD_MANIFEST_FORMAT.into(),
            version: fusion_train::SHARD_MANIFEST_VERSION,
            run_id: self.run_id.clone(),
            model: self.job.model.name.clone(),
            model_signature: model_signature(&self.graph),
            model_spec: self.job.model.clone(),
            step: snap.step,
            data_position: snap.data_position,
            optimizer: cfg.optimizer.clone(),
            optimizer_step: snap.opt_step,
            config: cfg.clone(),
            shards: snap.shards.iter().map(|s| s.entry.clone()).collect(),
            loss_scale: snap.loss_scale.clone(),
        };
        let dir = root.join(format!("step-{:08}", snap.step));
        tokio::task::spawn_blocking(move || {
            manifest.write(&dir)?;
            prune_manifests(&root, MANIFESTS_KEPT);
            Ok(())
        })
        .await
        .unwrap_or_else(|e| Err(ShardError::Writer(e.to_string())))
    }

    /// Makes every node of the new placement hold the shards its stage loads (copies fetched
    /// from surviving holders first); returns, per member, the shards to load. Err(shard): a
    /// needed shard has no holder left (the caller rolls back to the broker's snapshot).
    pub(super) async fn place_shards(
        &mut self,
        layout: &Layout,
        stage_params: &[Vec<usize>],
    ) -> Flow<std::result::Result<HashMap<usize, Vec<usize>>, ShardError>> {
        let Some(mut snap) = self.sharded.clone() else {
            return Ok(Ok(HashMap::new()));
        };
        let needs: Vec<(usize, Vec<usize>)> = layout
            .replicas
            .iter()
            .flat_map(|nodes| nodes.iter().enumerate())
            .map(|(s, &m)| (m, shards_for(&stage_params[s], &snap.shards)))
            .collect();
        snap.pin_holders(&self.members);
        // A copy that fails is made again from another holder, a few rounds at most.
        let keep = [snap.step];
        let mut refused: Vec<(usize, usize)> = Vec::new();
        let mut last_error = None;
        for round in 1..=FETCH_ROUNDS {
            let holders: Vec<Vec<usize>> = (0..snap.shards.len())
                .map(|k| {
                    (0..self.members.len())
                        .filter(|&i| {
                            let m = &self.members[i];
                            m.gone.is_none() && snap.held_by(k, m) && !refused.contains(&(k, i))
                        })
                        .collect()
                })
                .collect();
            let fetches = match fetch_plan(&needs, &holders, |h| self.reachable(h)) {
                Ok(f) => f,
                Err(k) => {
                    let none = ShardError::NoHolder(snap.shards[k].entry.id.clone());
                    return Ok(Err(last_error.unwrap_or(none)));
                }
            };
            let failed = self
                .fetch_all(&fetches, &mut snap.shards, snap.step, &keep)
                .await?;
            let Some((f, why)) = failed.first().cloned() else {
                break;
            };
            let error = ShardError::CopyFailed {
                node: self.members[f.fetcher].id.clone(),
                shard: snap.shards[f.shard].entry.id.clone(),
                reason: format!("from {}: {why}", self.members[f.holder].id),
            };
            if round == FETCH_ROUNDS {
                return Ok(Err(error));
            }
            tracing::warn!("{error}; trying another holder");
            refused.extend(failed.iter().map(|(f, _)| (f.shard, f.holder)));
            last_error = Some(error);
        }
        self.sharded = Some(snap);
        Ok(Ok(needs.into_iter().collect()))
    }

    /// Tells member `me` to load its stage from `shards` of the sharded snapshot.
    pub(super) async fn load_shards(&self, me: usize, shards: &[usize]) -> Flow<()> {
        let Some(snap) = &self.sharded else {
            return Ok(());
        };
        let (names, sums) = shards
            .iter()
            .filter_map(|&k| snap.shards.get(k))
            .map(|s| (s.entry.id.clone(), s.entry.sha256.clone()))
            .unzip();
        let body = broker_message::Body::LoadShards(LoadShards {
            step: snap.step,
            run_id: self.run_id.clone(),
            shards: names,
            sha256: sums,
        });
        self.send(me, body).await
    }
}

/// Removes all but the newest `keep` `step-N` directories under `root`.
fn prune_manifests(root: &std::path::Path, keep: usize) {
    let Ok(steps) = fusion_train::step_dirs(root) else {
        return;
    };
    for (_, path) in steps.into_iter().skip(keep) {
        let _ = std::fs::remove_dir_all(path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buddies_are_the_fastest_linked_other_nodes_spread_over_the_candidates() {
        // Two sites: members 0 and 1 at 1000 Mbit/s, 2 and 3 at 1000; 50 between the sites.
        let site = |m: usize| m / 2;
        let bw = |a: usize, b: usize| if site(a) == site(b) { 1000.0 } else { 50.0 };
        let b = choose_buddies(&[0, 1, 2, 3], &[0, 1, 2, 3], bw);
        assert_eq!(b, vec![Some(1), Some(0), Some(3), Some(2)]);
        // Within a factor of two the links count as equal: the next node in order wins.
        let near = |a: usize, b: usize| if a == 0 && b == 2 { 1500.0 } else { 1000.0 };
        assert_eq!(choose_buddies(&[0], &[0, 1, 2], near), vec![Some(1)]);
        // Three holders on one site of three: each buddies a different node.
        let b = choose_buddies(&[0, 1, 2], &[0, 1, 2], |_, _| 1000.0);
        assert_eq!(b, vec![Some(1), Some(2), Some(0)]);
        // Unknown links (0) rank last, a lone holder has no buddy.
        let b = choose_buddies(&[0], &[0, 1, 2], |_, b| if b == 2 { 10.0 } else { 0.0 });
        assert_eq!(b, vec![Some(2)]);
        assert_eq!(choose_buddies(&[0], &[0], bw), vec![None]);
    }

    #[test]
    fn fetches_bring_each_node_the_shards_it_lacks_from_the_least_loaded_holder() {
        // Shard 0 on members 0 and 1, shard 1 on member 2 only.
        let holders = vec![vec![0, 1], vec![2]];
        let needs = vec![(0, vec![0]), (3, vec![0, 1]), (4, vec![0])];
        let plan = fetch_plan(&needs, &holders, |_| true).expect("plan");
        let f = |fetcher, shard, holder| Fetch {
            fetcher,
            shard,
            holder,
        };
        assert_eq!(plan, vec![f(3, 0, 0), f(3, 1, 2), f(4, 0, 1)]);
        // A shard nobody holds any more: named.
        assert_eq!(
            fetch_plan(&[(0, vec![1])], &[vec![0], vec![]], |_| true),
            Err(1)
        );
        assert_eq!(fetch_plan(&[(0, vec![5])], &[vec![0]], |_| true), Err(5));
        // A holder that accepts no connections serves nobody; it still has its own shard.
        let behind_nat = |h: usize| h != 0;
        let plan = fetch_plan(&needs, &holders, behind_nat).expect("plan");
        assert_eq!(plan, vec![f(3, 0, 1), f(3, 1, 2), f(4, 0, 1)]);
        assert_eq!(fetch_plan(&[(1, vec![0])], &[vec![0]], behind_nat), Err(0));
        assert_eq!(
            fetch_plan(&[(0, vec![0])], &[vec![0]], behind_nat),
            Ok(vec![])
        );
    }

    #[test]
    fn a_stage_loads_every_shard_that_holds_one_of_its_parameters() {
        let shard = |params: Vec<usize>| Shard {
            entry: ShardEntry {
                id: "s".into(),
                stage: 0,
                params: Vec::new(),
                bytes: 0,
                sha256: String::new(),
                copies: Vec::new(),
            },
            params,
            holders: Vec::new(),
        };
        let shards = vec![shard(vec![0, 1, 2]), shard(vec![3, 4]), shard(vec![5, 0])];
        assert_eq!(shards_for(&[1, 3], &shards), vec![0, 1]);
        assert_eq!(shards_for(&[0], &shards), vec![0, 2]);
        assert!(shards_for(&[9], &shards).is_empty());
    }

    #[test]
    fn only_the_newest_manifests_are_kept() {
        let dir = tempfile::tempdir().expect("tempdir");
        for step in [5, 10, 15] {
            std::fs::create_dir_all(dir.path().join(format!("step-{step:08}"))).expect("mkdir");
        }
        std::fs::create_dir_all(dir.path().join("other")).expect("mkdir");
        prune_manifests(dir.path(), 2);
        assert!(!dir.path().join("step-00000005").exists());
        assert!(dir.path().join("step-00000010").exists());
        assert!(dir.path().join("step-00000015").exists());
        assert!(dir.path().join("other").exists());
    }
}

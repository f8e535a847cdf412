//! The broker's copy of the training state, kept on disk: one safetensors file per snapshot, laid
//! out exactly as a checkpoint's tensors, read and written in pieces. The broker's memory stays
//! bounded whatever the model's size: state streams from the nodes into a file, from the file to
//! the nodes, and a checkpoint is a link to the file (or a copy on another file system).

use crate::error::{io_err, Result, RuntimeError};
use crate::wire::PARAM_PIECE_BYTES;
use fusion_graph::Graph;
use fusion_proto::{ParamData, ParamPart};
use fusion_train::{
    checkpoint_layout, link_or_copy, CheckpointState, TensorFile, TrainConfig, WeightSource,
};
use std::path::{Path, PathBuf};

/// The directory the state files live in: the configured one, else a temporary directory that
/// is removed with it.
pub(super) struct StateDir {
    path: PathBuf,
    /// A temporary directory, removed with it.
    _temp: Option<tempfile::TempDir>,
    next: u64,
    /// Held locked (an advisory lock the kernel drops when the process ends, however it ends)
    /// while this broker uses the directory.
    lock: Option<std::fs::File>,
}

/// The lock file of a configured state directory.
const LOCK_FILE: &str = ".lock";

/// Locks `dir` for this process, writing its pid into the lock file; refuses when another
/// process holds it.
fn lock(dir: &Path) -> Result<std::fs::File> {
    use std::io::{Read, Seek, Write};
    let path = dir.join(LOCK_FILE);
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(io_err(format!("opening {}", path.display())))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = match holder.trim() {
                "" => "its lock is held".to_string(),
                pid => format!("process {}", crate::service::printable(pid, 20)),
            };
            return Err(RuntimeError::StateDirInUse {
                path: dir.display().to_string(),
                holder,
            });
        }
        Err(std::fs::TryLockError::Error(e)) => {
            return Err(io_err(format!("locking {}", path.display()))(e));
        }
    }
    let pid = std::process::id().to_string();
    file.set_len(0)
        .and_then(|()| file.rewind())
        .and_then(|()| file.write_all(pid.as_bytes()))
        .map_err(io_err(format!("writing {}", path.display())))?;
    Ok(file)
}

impl StateDir {
    /// Opens (creating) `configured`, or a new temporary directory when none is given. Files a
    /// previous broker left there are removed: they belong to no snapshot of this one.
    pub fn open(configured: Option<&Path>) -> Result<StateDir> {
        let (path, temp) = match configured {
            Some(p) => (p.to_path_buf(), None),
            None => {
                let t = tempfile::Builder::new()
                    .prefix("fusionllm-broker-state-")
                    .tempdir()
                    .map_err(io_err("creating a temporary state directory"))?;
                (t.path().to_path_buf(), Some(t))
            }
        };
        let context = format!("state directory {}", path.display());
        std::fs::create_dir_all(&path).map_err(io_err(context.clone()))?;
        // Before anything there is removed: it may be another broker's live state.
        let lock = match temp {
            Some(_) => None,
            None => Some(lock(&path)?),
        };
        for e in std::fs::read_dir(&path).map_err(io_err(context))?.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if is_state_file(&name) {
                let _ = std::fs::remove_file(e.path());
            }
        }
        Ok(StateDir {
            path,
            _temp: temp,
            next: 0,
            lock,
        })
    }

    /// A new file name for a snapshot of `step`: (the partial name, the final one).
    fn names(&mut self, step: u64) -> (PathBuf, PathBuf) {
        self.next += 1;
        let base = format!("state-{step:08}-{}.safetensors", self.next);
        (
            self.path.join(format!(".partial-{base}")),
            self.path.join(base),
        )
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for StateDir {
    fn drop(&mut self) {
        // The lock file stays (removing it while locked would let two later brokers lock two
        // different files), and with it the directory; the lock goes with the file handle.
        drop(self.lock.take());
    }
}

/// Whether `name` is one of the files a state directory holds (`state-SSSSSSSS-N.safetensors`,
/// or its `.partial-` form): nothing else there is ever removed.
fn is_state_file(name: &str) -> bool {
    let name = name.strip_prefix(".partial-").unwrap_or(name);
    name.strip_prefix("state-")
        .and_then(|n| n.strip_suffix(".safetensors"))
        .and_then(|n| n.split_once('-'))
        .is_some_and(|(step, n)| {
            step.len() >= 8
                && step.bytes().all(|b| b.is_ascii_digit())
                && !n.is_empty()
                && n.bytes().all(|b| b.is_ascii_digit())
        })
}

/// One complete snapshot of the training state, never written again once made (a checkpoint
/// may share its bytes). Its file is removed when it is dropped.
pub(super) struct Stored {
    file: TensorFile,
    /// Per island and parameter: the file's tensors holding its parts.
    parts: Slots,
    pub step: u64,
    pub data_position: u64,
    /// The optimizer's step count the moments belong to.
    pub opt_step: u64,
}

/// The parts a state file may hold of a parameter ([`ParamPart`] less one): value, first and
/// second moment, outer momentum.
const PARTS: usize = 4;

/// Per island (islands runs; else one), per parameter of the graph (graph order): the tensors of
/// a state file holding each part. Island 0 holds every part; the islands after it only their
/// own optimizer moments (the values and the outer momentum are island 0's).
type Slots = Vec<Vec<[Option<usize>; PARTS]>>;

/// The [`Slots`] of `file`. Every parameter's value must be there.
fn index_of(file: &TensorFile, graph: &Graph) -> Result<Slots> {
    let mut islands = vec![island0_of(file, graph)?];
    for r in 1..=file.entries().len() {
        let moments: Vec<[Option<usize>; PARTS]> = graph
            .params
            .iter()
            .map(|p| {
                let find = |part: &str| {
                    let prefix = fusion_train::island_moment_prefix(r, part);
                    fitting(file, &format!("{prefix}.{}", p.name), p)
                };
                [None, find("opt.first"), find("opt.second"), None]
            })
            .collect();
        if moments.iter().flatten().all(Option::is_none) {
            break;
        }
        islands.push(moments);
    }
    Ok(islands)
}

/// The tensor `name` of `file` when it is there and fits trainable parameter `p` (an islands
/// state's outer momentum or an island's moment); one that does not is left out, with a
/// warning, and the island or the outer optimizer then starts without it.
fn fitting(file: &TensorFile, name: &str, p: &fusion_graph::ParamSpec) -> Option<usize> {
    let t = file.find(name)?;
    let shape = &file.entries()[t].shape;
    if p.trainable && *shape == p.shape {
        return Some(t);
    }
    tracing::warn!(
        "{}: '{name}' ({shape:?}) does not fit parameter '{}' ({:?}{}); left out",
        file.path().display(),
        p.name,
        p.shape,
        if p.trainable { "" } else { ", frozen" }
    );
    None
}

/// Island 0's tensors of each parameter: value, first and second moment, outer momentum.
fn island0_of(file: &TensorFile, graph: &Graph) -> Result<Vec<[Option<usize>; PARTS]>> {
    let mut parts = Vec::with_capacity(graph.params.len());
    for p in &graph.params {
        let find = |prefix: &str| file.find(&format!("{prefix}.{}", p.name));
        let value = find("param").ok_or_else(|| {
            RuntimeError::Config(format!(
                "state file {} has no parameter '{}'",
                file.path().display(),
                p.name
            ))
        })?;
        parts.push([
            Some(value),
            find("opt.first"),
            find("opt.second"),
            fitting(
                file,
                &format!("{}.{}", fusion_train::OUTER_MOMENTUM_PREFIX, p.name),
                p,
            ),
        ]);
    }
    Ok(parts)
}

impl Stored {
    /// A complete state file of `graph`.
    fn index(file: TensorFile, graph: &Graph) -> Result<Stored> {
        Ok(Stored {
            parts: index_of(&file, graph)?,
            file,
            step: 0,
            data_position: 0,
            opt_step: 0,
        })
    }

    /// A fresh run's state: initial parameters (the seed's, or `init`'s; written one at a time)
    /// and zero moments.
    pub fn fresh(
        dir: &mut StateDir,
        graph: &Graph,
        cfg: &TrainConfig,
        init: Option<&dyn WeightSource>,
    ) -> Result<Stored> {
        if let Some(source) = init {
            source.check(graph)?;
        }
        let (partial, done) = dir.names(0);
        let file = TensorFile::create(&partial, &checkpoint_layout(graph, &cfg.optimizer))?;
        for p in &graph.params {
            if let Some(t) = file.find(&format!("param.{}", p.name)) {
                let values = match init {
                    Some(source) => fusion_train::load_weight(source, p)?,
                    None => fusion_exec::init_param(p, cfg.seed),
                };
                file.write(t, 0, &values)?;
            }
        }
        drop(file);
        rename(&partial, &done)?;
        Stored::index(TensorFile::open(&done)?, graph)
    }

    /// The state of a verified checkpoint (`dir_of_checkpoint` with its sidecar `state`),
    /// linked into the state directory.
    pub fn from_checkpoint(
        dir: &mut StateDir,
        graph: &Graph,
        checkpoint: &Path,
        state: &CheckpointState,
    ) -> Result<Stored> {
        let (_, done) = dir.names(state.step);
        link_or_copy(&checkpoint.join(fusion_train::CHECKPOINT_TENSORS), &done)?;
        let mut s = Stored::index(TensorFile::open(&done)?, graph)?;
        s.step = state.step;
        s.data_position = state.data_position;
        s.opt_step = state.optimizer_step;
        Ok(s)
    }

    pub fn path(&self) -> &Path {
        self.file.path()
    }

    /// Whether the state holds the islands' outer momentum.
    pub fn has_outer_momentum(&self) -> bool {
        self.parts[0].iter().any(|p| p[3].is_some())
    }

    /// Parameter `param`'s `part` for island `island` as in-order pieces read from disk: the
    /// island's own optimizer moments where the state holds them, else island 0's (as every
    /// value and the outer momentum); none when the part is absent, as a buffer's moments are.
    pub fn pieces(
        &self,
        island: usize,
        param: usize,
        part: ParamPart,
    ) -> impl Iterator<Item = Result<ParamData>> + '_ {
        let slot = |r: usize, k: usize| {
            self.parts
                .get(r)
                .and_then(|ps| ps.get(param))
                .and_then(|p| p[k])
        };
        let t = part_index(part).and_then(|k| slot(island, k).or_else(|| slot(0, k)));
        let total = t.map_or(0, |t| self.file.entries()[t].numel);
        let per = PARAM_PIECE_BYTES / 4;
        (0..total.div_ceil(per)).map(move |i| {
            let offset = i * per;
            let n = per.min(total - offset);
            let data = self.file.read_bytes(t.unwrap_or(0), offset, n)?;
            Ok(ParamData {
                param: param as u64,
                part: part as i32,
                offset: offset as u64,
                total_elements: total as u64,
                data: data.into(),
            })
        })
    }

    /// Every parameter's value, in graph order (for callers that want the final model in
    /// memory, such as tests comparing runs).
    pub fn params(&self) -> Result<Vec<Vec<f32>>> {
        self.parts[0]
            .iter()
            .map(|p| match p[0] {
                Some(t) => Ok(self.file.read(t)?),
                None => Ok(Vec::new()),
            })
            .collect()
    }
}

impl Drop for Stored {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.file.path());
    }
}

fn part_index(part: ParamPart) -> Option<usize> {
    match part {
        ParamPart::Value => Some(0),
        ParamPart::FirstMoment => Some(1),
        ParamPart::SecondMoment => Some(2),
        ParamPart::OuterMomentum => Some(3),
        ParamPart::Unspecified => None,
    }
}

fn rename(from: &Path, to: &Path) -> Result<()> {
    std::fs::rename(from, to).map_err(io_err(format!(
        "renaming {} to {}",
        from.display(),
        to.display()
    )))
}

/// Why gathering a snapshot failed.
#[derive(Debug, thiserror::Error)]
pub(super) enum GatherError {
    /// A stage sent state that does not fit, is not finite, or is incomplete.
    #[error("{0}")]
    Peer(String),
    /// The broker could not write the snapshot (a full disk): the run goes on with the last one.
    #[error("{0}")]
    Disk(String),
}

/// A snapshot being gathered into a new file: how many elements of each part of each parameter
/// have arrived. The partial file is removed unless the gather completes.
pub(super) struct Gathered {
    file: TensorFile,
    parts: Slots,
    /// Elements arrived, per island, parameter and part.
    filled: Vec<Vec<[usize; PARTS]>>,
    /// A write that failed: later pieces are drained unwritten, and the gather fails.
    disk_error: Option<String>,
    done: Option<PathBuf>,
}

impl Gathered {
    /// Starts gathering the state after `step` into a new file of the state directory.
    /// With `outer` (islands), every trainable parameter's outer momentum too, and the
    /// optimizer moments of each of `islands` islands.
    pub fn new(
        dir: &mut StateDir,
        graph: &Graph,
        cfg: &TrainConfig,
        step: u64,
        outer: bool,
        islands: usize,
    ) -> std::result::Result<Gathered, GatherError> {
        let (partial, done) = dir.names(step);
        let mut layout = checkpoint_layout(graph, &cfg.optimizer);
        if outer {
            layout.extend(fusion_train::outer_layout(&graph.params));
        }
        layout.extend(fusion_train::island_layout(
            &graph.params,
            &cfg.optimizer,
            islands,
        ));
        let file =
            TensorFile::create(&partial, &layout).map_err(|e| GatherError::Disk(e.to_string()))?;
        let parts = match index_of(&file, graph) {
            Ok(p) => p,
            Err(e) => {
                let _ = std::fs::remove_file(&partial);
                return Err(GatherError::Disk(e.to_string()));
            }
        };
        Ok(Gathered {
            filled: parts.iter().map(|p| vec![[0; PARTS]; p.len()]).collect(),
            parts,
            file,
            disk_error: None,
            done: Some(done),
        })
    }

    /// Takes one piece from stage `stage` of island `island`; `keeper[i]` is the stage whose
    /// copy of parameter i is kept (other holders' pieces of it are ignored). An error is the
    /// sender's fault.
    pub fn absorb(
        &mut self,
        keeper: &[usize],
        stage: usize,
        island: usize,
        held: &[usize],
        p: &ParamData,
    ) -> std::result::Result<(), String> {
        let i = usize::try_from(p.param).unwrap_or(usize::MAX);
        match keeper.get(i) {
            Some(&k) if k == stage => {}
            // A tied parameter's later copy: ignored, but only from a stage that holds it.
            Some(&k) if k < stage && held.contains(&i) => return Ok(()),
            _ => {
                return Err(format!(
                    "sent state for parameter #{}, which its stage does not hold",
                    p.param
                ))
            }
        }
        let k = part_index(p.part()).ok_or("sent state with no part")?;
        let Some(t) = self.parts.get(island).and_then(|ps| ps[i][k]) else {
            let (part, param) = (p.part(), p.param);
            return Err(match island {
                0 => format!("sent a {part:?} of parameter #{param}, which has none"),
                r => format!(
                    "sent a {part:?} of parameter #{param} for island {r}, of which a snapshot \
                     keeps only the optimizer moments of trainable parameters"
                ),
            });
        };
        let numel = self.file.entries()[t].numel;
        // Pieces come in order, each starting where the last ended: every element exactly once.
        let due = self.filled[island][i][k];
        if p.offset != due as u64 || p.total_elements != numel as u64 {
            return Err(format!(
                "sent a piece of parameter #{} at element {} of {} where element {due} of {numel} \
                 was due",
                p.param, p.offset, p.total_elements
            ));
        }
        if !p.data.len().is_multiple_of(4) || due + p.data.len() / 4 > numel {
            return Err(format!(
                "sent a piece of parameter #{} ({} bytes) that does not fit its {numel} elements",
                p.param,
                p.data.len()
            ));
        }
        let finite = p
            .data
            .chunks_exact(4)
            .all(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]).is_finite());
        if !finite {
            return Err(format!("sent non-finite state for parameter #{}", p.param));
        }
        if self.disk_error.is_none() {
            if let Err(e) = self.file.write_bytes(t, due, &p.data) {
                self.disk_error = Some(e.to_string());
            }
        }
        self.filled[island][i][k] += p.data.len() / 4;
        Ok(())
    }

    /// The first part of island `island`'s parameters that `keeps` selects which has not
    /// arrived whole: (parameter, elements arrived, elements due). An island with no place in
    /// the snapshot (a model without trainable values) owes nothing.
    fn shortfall(
        &self,
        island: usize,
        keeps: impl Fn(usize) -> bool,
    ) -> Option<(usize, usize, usize)> {
        self.shortfall_of(island, keeps, |_, numel| numel)
    }

    /// [`shortfall`](Self::shortfall) against `due(parameter, its elements)` elements of each
    /// part instead of all of them.
    fn shortfall_of(
        &self,
        island: usize,
        keeps: impl Fn(usize) -> bool,
        due: impl Fn(usize, usize) -> usize,
    ) -> Option<(usize, usize, usize)> {
        let (all, got) = (self.parts.get(island)?, self.filled.get(island)?);
        all.iter()
            .zip(got)
            .enumerate()
            .filter(|(i, _)| keeps(*i))
            .find_map(|(i, (parts, filled))| {
                parts.iter().zip(filled).find_map(|(t, &n)| {
                    let want = t.map_or(0, |t| due(i, self.file.entries()[t].numel));
                    (n != want).then_some((i, n, want))
                })
            })
    }

    /// Whether stage `stage` sent every part of the parameters it keeps up to `due(parameter)`
    /// elements (a sharded replica's round of a snapshot ends where its chunk ends): Err names
    /// the first part that stops elsewhere.
    pub fn complete_to(
        &self,
        keeper: &[usize],
        stage: usize,
        due: impl Fn(usize) -> usize,
    ) -> std::result::Result<(), String> {
        let keeps = |i: usize| keeper.get(i) == Some(&stage);
        match self.shortfall_of(0, keeps, |i, numel| due(i).min(numel)) {
            Some((i, n, want)) => Err(format!(
                "said its piece was complete with {n} elements of a part of parameter #{i} where \
                 its chunk ends at element {want}"
            )),
            None => Ok(()),
        }
    }

    /// Whether stage `stage` of island `island` sent every element of every part of the
    /// parameters it keeps (checked when it says it is done): Err names the first one missing.
    pub fn complete_from(
        &self,
        keeper: &[usize],
        stage: usize,
        island: usize,
    ) -> std::result::Result<(), String> {
        match self.shortfall(island, |i| keeper.get(i) == Some(&stage)) {
            Some((i, n, want)) => Err(format!(
                "said its state was complete with {n} of {want} elements of a part of \
                 parameter #{i}"
            )),
            None => Ok(()),
        }
    }

    /// The complete snapshot, its file renamed into place; `Peer` when a part arrived
    /// incomplete, `Disk` when it could not be written.
    pub fn finish(mut self, graph: &Graph) -> std::result::Result<Stored, GatherError> {
        if let Some((i, n, want)) = (0..self.parts.len()).find_map(|r| self.shortfall(r, |_| true))
        {
            return Err(GatherError::Peer(format!(
                "the state of parameter '{}' arrived incomplete ({n} of {want} elements)",
                graph.params[i].name
            )));
        }
        if let Some(e) = self.disk_error.take() {
            return Err(GatherError::Disk(e));
        }
        let done = self.done.clone().unwrap_or_default();
        let disk = |e: RuntimeError| GatherError::Disk(e.to_string());
        rename(self.file.path(), &done).map_err(disk)?;
        let stored = TensorFile::open(&done)
            .map_err(RuntimeError::from)
            .and_then(|file| Stored::index(file, graph));
        if stored.is_err() {
            let _ = std::fs::remove_file(&done);
        }
        // Renamed: nothing partial is left to remove.
        self.done = None;
        stored.map_err(disk)
    }
}

impl Drop for Gathered {
    fn drop(&mut self) {
        // Not finished: the partial file is garbage.
        if self.done.is_some() {
            let _ = std::fs::remove_file(self.file.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{bytes_to_f32, param_messages};

    fn graph() -> Graph {
        fusion_models::ModelSpec::preset("gpt2-tiny")
            .and_then(|m| m.graph(1, 4))
            .expect("graph")
    }

    /// Every piece of the state in `stored`, as a stage would send it.
    fn all_pieces(stored: &Stored, n: usize) -> Vec<ParamData> {
        let mut out = Vec::new();
        for i in 0..n {
            for part in [
                ParamPart::Value,
                ParamPart::FirstMoment,
                ParamPart::SecondMoment,
            ] {
                out.extend(stored.pieces(0, i, part).map(|p| p.expect("piece")));
            }
        }
        out
    }

    #[test]
    fn a_state_directory_in_use_is_refused_and_left_alone() {
        let root = tempfile::tempdir().expect("tempdir");
        let path = root.path().join("state");
        let first = StateDir::open(Some(&path)).expect("first broker");
        let live = path.join("state-00000007-1.safetensors");
        std::fs::write(&live, b"the first broker's snapshot").expect("write");
        let err = StateDir::open(Some(&path)).err().expect("refused");
        assert!(
            matches!(&err, RuntimeError::StateDirInUse { holder, .. }
                if *holder == format!("process {}", std::process::id())),
            "{err}"
        );
        assert!(
            live.exists(),
            "the second broker removed the first one's snapshot"
        );
        drop(first);
        std::fs::remove_file(&live).expect("remove");
        // Released with its broker: the next one may use it.
        let _again = StateDir::open(Some(&path)).expect("reopened");
    }

    #[test]
    fn a_fresh_state_streams_its_initial_parameters_and_zero_moments() {
        let (g, cfg) = (graph(), TrainConfig::default());
        let mut dir = StateDir::open(None).expect("dir");
        let s = Stored::fresh(&mut dir, &g, &cfg, None).expect("fresh");
        assert_eq!(
            s.params().expect("params"),
            fusion_exec::init_params(&g, cfg.seed)
        );
        let trainable = g.params.iter().position(|p| p.trainable).expect("one");
        let m: Vec<ParamData> = s
            .pieces(0, trainable, ParamPart::SecondMoment)
            .map(|p| p.expect("piece"))
            .collect();
        assert_eq!(
            m.iter().map(|p| p.data.len()).sum::<usize>(),
            g.params[trainable].numel() * 4
        );
        assert!(m.iter().all(|p| p.data.iter().all(|&b| b == 0)));
        let path = s.path().to_path_buf();
        drop(s);
        assert!(!path.exists(), "a dropped snapshot removes its file");
    }

    #[test]
    fn gathered_state_must_come_whole_finite_and_from_the_stage_that_holds_it() {
        let (g, cfg) = (graph(), TrainConfig::default());
        let mut dir = StateDir::open(None).expect("dir");
        let source = Stored::fresh(&mut dir, &g, &cfg, None).expect("fresh");
        let n = g.params.len();
        // Everything is kept from stage 0 but parameter 1, kept from stage 1.
        let mut keeper = vec![0; n];
        keeper[1] = 1;
        let mut st = Gathered::new(&mut dir, &g, &cfg, 3, false, 1).expect("gather");
        let p1 = source
            .pieces(0, 1, ParamPart::Value)
            .next()
            .expect("one")
            .expect("piece");
        // Stage 0 holds every parameter but 1, stage 1 holds 0 (tied) and 1.
        let held0: Vec<usize> = (0..n).filter(|&i| i != 1).collect();
        let held1 = vec![0, 1];
        let err = st
            .absorb(&keeper, 0, 0, &held0, &p1)
            .map(|_| ())
            .unwrap_err();
        assert!(err.contains("does not hold"), "{err}");
        let nan: Vec<ParamData> =
            param_messages(1, ParamPart::Value, &vec![f32::NAN; g.params[1].numel()]).collect();
        let err = st.absorb(&keeper, 1, 0, &held1, &nan[0]).unwrap_err();
        assert!(err.contains("non-finite"), "{err}");
        let long: Vec<ParamData> =
            param_messages(1, ParamPart::Value, &vec![1.0; g.params[1].numel() + 1]).collect();
        let err = st.absorb(&keeper, 1, 0, &held1, &long[0]).unwrap_err();
        assert!(err.contains("was due"), "{err}");
        // A later stage's copy of a tied parameter kept elsewhere is ignored, not an error;
        // a parameter of an earlier stage it does not hold is.
        let p0 = source
            .pieces(0, 0, ParamPart::Value)
            .next()
            .expect("one")
            .expect("piece");
        assert!(st.absorb(&keeper, 1, 0, &held1, &p0).is_ok());
        let p2 = source
            .pieces(0, 2, ParamPart::Value)
            .next()
            .expect("one")
            .expect("piece");
        let err = st.absorb(&keeper, 1, 0, &held1, &p2).unwrap_err();
        assert!(err.contains("does not hold"), "{err}");
        // Everything but the second moments: incomplete, the senders' fault, found when each
        // says it is done.
        let held = |stage: usize| if stage == 0 { &held0 } else { &held1 };
        for p in all_pieces(&source, n) {
            if p.part() != ParamPart::SecondMoment {
                let stage = keeper[p.param as usize];
                st.absorb(&keeper, stage, 0, held(stage), &p)
                    .expect("piece");
            }
        }
        let err = st.complete_from(&keeper, 1, 0).unwrap_err();
        assert!(err.contains("parameter #1"), "{err}");
        match st.finish(&g) {
            Err(GatherError::Peer(e)) => assert!(e.contains("incomplete"), "{e}"),
            other => panic!("expected an incomplete state, got {:?}", other.map(|_| ())),
        }
        // All of it: the snapshot holds exactly what was sent.
        let mut st = Gathered::new(&mut dir, &g, &cfg, 3, false, 1).expect("gather");
        for p in all_pieces(&source, n) {
            let stage = keeper[p.param as usize];
            st.absorb(&keeper, stage, 0, held(stage), &p)
                .expect("piece");
        }
        assert!(st.complete_from(&keeper, 0, 0).is_ok() && st.complete_from(&keeper, 1, 0).is_ok());
        let got = st.finish(&g).expect("complete");
        assert_eq!(
            got.params().expect("params"),
            source.params().expect("params")
        );
        // Only the two snapshots' files are left: a failed gather removes its partial file.
        let files = std::fs::read_dir(dir.path()).expect("dir").count();
        assert_eq!(files, 2);
        // Only the state directory's own files are ever removed from it.
        assert!(is_state_file("state-00000003-2.safetensors"));
        assert!(is_state_file(".partial-state-00000003-2.safetensors"));
        assert!(!is_state_file("optimizer_state-final.safetensors"));
        assert!(!is_state_file("state-final.safetensors"));
    }

    /// Every element of `part` of parameter `i` of island `island` in `stored`.
    fn part_of(stored: &Stored, island: usize, i: usize, part: ParamPart) -> Vec<f32> {
        stored
            .pieces(island, i, part)
            .flat_map(|p| bytes_to_f32(&p.expect("piece").data))
            .collect()
    }

    #[test]
    fn an_islands_gather_keeps_the_outer_momentum_and_needs_all_of_it() {
        let (g, cfg) = (graph(), TrainConfig::default());
        let mut dir = StateDir::open(None).expect("dir");
        let source = Stored::fresh(&mut dir, &g, &cfg, None).expect("fresh");
        assert!(!source.has_outer_momentum());
        let n = g.params.len();
        let keeper = vec![0; n];
        let held: Vec<usize> = (0..n).collect();
        let trainable = g.params.iter().position(|p| p.trainable).expect("one");
        let momentum = |i: usize| vec![0.25 + i as f32; g.params[i].numel()];
        // Without islands a gather has no place for it: the sender is at fault.
        let mut plain = Gathered::new(&mut dir, &g, &cfg, 1, false, 1).expect("gather");
        let piece = param_messages(trainable, ParamPart::OuterMomentum, &momentum(trainable))
            .next()
            .expect("piece");
        let err = plain.absorb(&keeper, 0, 0, &held, &piece).unwrap_err();
        assert!(err.contains("which has none"), "{err}");
        // With islands every trainable parameter's must arrive.
        let mut st = Gathered::new(&mut dir, &g, &cfg, 2, true, 1).expect("gather");
        for p in all_pieces(&source, n) {
            st.absorb(&keeper, 0, 0, &held, &p).expect("piece");
        }
        let err = st.complete_from(&keeper, 0, 0).unwrap_err();
        assert!(err.contains("said its state was complete"), "{err}");
        for i in (0..n).filter(|&i| g.params[i].trainable && g.params[i].numel() > 0) {
            for p in param_messages(i, ParamPart::OuterMomentum, &momentum(i)) {
                st.absorb(&keeper, 0, 0, &held, &p).expect("piece");
            }
        }
        st.complete_from(&keeper, 0, 0).expect("complete");
        let got = st.finish(&g).expect("complete");
        assert!(got.has_outer_momentum());
        let sent = part_of(&got, 0, trainable, ParamPart::OuterMomentum);
        assert_eq!(sent, momentum(trainable));
    }

    #[test]
    fn an_islands_gather_keeps_every_islands_own_moments() {
        let (g, cfg) = (graph(), TrainConfig::default());
        let mut dir = StateDir::open(None).expect("dir");
        let source = Stored::fresh(&mut dir, &g, &cfg, None).expect("fresh");
        let n = g.params.len();
        let (keeper, held): (Vec<usize>, Vec<usize>) = (vec![0; n], (0..n).collect());
        let trainable = g.params.iter().position(|p| p.trainable).expect("one");
        let moment = |i: usize| vec![-0.5 - i as f32; g.params[i].numel()];
        let mut st = Gathered::new(&mut dir, &g, &cfg, 2, false, 2).expect("gather");
        for p in all_pieces(&source, n) {
            st.absorb(&keeper, 0, 0, &held, &p).expect("piece");
        }
        // Island 1 sends its moments only: a value is its fault.
        let value = all_pieces(&source, n)
            .into_iter()
            .find(|p| p.part() == ParamPart::Value)
            .expect("a value");
        let err = st.absorb(&keeper, 0, 1, &held, &value).unwrap_err();
        assert!(err.contains("for island 1"), "{err}");
        let trainables = (0..n).filter(|&i| g.params[i].trainable && g.params[i].numel() > 0);
        for i in trainables.clone() {
            for p in param_messages(i, ParamPart::FirstMoment, &moment(i)) {
                st.absorb(&keeper, 0, 1, &held, &p).expect("piece");
            }
        }
        // Its second moments are missing.
        let err = st.complete_from(&keeper, 0, 1).unwrap_err();
        assert!(err.contains("said its state was complete"), "{err}");
        for i in trainables {
            for p in param_messages(i, ParamPart::SecondMoment, &moment(i)) {
                st.absorb(&keeper, 0, 1, &held, &p).expect("piece");
            }
        }
        st.complete_from(&keeper, 0, 1).expect("complete");
        let got = st.finish(&g).expect("complete");
        // Island 1 gets its own moments back, and island 0's values; a third island (none in
        // the snapshot) island 0's moments.
        let first = ParamPart::FirstMoment;
        assert_eq!(part_of(&got, 1, trainable, first), moment(trainable));
        assert_eq!(
            part_of(&got, 1, trainable, ParamPart::Value),
            part_of(&source, 0, trainable, ParamPart::Value)
        );
        assert_eq!(
            part_of(&got, 2, trainable, first),
            part_of(&got, 0, trainable, first)
        );
        assert_ne!(part_of(&got, 0, trainable, first), moment(trainable));
    }
}

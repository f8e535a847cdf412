//! The training loop.

use crate::checkpoint::{self, CheckpointState, CHECKPOINT_FORMAT, CHECKPOINT_VERSION};
use crate::config::TrainConfig;
use crate::error::{Result, TrainError};
use crate::optim::{clip_global_norm, OptimizerState};
use crate::report::{peak_rss_bytes, EvalRecord, Report, StepRecord};
use crate::resident::{Resident, UpdateError};
use crate::scaler::{self, LossScaler, Verdict};
use crate::schedule::learning_rate;
use crate::weights::{load_all as load_all_weights, WeightSource};
use fusion_backend::{Backend, Precision};
use fusion_data::{Batch, DataKind, Dataset, HostTensor, Split};
use fusion_exec::{init_params, Executor, IdTensor, LocalPipeline, Mode, Value};
use fusion_graph::TensorId;
use fusion_models::ModelSpec;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// Matches a model to its data: the vocabulary of a text corpus, or the geometry and classes of an
/// image set. Refuses a language model on images and the other way round.
pub fn adapt_model(model: ModelSpec, kind: DataKind) -> Result<ModelSpec> {
    match kind {
        DataKind::Text { vocab } => {
            if !model.is_language_model() {
                return Err(TrainError::DataMismatch(format!(
                    "{} is an image model but the data is text",
                    model.name
                )));
            }
            model
                .fits_text(vocab)
                .map_err(|e| TrainError::DataMismatch(e.to_string()))?;
            Ok(model.with_vocab(vocab))
        }
        DataKind::Images {
            channels,
            size,
            classes,
        } => {
            if model.is_language_model() {
                return Err(TrainError::DataMismatch(format!(
                    "{} is a language model but the data is images",
                    model.name
                )));
            }
            model
                .fits_images(channels, size, classes)
                .map_err(|e| TrainError::DataMismatch(e.to_string()))?;
            Ok(model.with_images(channels, size, classes))
        }
    }
}

/// Which parameters get weight decay: matrices and kernels, not biases and norm gains.
pub fn decay_mask(graph: &fusion_graph::Graph) -> Vec<bool> {
    graph.params.iter().map(|p| p.shape.len() >= 2).collect()
}

/// The optimizer state before the first step: zero moments for every trainable parameter.
fn zero_optimizer_state(cfg: &TrainConfig, graph: &fusion_graph::Graph) -> OptimizerState {
    let sizes: Vec<Option<usize>> = graph
        .params
        .iter()
        .map(|p| p.trainable.then(|| p.numel()))
        .collect();
    OptimizerState::new(&cfg.optimizer, &sizes)
}

/// Trains one model on one backend in this process.
pub struct Trainer<B: Backend> {
    exec: Executor<B>,
    /// When training as in-process pipeline stages.
    pipeline: Option<LocalPipeline<B>>,
    model: ModelSpec,
    pub(crate) data: Arc<dyn Dataset>,
    pub(crate) cfg: TrainConfig,
    /// Host master copy of every parameter and buffer, in graph order (empty while `resident`
    /// holds the master state).
    pub(crate) params: Vec<Vec<f32>>,
    pub(crate) opt: OptimizerState,
    /// The master state on the compute device between steps, when the optimizer runs there.
    resident: Option<Resident<B>>,
    /// The step whose device update failed part way: the state is lost until a checkpoint or
    /// initial weights are loaded.
    lost: Option<u64>,
    /// Dynamic loss scaling, on backends that compute in f16.
    pub(crate) scaler: Option<LossScaler>,
    decay: Vec<bool>,
    pub(crate) step: u64,
    pub(crate) data_position: u64,
    inputs: (TensorId, TensorId),
    outputs: (TensorId, TensorId),
}

impl<B: Backend> Trainer<B> {
    /// Builds the model's graph for the configured micro-batch, matched to the data (vocabulary
    /// or image geometry), and initialises parameters from the seed.
    pub fn new(
        backend: B,
        model: ModelSpec,
        data: Arc<dyn Dataset>,
        cfg: TrainConfig,
    ) -> Result<Self> {
        Self::with_weights(backend, model, data, cfg, None)
    }

    /// [`Trainer::new`], starting from `init`'s weights when given (checked against the graph
    /// before any parameter is allocated) instead of the seed's.
    pub fn with_weights(
        backend: B,
        model: ModelSpec,
        data: Arc<dyn Dataset>,
        cfg: TrainConfig,
        init: Option<&dyn WeightSource>,
    ) -> Result<Self> {
        cfg.validate()?;
        if cfg.optimizer_on == crate::OptimizerPlacement::Device && backend.is_f64() {
            return Err(TrainError::Config(format!(
                "the optimizer on the device keeps f32 state in the backend's tensors; the {} \
                 backend computes in f64 and keeps it on the host",
                backend.name()
            )));
        }
        let backend_precision = backend.precision();
        let model = adapt_model(model, data.kind())?;
        let graph = Arc::new(model.graph(cfg.batch_size, cfg.seq_len)?);
        let exec = Executor::new(backend.clone(), graph.clone())?
            .with_recompute(cfg.recompute.forced_segments(graph.nodes.len()));
        let pipeline = match cfg.pipeline_stages {
            1 => None,
            n => Some(
                LocalPipeline::new(backend, &graph, &graph.even_assignment(n)?)?
                    .with_recompute(cfg.recompute == crate::Recompute::On),
            ),
        };
        let params = match init {
            Some(source) => load_all_weights(source, &graph)?,
            None => init_params(&graph, cfg.seed),
        };
        let opt = zero_optimizer_state(&cfg, &graph);
        let decay = decay_mask(&graph);
        let (&a, &b) = match &graph.inputs[..] {
            [a, b] => (a, b),
            _ => {
                return Err(TrainError::DataMismatch(
                    "model graphs must have two inputs".into(),
                ))
            }
        };
        let (&loss, &logits) = match &graph.outputs[..] {
            [l, g] => (l, g),
            _ => {
                return Err(TrainError::DataMismatch(
                    "model graphs must have outputs loss and logits".into(),
                ))
            }
        };
        Ok(Trainer {
            exec,
            pipeline,
            model,
            data,
            cfg,
            params,
            opt,
            resident: None,
            lost: None,
            scaler: (backend_precision == Precision::F16).then(LossScaler::default),
            decay,
            step: 0,
            data_position: 0,
            inputs: (a, b),
            outputs: (loss, logits),
        })
    }

    pub fn step(&self) -> u64 {
        self.step
    }
    /// The host master copy of the parameters. While the optimizer state lives on the device
    /// (between the steps of a run on a GPU) it is empty: [`Trainer::run`] and
    /// [`Trainer::settle`] bring the state back.
    pub fn params(&self) -> &[Vec<f32>] {
        &self.params
    }

    /// Whether this run keeps its optimizer state on the compute device. Never on an `f64`
    /// backend (the reference oracle, gradient checks): there the `f32` master state is rounded
    /// on the host after every step, as a checkpoint rounds it, so runs resume bit-exactly.
    pub fn optimizer_on_device(&self) -> bool {
        let b = self.exec.backend();
        !b.is_f64() && self.cfg.optimizer_on.on_device(b.in_host_memory())
    }

    /// Copies the master state kept on the device back into host memory, which holds it from
    /// then on (the next device step uploads it again).
    pub fn settle(&mut self) -> Result<()> {
        if let Some(r) = &self.resident {
            let (params, opt) = r.download(self.exec.backend())?;
            self.params = params;
            self.opt = opt;
            self.resident = None;
        }
        Ok(())
    }

    /// Keeps the optimizer state in host memory from now on (islands swap host states).
    pub(crate) fn keep_optimizer_on_host(&mut self) -> Result<()> {
        self.settle()?;
        self.cfg.optimizer_on = crate::OptimizerPlacement::Host;
        Ok(())
    }
    pub fn graph(&self) -> &fusion_graph::Graph {
        self.exec.graph()
    }
    pub fn config(&self) -> &TrainConfig {
        &self.cfg
    }
    pub fn backend_name(&self) -> String {
        self.exec.backend().name()
    }

    fn feeds(&self, batch: Batch) -> Result<HashMap<TensorId, Value<B>>> {
        let b = self.exec.backend();
        let value = |t: HostTensor| -> Result<Value<B>> {
            Ok(match t {
                HostTensor::Float { data, shape } => Value::Float(b.upload(data, &shape)?),
                HostTensor::Ids { data, shape } => Value::Ids(
                    IdTensor::new(data, shape)
                        .map_err(|e| TrainError::DataMismatch(e.to_string()))?,
                ),
            })
        };
        let [x, y] = batch.into_inputs();
        Ok(HashMap::from([
            (self.inputs.0, value(x)?),
            (self.inputs.1, value(y)?),
        ]))
    }

    fn scalar(&self, v: &Value<B>) -> Result<f32> {
        let t = v
            .float()
            .map_err(|e| TrainError::DataMismatch(e.to_string()))?;
        Ok(self
            .exec
            .backend()
            .to_vec(t)?
            .first()
            .copied()
            .unwrap_or(f32::NAN))
    }

    /// Loss, parameter gradients and buffer updates of one micro-batch, through the whole graph
    /// or through the in-process pipeline stages.
    #[allow(clippy::type_complexity)]
    fn forward_backward(
        &self,
        device: &[B::Tensor],
        feeds: HashMap<TensorId, Value<B>>,
        seed: &B::Tensor,
    ) -> Result<(
        f32,
        Vec<Option<B::Tensor>>,
        Vec<(fusion_graph::ParamId, B::Tensor)>,
    )> {
        let seeds = HashMap::from([(self.outputs.0, seed.clone())]);
        let no_loss = || TrainError::DataMismatch("no loss output".into());
        if let Some(pipe) = &self.pipeline {
            let step = pipe.step(device, feeds, seeds, Mode::Train)?;
            let loss = self.scalar(step.outputs.get(&self.outputs.0).ok_or_else(no_loss)?)?;
            return Ok((loss, step.param_grads, step.buffer_updates));
        }
        let mut pass = self.exec.forward(device, feeds, Mode::Train, true)?;
        let loss = self.scalar(pass.output(self.outputs.0).ok_or_else(no_loss)?)?;
        let updates = std::mem::take(&mut pass.buffer_updates);
        let grads = self.exec.backward(pass, device, seeds)?;
        Ok((loss, grads.params, updates))
    }

    /// One optimizer step over `micro_batches` micro-batches. Returns (mean loss, grad norm, lr).
    pub fn train_step(&mut self) -> Result<(f32, f32, f32)> {
        if self.optimizer_on_device() {
            return self.train_step_resident();
        }
        self.check_not_lost()?;
        self.settle()?;
        let b = self.exec.backend().clone();
        let mut device = self.lend_params()?;
        let accumulated = self.accumulate(&mut device);
        self.reclaim_params(device)?;
        let (loss_sum, sum) = accumulated?;
        let m = self.cfg.micro_batches;
        let loss = loss_sum / m as f32;
        if !loss.is_finite() {
            return Err(TrainError::Diverged {
                step: self.step,
                value: loss,
            });
        }
        let graph = self.exec.graph().clone();
        // One gradient at a time to the host, each tensor freed as it is copied.
        let mut host: Vec<Option<Vec<f32>>> = sum
            .into_iter()
            .zip(&graph.params)
            .map(|(g, spec)| match (g, spec.trainable) {
                (Some(g), true) => b.to_vec(&g).map(Some),
                _ => Ok(None),
            })
            .collect::<std::result::Result<_, _>>()?;
        let lr = learning_rate(&self.cfg.schedule, self.step, self.cfg.steps);
        if !self.unscale(&mut host)? {
            return Ok((loss, 0.0, lr));
        }
        let norm = clip_global_norm(&mut host, self.cfg.clip_norm);
        self.opt.update(
            &self.cfg.optimizer,
            &mut self.params,
            &host,
            &self.decay,
            lr,
        );
        self.step += 1;
        Ok((loss, norm, lr))
    }

    /// [`Trainer::train_step`] with the master state on the device: it is uploaded before the
    /// first step, and the host copy freed so that it is never read stale.
    fn train_step_resident(&mut self) -> Result<(f32, f32, f32)> {
        self.check_not_lost()?;
        let b = self.exec.backend().clone();
        let mut resident = match self.resident.take() {
            Some(r) => r,
            None => self.upload_resident()?,
        };
        let accumulated = self.accumulate(&mut resident.params);
        let (loss_sum, sum) = match accumulated {
            Ok(a) => a,
            Err(e) => {
                self.resident = Some(resident);
                return Err(e);
            }
        };
        let loss = loss_sum / self.cfg.micro_batches as f32;
        if !loss.is_finite() {
            self.resident = Some(resident);
            return Err(TrainError::Diverged {
                step: self.step,
                value: loss,
            });
        }
        let graph = self.exec.graph().clone();
        let grads = sum
            .into_iter()
            .zip(&graph.params)
            .map(|(g, spec)| g.filter(|_| spec.trainable))
            .collect();
        let lr = learning_rate(&self.cfg.schedule, self.step, self.cfg.steps);
        let used_scale = self.loss_scale();
        let update = resident.update(
            &b,
            &self.cfg.optimizer,
            grads,
            &self.decay,
            lr,
            self.cfg.clip_norm,
            self.scaler.as_mut(),
        );
        let norm = match update {
            Ok(Some(norm)) => norm,
            Ok(None) => {
                self.resident = Some(resident);
                self.skipped(used_scale)?;
                return Ok((loss, 0.0, lr));
            }
            Err(UpdateError::Untouched(e)) => {
                self.resident = Some(resident);
                return Err(e);
            }
            // Part of the parameters moved: the state is no step's, and is dropped.
            Err(UpdateError::PartlyApplied(e)) => {
                self.lost = Some(self.step);
                return Err(e);
            }
        };
        self.resident = Some(resident);
        self.step += 1;
        Ok((loss, norm, lr))
    }

    /// Divides loss-scaled gradients by the scale they were taken at. Returns false, after
    /// halving the scale, when they overflowed and the step is to be skipped; an overflow at
    /// scale 1 is an error (no smaller scale can help: the gradients are not finite).
    fn unscale(&mut self, host: &mut [Option<Vec<f32>>]) -> Result<bool> {
        let Some(scaler) = &mut self.scaler else {
            return Ok(true);
        };
        let used = scaler.scale;
        match scaler.judge(scaler::all_finite(host)) {
            Verdict::Apply { scale } => {
                scaler::unscale(host, scale);
                Ok(true)
            }
            Verdict::Skip => self.skipped(used).map(|()| false),
        }
    }

    /// Accounts for a step the scaler skipped after its gradients overflowed at scale `used`:
    /// an error at scale 1 (no smaller scale can help), else the step counts, unapplied.
    fn skipped(&mut self, used: f32) -> Result<()> {
        if used <= 1.0 {
            return Err(TrainError::GradientsNotFinite { step: self.step });
        }
        tracing::warn!(
            step = self.step,
            next_scale = self.loss_scale(),
            "f16 gradients overflowed: step skipped, loss scale halved"
        );
        self.step += 1;
        Ok(())
    }

    /// The factor backward starts from: the loss scale in f16, else 1.
    fn loss_scale(&self) -> f32 {
        self.scaler.as_ref().map_or(1.0, |s| s.scale)
    }

    /// Refuses to go on from a state that a failed device update left part updated.
    fn check_not_lost(&self) -> Result<()> {
        match self.lost {
            Some(step) => Err(TrainError::StateLost { step }),
            None => Ok(()),
        }
    }

    fn upload_resident(&mut self) -> Result<Resident<B>> {
        let params = self.exec.upload_params(&self.params)?;
        let b = self.exec.backend();
        let r = Resident::upload(b, self.exec.graph(), &self.params, params, &self.opt)?;
        self.params = Vec::new();
        self.opt = OptimizerState {
            step: self.opt.step,
            first: Vec::new(),
            second: Vec::new(),
        };
        Ok(r)
    }

    /// The micro-batches of one step: summed loss and summed parameter gradients. Buffer
    /// updates (batch-norm statistics) go into `device`.
    #[allow(clippy::type_complexity)]
    fn accumulate(&mut self, device: &mut [B::Tensor]) -> Result<(f32, Vec<Option<B::Tensor>>)> {
        let b = self.exec.backend().clone();
        let m = self.cfg.micro_batches;
        let seed = b.upload(vec![self.loss_scale() / m as f32], &[1])?;
        let mut sum: Vec<Option<B::Tensor>> = (0..device.len()).map(|_| None).collect();
        let mut loss_sum = 0.0f32;
        for _ in 0..m {
            let batch = self.data.batch(
                Split::Train,
                self.data_position,
                self.cfg.batch_size,
                self.cfg.seq_len,
            )?;
            self.data_position += 1;
            let feeds = self.feeds(batch)?;
            let (loss, grads, buffer_updates) = self.forward_backward(device, feeds, &seed)?;
            loss_sum += loss;
            for (pid, t) in buffer_updates {
                device[pid.0] = t;
            }
            for (slot, g) in sum.iter_mut().zip(grads) {
                if let Some(g) = g {
                    *slot = Some(b.accumulate(slot.take(), g)?);
                }
            }
        }
        Ok((loss_sum, sum))
    }

    /// The parameters as backend tensors for one step. Where tensors live in host memory the
    /// host vectors are handed over (the weights are not held twice during the step) and
    /// [`Trainer::reclaim_params`] takes them back; elsewhere they are uploaded copies.
    fn lend_params(&mut self) -> Result<Vec<B::Tensor>> {
        let b = self.exec.backend().clone();
        let graph = self.exec.graph().clone();
        let sized = graph
            .params
            .iter()
            .zip(&self.params)
            .all(|(spec, v)| v.len() == spec.numel());
        if !b.host_resident() || !sized || self.params.len() != graph.params.len() {
            return Ok(self.exec.upload_params(&self.params)?);
        }
        let host = std::mem::take(&mut self.params);
        let mut out = Vec::with_capacity(host.len());
        let mut rest = host.into_iter();
        for spec in &graph.params {
            let Some(v) = rest.next() else { break };
            match b.upload(v, &spec.shape) {
                Ok(t) => out.push(t),
                Err(e) => {
                    // A host-resident backend cannot fail a sized upload; should one fail, the
                    // weights already handed over come back and the lost one is left empty, so
                    // that every later use names it (a size error) instead of misreading it.
                    let mut back = Vec::with_capacity(graph.params.len());
                    for t in &out {
                        back.push(b.to_vec(t)?);
                    }
                    back.push(Vec::new());
                    back.extend(rest);
                    self.params = back;
                    return Err(e.into());
                }
            }
        }
        Ok(out)
    }

    /// Takes the parameters back after a step (with any new buffer values): each tensor is
    /// copied to the host and freed in turn when they were lent, else only buffers are copied.
    fn reclaim_params(&mut self, device: Vec<B::Tensor>) -> Result<()> {
        let b = self.exec.backend().clone();
        if self.params.is_empty() {
            // One tensor at a time, each freed once copied; on an error the tensors not yet
            // copied stay with the caller's error and the weights copied so far are kept.
            let mut back = Vec::with_capacity(device.len());
            for t in device {
                back.push(b.to_vec(&t)?);
            }
            self.params = back;
            return Ok(());
        }
        let graph = self.exec.graph().clone();
        for (i, spec) in graph.params.iter().enumerate() {
            if !spec.trainable {
                self.params[i] = b.to_vec(&device[i])?;
            }
        }
        Ok(())
    }

    /// Mean loss and accuracy over the evaluation split.
    pub fn evaluate(&mut self) -> Result<EvalRecord> {
        self.check_not_lost()?;
        if let Some(r) = &self.resident {
            return self.evaluate_with(&r.params);
        }
        let device = self.lend_params()?;
        let record = self.evaluate_with(&device);
        self.reclaim_params(device)?;
        record
    }

    fn evaluate_with(&self, device: &[B::Tensor]) -> Result<EvalRecord> {
        let b = self.exec.backend();
        let n = self
            .cfg
            .eval_batches
            .unwrap_or(usize::MAX)
            .min(self.data.eval_batches(self.cfg.batch_size))
            .max(1);
        let (mut loss, mut correct, mut total) = (0.0f64, 0usize, 0usize);
        for i in 0..n {
            let batch =
                self.data
                    .batch(Split::Eval, i as u64, self.cfg.batch_size, self.cfg.seq_len)?;
            let targets = batch.targets().to_vec();
            let pass = self
                .exec
                .forward(device, self.feeds(batch)?, Mode::Eval, false)?;
            let l = pass
                .output(self.outputs.0)
                .ok_or_else(|| TrainError::DataMismatch("no loss output".into()))?;
            loss += self.scalar(l)? as f64;
            let logits = pass
                .output(self.outputs.1)
                .ok_or_else(|| TrainError::DataMismatch("no logits output".into()))?;
            let logits = b.to_vec(
                logits
                    .float()
                    .map_err(|e| TrainError::DataMismatch(e.to_string()))?,
            )?;
            let classes = logits.len() / targets.len().max(1);
            for (row, &t) in logits.chunks(classes.max(1)).zip(&targets) {
                let arg = row
                    .iter()
                    .enumerate()
                    .fold(
                        (0, f32::NEG_INFINITY),
                        |acc, (i, &v)| if v > acc.1 { (i, v) } else { acc },
                    )
                    .0;
                correct += usize::from(arg as u32 == t);
                total += 1;
            }
        }
        Ok(EvalRecord {
            step: self.step,
            loss: (loss / n as f64) as f32,
            accuracy: correct as f32 / total.max(1) as f32,
        })
    }

    /// Replaces the seeded initial parameters with `source`'s (the optimizer state stays zero), so
    /// training starts from published or exported weights. Only before the first step.
    pub fn init_from(&mut self, source: &dyn WeightSource) -> Result<()> {
        if self.step != 0 {
            return Err(TrainError::Config(format!(
                "initial weights can only be loaded before the first step (this run is at step {})",
                self.step
            )));
        }
        let params = load_all_weights(source, self.exec.graph())?;
        self.settle()?;
        self.params = params;
        if self.lost.take().is_some() {
            self.opt = zero_optimizer_state(&self.cfg, self.exec.graph());
        }
        Ok(())
    }

    /// The model as trained: the configured one matched to the data (vocabulary, geometry).
    pub fn model(&self) -> &ModelSpec {
        &self.model
    }

    /// Writes a checkpoint into `dir` and returns its path.
    pub fn save_checkpoint(&self, dir: &Path) -> Result<PathBuf> {
        self.check_not_lost()?;
        let downloaded = match &self.resident {
            Some(r) => Some(r.download(self.exec.backend())?),
            None => None,
        };
        let (params, opt) = match &downloaded {
            Some((p, o)) => (p, o),
            None => (&self.params, &self.opt),
        };
        let graph = self.exec.graph();
        let state = CheckpointState {
            format: CHECKPOINT_FORMAT.into(),
            version: CHECKPOINT_VERSION,
            model: self.model.name.clone(),
            model_signature: checkpoint::model_signature(graph),
            step: self.step,
            data_position: self.data_position,
            optimizer: self.cfg.optimizer.clone(),
            optimizer_step: opt.step,
            config: self.cfg.clone(),
            tensors_sha256: String::new(),
            run_id: None,
            model_spec: Some(self.model.clone()),
            loss_scale: self.scaler.clone(),
        };
        checkpoint::save(dir, graph, params, opt, state)
    }

    /// Restores parameters, optimizer state, step and data position from a checkpoint directory
    /// (a `step-N` directory, or a run directory whose `latest` is used).
    pub fn load_checkpoint(&mut self, path: &Path) -> Result<()> {
        let path = match checkpoint::latest_checkpoint(path)? {
            Some(p) => p,
            None => path.to_path_buf(),
        };
        let snap = checkpoint::load(&path, self.exec.graph(), &self.cfg.optimizer)?;
        self.params = snap.params;
        self.opt = snap.optimizer;
        self.resident = None;
        self.lost = None;
        self.step = snap.state.step;
        self.data_position = snap.state.data_position;
        if self.scaler.is_some() {
            self.scaler = Some(snap.state.loss_scale.unwrap_or_default());
        }
        Ok(())
    }

    /// Trains until `cfg.steps`, evaluating and checkpointing as configured; `on_step` sees every
    /// step (for progress display).
    ///
    /// The master state is in host memory when it returns, also after an error (unless a
    /// failed device update lost it).
    pub fn run(&mut self, on_step: impl FnMut(&StepRecord, Option<&EvalRecord>)) -> Result<Report> {
        let report = self.run_steps(on_step);
        let settled = match self.lost {
            Some(_) => Ok(()),
            None => self.settle(),
        };
        let report = report?;
        settled?;
        Ok(report)
    }

    fn run_steps(
        &mut self,
        mut on_step: impl FnMut(&StepRecord, Option<&EvalRecord>),
    ) -> Result<Report> {
        let start = Instant::now();
        let start_step = self.step;
        let per_step = self.samples_per_step();
        let (mut steps, mut evals) = (Vec::new(), Vec::new());
        while self.step < self.cfg.steps {
            let t0 = Instant::now();
            let (loss, grad_norm, lr) = self.train_step()?;
            let rec = StepRecord {
                step: self.step,
                loss,
                lr,
                grad_norm,
                elapsed_s: start.elapsed().as_secs_f64(),
                throughput: per_step / t0.elapsed().as_secs_f64().max(1e-9),
            };
            let last = self.step == self.cfg.steps;
            let eval = if last
                || (self.cfg.eval_every > 0 && self.step.is_multiple_of(self.cfg.eval_every))
            {
                Some(self.evaluate()?)
            } else {
                None
            };
            if let Some(dir) = self.cfg.checkpoint_dir.clone() {
                if last
                    || (self.cfg.checkpoint_every > 0
                        && self.step.is_multiple_of(self.cfg.checkpoint_every))
                {
                    self.save_checkpoint(&dir)?;
                }
            }
            on_step(&rec, eval.as_ref());
            steps.push(rec);
            evals.extend(eval);
        }
        let done = (self.step - start_step) as f64;
        Ok(self.report(start_step, steps, evals, per_step * done, start.elapsed()))
    }

    /// Tokens (language models) or samples (image models) one optimizer step sees.
    pub(crate) fn samples_per_step(&self) -> f64 {
        let per_batch = match self.data.kind() {
            DataKind::Text { .. } => self.cfg.batch_size * self.cfg.seq_len,
            DataKind::Images { .. } => self.cfg.batch_size,
        };
        (per_batch * self.cfg.micro_batches) as f64
    }

    /// The run's report: `samples` trained in `wall` time.
    pub(crate) fn report(
        &self,
        start_step: u64,
        steps: Vec<StepRecord>,
        evals: Vec<EvalRecord>,
        samples: f64,
        wall: std::time::Duration,
    ) -> Report {
        let wall = wall.as_secs_f64();
        Report {
            model: self.model.name.clone(),
            backend: self.exec.backend().name(),
            data: self.data.describe(),
            params: self.exec.graph().num_trainable(),
            config: self.cfg.clone(),
            start_step,
            steps,
            evals,
            throughput: samples / wall.max(1e-9),
            throughput_unit: match self.data.kind() {
                DataKind::Text { .. } => "tokens/s",
                DataKind::Images { .. } => "samples/s",
            },
            wall_s: wall,
            peak_rss_bytes: peak_rss_bytes(),
            entropy_floor: self.data.entropy_floor(),
            unigram_entropy: self.data.unigram_entropy(),
            outer: None,
            loss_scale: self.scaler.clone(),
        }
    }
}

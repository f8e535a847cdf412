//! Models as files. A model file is either an OP-DAG written out (JSON of format
//! `fusionllm.opdag`, as `fusionllm model export` writes it or a user builds it) or an
//! architecture: a [`ModelSpec`] in TOML or JSON (`name`, and `[kind]` with `family = "gpt2"` or
//! `"res_net"` and the family's fields). Either is accepted wherever a preset name is.

use crate::spec::{ModelError, ModelKind, ModelSpec};
use fusion_graph::{DType, Graph, FORMAT_NAME};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Most bytes a model file may have (a graph of a million operators is well under this).
pub const MAX_MODEL_FILE: u64 = 256 << 20;

/// Largest width, vocabulary, context, head count or image size an architecture file may give:
/// products of two stay far below 2^64.
pub const MAX_DIMENSION: usize = 1 << 22;

/// Most layers (blocks) an architecture file may give.
pub const MAX_LAYERS: usize = 1024;

/// A fixed OP-DAG: its shapes, including the micro-batch and sequence length, are those it was
/// built with. Only [`GraphModel::new`] makes one, deserialising included, so every one honours
/// the model contract.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "UncheckedGraphModel")]
pub struct GraphModel {
    graph: Graph,
}

/// A graph model as it arrives from outside, before [`GraphModel::new`] checks it.
#[derive(Deserialize)]
struct UncheckedGraphModel {
    graph: Graph,
}

impl TryFrom<UncheckedGraphModel> for GraphModel {
    type Error = ModelError;

    fn try_from(u: UncheckedGraphModel) -> Result<Self, ModelError> {
        GraphModel::new(u.graph)
    }
}

impl GraphModel {
    /// Checks `graph` (structure and shapes, with errors naming the node) and the model
    /// contract: two inputs, token ids `[B, T]` or images `[B, C, H, W]` then the targets, and two
    /// outputs, the loss (`[1]`) then the logits.
    pub fn new(graph: Graph) -> Result<Self, ModelError> {
        graph.validate()?;
        let name = graph.name.clone();
        let bad = |m: String| Err(ModelError::Contract(format!("graph '{name}': {m}")));
        let [data, targets] = graph.inputs[..] else {
            return bad(format!(
                "it has {} inputs; a model takes two (its data, then the targets)",
                graph.inputs.len()
            ));
        };
        let (data, targets) = (graph.tensor(data), graph.tensor(targets));
        let lm = match (data.dtype, data.shape.len()) {
            (DType::I32, 2) => true,
            (DType::F32, 4) => false,
            (d, n) => {
                return bad(format!(
                    "input '{}' is {d:?} of {n} dimensions: a model reads token ids [batch, \
                     sequence] or images [batch, channels, height, width]",
                    data.name
                ))
            }
        };
        let want_targets = if lm {
            data.shape.clone()
        } else {
            vec![data.shape[0]]
        };
        if targets.dtype != DType::I32 || targets.shape != want_targets {
            return bad(format!(
                "targets '{}' are {:?} {:?}; this model's are I32 {want_targets:?}",
                targets.name, targets.dtype, targets.shape
            ));
        }
        let [loss, logits] = graph.outputs[..] else {
            return bad(format!(
                "it has {} outputs; a model gives two (the loss, then the logits)",
                graph.outputs.len()
            ));
        };
        let (loss, logits) = (graph.tensor(loss), graph.tensor(logits));
        if loss.shape != [1] || logits.shape.len() < 2 {
            return bad(format!(
                "its outputs '{}' {:?} and '{}' {:?} are not a loss [1] and logits",
                loss.name, loss.shape, logits.name, logits.shape
            ));
        }
        Ok(GraphModel { graph })
    }

    /// Whether the graph reads token ids (else images).
    pub fn is_language_model(&self) -> bool {
        self.data().shape.len() == 2
    }

    fn data(&self) -> &fusion_graph::TensorInfo {
        self.graph.tensor(self.graph.inputs[0])
    }

    /// The graph as it is.
    pub fn as_graph(&self) -> &Graph {
        &self.graph
    }

    /// The data input's shape: `[B, T]` or `[B, C, H, W]`.
    pub fn data_shape(&self) -> &[usize] {
        &self.data().shape
    }

    /// Sequences or images per micro-batch.
    pub fn batch(&self) -> usize {
        self.data().shape[0]
    }

    /// The sequence length of a language model (else 0).
    pub fn seq(&self) -> usize {
        if self.is_language_model() {
            self.data().shape[1]
        } else {
            0
        }
    }

    /// Classes the logits score (the vocabulary of a language model).
    pub fn classes(&self) -> usize {
        let logits = self.graph.tensor(self.graph.outputs[1]);
        logits.shape.last().copied().unwrap_or(0)
    }

    /// The graph, if it was built for micro-batches of `batch` (× `seq` tokens).
    pub fn graph(&self, batch: usize, seq: usize) -> Result<Graph, ModelError> {
        let shape = &self.data().shape;
        let wanted_seq = if self.is_language_model() {
            seq
        } else {
            shape[1..].iter().product()
        };
        let have_seq = if self.is_language_model() {
            shape[1]
        } else {
            wanted_seq
        };
        if shape[0] != batch || have_seq != wanted_seq {
            return Err(ModelError::Contract(format!(
                "graph '{}' is built for micro-batches of {}; this run asks for {batch}{} \
                 (export it again with --batch {batch}{}, or train at its own: leave out \
                 --batch and --seq, or batch_size and seq_len in a job file's [train])",
                self.graph.name,
                describe(shape, self.is_language_model()),
                if self.is_language_model() {
                    format!(" x {seq} tokens")
                } else {
                    String::new()
                },
                if self.is_language_model() {
                    format!(" --seq {seq}")
                } else {
                    String::new()
                },
            )));
        }
        Ok(self.graph.clone())
    }
}

fn describe(shape: &[usize], lm: bool) -> String {
    if lm {
        format!("{} x {} tokens", shape[0], shape[1])
    } else {
        format!("{} images of {:?}", shape[0], &shape[1..])
    }
}

/// Whether `arg` names a model file rather than a preset.
pub fn is_model_file(arg: &str) -> bool {
    arg.contains('/')
        || arg.contains(std::path::MAIN_SEPARATOR)
        || [".json", ".toml"].iter().any(|e| arg.ends_with(e))
}

impl ModelSpec {
    /// A preset name, or a model file (a path, resolved against `base` when relative).
    pub fn resolve(arg: &str, base: Option<&Path>) -> Result<ModelSpec, ModelError> {
        if !is_model_file(arg) {
            return ModelSpec::preset(arg);
        }
        let path = match base {
            Some(b) if Path::new(arg).is_relative() => b.join(arg),
            _ => PathBuf::from(arg),
        };
        ModelSpec::load(&path)
    }

    /// Reads a model file: an OP-DAG (JSON with `"format": "fusionllm.opdag"`) or an
    /// architecture (TOML, or JSON without that format).
    pub fn load(path: &Path) -> Result<ModelSpec, ModelError> {
        let file = |reason: String| ModelError::File {
            path: path.display().to_string(),
            reason,
        };
        let len = std::fs::metadata(path)
            .map_err(|e| file(e.to_string()))?
            .len();
        if len > MAX_MODEL_FILE {
            return Err(file(format!("{len} bytes (at most {MAX_MODEL_FILE})")));
        }
        let text = std::fs::read_to_string(path).map_err(|e| file(e.to_string()))?;
        let toml = path.extension().is_some_and(|e| e == "toml");
        ModelSpec::parse(&text, toml).map_err(|e| match e {
            ModelError::File { reason, .. } => file(reason),
            e => file(e.to_string()),
        })
    }

    /// A model file's text: an architecture in TOML (`toml`), else JSON holding an OP-DAG or an
    /// architecture. Checked as [`ModelSpec::load`] says.
    pub fn parse(text: &str, toml: bool) -> Result<ModelSpec, ModelError> {
        let contract = |reason: String| ModelError::Contract(reason);
        let spec = if toml {
            toml::from_str::<ModelSpec>(text).map_err(|e| contract(e.to_string()))?
        } else {
            let value: serde_json::Value =
                serde_json::from_str(text).map_err(|e| contract(e.to_string()))?;
            if value.get("format").and_then(|f| f.as_str()) == Some(FORMAT_NAME) {
                return ModelSpec::from_graph(Graph::from_json(text)?);
            }
            serde_json::from_value::<ModelSpec>(value).map_err(|e| contract(e.to_string()))?
        };
        spec.check()?;
        Ok(spec)
    }

    /// A model that is the fixed graph `graph` (checked against the model contract).
    pub fn from_graph(graph: Graph) -> Result<ModelSpec, ModelError> {
        Ok(ModelSpec {
            name: graph.name.clone(),
            kind: ModelKind::Graph(Box::new(GraphModel::new(graph)?)),
            fixed_vocab: false,
        })
    }

    /// The architecture as a TOML model file (a fixed graph has none: export its graph).
    pub fn architecture_toml(&self) -> Result<String, ModelError> {
        if let ModelKind::Graph(_) = self.kind {
            return Err(ModelError::Contract(format!(
                "'{}' is a fixed graph, not an architecture: export its graph instead",
                self.name
            )));
        }
        toml::to_string(self).map_err(|e| ModelError::Contract(e.to_string()))
    }

    /// Checks an architecture read from a file: its sizes within [`MAX_DIMENSION`] and
    /// [`MAX_LAYERS`] (so no shape overflows and building it is quick), then its graph, built
    /// once at a tiny batch.
    pub fn check(&self) -> Result<(), ModelError> {
        let (dims, layers): (Vec<usize>, usize) = match &self.kind {
            ModelKind::Graph(_) => return Ok(()),
            ModelKind::Gpt2(c) => (vec![c.vocab, c.n_ctx, c.n_embd, c.n_head], c.n_layer),
            ModelKind::Llama(c) => (
                vec![
                    c.vocab,
                    c.n_ctx,
                    c.n_embd,
                    c.n_head,
                    c.n_kv_head,
                    c.intermediate,
                ],
                c.n_layer,
            ),
            ModelKind::ResNet(c) => {
                let mut d = c.widths.clone();
                d.extend([c.in_channels, c.image_size, c.classes, c.layers.len()]);
                (d, c.layers.iter().fold(0usize, |a, &l| a.saturating_add(l)))
            }
        };
        if let Some(d) = dims.iter().find(|&&d| d > MAX_DIMENSION) {
            return Err(ModelError::Contract(format!(
                "a size of {d} (at most {MAX_DIMENSION})"
            )));
        }
        if layers > MAX_LAYERS {
            return Err(ModelError::Contract(format!(
                "{layers} layers (at most {MAX_LAYERS})"
            )));
        }
        self.graph(1, self.context().clamp(1, 8)).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).expect("write");
        p
    }

    #[test]
    fn an_exported_graph_loads_back_as_the_same_model_and_checks_its_shapes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let g = ModelSpec::preset("gpt2-tiny")
            .and_then(|m| m.graph(2, 16))
            .expect("graph");
        let p = write(dir.path(), "m.json", &g.to_json());
        let m = ModelSpec::resolve(&p.display().to_string(), None).expect("loaded");
        assert!(m.is_language_model());
        assert_eq!(m.context(), 16);
        assert_eq!(m.graph(2, 16).expect("same shapes"), g);
        let err = m.graph(4, 16).expect_err("other batch").to_string();
        assert!(
            err.contains("built for micro-batches of 2 x 16 tokens")
                && err.contains("--batch 4 --seq 16"),
            "{err}"
        );
        // Relative to a base directory, as job files name them.
        assert!(ModelSpec::resolve("m.json", Some(dir.path())).is_ok());
    }

    #[test]
    fn an_architecture_file_in_toml_builds_its_graph() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = write(
            dir.path(),
            "arch.toml",
            "name = \"my-gpt\"\n[kind]\nfamily = \"gpt2\"\nvocab = 512\nn_ctx = 64\nn_embd = 32\nn_layer = 3\nn_head = 4\n",
        );
        let m = ModelSpec::load(&p).expect("loaded");
        assert_eq!(m.name, "my-gpt");
        let three = m.graph(1, 64).expect("graph").num_trainable();
        let two = crate::Gpt2Config {
            vocab: 512,
            n_ctx: 64,
            n_embd: 32,
            n_layer: 2,
            n_head: 4,
        }
        .graph("two", 1, 64)
        .expect("graph")
        .num_trainable();
        // A GPT-2 block of width 32: 12 * 32^2 weights and 13 * 32 biases and gains.
        assert_eq!(three - two, 12 * 32 * 32 + 13 * 32);
    }

    #[test]
    fn bad_model_files_are_refused_naming_the_problem() {
        let dir = tempfile::tempdir().expect("tempdir");
        let missing = ModelSpec::resolve("no/such/model.json", None).expect_err("missing");
        assert!(
            missing.to_string().contains("no/such/model.json"),
            "{missing}"
        );
        let p = write(
            dir.path(),
            "bad.toml",
            "name = \"x\"\n[kind]\nfamily = \"gpt3\"\n",
        );
        let err = ModelSpec::load(&p).expect_err("unknown family").to_string();
        assert!(err.contains("bad.toml") && err.contains("gpt3"), "{err}");
        let p = write(
            dir.path(),
            "heads.toml",
            "name = \"x\"\n[kind]\nfamily = \"gpt2\"\nvocab = 64\nn_ctx = 8\nn_embd = 30\nn_layer = 1\nn_head = 4\n",
        );
        let err = ModelSpec::load(&p)
            .expect_err("30 is not divisible by 4")
            .to_string();
        assert!(err.contains("heads.toml"), "{err}");
        // A graph whose node reads a tensor nobody produces: the node is named.
        let mut g = ModelSpec::preset("gpt2-tiny")
            .and_then(|m| m.graph(1, 4))
            .expect("graph");
        let victim = g.nodes[3].name.clone();
        g.nodes[3].inputs[0] = fusion_graph::TensorId(g.tensors.len() + 5);
        let p = write(dir.path(), "dangling.json", &g.to_json());
        let err = ModelSpec::load(&p).expect_err("dangling").to_string();
        assert!(err.contains(&victim), "{err}");
        // Sizes that would overflow a shape or take hours to build are refused up front.
        let p = write(
            dir.path(),
            "huge.toml",
            "name = \"x\"\n[kind]\nfamily = \"gpt2\"\nvocab = 64\nn_ctx = 8\nn_embd = 8\nn_layer = 1000000000\nn_head = 2\n",
        );
        let err = ModelSpec::load(&p).expect_err("too deep").to_string();
        assert!(err.contains("1000000000 layers"), "{err}");
        // A graph smuggled into an architecture file gets the same checks.
        let p = write(
            dir.path(),
            "smuggled.json",
            r#"{"name": "x", "kind": {"family": "graph", "graph": {"format": "fusionllm.opdag",
                "version": 1, "name": "x", "tensors": [], "params": [], "nodes": [],
                "inputs": [], "outputs": []}}}"#,
        );
        let err = ModelSpec::load(&p).expect_err("no inputs").to_string();
        assert!(
            err.contains("smuggled.json") && err.contains("0 inputs"),
            "{err}"
        );
        // A valid graph that is not a model: logits where the loss belongs, or no logits.
        let mut g = ModelSpec::preset("gpt2-tiny")
            .and_then(|m| m.graph(1, 4))
            .expect("graph");
        g.outputs.swap(0, 1);
        let err = ModelSpec::from_graph(g.clone())
            .expect_err("swapped")
            .to_string();
        assert!(err.contains("are not a loss [1] and logits"), "{err}");
        g.outputs.truncate(1);
        let err = ModelSpec::from_graph(g)
            .expect_err("one output")
            .to_string();
        assert!(err.contains("it has 1 outputs"), "{err}");
    }
}

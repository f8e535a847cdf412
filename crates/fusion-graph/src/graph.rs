//! Graph structure, validation and (de)serialization.

use crate::error::GraphError;
use crate::op::{Init, Op};
use crate::shape::{numel, DType};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet, VecDeque};

/// Name written into every serialized graph; a reader refuses anything else.
pub const FORMAT_NAME: &str = "fusionllm.opdag";
/// Bumped whenever the serialized form changes incompatibly.
pub const FORMAT_VERSION: u32 = 1;

macro_rules! id_type {
    ($name:ident) => {
        #[derive(
            Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
        )]
        #[serde(transparent)]
        pub struct $name(pub usize);
    };
}
id_type!(TensorId);
id_type!(NodeId);
id_type!(ParamId);

/// An edge of the DAG: a tensor with a static shape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorInfo {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
}

impl TensorInfo {
    pub fn numel(&self) -> usize {
        numel(&self.shape)
    }
    pub fn bytes(&self) -> usize {
        self.numel() * self.dtype.size_bytes()
    }
}

/// A named parameter (or non-trainable buffer such as batch-norm running statistics).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub trainable: bool,
    pub init: Init,
}

impl ParamSpec {
    pub fn numel(&self) -> usize {
        numel(&self.shape)
    }
}

/// An operator instance.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Node {
    pub name: String,
    pub op: Op,
    pub inputs: Vec<TensorId>,
    pub outputs: Vec<TensorId>,
    pub params: Vec<ParamId>,
}

/// The OP-DAG. Nodes are stored in a valid topological order once validated.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Graph {
    pub format: String,
    pub version: u32,
    pub name: String,
    pub tensors: Vec<TensorInfo>,
    pub params: Vec<ParamSpec>,
    pub nodes: Vec<Node>,
    /// Tensors fed from outside (data, or activations from another machine).
    pub inputs: Vec<TensorId>,
    /// Tensors whose values leave the graph (the loss).
    pub outputs: Vec<TensorId>,
}

impl Graph {
    pub fn tensor(&self, id: TensorId) -> &TensorInfo {
        &self.tensors[id.0]
    }
    pub fn param(&self, id: ParamId) -> &ParamSpec {
        &self.params[id.0]
    }
    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id.0]
    }
    pub fn tensor_by_name(&self, name: &str) -> Option<TensorId> {
        self.tensors
            .iter()
            .position(|t| t.name == name)
            .map(TensorId)
    }
    pub fn param_by_name(&self, name: &str) -> Option<ParamId> {
        self.params.iter().position(|p| p.name == name).map(ParamId)
    }

    /// Total number of trainable parameter elements (shared parameters counted once).
    pub fn num_trainable(&self) -> usize {
        self.params
            .iter()
            .filter(|p| p.trainable)
            .map(|p| p.numel())
            .sum()
    }

    /// The node that produces each tensor (None for graph inputs).
    pub fn producers(&self) -> Vec<Option<NodeId>> {
        let mut prod = vec![None; self.tensors.len()];
        for (i, n) in self.nodes.iter().enumerate() {
            for o in &n.outputs {
                if let Some(slot) = prod.get_mut(o.0) {
                    *slot = Some(NodeId(i));
                }
            }
        }
        prod
    }

    /// Nodes in a topological order (Kahn's algorithm; ties broken by stored order so the result
    /// is deterministic).
    pub fn topo_order(&self) -> Result<Vec<NodeId>, GraphError> {
        let producers = self.producers();
        let mut indeg = vec![0usize; self.nodes.len()];
        let mut consumers: Vec<Vec<usize>> = vec![Vec::new(); self.nodes.len()];
        for (i, n) in self.nodes.iter().enumerate() {
            for t in &n.inputs {
                if let Some(Some(p)) = producers.get(t.0) {
                    indeg[i] += 1;
                    consumers[p.0].push(i);
                }
            }
        }
        let mut queue: VecDeque<usize> = (0..self.nodes.len()).filter(|&i| indeg[i] == 0).collect();
        let mut order = Vec::with_capacity(self.nodes.len());
        while let Some(i) = queue.pop_front() {
            order.push(NodeId(i));
            for &c in &consumers[i] {
                indeg[c] -= 1;
                if indeg[c] == 0 {
                    queue.push_back(c);
                }
            }
        }
        if order.len() != self.nodes.len() {
            let stuck = (0..self.nodes.len()).find(|&i| indeg[i] > 0).unwrap_or(0);
            return Err(GraphError::Cycle(self.nodes[stuck].name.clone()));
        }
        Ok(order)
    }

    /// Checks the whole graph: format, references, single producers, acyclicity, operator
    /// arity, shapes and dtypes of every edge, and parameter shapes.
    pub fn validate(&self) -> Result<(), GraphError> {
        if self.format != FORMAT_NAME || self.version != FORMAT_VERSION {
            return Err(GraphError::Version {
                found: self.format.clone(),
                expected: FORMAT_NAME.into(),
                version: self.version,
                supported: FORMAT_VERSION,
            });
        }
        // Sizes come from untrusted files too: refuse shapes whose element count overflows or is
        // absurd before anything multiplies them.
        let too_large = |shape: &[usize]| {
            shape
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))
                .is_none_or(|n| n > 1 << 40)
        };
        for t in &self.tensors {
            if too_large(&t.shape) {
                return Err(GraphError::TooLarge {
                    what: "tensor",
                    name: t.name.clone(),
                    shape: t.shape.clone(),
                });
            }
        }
        for p in &self.params {
            if too_large(&p.shape) {
                return Err(GraphError::TooLarge {
                    what: "parameter",
                    name: p.name.clone(),
                    shape: p.shape.clone(),
                });
            }
        }
        let mut names = HashSet::new();
        for n in &self.nodes {
            if !names.insert(n.name.as_str()) {
                return Err(GraphError::DuplicateName(n.name.clone()));
            }
        }
        let mut pnames = HashSet::new();
        for p in &self.params {
            if !pnames.insert(p.name.as_str()) {
                return Err(GraphError::DuplicateName(p.name.clone()));
            }
        }
        let mut producer: HashMap<usize, &str> = HashMap::new();
        let inputs: HashSet<usize> = self.inputs.iter().map(|t| t.0).collect();
        for t in &self.inputs {
            if t.0 >= self.tensors.len() {
                return Err(GraphError::DanglingTensor {
                    node: "<graph inputs>".into(),
                    tensor: t.0,
                });
            }
        }
        for n in &self.nodes {
            for t in n.inputs.iter().chain(&n.outputs) {
                if t.0 >= self.tensors.len() {
                    return Err(GraphError::DanglingTensor {
                        node: n.name.clone(),
                        tensor: t.0,
                    });
                }
            }
            for p in &n.params {
                if p.0 >= self.params.len() {
                    return Err(GraphError::DanglingParam {
                        node: n.name.clone(),
                        param: p.0,
                    });
                }
            }
            for o in &n.outputs {
                if inputs.contains(&o.0) {
                    return Err(GraphError::InputProduced {
                        tensor: self.tensors[o.0].name.clone(),
                        node: n.name.clone(),
                    });
                }
                if let Some(first) = producer.insert(o.0, &n.name) {
                    return Err(GraphError::MultipleProducers {
                        tensor: self.tensors[o.0].name.clone(),
                        first: first.to_string(),
                        second: n.name.clone(),
                    });
                }
            }
        }
        for n in &self.nodes {
            for t in &n.inputs {
                if !producer.contains_key(&t.0) && !inputs.contains(&t.0) {
                    return Err(GraphError::Unproduced {
                        node: n.name.clone(),
                        tensor: self.tensors[t.0].name.clone(),
                    });
                }
            }
        }
        for o in &self.outputs {
            if o.0 >= self.tensors.len() {
                return Err(GraphError::BadOutput(o.0));
            }
        }
        self.topo_order()?;
        for n in &self.nodes {
            self.check_node(n)?;
        }
        Ok(())
    }

    fn check_node(&self, n: &Node) -> Result<(), GraphError> {
        let op = n.op.name().to_string();
        if n.inputs.len() != n.op.num_inputs() {
            return Err(GraphError::Arity {
                node: n.name.clone(),
                op,
                what: "inputs",
                expected: n.op.num_inputs(),
                found: n.inputs.len(),
            });
        }
        if n.outputs.len() != 1 {
            return Err(GraphError::Arity {
                node: n.name.clone(),
                op,
                what: "outputs",
                expected: 1,
                found: n.outputs.len(),
            });
        }
        let ins: Vec<(Vec<usize>, DType)> = n
            .inputs
            .iter()
            .map(|t| (self.tensors[t.0].shape.clone(), self.tensors[t.0].dtype))
            .collect();
        let out = &self.tensors[n.outputs[0].0];
        let param_shapes: Vec<Vec<usize>> = n
            .params
            .iter()
            .map(|p| self.params[p.0].shape.clone())
            .collect();
        let expected_slots = n.op.param_slots(
            &ins.iter().map(|i| i.0.clone()).collect::<Vec<_>>(),
            &out.shape,
        );
        let expected_params = match n.op {
            Op::Embedding | Op::PositionalEmbedding => 1,
            _ => expected_slots.len(),
        };
        if n.params.len() != expected_params {
            return Err(GraphError::Arity {
                node: n.name.clone(),
                op,
                what: "parameters",
                expected: expected_params,
                found: n.params.len(),
            });
        }
        for (slot, pid) in expected_slots.iter().zip(&n.params) {
            let p = &self.params[pid.0];
            if p.shape != slot.shape {
                return Err(GraphError::ParamShape {
                    node: n.name.clone(),
                    param: p.name.clone(),
                    found: p.shape.clone(),
                    expected: slot.shape.clone(),
                });
            }
        }
        let inferred =
            n.op.infer(&ins, &param_shapes, Some(&out.shape))
                .map_err(|message| GraphError::Shape {
                    node: n.name.clone(),
                    op: op.clone(),
                    message,
                })?;
        let (shape, dtype) = &inferred[0];
        if *shape != out.shape || *dtype != out.dtype {
            return Err(GraphError::Shape {
                node: n.name.clone(),
                op,
                message: format!(
                    "output '{}' is declared {:?} {:?} but the operator produces {:?} {:?}",
                    out.name, out.shape, out.dtype, shape, dtype
                ),
            });
        }
        Ok(())
    }

    /// Serializes to the versioned JSON form.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }

    /// Parses and validates a serialized graph.
    pub fn from_json(text: &str) -> Result<Graph, GraphError> {
        let g: Graph = serde_json::from_str(text).map_err(|e| GraphError::Parse(e.to_string()))?;
        g.validate()?;
        Ok(g)
    }
}

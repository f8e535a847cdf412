//! A builder so users define networks as graphs without touching kernels.

use crate::error::GraphError;
use crate::graph::{
    Graph, Node, ParamId, ParamSpec, TensorId, TensorInfo, FORMAT_NAME, FORMAT_VERSION,
};
use crate::op::{Init, Op};
use crate::shape::DType;

/// Builds a [`Graph`] node by node, inferring every output shape and creating each operator's
/// parameters. Every call checks its operator immediately, so a mistake is reported at the line
/// that made it.
pub struct GraphBuilder {
    graph: Graph,
    scopes: Vec<String>,
}

impl GraphBuilder {
    pub fn new(name: impl Into<String>) -> Self {
        GraphBuilder {
            graph: Graph {
                format: FORMAT_NAME.into(),
                version: FORMAT_VERSION,
                name: name.into(),
                tensors: Vec::new(),
                params: Vec::new(),
                nodes: Vec::new(),
                inputs: Vec::new(),
                outputs: Vec::new(),
            },
            scopes: Vec::new(),
        }
    }

    /// Runs `f` with `name` appended to the naming scope ("h.3.attn").
    pub fn scoped<T>(&mut self, name: &str, f: impl FnOnce(&mut Self) -> T) -> T {
        self.scopes.push(name.to_string());
        let r = f(self);
        self.scopes.pop();
        r
    }

    fn qualified(&self, name: &str) -> String {
        let mut parts = self.scopes.clone();
        parts.push(name.to_string());
        parts.join(".")
    }

    pub fn shape(&self, t: TensorId) -> &[usize] {
        &self.graph.tensors[t.0].shape
    }

    fn new_tensor(&mut self, name: String, shape: Vec<usize>, dtype: DType) -> TensorId {
        self.graph.tensors.push(TensorInfo { name, shape, dtype });
        TensorId(self.graph.tensors.len() - 1)
    }

    /// Declares a graph input (data fed from outside).
    pub fn input(&mut self, name: &str, shape: Vec<usize>, dtype: DType) -> TensorId {
        let t = self.new_tensor(name.to_string(), shape, dtype);
        self.graph.inputs.push(t);
        t
    }

    /// Declares a parameter explicitly (embedding tables, which other nodes may share).
    pub fn param(&mut self, name: &str, shape: Vec<usize>, init: Init) -> ParamId {
        let name = self.qualified(name);
        self.graph.params.push(ParamSpec {
            name,
            shape,
            trainable: true,
            init,
        });
        crate::graph::ParamId(self.graph.params.len() - 1)
    }

    /// Adds a node whose parameters are derived from its operator (`out_hint` gives the output
    /// feature count for `Linear` / `Conv2d`).
    pub fn op(
        &mut self,
        name: &str,
        op: Op,
        inputs: &[TensorId],
        out_hint: Option<Vec<usize>>,
    ) -> Result<TensorId, GraphError> {
        let ins: Vec<Vec<usize>> = inputs.iter().map(|t| self.shape(*t).to_vec()).collect();
        let hint = out_hint.unwrap_or_default();
        let slots = op.param_slots(&ins, &hint);
        let node_name = self.qualified(name);
        let params = slots
            .into_iter()
            .map(|s| {
                self.graph.params.push(ParamSpec {
                    name: format!("{node_name}.{}", s.role),
                    shape: s.shape,
                    trainable: s.trainable,
                    init: s.init,
                });
                ParamId(self.graph.params.len() - 1)
            })
            .collect();
        self.op_with_params(name, op, inputs, params)
    }

    /// Adds a node that uses the given (possibly shared) parameters.
    pub fn op_with_params(
        &mut self,
        name: &str,
        op: Op,
        inputs: &[TensorId],
        params: Vec<ParamId>,
    ) -> Result<TensorId, GraphError> {
        let node_name = self.qualified(name);
        let ins: Vec<(Vec<usize>, DType)> = inputs
            .iter()
            .map(|t| {
                (
                    self.graph.tensors[t.0].shape.clone(),
                    self.graph.tensors[t.0].dtype,
                )
            })
            .collect();
        let pshapes: Vec<Vec<usize>> = params
            .iter()
            .map(|p| self.graph.params[p.0].shape.clone())
            .collect();
        let outs = op
            .infer(&ins, &pshapes, None)
            .map_err(|message| GraphError::Shape {
                node: node_name.clone(),
                op: op.name().into(),
                message,
            })?;
        let (shape, dtype) = outs.into_iter().next().ok_or_else(|| GraphError::Shape {
            node: node_name.clone(),
            op: op.name().into(),
            message: "operator produced no output".into(),
        })?;
        let out = self.new_tensor(node_name.clone(), shape, dtype);
        self.graph.nodes.push(Node {
            name: node_name,
            op,
            inputs: inputs.to_vec(),
            outputs: vec![out],
            params,
        });
        Ok(out)
    }

    pub fn linear(
        &mut self,
        name: &str,
        x: TensorId,
        out_features: usize,
        bias: bool,
    ) -> Result<TensorId, GraphError> {
        let mut hint = self.shape(x).to_vec();
        if let Some(l) = hint.last_mut() {
            *l = out_features;
        }
        self.op(name, Op::Linear { bias }, &[x], Some(hint))
    }

    pub fn conv2d(
        &mut self,
        name: &str,
        x: TensorId,
        out_channels: usize,
        kernel: usize,
        stride: usize,
        padding: usize,
    ) -> Result<TensorId, GraphError> {
        let s = self.shape(x).to_vec();
        let hint = vec![s.first().copied().unwrap_or(0), out_channels, 0, 0];
        self.op(
            name,
            Op::Conv2d {
                kernel,
                stride,
                padding,
                bias: false,
            },
            &[x],
            Some(hint),
        )
    }

    /// Overrides how a parameter is initialised (e.g. GPT-2's scaled residual projections).
    pub fn set_init(&mut self, p: ParamId, init: Init) {
        if let Some(spec) = self.graph.params.get_mut(p.0) {
            spec.init = init;
        }
    }

    /// The parameters of the most recently added node.
    pub fn last_params(&self) -> Vec<ParamId> {
        self.graph
            .nodes
            .last()
            .map(|n| n.params.clone())
            .unwrap_or_default()
    }

    /// Marks a tensor as a graph output.
    pub fn output(&mut self, t: TensorId) {
        self.graph.outputs.push(t);
    }

    /// Validates and returns the graph.
    pub fn finish(self) -> Result<Graph, GraphError> {
        self.graph.validate()?;
        Ok(self.graph)
    }
}

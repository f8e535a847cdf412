//! Builds a two-layer perceptron for 28x28 grey images in 10 classes with the graph builder and
//! writes it as a model file: `cargo run -p fusion-models --example mlp_model > mlp.json`, then
//! `fusionllm train --model mlp.json --data fashion-mnist:DIR`. See docs/MODELS.md.

use fusion_graph::{DType, Graph, GraphBuilder, GraphError, Op};
use fusion_models::ModelSpec;

/// The perceptron for micro-batches of `batch` images: the model contract's two inputs (images,
/// then labels) and two outputs (the loss, then the logits).
fn mlp(batch: usize, hidden: usize) -> Result<Graph, GraphError> {
    let mut g = GraphBuilder::new("mlp");
    let images = g.input("images", vec![batch, 1, 28, 28], DType::F32);
    let labels = g.input("labels", vec![batch], DType::I32);
    let x = g.op("flatten", Op::Flatten, &[images], None)?;
    let x = g.linear("fc1", x, hidden, true)?;
    let x = g.op("relu", Op::Relu, &[x], None)?;
    let logits = g.linear("fc2", x, 10, true)?;
    let loss = g.op("loss", Op::SoftmaxCrossEntropy, &[logits, labels], None)?;
    g.output(loss);
    g.output(logits);
    g.finish()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let graph = mlp(32, 128)?;
    // The same checks `--model mlp.json` makes: a valid graph that honours the model contract.
    ModelSpec::from_graph(graph.clone())?;
    println!("{}", graph.to_json());
    Ok(())
}

//! `fusionllm model summary` and `fusionllm model export`.

use anyhow::Result;
use clap::Args;
use fusion_graph::GraphCost;
use fusion_models::ModelSpec;

#[derive(Args)]
pub struct SummaryArgs {
    /// Preset name (see `fusionllm model list`) or model file.
    preset: String,
    /// Sequences (or images) per micro-batch (default: 1, or a model file's).
    #[arg(long)]
    batch: Option<usize>,
    /// Tokens per sequence (default: the model's context).
    #[arg(long)]
    seq: Option<usize>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Also print the serialized graph (JSON IR).
    #[arg(long)]
    graph: bool,
}

fn human(x: f64) -> String {
    let units = [(1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")];
    for (s, u) in units {
        if x >= s {
            return format!("{:.2}{u}", x / s);
        }
    }
    format!("{x:.0}")
}

pub fn run(a: SummaryArgs) -> Result<()> {
    let spec = ModelSpec::resolve(&a.preset, None)?;
    let (batch, seq) = shape(&spec, a.batch, a.seq, 1);
    let graph = spec.graph(batch, seq)?;
    let cost = GraphCost::of(&graph);
    if a.graph {
        println!("{}", graph.to_json());
        return Ok(());
    }
    if a.json {
        let out = serde_json::json!({
            "model": spec.name,
            "batch": batch,
            "seq": seq,
            "params": cost.params,
            "fwd_flops": cost.fwd_flops,
            "bwd_flops": cost.bwd_flops,
            "activation_bytes": cost.activation_bytes,
            "ops": cost.nodes,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "{} (batch {}, seq {seq}): {} operators, {} parameters",
        spec.name,
        batch,
        cost.nodes.len(),
        cost.params
    );
    println!(
        "{:<36} {:<22} {:>18} {:>10} {:>10} {:>10} {:>10}",
        "operator", "op", "output", "params", "fwd FLOP", "bwd FLOP", "act bytes"
    );
    for n in &cost.nodes {
        println!(
            "{:<36} {:<22} {:>18} {:>10} {:>10} {:>10} {:>10}",
            n.name,
            n.op,
            format!("{:?}", n.output_shape),
            human(n.params as f64),
            human(n.fwd_flops),
            human(n.bwd_flops),
            human((n.activation_bytes + n.saved_bytes) as f64)
        );
    }
    println!(
        "total: {} params ({:.1} MB f32), {} FLOP forward, {} FLOP backward, {} activation bytes per micro-batch",
        cost.params,
        cost.params as f64 * 4.0 / 1e6,
        human(cost.fwd_flops),
        human(cost.bwd_flops),
        human(cost.activation_bytes as f64)
    );
    Ok(())
}

/// The micro-batch and sequence length: the user's, else a model file's, else `batch` and the
/// model's context.
fn shape(
    spec: &ModelSpec,
    batch: Option<usize>,
    seq: Option<usize>,
    default: usize,
) -> (usize, usize) {
    let (b, s) = spec.fixed_shape().unwrap_or((default, spec.context()));
    (batch.unwrap_or(b), seq.unwrap_or(s))
}

#[derive(Args)]
pub struct ExportArgs {
    /// Preset name (see `fusionllm model list`) or model file.
    model: String,
    /// Sequences (or images) per micro-batch the graph is built for (default: 4).
    #[arg(long)]
    batch: Option<usize>,
    /// Tokens per sequence (default: the model's context).
    #[arg(long)]
    seq: Option<usize>,
    /// Write the architecture (TOML: name, family and its fields) instead of the graph, to edit
    /// and train at any batch and sequence length.
    #[arg(long)]
    architecture: bool,
}

/// Writes the model's OP-DAG (JSON) or its architecture (TOML) to standard output.
pub fn export(a: ExportArgs) -> Result<()> {
    let spec = ModelSpec::resolve(&a.model, None)?;
    if a.architecture {
        print!("{}", spec.architecture_toml()?);
        return Ok(());
    }
    let (batch, seq) = shape(&spec, a.batch, a.seq, 4);
    println!("{}", spec.graph(batch, seq)?.to_json());
    Ok(())
}

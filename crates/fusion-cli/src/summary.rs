//! `fusionllm model summary`.

use anyhow::Result;
use clap::Args;
use fusion_graph::GraphCost;
use fusion_models::ModelSpec;

#[derive(Args)]
pub struct SummaryArgs {
    /// Preset name (see `fusionllm model list`).
    preset: String,
    /// Sequences (or images) per micro-batch.
    #[arg(long, default_value_t = 1)]
    batch: usize,
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
    let spec = ModelSpec::preset(&a.preset)?;
    let seq = a.seq.unwrap_or(spec.context());
    let graph = spec.graph(a.batch, seq)?;
    let cost = GraphCost::of(&graph);
    if a.graph {
        println!("{}", graph.to_json());
        return Ok(());
    }
    if a.json {
        let out = serde_json::json!({
            "model": spec.name,
            "batch": a.batch,
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
        a.batch,
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

//! `fusionllm`: the command-line entry point.

mod bench;
mod peak;
mod summary;
mod train;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "fusionllm",
    version,
    about = "Decentralized training of large models over an operator DAG"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Inspect model presets.
    Model {
        #[command(subcommand)]
        action: ModelAction,
    },
    /// Train a model (default: gpt2-tiny on the built-in synthetic corpus).
    Train(train::TrainArgs),
    /// Measure kernel and training-step speed on this machine.
    Bench(bench::BenchArgs),
}

#[derive(Subcommand)]
enum ModelAction {
    /// Operators, parameters, FLOPs and activation bytes per operator.
    Summary(summary::SummaryArgs),
    /// List the presets.
    List,
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Model {
            action: ModelAction::Summary(a),
        } => summary::run(a),
        Command::Model {
            action: ModelAction::List,
        } => {
            fusion_models::PRESETS.iter().for_each(|p| println!("{p}"));
            Ok(())
        }
        Command::Train(a) => train::run(a),
        Command::Bench(a) => bench::run(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

//! `fusionllm`: the command-line entry point.

mod bench;
mod bench_adatopk;
mod bench_anneal;
mod bench_cluster;
mod bench_compress;
mod bench_dashboard;
mod bench_fidelity;
mod bench_islands;
mod bench_planner;
mod bench_recovery;
mod bench_simd;
mod bench_soak;
mod bench_transport;
mod cert;
mod checkpoint_cmd;
mod cluster;
mod dashboard;
mod islands_plan;
mod peak;
mod plan_cmd;
mod soak_proxy;
mod standby;
mod summary;
mod supervisor;
mod testbed_cmd;
mod train;
mod weights;

use clap::{Parser, Subcommand};

/// Keeps freed memory in the process for reuse. By default glibc serves every allocation above
/// 32 MB with a fresh `mmap` and unmaps it on free, so each large tensor (the logits of a
/// 50257-token vocabulary are 200 MB) is page-faulted and zeroed by the kernel again: in a one-off
/// probe on the 2-vCPU development machine, a 200 MB element-wise map took 125 ms that way and 22 ms on reused memory.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn keep_freed_memory() {
    // SAFETY: mallopt only changes allocator tuning parameters; called before any threads start.
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn keep_freed_memory() {}

/// Ends the process quietly when its output pipe closes (`fusionllm model summary X | head`),
/// as command-line tools do, instead of panicking on the failed write. Only for the commands
/// that print and exit: the long-lived ones keep Rust's default (SIGPIPE ignored, so a write to
/// a closed socket or pipe is an error to handle, not the end of the process).
#[cfg(unix)]
fn quiet_on_closed_pipe() {
    // SAFETY: restores the default disposition of SIGPIPE before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

#[cfg(not(unix))]
fn quiet_on_closed_pipe() {}

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
    /// Train a model (default: gpt2-tiny on the built-in synthetic corpus, on a local emulated
    /// cluster of 4 node processes at two sites; --nodes 1 trains in this process).
    Train(Box<train::TrainArgs>),
    /// Run the broker of a distributed job.
    Broker(Box<cluster::BrokerArgs>),
    /// Run a compute node that joins a broker.
    Node(Box<cluster::NodeArgs>),
    /// Faithful link emulation with network namespaces, tc and a delay bridge (root).
    Testbed {
        #[command(subcommand)]
        action: testbed_cmd::TestbedAction,
    },
    /// Measure kernel and training-step speed on this machine.
    Bench(bench::BenchArgs),
    /// Make a private CA and certificates for the broker and nodes.
    Cert(cert::CertArgs),
    /// Workload estimate: FLOPs, bytes, memory and time per operator on a device.
    Estimate(Box<plan_cmd::EstimateArgs>),
    /// Plan a model on a testbed (OP-Fence or a baseline) and compare the schedulers.
    Plan(Box<plan_cmd::PlanArgs>),
    /// Simulate a plan file step by step.
    Simulate(plan_cmd::SimulateArgs),
    /// Write a checkpoint as a Hugging Face model directory (config.json and model.safetensors)
    /// that transformers loads with from_pretrained.
    Export(weights::ExportArgs),
    /// Sample text from a checkpoint or a Hugging Face model directory (GPT-2 or Llama family,
    /// GPT-2 BPE or byte tokens), one token at a time with a key/value cache.
    Generate(weights::GenerateArgs),
    /// Write the dashboard's page for a finished run's JSON report (`--html OUT.html`).
    Report(dashboard::ReportArgs),
    /// Work on checkpoints: merge a sharded snapshot's shards into one checkpoint.
    Checkpoint {
        #[command(subcommand)]
        action: checkpoint_cmd::CheckpointAction,
    },
}

#[derive(Subcommand)]
enum ModelAction {
    /// Operators, parameters, FLOPs and activation bytes per operator.
    Summary(summary::SummaryArgs),
    /// List the presets.
    List,
    /// Write a model's graph (OP-DAG JSON) or architecture (TOML) to standard output, to train
    /// with `--model FILE` or edit.
    Export(summary::ExportArgs),
}

fn main() {
    keep_freed_memory();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    if matches!(
        cli.command,
        Command::Model { .. }
            | Command::Estimate(_)
            | Command::Plan(_)
            | Command::Simulate(_)
            | Command::Generate(_)
    ) {
        quiet_on_closed_pipe();
    }
    let result = match cli.command {
        Command::Model {
            action: ModelAction::Summary(a),
        } => summary::run(a),
        Command::Model {
            action: ModelAction::Export(a),
        } => summary::export(a),
        Command::Model {
            action: ModelAction::List,
        } => {
            fusion_models::PRESETS.iter().for_each(|p| println!("{p}"));
            Ok(())
        }
        Command::Train(a) => train::run(*a),
        Command::Broker(a) => cluster::run_broker_cmd(*a),
        Command::Node(a) => cluster::run_node_cmd(*a),
        Command::Testbed { action } => testbed_cmd::run(action),
        Command::Bench(a) => bench::run(a),
        Command::Cert(a) => cert::run(a),
        Command::Estimate(a) => plan_cmd::estimate(*a),
        Command::Plan(a) => plan_cmd::run_plan(*a),
        Command::Simulate(a) => plan_cmd::simulate(a),
        Command::Export(a) => weights::run_export(a),
        Command::Generate(a) => weights::run_generate(a),
        Command::Checkpoint { action } => checkpoint_cmd::run(action),
        Command::Report(a) => dashboard::run_report(a),
    };
    if let Err(e) = result {
        eprintln!("error: {}", describe(&e));
        std::process::exit(1);
    }
}

/// An error and its causes, each said once: a typed error that shows its source in its own
/// message (`training: {0}`) is not followed by that source again.
fn describe(e: &anyhow::Error) -> String {
    let mut out = String::new();
    let mut previous = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if !previous.is_empty() && previous.contains(&text) {
            previous = text;
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
        previous = text;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::describe;

    #[test]
    fn every_cause_is_said_once() {
        let typed = fusion_runtime::RuntimeError::from(fusion_train::TrainError::Config(
            "shares add up to 7".into(),
        ));
        let e = anyhow::Error::from(typed).context("starting the broker");
        assert_eq!(
            describe(&e),
            "starting the broker: training: invalid training configuration: shares add up to 7"
        );
        let plain = anyhow::anyhow!("disk full").context("writing the checkpoint");
        assert_eq!(describe(&plain), "writing the checkpoint: disk full");
    }
}

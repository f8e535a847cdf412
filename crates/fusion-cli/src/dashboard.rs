//! `--dashboard ADDR` for the broker and the local launcher, and `fusionllm report RUN.json
//! --html OUT.html`.

use anyhow::{Context, Result};
use clap::Args;
use fusion_monitor::{Dashboard, Monitor, RunInfo};
use fusion_runtime::BrokerEvent;
use fusion_testbed::Testbed;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Args, Clone, Debug, Default)]
pub struct DashboardArgs {
    /// Serve a live dashboard (and Prometheus metrics at /metrics) on this address, e.g.
    /// 0.0.0.0:8080 (port 0: any free port; without a value: loopback, any free port); the URL
    /// is printed. Beyond loopback it requires a token.
    #[arg(long, value_name = "ADDR", num_args = 0..=1, default_missing_value = "127.0.0.1:0")]
    pub dashboard: Option<SocketAddr>,
    /// The token the dashboard requires (`?token=` or `Authorization: Bearer`); default: none
    /// on loopback, a random one (printed in its URL) on any other address.
    #[arg(long, env = "FUSIONLLM_DASHBOARD_TOKEN", hide_env_values = true)]
    pub dashboard_token: Option<String>,
}

/// What the run is, for the dashboard's header and placement picture.
pub fn run_info(
    model: &str,
    data: &str,
    steps: u64,
    unit: &str,
    testbed: Option<&Testbed>,
) -> RunInfo {
    RunInfo {
        model: model.into(),
        data: data.into(),
        steps,
        unit: unit.into(),
        sites: testbed
            .map(|t| {
                t.devices
                    .iter()
                    .map(|d| (d.name.clone(), d.site.clone()))
                    .collect()
            })
            .unwrap_or_default(),
    }
}

/// A served dashboard and its monitor; None without `--dashboard`.
pub struct Live {
    pub monitor: Arc<Monitor>,
    _server: Dashboard,
}

impl Live {
    /// Starts the dashboard on the current tokio runtime and prints its URL.
    pub async fn start(args: &DashboardArgs, info: RunInfo) -> Result<Option<Live>> {
        let Some(addr) = args.dashboard else {
            return Ok(None);
        };
        let token = match (&args.dashboard_token, addr.ip().is_loopback()) {
            (Some(t), _) => Some(t.clone()),
            (None, true) => None,
            (None, false) => Some(crate::cluster::random_token()),
        };
        let monitor = Monitor::new(info)?;
        let server = fusion_monitor::serve(monitor.clone(), addr, token)
            .await
            .with_context(|| format!("starting the dashboard on {addr}"))?;
        eprintln!(
            "dashboard: {}  (Prometheus metrics at /metrics)",
            server.url
        );
        Ok(Some(Live {
            monitor,
            _server: server,
        }))
    }
}

/// `handler` that also feeds the dashboard's monitor.
pub fn observed<'a>(
    live: Option<Arc<Monitor>>,
    mut handler: impl FnMut(BrokerEvent) + Send + Sync + 'a,
) -> impl FnMut(BrokerEvent) + Send + Sync + 'a {
    move |ev: BrokerEvent| {
        if let Some(m) = &live {
            m.observe(&ev);
        }
        handler(ev)
    }
}

/// Tells the dashboard how the run ended, and gives its viewers a moment to read it before the
/// server closes with the run.
pub async fn finished<T, E: std::fmt::Display>(
    live: Option<&Live>,
    result: &std::result::Result<T, E>,
) {
    let Some(l) = live else {
        return;
    };
    match result {
        Ok(_) => l.monitor.finish(true, "training finished"),
        Err(e) => l.monitor.finish(false, &format!("the job failed: {e}")),
    }
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    eprintln!(
        "dashboard: closed with the run (`fusionllm report RUN.json --html OUT.html` draws a \
         finished run's report)"
    );
}

#[derive(Args)]
pub struct ReportArgs {
    /// A run's JSON report (`train --report`, `broker --report`).
    report: PathBuf,
    /// Write the dashboard's page for it here: one self-contained HTML file.
    #[arg(long)]
    html: PathBuf,
}

pub fn run_report(a: ReportArgs) -> Result<()> {
    fusion_monitor::report_page(&a.report, &a.html)?;
    println!("wrote {}", a.html.display());
    Ok(())
}

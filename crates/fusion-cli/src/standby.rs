//! `fusionllm broker --etcd`: brokers of one run campaign in an etcd election. The elected one
//! serves; the others stand by and, when the leader is lost, continue the same run from its
//! newest checkpoint. A leader that loses its lease stops serving at once.

use anyhow::{bail, Context, Result};
use clap::Args;
use fusion_coord::{campaign, read_record, takeover, write_record, Etcd, Leadership, RunRecord};
use fusion_runtime::BrokerConfig;
use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

#[derive(Args)]
pub struct ElectionArgs {
    /// etcd endpoint (http://HOST:PORT). Brokers of one run started with it campaign there: the
    /// elected one serves the nodes, the others stand by and take the run over from its newest
    /// checkpoint when the leader is lost. The job's checkpoint_dir must be on storage every
    /// broker reads; give nodes every broker's URL (--broker A,B).
    #[arg(long)]
    pub etcd: Option<String>,
    /// The election's name in etcd (default: fusionllm/ and the job file's name).
    #[arg(long, requires = "etcd")]
    pub election: Option<String>,
    /// Seconds of the leader's lease: a lost leader is replaced after about this long.
    #[arg(long, default_value_t = 5)]
    pub lease_ttl: u64,
    /// This broker's control-plane URL as nodes reach it, recorded in etcd for operators
    /// (default: https:// and --listen).
    #[arg(long)]
    pub advertise: Option<String>,
}

/// A broker elected to serve a run.
pub struct Elected {
    leadership: Leadership,
    record: RunRecord,
}

/// Campaigns (standing by as long as another broker leads) and, once elected, decides which
/// run to serve: `cfg.run_id` (and `cfg.resume` to continue one). None: the run this broker
/// stood by for finished under the other broker.
pub async fn stand_by(
    e: &ElectionArgs,
    endpoint: &str,
    job: &Path,
    checkpoints: Option<&Path>,
    listen: SocketAddr,
    cfg: &mut BrokerConfig,
) -> Result<Option<Elected>> {
    let Some(checkpoints) = checkpoints else {
        bail!(
            "--etcd needs the job's checkpoint_dir: a standby broker takes the run over from its \
             checkpoints"
        );
    };
    let etcd = Etcd::new(endpoint)?;
    let election = e.election.clone().unwrap_or_else(|| {
        let stem = job.file_stem().map(|s| s.to_string_lossy().into_owned());
        format!("fusionllm/{}", stem.unwrap_or_else(|| "job".into()))
    });
    let advertise = e
        .advertise
        .clone()
        .unwrap_or_else(|| format!("https://{listen}"));
    let started_at = etcd.revision().await?;
    if let Some(leader) = etcd.leader(&election).await? {
        eprintln!("standing by: {leader} leads election '{election}' at {endpoint}");
    }
    let ttl = Duration::from_secs(e.lease_ttl.max(1));
    let leadership = campaign(&etcd, &election, &advertise, ttl, |why| {
        eprintln!("standing by for election '{election}': {why}");
    })
    .await?;
    eprintln!("elected leader of election '{election}' at {endpoint}");
    let record = read_record(&etcd, &election).await?;
    let run_id = match takeover(record.as_ref().map(|(r, rev)| (r, *rev)), started_at) {
        fusion_coord::Takeover::FinishedElsewhere { run_id } => {
            eprintln!("run {run_id} finished under another broker; nothing to do");
            leadership.resign().await;
            return Ok(None);
        }
        fusion_coord::Takeover::Continue { run_id } => {
            eprintln!(
                "taking over run {run_id}: from its newest checkpoint in {}",
                checkpoints.display()
            );
            cfg.resume = Some(checkpoints.to_path_buf());
            run_id
        }
        fusion_coord::Takeover::NewRun => match &cfg.resume {
            Some(dir) => fusion_train::latest_run_id(dir).with_context(|| {
                format!(
                    "{} names no run (a checkpoint from before run ids): resume it without --etcd",
                    dir.display()
                )
            })?,
            None => fusion_runtime::new_run_id(),
        },
    };
    cfg.run_id = Some(run_id.clone());
    let record = RunRecord {
        run_id,
        finished: false,
        leader: advertise,
    };
    write_record(&etcd, &election, &record).await?;
    Ok(Some(Elected { leadership, record }))
}

impl Elected {
    /// Runs `run` while this broker leads. Losing the lease ends it at once with an error (the
    /// standby takes over); a run that finishes is recorded as finished, and either way the
    /// leadership is handed on.
    pub async fn serve<T>(self, run: impl Future<Output = Result<T>>) -> Result<T> {
        let outcome = tokio::select! {
            r = run => r,
            why = self.leadership.lost() => {
                bail!(
                    "this broker lost the leadership of election '{}': {why}; it stops so that a \
                     standby can take the run over",
                    self.leadership.election()
                )
            }
        };
        if outcome.is_ok() {
            let done = RunRecord {
                finished: true,
                ..self.record.clone()
            };
            let etcd = self.leadership.etcd().clone();
            if let Err(e) = write_record(&etcd, self.leadership.election(), &done).await {
                eprintln!("warning: recording run {} as finished: {e}", done.run_id);
            }
        }
        self.leadership.resign().await;
        outcome
    }
}

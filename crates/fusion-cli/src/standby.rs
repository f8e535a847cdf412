//! `fusionllm broker --etcd`: brokers of one run campaign in an etcd election. The elected one
//! serves; the others stand by and, when the leader is lost, continue the same run from its
//! newest checkpoint. A leader that loses its lease stops serving at once.

use anyhow::{bail, Context, Result};
use clap::Args;
use fusion_coord::{
    campaign, read_record, takeover, write_record, Etcd, Leadership, RunRecord, Takeover,
};
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
    /// The election's name in etcd (default: fusionllm/, the job file's name and a hash of its
    /// contents, so brokers of the same job file meet and other jobs do not).
    #[arg(long, requires = "etcd")]
    pub election: Option<String>,
    /// Seconds of the leader's lease: a lost leader is replaced about this long after it died
    /// (plus etcd's expiry check); a leader whose renewals go unconfirmed for 3/4 of it stops.
    #[arg(long, default_value_t = 5, requires = "etcd",
          value_parser = clap::value_parser!(u64).range(2..=3600))]
    pub lease_ttl: u64,
    /// This broker's control-plane URL as nodes reach it, recorded in etcd for operators
    /// (default: https:// and --listen).
    #[arg(long, requires = "etcd")]
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
    let election = match &e.election {
        Some(name) => name.clone(),
        None => default_election(job)?,
    };
    let advertise = e
        .advertise
        .clone()
        .unwrap_or_else(|| format!("https://{listen}"));
    let started_at = etcd.revision().await?;
    if let Some(leader) = etcd.leader(&election).await? {
        eprintln!("standing by: {leader} leads election '{election}' at {endpoint}");
    }
    let ttl = Duration::from_secs(e.lease_ttl);
    let leadership = campaign(&etcd, &election, &advertise, ttl, |why| {
        eprintln!("standing by for election '{election}': {why}");
    })
    .await?;
    eprintln!("elected leader of election '{election}' at {endpoint}");
    match take_the_run(&leadership, started_at, checkpoints, &advertise, cfg).await {
        Ok(Some(record)) => Ok(Some(Elected { leadership, record })),
        other => {
            // Handed on at once, not after the lease lapses.
            leadership.resign().await;
            other.map(|_| None)
        }
    }
}

/// `fusionllm/<job file name>-<12 hex digits of its contents' SHA-256>`.
fn default_election(job: &Path) -> Result<String> {
    use sha2::Digest;
    let text = std::fs::read(job).with_context(|| format!("reading {}", job.display()))?;
    let hash = hex::encode(sha2::Sha256::digest(&text));
    let stem = job
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let stem: String = stem
        .chars()
        .map(|c| if c.is_ascii_graphic() { c } else { '_' })
        .take(64)
        .collect();
    Ok(format!("fusionllm/{stem}-{}", &hash[..12]))
}

/// Decides the run an elected broker serves (`cfg.run_id`, and `cfg.resume` to continue one)
/// and records it; None when the run finished while this broker stood by.
async fn take_the_run(
    leadership: &Leadership,
    started_at: i64,
    checkpoints: &Path,
    advertise: &str,
    cfg: &mut BrokerConfig,
) -> Result<Option<RunRecord>> {
    let record = read_record(leadership.etcd(), leadership.election()).await?;
    let run_id = match takeover(record.as_ref().map(|(r, rev)| (r, *rev)), started_at) {
        Takeover::FinishedElsewhere { run_id } => {
            eprintln!("run {run_id} finished under another broker; nothing to do");
            return Ok(None);
        }
        Takeover::Continue { run_id } => {
            eprintln!(
                "taking over run {run_id}: from its newest checkpoint in {}",
                checkpoints.display()
            );
            cfg.resume = Some(checkpoints.to_path_buf());
            run_id
        }
        Takeover::NewRun => match &cfg.resume {
            Some(dir) => fusion_train::latest_run_id(dir).with_context(|| {
                format!(
                    "{} names no run id in its `latest` (a checkpoint from before run ids, or a \
                     step directory): with --etcd, resume from a run's checkpoint directory",
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
        leader: advertise.into(),
    };
    write_record(leadership, &record).await?;
    Ok(Some(record))
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
            // A standby must not take a finished run over: tried a few times while leading.
            for attempt in 1..=3 {
                match write_record(&self.leadership, &done).await {
                    Ok(()) => break,
                    Err(e) if attempt == 3 || self.leadership.is_lost() => {
                        eprintln!(
                            "warning: run {} could not be recorded as finished ({e}); a standby \
                             elected now would continue it from its final checkpoint",
                            done.run_id
                        );
                        break;
                    }
                    Err(_) => tokio::time::sleep(Duration::from_secs(1)).await,
                }
            }
        }
        self.leadership.resign().await;
        outcome
    }
}

//! Leadership of an election: a lease kept alive in the background, a campaign that waits
//! until elected, and the signal that leadership is lost.

use crate::error::Result;
use crate::etcd::{Etcd, LeaderKey, Lease};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// The share of the lease's TTL after the last confirmed renewal at which a holder gives it up
/// as lost: etcd keeps the lease at least the whole TTL after that renewal arrived, so a leader
/// steps down before anyone else can be elected.
const STEP_DOWN_SHARE: f64 = 0.75;

/// A lease renewed every quarter of its TTL by a background task, and the reason it was lost.
struct KeptLease {
    lease: Lease,
    lost: watch::Receiver<Option<String>>,
    keeper: tokio::task::JoinHandle<()>,
}

impl Drop for KeptLease {
    fn drop(&mut self) {
        self.keeper.abort();
    }
}

async fn keep(etcd: &Etcd, ttl: Duration) -> Result<KeptLease> {
    let lease = etcd.grant(ttl.as_secs().max(1) as i64).await?;
    let (tx, lost) = watch::channel(None);
    let etcd = etcd.clone();
    let ttl = Duration::from_secs(lease.ttl_s as u64);
    let keeper = tokio::spawn(async move {
        let why = renew(&etcd, lease.id, ttl).await;
        let _ = tx.send(Some(why));
    });
    Ok(KeptLease {
        lease,
        lost,
        keeper,
    })
}

/// Renews lease `id` until it cannot be confirmed in time; why it was lost.
async fn renew(etcd: &Etcd, id: i64, ttl: Duration) -> String {
    let every = ttl / 4;
    let give_up = ttl.mul_f64(STEP_DOWN_SHARE);
    let mut confirmed = Instant::now();
    let mut last_error = String::from("no renewal was confirmed");
    loop {
        tokio::time::sleep(every).await;
        if confirmed.elapsed() >= give_up {
            return format!(
                "its lease was not renewed for {:.1} s of its {} s ({last_error})",
                confirmed.elapsed().as_secs_f64(),
                ttl.as_secs()
            );
        }
        let sent = Instant::now();
        let budget = give_up.saturating_sub(confirmed.elapsed()).min(every);
        match etcd
            .keep_alive(id, budget.max(Duration::from_millis(100)))
            .await
        {
            Ok(Some(_)) => confirmed = sent,
            Ok(None) => return "etcd says its lease has expired".into(),
            Err(e) => last_error = e.to_string(),
        }
    }
}

/// This broker's leadership of an election.
pub struct Leadership {
    etcd: Etcd,
    election: String,
    kept: KeptLease,
    key: LeaderKey,
}

/// Campaigns in `election` as `value` (the broker's address, shown to operators) with a lease
/// of `ttl`; returns once elected. While it stands by, a lease it loses (etcd unreachable for a
/// while) is taken out again and the campaign goes on; `on_wait` is told each time.
pub async fn campaign(
    etcd: &Etcd,
    election: &str,
    value: &str,
    ttl: Duration,
    mut on_wait: impl FnMut(&str),
) -> Result<Leadership> {
    crate::record::check_election(election)?;
    loop {
        let kept = keep(etcd, ttl).await?;
        let mut lost = kept.lost.clone();
        tokio::select! {
            elected = etcd.campaign(election, kept.lease.id, value) => {
                let key = elected?;
                if let Some(why) = kept.lost.borrow().clone() {
                    on_wait(&format!("elected, but {why}; campaigning again"));
                    continue;
                }
                return Ok(Leadership { etcd: etcd.clone(), election: election.into(), kept, key });
            }
            _ = lost.wait_for(Option::is_some) => {
                let why = kept.lost.borrow().clone().unwrap_or_default();
                on_wait(&format!("the standby's lease was lost ({why}); campaigning again"));
                kept.keeper.abort();
            }
        }
    }
}

impl Leadership {
    pub fn election(&self) -> &str {
        &self.election
    }

    pub fn etcd(&self) -> &Etcd {
        &self.etcd
    }

    /// Resolves, with the reason, once leadership is lost (the lease could not be renewed in
    /// time): the holder must stop acting as leader at once.
    pub async fn lost(&self) -> String {
        let mut rx = self.kept.lost.clone();
        let why = match rx.wait_for(Option::is_some).await {
            Ok(why) => why.clone().unwrap_or_default(),
            Err(_) => "its lease keeper ended".into(),
        };
        why
    }

    /// Whether leadership is already lost.
    pub fn is_lost(&self) -> bool {
        self.kept.lost.borrow().is_some()
    }

    /// Gives leadership up now: the next standby is elected at once.
    pub async fn resign(self) {
        self.kept.keeper.abort();
        if let Err(e) = self.etcd.resign(&self.key).await {
            tracing::warn!("resigning election '{}': {e}", self.election);
        }
        if let Err(e) = self.etcd.revoke(self.kept.lease.id).await {
            tracing::debug!("revoking the leader's lease: {e}");
        }
    }
}

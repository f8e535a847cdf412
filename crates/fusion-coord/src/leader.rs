//! Leadership of an election: a lease kept alive on a thread of its own, a campaign that waits
//! until elected, and the signal that leadership is lost.

use crate::error::{CoordError, Result};
use crate::etcd::{Etcd, LeaderKey, Lease};
use std::time::{Duration, Instant};
use tokio::sync::{oneshot, watch};
use tokio::time::sleep_until;

/// The share of the lease's TTL after the last confirmed renewal was *sent* at which a holder
/// gives it up as lost. etcd keeps the lease at least the whole TTL after that renewal arrived,
/// so a leader stops a quarter of the TTL before anyone else can be elected, less whatever its
/// own process is stopped for (a paused process cannot notice anything).
const STEP_DOWN_SHARE: f64 = 0.75;

/// How long a standby waits before campaigning again after etcd failed it.
const RETRY: Duration = Duration::from_secs(2);

/// A lease renewed by a thread of its own (so a busy runtime cannot delay the renewals or the
/// step-down), and the reason it was lost.
struct KeptLease {
    lease: Lease,
    lost: watch::Receiver<Option<String>>,
    stop: Option<oneshot::Sender<()>>,
}

impl Drop for KeptLease {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

async fn keep(etcd: &Etcd, ttl: Duration) -> Result<KeptLease> {
    let asked = Instant::now();
    let ttl_s = i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX);
    let lease = etcd.grant(ttl_s).await?;
    let (tx, lost) = watch::channel(None);
    let (stop, stopped) = oneshot::channel();
    let endpoint = etcd.endpoint().to_string();
    let ttl = Duration::from_secs(lease.ttl_s.unsigned_abs());
    let thread = std::thread::Builder::new()
        .name("etcd-lease".into())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            let why = match (rt, Etcd::new(&endpoint)) {
                (Ok(rt), Ok(etcd)) => rt.block_on(async {
                    tokio::select! {
                        why = renew(&etcd, lease.id, ttl, asked) => Some(why),
                        _ = stopped => None,
                    }
                }),
                (Err(e), _) => Some(format!("no runtime for its renewals: {e}")),
                (_, Err(e)) => Some(e.to_string()),
            };
            if let Some(why) = why {
                let _ = tx.send(Some(why));
            }
        });
    if let Err(e) = thread {
        return Err(CoordError::Unreachable {
            endpoint: etcd.endpoint().into(),
            why: format!("no thread for the lease's renewals: {e}"),
        });
    }
    Ok(KeptLease {
        lease,
        lost,
        stop: Some(stop),
    })
}

/// Renews lease `id` until a renewal cannot be confirmed by the deadline (`STEP_DOWN_SHARE` of
/// the TTL after the last confirmed one was sent; `asked`: when the grant was asked for); why it
/// was lost. A failed renewal is retried soon, never past the deadline.
async fn renew(etcd: &Etcd, id: i64, ttl: Duration, asked: Instant) -> String {
    let every = ttl / 4;
    let give_up = ttl.mul_f64(STEP_DOWN_SHARE);
    let mut confirmed = tokio::time::Instant::from_std(asked);
    let mut next = confirmed + every;
    let mut last_error = String::from("no renewal was confirmed");
    loop {
        let deadline = confirmed + give_up;
        sleep_until(next.min(deadline)).await;
        let sent = tokio::time::Instant::now();
        if sent >= deadline {
            return format!(
                "its lease was not renewed for {:.1} s of its {} s ({last_error})",
                (sent - confirmed).as_secs_f64(),
                ttl.as_secs()
            );
        }
        match etcd.keep_alive(id, deadline - sent).await {
            Ok(Some(_)) => {
                confirmed = sent;
                next = sent + every;
            }
            Ok(None) => return "etcd says its lease has expired".into(),
            Err(e) => {
                last_error = e.to_string();
                next = tokio::time::Instant::now() + every / 4;
            }
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

/// Whether etcd may answer differently later (it is unreachable, or refused for the moment).
fn transient(e: &CoordError) -> bool {
    matches!(
        e,
        CoordError::Unreachable { .. } | CoordError::Refused { .. } | CoordError::Malformed(_)
    )
}

/// Campaigns in `election` as `value` (the broker's address, shown to operators) with a lease
/// of `ttl`; returns once elected. A standby outlives etcd's trouble: a lease it loses, or a
/// campaign etcd fails, is given up (revoked where etcd still answers) and the campaign starts
/// again after a pause, `on_wait` told why each time. Only a bad election name, or an etcd that
/// cannot be reached at all on the first try, is an error.
pub async fn campaign(
    etcd: &Etcd,
    election: &str,
    value: &str,
    ttl: Duration,
    mut on_wait: impl FnMut(&str),
) -> Result<Leadership> {
    crate::record::check_election(election)?;
    let mut first = true;
    loop {
        let kept = match keep(etcd, ttl).await {
            Ok(k) => k,
            Err(e) if first || !transient(&e) => return Err(e),
            Err(e) => {
                on_wait(&format!("{e}; campaigning again in {RETRY:?}"));
                tokio::time::sleep(RETRY).await;
                continue;
            }
        };
        first = false;
        let mut lost = kept.lost.clone();
        let why = tokio::select! {
            elected = etcd.campaign(election, kept.lease.id, value) => {
                let lost_now = kept.lost.borrow().clone();
                match (elected, lost_now) {
                    (Ok(key), None) => {
                        return Ok(Leadership { etcd: etcd.clone(), election: election.into(), kept, key });
                    }
                    (Ok(key), Some(why)) => {
                        // Elected on a lease already judged lost: hand the election on.
                        let _ = etcd.resign(&key).await;
                        format!("elected, but {why}")
                    }
                    (Err(e), _) if transient(&e) => e.to_string(),
                    (Err(e), _) => return Err(e),
                }
            }
            _ = async { drop(lost.wait_for(Option::is_some).await) } => {
                let why = kept.lost.borrow().clone().unwrap_or_default();
                format!("the standby's lease was lost ({why})")
            }
        };
        // Its candidate key must not linger as a candidate nobody serves.
        let _ = etcd.revoke(kept.lease.id).await;
        drop(kept);
        on_wait(&format!("{why}; campaigning again in {RETRY:?}"));
        tokio::time::sleep(RETRY).await;
    }
}

impl Leadership {
    pub fn election(&self) -> &str {
        &self.election
    }

    pub fn etcd(&self) -> &Etcd {
        &self.etcd
    }

    /// The leader's key: its creation revision is this leadership's epoch, which a write
    /// compares so that only the current leader's lands.
    pub fn key(&self) -> &LeaderKey {
        &self.key
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
        if let Err(e) = self.etcd.resign(&self.key).await {
            tracing::warn!("resigning election '{}': {e}", self.election);
        }
        if let Err(e) = self.etcd.revoke(self.kept.lease.id).await {
            tracing::debug!("revoking the leader's lease: {e}");
        }
    }
}

//! The run record beside an election: which run its brokers serve and whether it has finished,
//! and what a newly elected broker does about it (a pure decision).

use crate::error::{CoordError, Result};
use crate::etcd::Etcd;
use crate::leader::Leadership;
use serde::{Deserialize, Serialize};

/// What the leader writes at `<election>.run` when it starts serving and when the run ends.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunRecord {
    pub run_id: String,
    pub finished: bool,
    /// The leader that wrote it (its control-plane address), for operators.
    pub leader: String,
}

/// What a newly elected broker does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Takeover {
    /// No run under way: start one (fresh, or from the checkpoint the user named).
    NewRun,
    /// A run is under way and its broker is gone: continue it from its newest checkpoint.
    Continue { run_id: String },
    /// The run this broker stood by for finished under another broker: nothing to do.
    FinishedElsewhere { run_id: String },
}

/// The decision, from the run record and the revision it was last written at (`record`), and
/// the store's revision when this broker started (`started_at`). A run finished before this
/// broker started belongs to an earlier job of the same election: a new run starts.
pub fn takeover(record: Option<(&RunRecord, i64)>, started_at: i64) -> Takeover {
    match record {
        None => Takeover::NewRun,
        Some((r, _)) if !r.finished => Takeover::Continue {
            run_id: r.run_id.clone(),
        },
        Some((r, written)) if written > started_at => Takeover::FinishedElsewhere {
            run_id: r.run_id.clone(),
        },
        Some(_) => Takeover::NewRun,
    }
}

/// Election names become etcd key prefixes: printable, no spaces, bounded.
pub fn check_election(election: &str) -> Result<()> {
    let ok = !election.is_empty()
        && election.len() <= 200
        && election.bytes().all(|b| b.is_ascii_graphic());
    if ok {
        Ok(())
    } else {
        Err(CoordError::BadElection(election.chars().take(60).collect()))
    }
}

/// The record's key: beside the election, not under it (every key under `<election>/` is a
/// candidate of the election, and the oldest leads).
fn key(election: &str) -> String {
    format!("{election}.run")
}

/// The run record of `election` and the revision it was written at, if there is one.
pub async fn read_record(etcd: &Etcd, election: &str) -> Result<Option<(RunRecord, i64)>> {
    let key = key(election);
    let Some(entry) = etcd.get(&key).await? else {
        return Ok(None);
    };
    let record: RunRecord =
        serde_json::from_slice(&entry.value).map_err(|e| CoordError::BadRecord {
            key: key.clone(),
            why: e.to_string(),
        })?;
    if record.run_id.is_empty() || !record.run_id.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return Err(CoordError::BadRecord {
            key,
            why: "its run id is not alphanumeric".into(),
        });
    }
    Ok(Some((record, entry.mod_revision)))
}

/// Writes the run record of the election `leader` leads, only while it still leads (a
/// transaction on its election key): a deposed leader's write cannot land.
pub async fn write_record(leader: &Leadership, record: &RunRecord) -> Result<()> {
    let value = serde_json::to_string(record).map_err(|e| CoordError::Malformed(e.to_string()))?;
    let held = leader.key();
    let written = leader
        .etcd()
        .put_if_exists(&held.key, held.rev, &key(leader.election()), &value)
        .await?;
    if written {
        Ok(())
    } else {
        Err(CoordError::NotLeader(leader.election().into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(finished: bool) -> RunRecord {
        RunRecord {
            run_id: "00ab".into(),
            finished,
            leader: "https://10.0.0.1:7070".into(),
        }
    }

    #[test]
    fn a_new_broker_starts_continues_or_stands_down_by_the_record() {
        assert_eq!(takeover(None, 10), Takeover::NewRun);
        let cont = Takeover::Continue {
            run_id: "00ab".into(),
        };
        // A run under way continues, whenever its record was written.
        assert_eq!(takeover(Some((&record(false), 5)), 10), cont);
        assert_eq!(takeover(Some((&record(false), 50)), 10), cont);
        // Finished while this broker stood by: done; finished before it started: a new run.
        assert_eq!(
            takeover(Some((&record(true), 11)), 10),
            Takeover::FinishedElsewhere {
                run_id: "00ab".into()
            }
        );
        assert_eq!(takeover(Some((&record(true), 10)), 10), Takeover::NewRun);
        assert_eq!(takeover(Some((&record(true), 3)), 10), Takeover::NewRun);
    }

    #[test]
    fn election_names_are_printable_and_bounded() {
        assert!(check_election("fusionllm/job-7").is_ok());
        for bad in ["", "a b", "tab\there", &"x".repeat(201)] {
            assert!(matches!(
                check_election(bad),
                Err(CoordError::BadElection(_))
            ));
        }
    }
}

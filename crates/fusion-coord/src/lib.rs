//! Broker leadership through etcd, so that a lost broker is not a lost run.
//!
//! Every broker of a run campaigns in one etcd election with a lease it keeps alive. The leader
//! serves the nodes; the others stand by, waiting in the election. When the leader dies (or
//! loses etcd), its lease lapses, etcd deletes its election key, and the oldest standby is
//! elected and continues *the same run* from its newest checkpoint: which run that is, and
//! whether it has already finished, is kept in a run record beside the election
//! ([`RunRecord`], decided by the pure [`takeover`]).
//!
//! Safety: a leader whose renewals go unconfirmed for 3/4 of the TTL stops, a quarter of the TTL
//! before etcd can let its lease lapse and elect another (renewals run on a thread of their own;
//! a process paused longer than that cannot notice). The run record is written in a transaction
//! on the leader's election key, so a deposed leader's record write cannot land. Checkpoint
//! writes into the shared directory are not fenced that way.

mod error;
mod etcd;
mod leader;
mod local;
mod record;

pub use error::{CoordError, Result};
pub use etcd::{Entry, Etcd, LeaderKey, Lease};
pub use leader::{campaign, Leadership};
pub use local::{etcd_binary, LocalEtcd};
pub use record::{check_election, read_record, takeover, write_record, RunRecord, Takeover};

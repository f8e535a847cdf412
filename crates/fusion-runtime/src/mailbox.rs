//! Where a node's compute thread picks up the tensors its peers sent. Reader tasks put validated
//! tensors in; the compute thread takes the one it needs next, waiting at most a deadline. A
//! failure anywhere (a peer's garbage, a lost connection, a reset) poisons the mailbox so that a
//! waiting compute thread stops at once with the reason instead of running into its timeout.

use crate::error::{Result, RuntimeError};
use fusion_proto::Direction;
use std::collections::HashMap;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// Identifies one tensor of one step: activations by (micro-batch, tensor), gradients also by the
/// stage that sent them (a tensor read by several stages gets a gradient from each).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Key {
    pub step: u64,
    pub micro_batch: u32,
    pub direction: i32,
    /// Global tensor id, or global parameter id for shared-parameter gradients.
    pub id: u64,
    pub from_stage: u32,
}

impl Key {
    pub fn new(
        step: u64,
        micro_batch: u32,
        direction: Direction,
        id: usize,
        from_stage: usize,
    ) -> Self {
        Key {
            step,
            micro_batch,
            direction: direction as i32,
            id: id as u64,
            from_stage: from_stage as u32,
        }
    }
}

/// A received tensor's values at the precision its sender computed in.
#[derive(Clone, Debug, PartialEq)]
pub enum Payload {
    F32(Vec<f32>),
    F64(Vec<f64>),
}

impl Payload {
    pub fn into_f64(self) -> Vec<f64> {
        match self {
            Payload::F32(v) => v.into_iter().map(f64::from).collect(),
            Payload::F64(v) => v,
        }
    }

    /// Uploads to `b` (keeping f64 values where the backend can hold them).
    pub fn upload<B: fusion_backend::Backend>(
        self,
        b: &B,
        shape: &[usize],
    ) -> fusion_backend::Result<B::Tensor> {
        match self {
            Payload::F32(v) => b.upload(v, shape),
            Payload::F64(v) => b.upload_f64(v, shape),
        }
    }

    /// Downloads `t` at the backend's precision.
    pub fn download<B: fusion_backend::Backend>(
        b: &B,
        t: &B::Tensor,
    ) -> fusion_backend::Result<Self> {
        Ok(if b.is_f64() {
            Payload::F64(b.to_f64(t)?)
        } else {
            Payload::F32(b.to_vec(t)?)
        })
    }
}

impl Payload {
    /// Bytes the values take in memory.
    pub fn bytes(&self) -> usize {
        match self {
            Payload::F32(v) => 4 * v.len(),
            Payload::F64(v) => 8 * v.len(),
        }
    }
}

/// Whether `key` is a piece of an outer exchange (kept apart from the steps' window).
fn is_outer(key: &Key) -> bool {
    key.direction == Direction::OuterExchange as i32
}

#[derive(Default)]
struct State {
    items: HashMap<Key, Payload>,
    /// The step the node is at (None before its first step of the assignment): tensors of this
    /// step and the next are accepted, older ones dropped, later ones refused.
    step: Option<u64>,
    /// Outer-exchange pieces (OUTER_EXCHANGE) of exchanges begun before this step are dropped;
    /// the others are accepted whatever step the node is at (an overlapped exchange runs beside
    /// later steps; a peer is at most one exchange ahead, and flow control bounds what it holds).
    outer_from: Option<u64>,
    /// Bytes held per sending stage.
    held: HashMap<u32, usize>,
    /// Why, and whom it is blamed on.
    poisoned: Option<(String, Blame)>,
}

/// Whom a poisoned mailbox blames.
enum Blame {
    /// Nobody's fault (a reset).
    Nobody,
    /// A peer, with whether that is proven.
    Peer(String, bool),
    /// The path to a peer, not the peer (a relayed session altered on the way).
    Path(String),
}

#[derive(Default)]
pub struct Mailbox {
    state: Mutex<State>,
    arrived: Condvar,
}

impl Mailbox {
    pub fn new() -> Self {
        Self::default()
    }

    /// Delivers a tensor. A second copy of the same key, or a tensor for a step beyond the next,
    /// is a protocol violation; one for a step already done is dropped (an outer-exchange
    /// piece only once a later exchange has begun).
    pub fn put(&self, key: Key, data: Payload) -> Result<()> {
        let mut st = self.state.lock().map_err(|_| poisoned_lock())?;
        if is_outer(&key) && st.outer_from.is_some_and(|from| key.step < from) {
            tracing::debug!("dropped {key:?}: a later outer exchange has begun");
            return Ok(());
        }
        if let Some(now) = st.step {
            // Outer-exchange pieces outlive the steps trained beside their exchange; no piece
            // is for a step beyond the next (islands move step by step together).
            if key.step < now && !is_outer(&key) {
                tracing::debug!("dropped {key:?}: step {now} has begun");
                return Ok(());
            }
            if key.step > now + 1 {
                return Err(RuntimeError::Protocol(format!(
                    "a tensor for step {} arrived while this node is at step {now} (only this \
                     step and the next are accepted)",
                    key.step
                )));
            }
        }
        let bytes = data.bytes();
        if st.items.insert(key, data).is_some() {
            return Err(RuntimeError::Protocol(format!(
                "tensor {key:?} delivered twice"
            )));
        }
        *st.held.entry(key.from_stage).or_default() += bytes;
        self.arrived.notify_all();
        Ok(())
    }

    /// The node begins `step`: tensors of earlier steps still held are dropped, and from now on
    /// only this step's and the next's are accepted.
    pub fn begin_step(&self, step: u64) {
        if let Ok(mut st) = self.state.lock() {
            st.step = Some(step);
            let stale: Vec<Key> = st
                .items
                .keys()
                .filter(|k| k.step < step && !is_outer(k))
                .copied()
                .collect();
            for k in stale {
                if let Some(v) = st.items.remove(&k) {
                    release(&mut st.held, k.from_stage, v.bytes());
                }
            }
        }
    }

    /// The node begins the outer exchange of `step`: pieces of earlier exchanges still held are
    /// dropped, and from now on only this exchange's and later ones' are accepted.
    pub fn begin_outer(&self, step: u64) {
        if let Ok(mut st) = self.state.lock() {
            st.outer_from = Some(step);
            let stale: Vec<Key> = st
                .items
                .keys()
                .filter(|k| k.step < step && is_outer(k))
                .copied()
                .collect();
            for k in stale {
                if let Some(v) = st.items.remove(&k) {
                    release(&mut st.held, k.from_stage, v.bytes());
                }
            }
        }
    }

    /// Bytes held from `stage` (what its sessions' readers have put in and the compute thread
    /// has not taken yet).
    pub fn held_from(&self, stage: u32) -> usize {
        self.state
            .lock()
            .map_or(0, |st| st.held.get(&stage).copied().unwrap_or(0))
    }

    /// Whether the mailbox is poisoned (its assignment or step was abandoned).
    pub fn is_poisoned(&self) -> bool {
        self.state.lock().map_or(true, |st| st.poisoned.is_some())
    }

    /// Makes every current and future wait fail with `reason` (the first reason wins).
    pub fn poison(&self, reason: String) {
        self.poison_as(reason, Blame::Nobody);
    }

    /// Like [`Mailbox::poison`], blaming the path to `peer`: the broker routes the pair another
    /// way.
    pub fn poison_path(&self, reason: String, peer: &str) {
        self.poison_as(reason, Blame::Path(peer.to_string()));
    }

    /// Like [`Mailbox::poison`], blaming `peer`: `proven` when its data was bad, not when its
    /// session broke.
    pub fn poison_blaming(&self, reason: String, peer: &str, proven: bool) {
        self.poison_as(reason, Blame::Peer(peer.to_string(), proven));
    }

    /// Fails if the mailbox is poisoned (a compute thread checks between passes, so one whose
    /// step was abandoned stops soon).
    pub fn check(&self) -> Result<()> {
        let st = self.state.lock().map_err(|_| poisoned_lock())?;
        match poison_error(&st) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn poison_as(&self, reason: String, blame: Blame) {
        if let Ok(mut st) = self.state.lock() {
            st.poisoned.get_or_insert((reason, blame));
            self.arrived.notify_all();
        }
    }

    /// Takes the tensor for `key`, waiting up to `timeout`; `what` names it in the error.
    pub fn take(&self, key: Key, timeout: Duration, what: impl Fn() -> String) -> Result<Payload> {
        let deadline = Instant::now() + timeout;
        let mut st = self.state.lock().map_err(|_| poisoned_lock())?;
        loop {
            if let Some(e) = poison_error(&st) {
                return Err(e);
            }
            if let Some(v) = st.items.remove(&key) {
                release(&mut st.held, key.from_stage, v.bytes());
                return Ok(v);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(RuntimeError::Timeout(format!(
                    "waited {:.1} s for {}",
                    timeout.as_secs_f64(),
                    what()
                )));
            }
            st = self
                .arrived
                .wait_timeout(st, deadline - now)
                .map_err(|_| poisoned_lock())?
                .0;
        }
    }
}

fn release(held: &mut HashMap<u32, usize>, stage: u32, bytes: usize) {
    if let Some(h) = held.get_mut(&stage) {
        *h = h.saturating_sub(bytes);
    }
}

fn poison_error(st: &State) -> Option<RuntimeError> {
    Some(match st.poisoned.as_ref()? {
        (reason, Blame::Peer(peer, proven)) => RuntimeError::Peer {
            peer: peer.clone(),
            reason: reason.clone(),
            proven: *proven,
        },
        (reason, Blame::Path(peer)) => RuntimeError::PathFailed {
            peer: peer.clone(),
            reason: reason.clone(),
        },
        (reason, Blame::Nobody) => RuntimeError::Reset(reason.clone()),
    })
}

fn poisoned_lock() -> RuntimeError {
    RuntimeError::Protocol("mailbox lock poisoned by a panicking thread".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn take_waits_for_put_and_poison_wakes_waiters() {
        let m = Arc::new(Mailbox::new());
        let k = Key::new(1, 0, Direction::Activation, 7, 0);
        let m2 = m.clone();
        let t = std::thread::spawn(move || m2.take(k, Duration::from_secs(10), || "x".into()));
        std::thread::sleep(Duration::from_millis(20));
        m.put(k, Payload::F32(vec![1.0])).expect("put");
        assert_eq!(
            t.join().expect("join").expect("take"),
            Payload::F32(vec![1.0])
        );
        assert!(
            m.put(k, Payload::F64(vec![1.0])).is_ok() && m.put(k, Payload::F32(vec![2.0])).is_err()
        );

        let k2 = Key::new(1, 1, Direction::Gradient, 7, 2);
        let m3 = m.clone();
        let t = std::thread::spawn(move || m3.take(k2, Duration::from_secs(10), || "y".into()));
        std::thread::sleep(Duration::from_millis(20));
        m.poison("peer gone".into());
        let err = t.join().expect("join").expect_err("poisoned");
        assert!(err.to_string().contains("peer gone"), "{err}");
    }

    #[test]
    fn only_the_current_and_next_step_are_accepted_and_held_bytes_are_counted() {
        let m = Mailbox::new();
        let at = |step, mb| Key::new(step, mb, Direction::Activation, 1, 0);
        // Before the first step any step is accepted (the byte count still bounds it).
        m.put(at(9, 0), Payload::F32(vec![0.0; 4])).expect("put");
        m.begin_step(10);
        assert_eq!(m.held_from(0), 0, "the stale tensor was dropped");
        m.put(at(10, 0), Payload::F32(vec![0.0; 4]))
            .expect("this step");
        m.put(at(11, 3), Payload::F64(vec![0.0; 2]))
            .expect("the next");
        m.put(at(9, 1), Payload::F32(vec![0.0; 4]))
            .expect("an old step is dropped");
        let err = m
            .put(at(12, 0), Payload::F32(vec![0.0]))
            .expect_err("two steps ahead");
        assert!(
            err.to_string().contains("only this step and the next"),
            "{err}"
        );
        assert_eq!(m.held_from(0), 32);
        m.take(at(10, 0), Duration::from_secs(1), || "x".into())
            .expect("take");
        assert_eq!(m.held_from(0), 16);
        m.begin_step(11);
        assert_eq!(m.held_from(0), 16, "the next step's tensor stays");
    }

    #[test]
    fn outer_exchange_pieces_outlive_the_steps_that_train_beside_them() {
        let m = Mailbox::new();
        let piece = |step, k| Key::new(step, k, Direction::OuterExchange, 0, 0);
        m.begin_step(25);
        m.begin_outer(24);
        // The exchange of step 24 goes on while steps 25.. train: its pieces are kept.
        m.put(piece(24, 0), Payload::F32(vec![0.0; 4]))
            .expect("this exchange");
        m.begin_step(48);
        // A peer island that began the next exchange while this node trains its last step of
        // the round.
        m.put(piece(49, 0), Payload::F32(vec![0.0; 4]))
            .expect("the next exchange");
        assert_eq!(m.held_from(0), 32, "steps do not drop outer pieces");
        m.take(piece(24, 0), Duration::from_secs(1), || "x".into())
            .expect("taken after later steps began");
        m.put(piece(24, 1), Payload::F32(vec![0.0; 4]))
            .expect("still this exchange");
        m.begin_step(49);
        m.begin_outer(49);
        assert_eq!(m.held_from(0), 16, "the old exchange's piece was dropped");
        m.put(piece(24, 2), Payload::F32(vec![0.0; 4]))
            .expect("an old exchange's piece is dropped, not refused");
        assert_eq!(m.held_from(0), 16);
        // Pieces of an exchange beyond the next step are refused, as activations are: a peer
        // cannot fill this node's buffers with exchanges it will never begin.
        let far = m.put(piece(74, 0), Payload::F32(vec![0.0; 4]));
        assert!(matches!(far, Err(RuntimeError::Protocol(_))), "{far:?}");
        assert!(m
            .put(
                Key::new(60, 0, Direction::Activation, 1, 1),
                Payload::F32(vec![0.0])
            )
            .is_err());
        assert_eq!(m.held_from(0), 16);
    }

    #[test]
    fn take_times_out_naming_the_tensor() {
        let m = Mailbox::new();
        let k = Key::new(3, 0, Direction::Activation, 1, 0);
        let err = m
            .take(k, Duration::from_millis(10), || {
                "activation h0 of micro-batch 0".into()
            })
            .expect_err("timeout");
        assert!(err.to_string().contains("activation h0"), "{err}");
    }
}

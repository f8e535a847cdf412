//! The ring all-reduce among the replicas of a stage: the vector is cut into one chunk per
//! replica; in R - 1 reduce-scatter steps each replica adds the chunk its predecessor passes on,
//! in R - 1 all-gather steps the fully reduced chunks travel around. Each replica sends
//! 2 (R - 1) / R of the vector, whatever R. With a codec, reduce-scatter messages are encoded
//! (a little is lost at every hop); the all-gather stays exact, so every replica ends with the
//! same bits: each reduced chunk is first settled to a fixed point of the codec (decoding its
//! encoding gives it back), and a chunk that is not one travels dense.
//!
//! Sparse (top-k) messages cannot be added up on the way: [`StageWorker::sparse_sums`] passes
//! each replica's whole message around instead, so each replica sends R - 1 messages of the
//! vector's density (more than the int8 ring's 2 (R - 1) / R quarter-size chunks beyond a few
//! replicas at 10% density).

use super::*;
use fusion_compress::{compressor, decode, Selection, ValueType};

/// One replica's place in the ring of its stage's replicas, and what it needs to send and take
/// its pieces without the stage's worker: an overlapped outer synchronisation's exchange runs
/// on a thread of its own while the worker trains (`worker/outer.rs`).
#[derive(Clone)]
pub(crate) struct Ring {
    pub(crate) replica: usize,
    pub(crate) replicas: usize,
    pub(crate) stage: usize,
    /// ALL_REDUCE for gradients and parameters, OUTER_EXCHANGE for pseudo-gradients.
    pub(crate) direction: Direction,
    /// Node id of the previous replica (whom a missing piece is blamed on).
    pub(crate) from: String,
    pub(crate) timeout: Duration,
    /// Where the compute thread reports its waits; None on an exchange's own thread (the
    /// node's progress is the compute thread's).
    pub(crate) progress: Option<Handle>,
}

impl<B: Backend> StageWorker<B> {
    /// This replica's ring for pieces of `direction`, waiting as the compute thread.
    pub(crate) fn ring(&self, direction: Direction) -> Ring {
        Ring {
            replica: self.replica,
            replicas: self.replicas,
            stage: self.stage,
            direction,
            from: self.ring_from.clone(),
            timeout: self.timeout,
            progress: Some(self.progress.clone()),
        }
    }
}

/// Whether two slices hold the same bits.
fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn encode(codec: Codec, x: &[f32]) -> Vec<u8> {
    compressor(codec, ValueType::F16, Selection::Exact, 0).compress(x)
}

/// Replaces `x` by what its encoding decodes to, until that no longer changes it (a few rounds
/// at most for int8, whose scale may move by an ulp; one for the casts).
fn settle(codec: Codec, x: &mut [f32]) {
    for _ in 0..8 {
        let Ok(y) = decode(&encode(codec, x), x.len()) else {
            return;
        };
        if same_bits(&y, x) {
            return;
        }
        x.copy_from_slice(&y);
    }
}

/// The non-zero values of `x` and where they are (a decoded top-k message is mostly zeros).
fn nonzeros(x: &[f32]) -> Vec<(usize, f32)> {
    x.iter()
        .enumerate()
        .filter(|(_, v)| **v != 0.0)
        .map(|(i, &v)| (i, v))
        .collect()
}

impl Ring {
    /// Sums `flat` over every replica of this stage (see the module documentation); chunk `c`
    /// travels as edge `edge_base + c`, so several rings can run in one step.
    pub(crate) fn ring_sum(
        &self,
        step: u64,
        edge_base: usize,
        flat: &mut [f32],
        codec: Codec,
        mailbox: &Mailbox,
        outbox: &Outbox,
    ) -> Result<()> {
        self.reduce_scatter(step, edge_base, flat, codec, mailbox, outbox)?;
        if codec != Codec::None {
            let (o0, ol) = ring_chunks(flat.len(), self.replicas)[self.owned_chunk()];
            settle(codec, &mut flat[o0..o0 + ol]);
        }
        let k0 = self.replicas - 1;
        self.all_gather(step, k0, edge_base, flat, codec, mailbox, outbox)
    }

    /// The chunk of a ring's vector this replica holds whole after a reduce-scatter (and sends
    /// first in an all-gather).
    pub(crate) fn owned_chunk(&self) -> usize {
        (self.replica + 1) % self.replicas
    }

    /// The reduce-scatter half of [`ring_sum`](Self::ring_sum): in R - 1 ring steps (0 to
    /// R - 2), each replica adds the chunk its predecessor passes on; after them chunk
    /// [`owned_chunk`](Self::owned_chunk) of `flat` holds the sum over every replica (the
    /// other chunks hold partial sums).
    pub(crate) fn reduce_scatter(
        &self,
        step: u64,
        edge_base: usize,
        flat: &mut [f32],
        codec: Codec,
        mailbox: &Mailbox,
        outbox: &Outbox,
    ) -> Result<()> {
        let (r, n) = (self.replica, self.replicas);
        let chunks = ring_chunks(flat.len(), n);
        for k in 0..n - 1 {
            let (send, recv) = ((r + n - k) % n, (r + 2 * n - k - 1) % n);
            let (s0, sl) = chunks[send];
            let chunk = &flat[s0..s0 + sl];
            self.ring_send(outbox, step, k, edge_base + send, chunk, codec, false)?;
            let (r0, rl) = chunks[recv];
            let got = self.ring_take(mailbox, step, k, edge_base + recv, rl)?;
            for (dst, v) in flat[r0..r0 + rl].iter_mut().zip(got) {
                *dst += v as f32;
            }
        }
        Ok(())
    }

    /// The all-gather half: starting from chunk [`owned_chunk`](Self::owned_chunk) of `flat`,
    /// in R - 1 ring steps (numbered from `k0`, so that two gathers of one step do not meet)
    /// every replica's chunk travels around, exactly (a codec's message is sent only when it
    /// decodes to the chunk bit for bit), and every replica ends with the same `flat`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn all_gather(
        &self,
        step: u64,
        k0: usize,
        edge_base: usize,
        flat: &mut [f32],
        codec: Codec,
        mailbox: &Mailbox,
        outbox: &Outbox,
    ) -> Result<()> {
        let (r, n) = (self.replica, self.replicas);
        let chunks = ring_chunks(flat.len(), n);
        for k in 0..n - 1 {
            let (send, recv) = ((r + 1 + n - k) % n, (r + n - k) % n);
            let (s0, sl) = chunks[send];
            let step_k = k0 + k;
            let chunk = &flat[s0..s0 + sl];
            self.ring_send(outbox, step, step_k, edge_base + send, chunk, codec, true)?;
            let (r0, rl) = chunks[recv];
            let got = self.ring_take(mailbox, step, step_k, edge_base + recv, rl)?;
            for (dst, v) in flat[r0..r0 + rl].iter_mut().zip(got) {
                *dst = v as f32;
            }
        }
        Ok(())
    }

    /// Islands with sparse pseudo-gradients: for every item `(edge_base, key, flat)` (one
    /// parameter's weighted delta), the sum of every island's `flat`, each encoded once by its
    /// own island with error feedback (`key`: the item's residual). In R - 1 ring steps every
    /// island's message travels whole around the ring (a message is forwarded exactly as it
    /// arrived: it is a fixed point of its codec), so every node holds every island's decoded
    /// message and adds them up in island order: the same bits everywhere. Edge
    /// `edge_base + i` carries island `i`'s message; every item's message of a ring step is
    /// sent before any is awaited, so a step costs one round trip, not one per parameter.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn sparse_sums(
        &self,
        step: u64,
        items: Vec<(usize, usize, Vec<f32>)>,
        codec: Codec,
        encoder: &mut PseudoGradientEncoder,
        mailbox: &Mailbox,
        outbox: &Outbox,
    ) -> Result<Vec<Vec<f32>>> {
        let (r, n) = (self.replica, self.replicas);
        let mut forward = Vec::with_capacity(items.len());
        let mut own_msgs = Vec::with_capacity(items.len());
        let mut parts: Vec<Vec<Vec<(usize, f32)>>> = Vec::with_capacity(items.len());
        for (_, key, flat) in &items {
            let msg = encoder.encode(*key, flat);
            let own = decode(&msg, flat.len()).map_err(|e| {
                RuntimeError::Protocol(format!("this node's own pseudo-gradient message: {e}"))
            })?;
            let mut p = vec![Vec::new(); n];
            p[r] = nonzeros(&own);
            parts.push(p);
            forward.push(own);
            own_msgs.push(msg);
        }
        for k in 0..n - 1 {
            let (origin, from) = ((r + n - k) % n, (r + 2 * n - k - 1) % n);
            if k == 0 {
                // This island's own messages go as encoded: they decode to what this node holds.
                for ((edge_base, _, flat), msg) in items.iter().zip(own_msgs.drain(..)) {
                    let header = header(step, k, self.direction, edge_base + origin, &[flat.len()]);
                    outbox.send_encoded_reporting(self.stage, header, msg, self.reports())?;
                }
            } else {
                for ((edge_base, _, _), f) in items.iter().zip(&forward) {
                    self.ring_send(outbox, step, k, edge_base + origin, f, codec, true)?;
                }
            }
            for (q, (edge_base, _, flat)) in items.iter().enumerate() {
                let got = self.ring_take(mailbox, step, k, edge_base + from, flat.len())?;
                forward[q] = got.into_iter().map(|v| v as f32).collect();
                parts[q][from] = nonzeros(&forward[q]);
            }
        }
        Ok(items
            .iter()
            .zip(&parts)
            .map(|((_, _, flat), islands)| {
                let mut sum = vec![0.0f32; flat.len()];
                for &(i, v) in islands.iter().flatten() {
                    sum[i] += v;
                }
                sum
            })
            .collect())
    }

    /// Sends one chunk to the next replica: dense without a codec; encoded with one, unless
    /// `exact` is asked and decoding would not give the chunk back bit for bit.
    #[allow(clippy::too_many_arguments)]
    fn ring_send(
        &self,
        outbox: &Outbox,
        step: u64,
        k: usize,
        edge: usize,
        chunk: &[f32],
        codec: Codec,
        exact: bool,
    ) -> Result<()> {
        let header = header(step, k, self.direction, edge, &[chunk.len()]);
        if codec != Codec::None {
            let msg = encode(codec, chunk);
            let faithful = || decode(&msg, chunk.len()).is_ok_and(|v| same_bits(&v, chunk));
            if !exact || faithful() {
                return outbox.send_encoded_reporting(self.stage, header, msg, self.reports());
            }
        }
        outbox.send_reporting(
            self.stage,
            header,
            &Payload::F32(chunk.to_vec()),
            self.reports(),
        )
    }

    /// Takes the previous replica's chunk `edge` of ring step `k`, checked to hold `len` values.
    fn ring_take(
        &self,
        mailbox: &Mailbox,
        step: u64,
        k: usize,
        edge: usize,
        len: usize,
    ) -> Result<Vec<f64>> {
        let key = Key::new(step, k as u32, self.direction, edge, self.stage);
        let got = self
            .take(mailbox, key, || {
                format!("all-reduce chunk {edge} (ring step {k}) from the previous replica")
            })?
            .into_f64();
        if got.len() != len {
            return Err(RuntimeError::Protocol(format!(
                "all-reduce chunk {edge} has {} values, expected {len}",
                got.len()
            )));
        }
        Ok(got)
    }

    /// Whether this ring's waits show in the node's progress (not on an exchange's own thread).
    fn reports(&self) -> bool {
        self.progress.is_some()
    }

    /// Waits for the previous replica's piece; a timeout is its fault.
    fn take(&self, mailbox: &Mailbox, key: Key, what: impl Fn() -> String) -> Result<Payload> {
        if let Some(p) = &self.progress {
            p.enter(
                Phase::Waiting,
                key.step,
                key.micro_batch as usize,
                &self.from,
            );
        }
        let got = mailbox.take(key, self.timeout, what);
        if let Some(p) = &self.progress {
            p.resume();
        }
        got.map_err(|e| match e {
            RuntimeError::Timeout(why) if !self.from.is_empty() => RuntimeError::Peer {
                reason: format!("timed out: {why} ({})", self.from),
                peer: self.from.clone(),
                proven: false,
            },
            e => e,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settled_chunks_survive_their_codec_bit_for_bit() {
        let x: Vec<f32> = (0..1000)
            .map(|i| ((i as f32) * 0.731).sin() * 1e-3 * (1 + i % 13) as f32)
            .collect();
        for codec in [Codec::Int8 { block: 256 }, Codec::Fp16, Codec::Bf16] {
            let mut v = x.clone();
            settle(codec, &mut v);
            let again = decode(&encode(codec, &v), v.len()).expect("decodes");
            assert!(same_bits(&again, &v), "{codec}");
            // Settling moved the values by the codec's error only (int8: half a step of max/127).
            let err = v
                .iter()
                .zip(&x)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            let max = x.iter().map(|a| a.abs()).fold(0.0, f32::max);
            assert!(err <= max / 200.0, "{codec}: {err} of {max}");
        }
    }
}

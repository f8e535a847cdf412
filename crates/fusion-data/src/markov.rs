//! A synthetic corpus from a random first-order Markov source. Its entropy rate is known exactly,
//! so a run shows how close its loss gets to the best any model can do.

use crate::seed::{rng_for, split_stream};
use crate::{Batch, DataKind, Dataset, Result, Split};
use rand::Rng;
use rand_distr::{Distribution, Gamma};

pub struct MarkovCorpus {
    vocab: usize,
    seed: u64,
    /// Per state: successors and cumulative probabilities.
    rows: Vec<(Vec<u32>, Vec<f64>)>,
    stationary: Vec<f64>,
    entropy: f64,
}

fn sample(succ: &[u32], cum: &[f64], u: f64) -> u32 {
    let i = cum.partition_point(|&c| c < u).min(succ.len() - 1);
    succ[i]
}

impl MarkovCorpus {
    /// `vocab` states, each with `branching` random successors whose probabilities come from a
    /// symmetric Dirichlet(`concentration`).
    pub fn new(vocab: usize, branching: usize, concentration: f64, seed: u64) -> Result<Self> {
        if vocab < 2 || branching == 0 || branching > vocab || concentration <= 0.0 {
            return Err(crate::DataError::Invalid(format!(
                "Markov corpus needs vocab >= 2 and 1 <= branching <= vocab, got vocab {vocab}, branching {branching}"
            )));
        }
        let mut rng = rng_for(seed, 0, 0);
        let gamma =
            Gamma::new(concentration, 1.0).map_err(|e| crate::DataError::Invalid(e.to_string()))?;
        let mut rows = Vec::with_capacity(vocab);
        let mut dense = vec![vec![0.0f64; vocab]; vocab];
        for (s, dense_row) in dense.iter_mut().enumerate() {
            let mut succ: Vec<u32> = Vec::with_capacity(branching);
            // Always allow the chain to move on, so it is irreducible: successor s+1 is included.
            succ.push(((s + 1) % vocab) as u32);
            while succ.len() < branching {
                let c = rng.random_range(0..vocab as u32);
                if !succ.contains(&c) {
                    succ.push(c);
                }
            }
            let w: Vec<f64> = (0..branching)
                .map(|_| gamma.sample(&mut rng).max(1e-12))
                .collect();
            let total: f64 = w.iter().sum();
            let mut acc = 0.0;
            let mut cum = Vec::with_capacity(branching);
            for (c, wi) in succ.iter().zip(&w) {
                let p = wi / total;
                dense_row[*c as usize] += p;
                acc += p;
                cum.push(acc);
            }
            rows.push((succ, cum));
        }
        // Stationary distribution by power iteration (the chain is irreducible and, with
        // self-loops possible, the iteration converges; 5000 rounds is far past what it needs).
        let mut pi = vec![1.0 / vocab as f64; vocab];
        for _ in 0..5000 {
            let mut next = vec![0.0; vocab];
            for (s, row) in dense.iter().enumerate() {
                for (t, p) in row.iter().enumerate() {
                    next[t] += pi[s] * p;
                }
            }
            // Average with the previous iterate so periodic chains converge too.
            for (p, n) in pi.iter_mut().zip(&next) {
                *p = 0.5 * (*p + n);
            }
        }
        let entropy = dense
            .iter()
            .zip(&pi)
            .map(|(row, w)| {
                w * row
                    .iter()
                    .filter(|&&p| p > 0.0)
                    .map(|&p| -p * p.ln())
                    .sum::<f64>()
            })
            .sum();
        Ok(MarkovCorpus {
            vocab,
            seed,
            rows,
            stationary: pi,
            entropy,
        })
    }

    /// The default synthetic corpus: 256 symbols, 8 successors each.
    pub fn default_corpus(seed: u64) -> Result<Self> {
        Self::new(256, 8, 0.5, seed)
    }

    pub fn entropy_rate(&self) -> f64 {
        self.entropy
    }
}

impl Dataset for MarkovCorpus {
    fn describe(&self) -> String {
        format!(
            "synthetic Markov corpus ({} symbols, entropy rate {:.4} nats/token)",
            self.vocab, self.entropy
        )
    }

    fn kind(&self) -> DataKind {
        DataKind::Text { vocab: self.vocab }
    }

    fn batch(&self, split: Split, index: u64, batch: usize, seq: usize) -> Result<Batch> {
        let mut rng = rng_for(self.seed, split_stream(split), index);
        let mut inputs = Vec::with_capacity(batch * seq);
        let mut targets = Vec::with_capacity(batch * seq);
        let mut cum_pi = Vec::with_capacity(self.vocab);
        let mut acc = 0.0;
        for p in &self.stationary {
            acc += p;
            cum_pi.push(acc);
        }
        let states: Vec<u32> = (0..self.vocab as u32).collect();
        for _ in 0..batch {
            let mut s = sample(&states, &cum_pi, rng.random::<f64>() * acc);
            for _ in 0..seq {
                let (succ, cum) = &self.rows[s as usize];
                let next = sample(succ, cum, rng.random::<f64>() * cum[cum.len() - 1]);
                inputs.push(s);
                targets.push(next);
                s = next;
            }
        }
        Ok(Batch::Tokens {
            inputs,
            targets,
            batch,
            seq,
        })
    }

    fn eval_batches(&self, _batch: usize) -> usize {
        8
    }

    fn entropy_floor(&self) -> Option<f64> {
        Some(self.entropy)
    }
}

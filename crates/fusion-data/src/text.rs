//! Text corpora: any UTF-8 file, read in chunks and tokenized with GPT-2's BPE or as raw bytes.

use crate::seed::{rng_for, split_stream};
use crate::{Batch, DataError, DataKind, Dataset, Result, Split};
use rand::Rng;
use std::io::Read;
use std::path::Path;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tokenizer {
    /// One token per byte (vocabulary 256).
    Bytes,
    /// GPT-2's byte-pair encoding (`r50k_base`, vocabulary 50257), bundled with `tiktoken-rs`.
    Gpt2,
}

impl Tokenizer {
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "bytes" | "byte" => Ok(Tokenizer::Bytes),
            "gpt2" | "bpe" | "r50k_base" => Ok(Tokenizer::Gpt2),
            other => Err(DataError::Invalid(format!(
                "unknown tokenizer '{other}' (use 'gpt2' or 'bytes')"
            ))),
        }
    }

    pub fn vocab(self) -> usize {
        match self {
            Tokenizer::Bytes => 256,
            Tokenizer::Gpt2 => 50257,
        }
    }

    /// Token ids of `text` (GPT-2's `<|endoftext|>` written out is read as that one token).
    pub fn encode(self, text: &str) -> Result<Vec<u32>> {
        Ok(match self {
            Tokenizer::Bytes => text.bytes().map(u32::from).collect(),
            Tokenizer::Gpt2 => gpt2_bpe()?.encode_with_special_tokens(text),
        })
    }

    /// The bytes `tokens` stand for (not always whole UTF-8 characters: a character can span
    /// tokens).
    pub fn decode_bytes(self, tokens: &[u32]) -> Result<Vec<u8>> {
        match self {
            Tokenizer::Bytes => tokens
                .iter()
                .map(|&t| {
                    u8::try_from(t).map_err(|_| {
                        DataError::Tokenizer(format!("token {t} is not a byte (0..=255)"))
                    })
                })
                .collect(),
            Tokenizer::Gpt2 => gpt2_bpe()?
                .decode_bytes(tokens)
                .map_err(|e| DataError::Tokenizer(e.to_string())),
        }
    }
}

/// GPT-2's BPE, built once per process (building it parses 50,000 ranks).
fn gpt2_bpe() -> Result<&'static tiktoken_rs::CoreBPE> {
    static BPE: std::sync::OnceLock<std::result::Result<tiktoken_rs::CoreBPE, String>> =
        std::sync::OnceLock::new();
    BPE.get_or_init(|| tiktoken_rs::r50k_base().map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| DataError::Tokenizer(e.clone()))
}

/// Size of each piece of the file read and tokenized at once.
const CHUNK: usize = 1 << 20;

/// Reads `path` in chunks, cutting each chunk after its last newline (or at a character boundary)
/// so no token straddles two chunks except at line breaks, and tokenizes it.
fn tokenize_file(path: &Path, tokenizer: Tokenizer) -> Result<Vec<u32>> {
    let p = path.display().to_string();
    let io = |source| DataError::Io {
        path: p.clone(),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let bpe = match tokenizer {
        Tokenizer::Gpt2 => {
            Some(tiktoken_rs::r50k_base().map_err(|e| DataError::Tokenizer(e.to_string()))?)
        }
        Tokenizer::Bytes => None,
    };
    let mut tokens = Vec::new();
    let mut pending: Vec<u8> = Vec::new();
    let mut buf = vec![0u8; CHUNK];
    let mut offset = 0usize;
    loop {
        let n = file.read(&mut buf).map_err(io)?;
        pending.extend_from_slice(&buf[..n]);
        let done = n == 0;
        let cut = if done {
            pending.len()
        } else {
            pending
                .iter()
                .rposition(|&b| b == b'\n')
                .map(|i| i + 1)
                .unwrap_or(0)
        };
        if cut > 0 {
            let piece: Vec<u8> = pending.drain(..cut).collect();
            match &bpe {
                None => tokens.extend(piece.iter().map(|&b| b as u32)),
                Some(bpe) => {
                    let text = std::str::from_utf8(&piece).map_err(|e| DataError::Format {
                        path: p.clone(),
                        message: format!("not UTF-8 near byte {}: {e}", offset + e.valid_up_to()),
                    })?;
                    tokens.extend(bpe.encode_ordinary(text));
                }
            }
            offset += cut;
        }
        if done {
            break;
        }
    }
    Ok(tokens)
}

/// Entropy in nats of the empirical unigram distribution of `tokens`: the loss of the best model
/// that ignores context.
pub fn unigram_entropy(tokens: &[u32]) -> f64 {
    let mut counts = std::collections::HashMap::new();
    for t in tokens {
        *counts.entry(*t).or_insert(0usize) += 1;
    }
    let n = tokens.len() as f64;
    counts
        .values()
        .map(|&c| {
            let p = c as f64 / n;
            -p * p.ln()
        })
        .sum()
}

/// A tokenized text file; the last tenth is held out for evaluation. Batches are random windows.
pub struct TextCorpus {
    name: String,
    tokenizer: Tokenizer,
    tokens: Vec<u32>,
    split_at: usize,
    seed: u64,
    unigram: f64,
}

impl TextCorpus {
    pub fn from_file(path: &Path, tokenizer: Tokenizer, seed: u64) -> Result<Self> {
        let tokens = tokenize_file(path, tokenizer)?;
        Self::from_tokens(path.display().to_string(), tokens, tokenizer, seed)
    }

    pub fn from_tokens(
        name: String,
        tokens: Vec<u32>,
        tokenizer: Tokenizer,
        seed: u64,
    ) -> Result<Self> {
        if tokens.len() < 64 {
            return Err(DataError::Invalid(format!(
                "{name}: only {} tokens, too little text to train on",
                tokens.len()
            )));
        }
        let split_at = tokens.len() - tokens.len() / 10;
        let unigram = unigram_entropy(&tokens[..split_at]);
        Ok(TextCorpus {
            name,
            tokenizer,
            tokens,
            split_at,
            seed,
            unigram,
        })
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
}

impl Dataset for TextCorpus {
    fn describe(&self) -> String {
        format!(
            "{} ({} tokens, {:?} tokenizer, unigram entropy {:.3} nats)",
            self.name,
            self.tokens.len(),
            self.tokenizer,
            self.unigram
        )
    }

    fn kind(&self) -> DataKind {
        DataKind::Text {
            vocab: self.tokenizer.vocab(),
        }
    }

    fn batch(&self, split: Split, index: u64, batch: usize, seq: usize) -> Result<Batch> {
        let range = match split {
            Split::Train => &self.tokens[..self.split_at],
            Split::Eval => &self.tokens[self.split_at..],
        };
        if range.len() < seq + 1 {
            return Err(DataError::Invalid(format!(
                "{}: {:?} split has {} tokens, fewer than a window of {}",
                self.name,
                split,
                range.len(),
                seq + 1
            )));
        }
        let mut rng = rng_for(self.seed, split_stream(split), index);
        let mut inputs = Vec::with_capacity(batch * seq);
        let mut targets = Vec::with_capacity(batch * seq);
        for _ in 0..batch {
            let start = rng.random_range(0..=range.len() - seq - 1);
            inputs.extend_from_slice(&range[start..start + seq]);
            targets.extend_from_slice(&range[start + 1..start + seq + 1]);
        }
        Ok(Batch::Tokens {
            inputs,
            targets,
            batch,
            seq,
        })
    }

    fn eval_batches(&self, _batch: usize) -> usize {
        16
    }

    fn unigram_entropy(&self) -> Option<f64> {
        Some(self.unigram)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_tokenizers_decode_what_they_encode() {
        let text = "To be, or not to be: <|endoftext|> caf\u{e9}";
        for t in [Tokenizer::Bytes, Tokenizer::Gpt2] {
            let ids = t.encode(text).expect("encode");
            assert!(ids.iter().all(|&i| (i as usize) < t.vocab()));
            assert_eq!(t.decode_bytes(&ids).expect("decode"), text.as_bytes());
        }
        assert_eq!(
            Tokenizer::Gpt2.encode("<|endoftext|>").expect("encode"),
            vec![50256]
        );
        assert!(Tokenizer::Bytes.decode_bytes(&[300]).is_err());
    }
}

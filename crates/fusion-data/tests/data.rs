use fusion_data::{Batch, Dataset, IdxImages, MarkovCorpus, Split, TextCorpus, Tokenizer};
use std::io::Write;

#[test]
fn markov_batches_are_deterministic_and_entropy_is_sane() {
    let c = MarkovCorpus::default_corpus(7).unwrap();
    let h = c.entropy_rate();
    assert!(h > 0.1 && h < (8f64).ln(), "entropy {h}");
    let a = c.batch(Split::Train, 3, 2, 16).unwrap();
    let b = c.batch(Split::Train, 3, 2, 16).unwrap();
    assert_eq!(a, b);
    assert_ne!(a, c.batch(Split::Train, 4, 2, 16).unwrap());
    let Batch::Tokens {
        inputs, targets, ..
    } = a
    else {
        panic!()
    };
    // Targets are the inputs shifted by one within each sequence.
    assert_eq!(&inputs[1..16], &targets[..15]);
}

#[test]
fn markov_empirical_entropy_matches_rate() {
    // The average -log p(next | current) over sampled text converges to the entropy rate.
    let c = MarkovCorpus::new(16, 4, 1.0, 3).unwrap();
    let mut counts = vec![vec![0usize; 16]; 16];
    for i in 0..200 {
        if let Batch::Tokens {
            inputs, targets, ..
        } = c.batch(Split::Train, i, 8, 64).unwrap()
        {
            for (x, y) in inputs.iter().zip(&targets) {
                counts[*x as usize][*y as usize] += 1;
            }
        }
    }
    let total: usize = counts.iter().flatten().sum();
    let mut h = 0.0;
    for row in &counts {
        let n: usize = row.iter().sum();
        for &k in row.iter().filter(|&&k| k > 0) {
            h -= (k as f64 / total as f64) * (k as f64 / n as f64).ln();
        }
    }
    assert!(
        (h - c.entropy_rate()).abs() < 0.03,
        "empirical {h} vs exact {}",
        c.entropy_rate()
    );
}

#[test]
fn text_corpus_tokenizes_with_gpt2_bpe_and_bytes() {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    for i in 0..200 {
        writeln!(f, "To be, or not to be, that is the question {i}.").unwrap();
    }
    let bpe = TextCorpus::from_file(f.path(), Tokenizer::Gpt2, 1).unwrap();
    let bytes = TextCorpus::from_file(f.path(), Tokenizer::Bytes, 1).unwrap();
    assert!(
        bpe.len() < bytes.len() / 2,
        "BPE should compress English: {} vs {}",
        bpe.len(),
        bytes.len()
    );
    let Batch::Tokens { inputs, .. } = bpe.batch(Split::Eval, 0, 2, 8).unwrap() else {
        panic!()
    };
    assert!(inputs.iter().all(|&t| t < 50257));
}

#[test]
fn bad_text_is_a_clear_error() {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(&[0xff, 0xfe, 0x00, b'\n']).unwrap();
    let err = TextCorpus::from_file(f.path(), Tokenizer::Gpt2, 1)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("UTF-8"), "{err}");
}

fn write_idx(dir: &std::path::Path, name: &str, header: &[u8], payload: &[u8]) {
    let mut f = std::fs::File::create(dir.join(name)).unwrap();
    f.write_all(header).unwrap();
    f.write_all(payload).unwrap();
}

#[test]
fn idx_loader_reads_and_rejects() {
    let dir = tempfile::tempdir().unwrap();
    let imgs = |n: u8| [0, 0, 8, 3, 0, 0, 0, n, 0, 0, 0, 2, 0, 0, 0, 2];
    let lbls = |n: u8| [0, 0, 8, 1, 0, 0, 0, n];
    write_idx(
        dir.path(),
        "train-images-idx3-ubyte",
        &imgs(3),
        &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
    );
    write_idx(dir.path(), "train-labels-idx1-ubyte", &lbls(3), &[0, 1, 1]);
    write_idx(
        dir.path(),
        "t10k-images-idx3-ubyte",
        &imgs(1),
        &[4, 3, 2, 1],
    );
    write_idx(dir.path(), "t10k-labels-idx1-ubyte", &lbls(1), &[1]);
    let d = IdxImages::from_dir(dir.path(), 0).unwrap();
    let Batch::Images { labels, pixels, .. } = d.batch(Split::Eval, 0, 1, 0).unwrap() else {
        panic!()
    };
    assert_eq!(labels, vec![1]);
    assert_eq!(pixels.len(), 4);
    // A truncated payload is rejected with the file named.
    write_idx(dir.path(), "t10k-images-idx3-ubyte", &imgs(1), &[4, 3]);
    let err = IdxImages::from_dir(dir.path(), 0)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("t10k-images") && err.contains("payload"),
        "{err}"
    );
}

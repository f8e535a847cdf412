//! Replays every fuzz target's seeds, its kept corpus (`fuzz/corpus/<target>`) and the inputs
//! that once crashed it (`fuzz/regressions/<target>`), on stable, under `cargo test`.

use std::path::{Path, PathBuf};

fn inputs(root: &Path, target: &str) -> Vec<PathBuf> {
    let dir = root.join(target);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz")
}

#[test]
fn every_target_holds_on_its_seeds_and_accepts_them() {
    for target in fusion_fuzz::TARGETS {
        let seeds = fusion_fuzz::seeds(target);
        assert!(!seeds.is_empty(), "{target} has no seeds");
        for (name, data) in seeds {
            // A seed its decoder refuses would start the fuzzer from nothing.
            assert_eq!(
                fusion_fuzz::run(target, &data),
                Some(true),
                "{target}: seed {name}"
            );
        }
    }
}

#[test]
fn every_target_holds_on_its_kept_corpus_and_past_crashes() {
    let mut replayed = 0;
    for target in fusion_fuzz::TARGETS {
        for kind in ["corpus", "regressions"] {
            for path in inputs(&fuzz_dir().join(kind), target) {
                let data = std::fs::read(&path).expect("read a corpus file");
                eprintln!("{target}: {}", path.display());
                assert!(fusion_fuzz::run(target, &data).is_some());
                replayed += 1;
            }
        }
    }
    // The corpus is kept in the repository: an empty one means it went missing.
    assert!(
        replayed >= fusion_fuzz::TARGETS.len(),
        "only {replayed} inputs replayed"
    );
}

//! Writes the seed corpus of every fuzz target into `DIR/<target>/seed-<name>` (default
//! `fuzz/corpus`), where `fuzz/run` and `cargo fuzz` start from.

fn main() -> std::io::Result<()> {
    let root = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "fuzz/corpus".into());
    for target in fusion_fuzz::TARGETS {
        let dir = std::path::Path::new(&root).join(target);
        std::fs::create_dir_all(&dir)?;
        for (name, data) in fusion_fuzz::seeds(target) {
            std::fs::write(dir.join(format!("seed-{name}")), data)?;
        }
    }
    Ok(())
}

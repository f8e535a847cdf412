use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// An RNG for one (seed, stream, index) triple: independent streams without shared state.
pub(crate) fn rng_for(seed: u64, stream: u64, index: u64) -> ChaCha8Rng {
    let mut r = ChaCha8Rng::seed_from_u64(seed ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    r.set_stream(index);
    r
}

pub(crate) fn split_stream(split: crate::Split) -> u64 {
    match split {
        crate::Split::Train => 1,
        crate::Split::Eval => 2,
    }
}

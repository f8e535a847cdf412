#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    fusion_fuzz::shard_manifest(data);
});

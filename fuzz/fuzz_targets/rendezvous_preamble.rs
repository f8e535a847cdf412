#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    fusion_fuzz::rendezvous_preamble(data);
});

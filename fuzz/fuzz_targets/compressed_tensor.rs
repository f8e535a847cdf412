#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    fusion_fuzz::compressed_tensor(data);
});

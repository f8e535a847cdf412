#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    fusion_fuzz::run_report(data);
});

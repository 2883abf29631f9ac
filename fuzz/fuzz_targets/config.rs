//! A model's `config.json`: parsed and checked for the architecture it names, as a model load
//! does before reading weights (`perch_engine::models::check_config`).

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = perch_engine::models::check_config(text);
    }
});

//! A weight file: `check_safetensors_header` (what `Weights::load` checks before MLX reads a
//! file), and for a file it accepts, `Weights::load` itself (MLX's reader, the cast to the
//! compute dtype, evaluation) on a model directory holding only that file.

#![no_main]

use libfuzzer_sys::fuzz_target;
use perch_engine::device::Backend;
use perch_engine::nn::weights::{check_safetensors_header, Weights};

fuzz_target!(|data: &[u8]| {
    if check_safetensors_header(data).is_err() {
        return;
    }
    let dir = perch_fuzz::scratch_dir().join("model");
    std::fs::create_dir_all(&dir).expect("create the model directory");
    std::fs::write(dir.join("model.safetensors"), data).expect("write the weights");
    let _ = Weights::load(&dir, Backend::current());
});

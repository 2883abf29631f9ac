//! A GGUF file, as `perch import` reads one: `GgufFile::open` (header, metadata, tensor infos,
//! bounds), every tensor's bytes, then the whole import into a scratch directory (metadata
//! checks, tensor plan, tokenizer, conversion, writing).

#![no_main]

use libfuzzer_sys::fuzz_target;
use perch_gguf::GgufFile;

fuzz_target!(|data: &[u8]| {
    let path = perch_fuzz::scratch_file("model.gguf", data);
    if let Ok(file) = GgufFile::open(&path) {
        let _ = file.architecture();
        for info in file.tensors() {
            let _ = (info.shape(), info.n_elements());
            if let Ok(bytes) = file.read_tensor_bytes(info) {
                assert_eq!(Some(bytes.len() as u64), info.n_bytes);
            }
        }
    }
    let out = perch_fuzz::scratch_dir().join("imported");
    let _ = perch_gguf::import(&path, &out);
    let _ = std::fs::remove_dir_all(&out);
});

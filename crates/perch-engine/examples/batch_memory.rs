//! Where the batch engine's peak memory comes from: runs `rows` requests of `prompt` tokens,
//! `gen` generated each (EOS ignored), through a `BatchGenerator` with this backend's defaults
//! and prints MLX's memory after every step that raised the peak by 100 MB or more, every
//! 16th step and the last: active bytes (live arrays), the peak so far, the prefix-cache store
//! and MLX's buffer cache (freed buffers kept for reuse; not in the peak), in MB.
//!
//! `cargo run --release -p perch-engine --example batch_memory -- MODEL_DIR [ROWS PROMPT GEN]`
//! (defaults 32 128 256). Run it on the device next to `scripts/bench_gpu.py` (the binary built
//! here runs there with `LD_LIBRARY_PATH` at the CUDA wheel's `mlx/lib`).

use std::error::Error;

use perch_engine::device::{memory_stats, reset_peak_memory};
use perch_engine::testing::{BatchConfig, BatchGenerator};
use perch_engine::{models, EngineConfig, GenerateRequest, Tokenizer};

fn main() -> Result<(), Box<dyn Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(dir) = args.first() else {
        return Err("usage: batch_memory MODEL_DIR [ROWS PROMPT GEN]".into());
    };
    let number = |i: usize, default: usize| -> Result<usize, Box<dyn Error>> {
        Ok(args
            .get(i)
            .map(|a| a.parse())
            .transpose()?
            .unwrap_or(default))
    };
    let (rows, prompt, generated) = (number(1, 32)?, number(2, 128)?, number(3, 256)?);
    let dir = std::path::Path::new(dir);
    let model = models::load(dir)?;
    let tokenizer = Tokenizer::load(dir)?;
    let engine = EngineConfig::default();
    let config = BatchConfig {
        max_running: rows,
        ..BatchConfig::for_budget(
            model.as_ref(),
            engine.kv_cache_bytes,
            engine.block_size,
            None,
        )
    };
    println!("{config:?}");
    let mut batch = BatchGenerator::new(model.as_ref(), &tokenizer, config, "batch_memory");
    let mb = |bytes: usize| bytes as f64 / 1e6;
    println!(
        "after load: active {:.0} MB",
        mb(memory_stats().active_bytes)
    );
    reset_peak_memory();
    let vocab = model.info().vocab_size;
    for r in 0..rows {
        // Distinct prompts (no shared prefix-cache blocks), ids spread over the vocabulary.
        let ids = (0..prompt).map(|i| ((10 + r * 7919 + i * 31) % vocab) as u32);
        let mut request = GenerateRequest::new(ids.collect());
        request.max_tokens = generated;
        request.ignore_eos = true;
        batch.insert(request)?;
    }
    let mut step = 0;
    while !batch.is_empty() {
        let peak_before = memory_stats().peak_bytes;
        batch.step()?;
        step += 1;
        let m = memory_stats();
        let raised = m.peak_bytes.saturating_sub(peak_before);
        if raised >= 100_000_000 || step % 16 == 0 || batch.is_empty() {
            println!(
                "step {step}: active {:.0}, peak {:.0} (+{:.0} this step), store {:.0}, buffer cache {:.0}, running {}",
                mb(m.active_bytes),
                mb(m.peak_bytes),
                mb(raised),
                mb(batch.kv_stats().prefix_cache_bytes),
                mb(m.cache_bytes),
                batch.num_running()
            );
        }
    }
    Ok(())
}

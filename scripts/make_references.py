"""Writes the reference fixtures the tests compare Perch with, using the pinned oracle
(mlx[cpu]==0.32.2, mlx-lm==0.32.2: target/oracle-venv, made by scripts/test.sh).

    make_references.py greedy MODEL_DIR OUT.json
        Greedy continuations by mlx_lm of the cases below on MODEL_DIR (the test model that
        scripts/test-inputs.sh makes): chat-templated prompt ids, the generated ids up to
        max_tokens or the first EOS (included, as mlx_lm yields it) and their text (without
        the EOS, as mlx_lm's generate returns it).
    make_references.py speculative MODEL_DIR GREEDY.json OUT.json
        Seeded sampled runs of mlx_lm's `speculative_generate_step` on MODEL_DIR with the model
        as its own draft (SPECULATIVE_RUNS: the first short cases of GREEDY.json, the fixture
        above), each run's ids and `from_draft` flags: what tests/speculative.rs compares with.
    make_references.py bounded MODEL_DIR OUT.json
        Greedy ids of MODEL_DIR (a Llama) with every layer's cache a `RotatingKVCache(64, keep=4)`
        for prompts of 70 and 130 tokens (longer than the bound), beside the same prompts' ids with
        plain caches: what tests/kv_cache_options.rs compares `max_kv_size` with. mlx_lm's
        `make_prompt_cache(model, max_kv_size)` returns the model's own `make_cache()` when it has
        one, and Llama's makes plain caches (mlx_lm ignores the bound there), so the caches are
        built as make_prompt_cache builds them for a model without one.
    make_references.py import IMPORT_DIR GGUF OUT.json
        SHA-256 of every file `perch import GGUF` wrote into IMPORT_DIR, and of the GGUF: the
        import is deterministic, so any machine must write these bytes.
    make_references.py mlx-community MODEL_DIR OUT_DIR
        What the GGUF import is checked against, from a real download of
        mlx-community/SmolLM2-135M-Instruct-4bit (made by mlx_lm.convert from the original
        safetensors, not from the GGUF): its small files verbatim, the header of its weights,
        and a sample of rows of its weights (whole norms). Not reachable without the Hub or a copy
        of that model; the fixture it writes is committed.

Every JSON fixture starts with a "regenerate" key holding the command that remakes it.
"""

import hashlib
import json
import shutil
import struct
import sys
from importlib.metadata import version
from pathlib import Path

# The chat cases of the reference: single and multi-turn, a system prompt, unicode and emoji,
# code, a raw prompt, one that stops on EOS, and a prompt longer than one prefill chunk
# (mlx_lm's prefill_step_size, set to 256 tokens).
MAX_TOKENS = 32
PREFILL_CHUNK = 256


def long_document():
    """About 330 tokens of varied, deterministic prose (more than one prefill chunk)."""
    subjects = ["The river", "A lighthouse keeper", "The old library", "Our weather station",
                "The night train", "A beekeeper", "The harbour crane", "The mountain school"]
    verbs = ["recorded", "noticed", "counted", "described", "measured", "remembered"]
    objects = ["seventeen swallows", "a copper kettle", "the autumn tide", "three lost letters",
               "a broken compass", "the winter stars", "forty blue lanterns", "a quiet storm"]
    places = ["near the bridge", "after midnight", "on the northern hill", "beside the mill",
              "during the fair", "under the station clock"]
    lines = []
    for i in range(14):
        lines.append(f"Entry {i + 1}: {subjects[i % 8]} {verbs[(i * 5) % 6]} {objects[(i * 3) % 8]} "
                     f"{places[(i * 7) % 6]}, and the count was {(i * 37) % 101}.")
    return " ".join(lines)


CASES = [
    {"id": "sky", "messages": [{"role": "user", "content": "Why is the sky blue?"}]},
    {"id": "haiku", "messages": [{"role": "system", "content": "You are a poet."},
                                 {"role": "user", "content": "Write a haiku about the sea."}]},
    {"id": "multi-turn", "messages": [{"role": "user", "content": "What is 2 + 2?"},
                                      {"role": "assistant", "content": "2 + 2 = 4."},
                                      {"role": "user", "content": "And times three?"}]},
    {"id": "unicode", "messages": [{"role": "user", "content":
                                    "Translate 'good morning' into French, Japanese (日本語) and add an emoji 🌅."}]},
    {"id": "raw-text", "text": "The capital of France is"},
    {"id": "code", "messages": [{"role": "user", "content": "Write a Rust function that reverses a string."}]},
    {"id": "long", "messages": [{"role": "user", "content":
                                 "Here is a logbook.\n\n" + long_document() + "\n\nWhat did the river record?"}]},
]


def sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_json(path, value):
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, ensure_ascii=False, indent=1)
        f.write("\n")


def command(*args):
    return "target/oracle-venv/bin/python scripts/make_references.py " + " ".join(args)


def made_on(model_dir, *args):
    """A fixture's first keys: the command that remakes it (`make_references.py ARGS` on the test
    model scripts/test-inputs.sh makes), the model it was made on and the oracle's versions."""
    return {
        "regenerate": "cargo build -p perch-cli && bash scripts/test-inputs.sh && " + command(*args),
        "model": Path(model_dir).name,
        "model_sha256": sha256(Path(model_dir) / "model.safetensors"),
        "mlx": version("mlx"),
        "mlx_lm": version("mlx-lm"),
    }


def greedy(model_dir, out):
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, tokenizer = load(model_dir)
    eos = sorted(tokenizer.eos_token_ids)
    cases = []
    for case in CASES:
        if "messages" in case:
            prompt = tokenizer.apply_chat_template(case["messages"], add_generation_prompt=True)
        else:
            prompt = tokenizer.encode(case["text"])
        ids = []
        for token, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS,
                                      prefill_step_size=PREFILL_CHUNK):
            ids.append(int(token))
            if ids[-1] in eos:
                break
        # The text mlx_lm's generate returns: without the EOS that ended it.
        text = tokenizer.decode(ids[:-1] if ids[-1] in eos else ids)
        cases.append({**case, "prompt_ids": prompt, "greedy_ids": ids, "greedy_text": text})
        print(f"{case['id']}: {len(prompt)} prompt tokens, {len(ids)} generated"
              f"{' (stopped on EOS)' if ids[-1] in eos else ''}: {tokenizer.decode(ids)!r}", file=sys.stderr)
    write_json(out, {
        **made_on(model_dir, "greedy", str(model_dir), str(out)),
        "sampler": "greedy (temp 0)",
        "max_tokens": MAX_TOKENS,
        "prefill_step_size": PREFILL_CHUNK,
        "eos_token_ids": eos,
        "cases": cases,
    })


# (short case index, num_draft_tokens, seed): drafts of 2, 3 and 4 tokens at temperature 1, 16
# tokens each past EOS. The model's proposals, drawn with other keys than the verify step's, are
# often rejected, so each run has accepted and rejected proposals.
SPECULATIVE_RUNS = [(0, 2, 5), (1, 4, 6), (2, 3, 7)]


def speculative(model_dir, greedy_json, out):
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import speculative_generate_step
    from mlx_lm.sample_utils import make_sampler

    reference = json.loads(Path(greedy_json).read_text())
    short = [c for c in reference["cases"] if len(c["prompt_ids"]) < reference["prefill_step_size"]]
    model, _ = load(model_dir)
    draft, _ = load(model_dir)
    runs = []
    for case, k, seed in SPECULATIVE_RUNS:
        mx.random.seed(seed)
        ids, flags = [], []
        for token, _, from_draft in speculative_generate_step(
                mx.array(short[case]["prompt_ids"]), model, draft, num_draft_tokens=k, max_tokens=16,
                sampler=make_sampler(temp=1.0), prefill_step_size=2048):
            ids.append(int(token))
            flags.append(bool(from_draft))
        runs.append({"case": short[case]["id"], "num_draft_tokens": k, "seed": seed, "temp": 1.0,
                     "max_tokens": 16, "ids": ids, "from_draft": flags})
        print(f"{short[case]['id']}: {sum(flags)} of {len(ids)} from the draft", file=sys.stderr)
    write_json(out, {
        **made_on(model_dir, "speculative", str(model_dir), str(greedy_json), str(out)),
        "sampler": "make_sampler(temp=1.0), mx.random.seed(seed) before each run; the model drafts for itself",
        "runs": runs,
    })


BOUNDED_MAX_KV_SIZE = 64
BOUNDED_TOKENS = 32
BOUNDED_TEXT = " ".join(
    f"Item {i}: the {['red', 'blue', 'green', 'small', 'large'][i % 5]} box holds {i * 7 % 13} apples."
    for i in range(30)
)


def bounded(model_dir, out):
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

    def greedy(model, prompt, cache):
        steps = generate_step(mx.array(prompt), model, max_tokens=BOUNDED_TOKENS, prompt_cache=cache)
        return [int(token) for (token, _), _ in zip(steps, range(BOUNDED_TOKENS))]

    model, tokenizer = load(model_dir)
    ids = tokenizer.encode(BOUNDED_TEXT)
    cases = []
    # Longer than the bound: decoding wraps at once (70), and the prompt's one pass masks a
    # window (130).
    for n in (70, 130):
        prompt = ids[:n]
        assert len(prompt) == n
        rotating = [RotatingKVCache(max_size=BOUNDED_MAX_KV_SIZE, keep=4) for _ in model.layers]
        cases.append({
            "prompt": prompt,
            "max_kv_size": BOUNDED_MAX_KV_SIZE,
            "ids": greedy(model, prompt, rotating),
            "plain_ids": greedy(model, prompt, make_prompt_cache(model)),
        })
    write_json(out, {
        **made_on(model_dir, "bounded", str(model_dir), str(out)),
        "cache": f"RotatingKVCache(max_size={BOUNDED_MAX_KV_SIZE}, keep=4) in every layer; greedy",
        "cases": cases,
    })


def import_hashes(import_dir, gguf, out):
    import_dir = Path(import_dir)
    files = sorted(p.name for p in import_dir.iterdir() if p.is_file())
    write_json(out, {
        "regenerate": "cargo build -p perch-cli && bash scripts/test-inputs.sh && " + command("import", str(import_dir), str(gguf), str(out)),
        "gguf": Path(gguf).name,
        "gguf_sha256": sha256(gguf),
        "files": {name: sha256(import_dir / name) for name in files},
    })


# Rows of each module kept in the weight sample: spread over the matrix, with neighbours (the
# RoPE permutation that the import undoes moves neighbouring rows apart).
def sample_rows(n):
    rows = set(range(0, 4))
    rows.update(range(0, n, max(1, n // 16)))
    rows.update(r + 1 for r in range(0, n - 1, max(1, n // 8)))
    return sorted(r for r in rows if r < n)


SAMPLED_LAYERS = [0, 15, 29]
SAMPLED_MODULES = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
WHOLE_TENSORS = ["model.norm.weight", "model.layers.3.input_layernorm.weight"]


def mlx_community(model_dir, out_dir):
    import mlx.core as mx

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ["config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json", "model.safetensors.index.json"]:
        shutil.copyfile(model_dir / name, out_dir / name)
    with open(model_dir / "model.safetensors", "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    weights = mx.load(str(model_dir / "model.safetensors"))
    sample, rows_of = {}, {}
    modules = [f"model.layers.{layer}.{m}" for layer in SAMPLED_LAYERS for m in SAMPLED_MODULES]
    modules.append("model.embed_tokens")
    for module in modules:
        n = weights[f"{module}.weight"].shape[0]
        rows = list(range(0, n, 997)) if module == "model.embed_tokens" else sample_rows(n)
        rows_of[module] = rows
        index = mx.array(rows)
        for part in ["weight", "scales", "biases"]:
            sample[f"{module}.{part}"] = weights[f"{module}.{part}"][index]
    for name in WHOLE_TENSORS:
        sample[name] = weights[name]
    mx.save_safetensors(str(out_dir / "weights-sample.safetensors"), sample)
    write_json(out_dir / "weights-sample.json", {
        "regenerate": command("mlx-community", "PATH/TO/mlx-community/SmolLM2-135M-Instruct-4bit", str(out_dir)),
        "source": "mlx-community/SmolLM2-135M-Instruct-4bit (mlx_lm.convert -q --dtype float32, mlx-lm 0.32.2)",
        "model_safetensors_sha256": sha256(model_dir / "model.safetensors"),
        "header": header,
        "rows": rows_of,
        "whole": WHOLE_TENSORS,
    })


def main():
    commands = {"greedy": (greedy, 2), "speculative": (speculative, 3), "bounded": (bounded, 2), "import": (import_hashes, 3), "mlx-community": (mlx_community, 2)}
    if len(sys.argv) < 2 or sys.argv[1] not in commands or len(sys.argv) - 2 != commands[sys.argv[1]][1]:
        raise SystemExit(__doc__)
    function, _ = commands[sys.argv[1]]
    function(*sys.argv[2:])


if __name__ == "__main__":
    main()

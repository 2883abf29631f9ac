"""Greedy parity on a GPU: Perch's batch engine against its single-stream path, and both against mlx_lm on the
same device, token by token (README's "On a GPU (CUDA)"; CI has no GPU, so this runs on the device by hand).

    python scripts/parity_gpu.py PERCH_BINARY MODEL_DIR CASES_JSON [--max-tokens 32] [--out DIR]
    python scripts/parity_gpu.py --margins OUT_DIR/parity.json MODEL_DIR CASES_JSON     (anywhere, e.g. on CPU)

CASES_JSON: {"cases": [{"id", "prompt_ids", "greedy_ids"?}, ...]} (the layout of the mlx_lm reference files
that make_references.py writes; `greedy_ids`, if present, are the CPU float32 reference). For each case it runs
`perch bench --prompt-ids` (single stream, `generate`) and once `perch bench --concurrency N` with every case
at once (the batch engine), both greedy with EOS ignored, and mlx_lm's `generate_step` greedy in this process;
then prints, per case, where each pair first differs ("=" when all `--max-tokens` ids agree). On a GPU the
model computes in bfloat16, where engines that order their sums differently can part at a near-tie; the table
says where. `--margins` explains each place: from a run's parity.json it recomputes, in float32 with the
weights dequantized, the logits after the prompt and the ids both sides agree on, and prints the gap between the
two tokens they chose there (a gap within bfloat16's rounding of the logits is a near-tie, not a bug).
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx


def perch_ids(binary: str, model: Path, prompts: list, max_tokens: int, out: Path) -> list:
    """Generated ids per prompt: one single-stream run each, then one batch run of all."""
    single = []
    for k, prompt in enumerate(prompts):
        (out / f"prompt-{k}.json").write_text(json.dumps(prompt))
        run(binary, "bench", "--model", model, "--prompt-ids", out / f"prompt-{k}.json", "--gen-tokens",
            max_tokens, "--runs", 1, "--output-ids", out / f"single-{k}.json")
        single.append(json.loads((out / f"single-{k}.json").read_text()))
    (out / "prompts.json").write_text(json.dumps(prompts))
    run(binary, "bench", "--model", model, "--concurrency", len(prompts), "--prompt-ids", out / "prompts.json",
        "--gen-tokens", max_tokens, "--output-ids", out / "batch.json")
    return single, json.loads((out / "batch.json").read_text())


def run(*args) -> None:
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        sys.exit(f"{' '.join(map(str, args))} failed: {result.stderr.strip()}")


def mlx_lm_ids(model_dir: Path, prompts: list, max_tokens: int) -> list:
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    model, _ = load(str(model_dir))
    out = []
    for prompt in prompts:
        ids = []
        for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
            ids.append(int(token))
        out.append(ids)
    return out


def margins(parity: Path, model_dir: Path, cases: list) -> None:
    from mlx_lm import load
    from mlx_lm.utils import dequantize_model
    model, _ = load(str(model_dir))
    model = dequantize_model(model)
    model.set_dtype(mx.float32)
    runs = json.loads(parity.read_text())
    print("\n| case | pair | step | tokens chosen | float32 logits of the two | gap | float32 argmax |")
    print("|---|---|---|---|---|---|---|")
    for k, case in enumerate(cases):
        for name, other in (("batch vs single", "batch"), ("mlx_lm vs perch", "mlx_lm")):
            a, b = runs["single"][k], runs[other][k]
            i = first_difference(a, b)
            if i == "=" or i >= min(len(a), len(b)):
                continue
            ids = mx.array([case["prompt_ids"] + a[:i]])
            logits = model(ids)[0, -1].astype(mx.float32)
            la, lb = logits[a[i]].item(), logits[b[i]].item()
            top = mx.argmax(logits).item()
            print(f"| {case['id']} | {name} | {i} | {a[i]} / {b[i]} | {la:.3f} / {lb:.3f} | {abs(la - lb):.3f} "
                  f"| {top} |")


def first_difference(a: list, b: list):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return "=" if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("perch", nargs="?")
    parser.add_argument("--margins", type=Path, metavar="PARITY_JSON")
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("cases", type=Path)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    cases = json.loads(args.cases.read_text())["cases"]
    if args.margins:
        return margins(args.margins, args.model_dir, cases)
    prompts = [c["prompt_ids"] for c in cases]
    out = args.out or Path(tempfile.mkdtemp(prefix="parity-"))
    out.mkdir(parents=True, exist_ok=True)
    single, batch = perch_ids(args.perch, args.model_dir, prompts, args.max_tokens, out)
    theirs = mlx_lm_ids(args.model_dir, prompts, args.max_tokens)
    print(json.dumps({"device": str(mx.default_device()), "mlx": mx.__version__, "max_tokens": args.max_tokens}))
    print("\nFirst index where the greedy ids differ (= : all equal):\n")
    print("| case | perch batch vs single stream | perch vs mlx_lm (same device) | perch vs CPU float32 reference |")
    print("|---|---|---|---|")
    for case, s, b, t in zip(cases, single, batch, theirs):
        reference = case.get("greedy_ids")
        ref = "—" if reference is None else first_difference(s, reference[: args.max_tokens])
        print(f"| {case['id']} | {first_difference(s, b)} | {first_difference(s, t)} | {ref} |")
    (out / "parity.json").write_text(json.dumps({"single": single, "batch": batch, "mlx_lm": theirs}))


if __name__ == "__main__":
    sys.exit(main())

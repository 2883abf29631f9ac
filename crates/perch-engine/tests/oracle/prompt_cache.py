"""mlx_lm's side of the prompt-cache interop test (tests/prompt_cache.rs), with mlx_lm 0.32.2.

    prompt_cache.py save MODEL_DIR IDS_JSON OUT.safetensors [DECODED [MAX_KV_SIZE]]
        runs the prompt ids through the model into a fresh cache (mlx_lm's make_prompt_cache;
        with MAX_KV_SIZE, a RotatingKVCache(MAX_KV_SIZE, keep=4) per layer, what
        make_prompt_cache gives models without their own make_cache) and writes it with mlx_lm's save_prompt_cache (no token ids
        recorded, as mlx_lm.cache_prompt does); the last DECODED ids (default 0) go in one at a
        time, as decode steps do, so that rotating caches wrap
    prompt_cache.py continue MODEL_DIR CACHE.safetensors IDS_JSON N
        loads a prompt cache with mlx_lm's load_prompt_cache, feeds the ids after it and prints
        the N greedy token ids that follow, as JSON
    prompt_cache.py serve
        reads one command a line from stdin (its arguments as a JSON list) and answers each with
        one line, what the command prints as a JSON string (or `{"error": traceback}` when it
        fails); a model stays loaded between commands
        (the tests run many on one process instead of starting mlx_lm for each)
"""

import contextlib
import functools
import io
import json
import os
import sys
import traceback

import mlx.core as mx
import mlx_lm_quirks  # noqa: F401 (MoE models run in mlx_lm 0.32.2)
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import RotatingKVCache, load_prompt_cache, make_prompt_cache, save_prompt_cache


@functools.lru_cache(maxsize=None)
def load_model(model_dir):
    return load(model_dir)[0]


def run(argv):
    command, model_dir = argv[0], argv[1]
    model = load_model(model_dir)
    if command == "save":
        ids = json.loads(argv[2])
        decoded = int(argv[4]) if len(argv) > 4 else 0
        max_kv_size = int(argv[5]) if len(argv) > 5 else None
        if max_kv_size is None:
            cache = make_prompt_cache(model)
        else:
            cache = [RotatingKVCache(max_size=max_kv_size, keep=4) for _ in model.layers]
        split = len(ids) - decoded
        model(mx.array(ids[:split])[None], cache=cache)
        for token in ids[split:]:
            model(mx.array([[token]]), cache=cache)
            mx.eval([c.state for c in cache])
        mx.eval([c.state for c in cache])
        save_prompt_cache(argv[3], cache, {"model": model_dir})
    elif command == "continue":
        cache = load_prompt_cache(argv[2])
        ids = json.loads(argv[3])
        n = int(argv[4])
        out = [int(t) for t, _ in generate_step(mx.array(ids), model, prompt_cache=cache, max_tokens=n)]
        print(json.dumps(out))
    else:
        raise SystemExit(f"unknown command {command}")


def serve():
    # Replies go to the process's stdout as it was; anything else printed to fd 1 (by a library)
    # goes to stderr, so that it cannot break the one-line-a-reply protocol.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for line in sys.stdin:
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                run(json.loads(line))
            reply = printed.getvalue()
        except BaseException:  # noqa: B036 (SystemExit too: the command's error goes back as the reply)
            reply = {"error": traceback.format_exc()}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        serve()
    else:
        run(sys.argv[1:])

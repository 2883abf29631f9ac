"""Whether a model's greedy choices depend on the shape of the pass that computes them, on this backend:
mlx_lm's own forward over 8 random prompts of 128 tokens, decoded a token at a time (a batch of 8 one-token
passes, as a draft proposes or a plain decode step runs), then the same positions' logits from one pass over
each whole sequence (as a verify pass reads several tokens a row). Prints how many greedy choices differ, the
top-two margins where they do, exact ties, and the largest logit difference between the two paths.

    [ROWS=8 PROMPT=128 GEN=64] python scripts/greedy_by_pass_shape.py MODEL_DIR

Used on the random pairs of make_draft_pair.py (docs/benchmarks.md, "A draft model in the batch").
"""
import sys, mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
import os
path = sys.argv[1]; rows, plen, gen = (int(os.environ.get(k, d)) for k, d in (("ROWS", 8), ("PROMPT", 128), ("GEN", 64)))
m, _ = load(path)
mx.random.seed(0)
vocab = m(mx.zeros((1, 1), dtype=mx.uint32)).shape[-1]
ids = mx.random.randint(0, vocab, (rows, plen)).astype(mx.uint32)
cache = make_prompt_cache(m)
lg = m(ids, cache=cache)[:, -1, :]
toks, step_logits = [], []
for i in range(gen):
    t = mx.argmax(lg, axis=-1)
    toks.append(t); step_logits.append(lg)
    if i + 1 < gen:
        lg = m(t[:, None], cache=cache)[:, -1, :]
seq = mx.concatenate([ids, mx.stack(toks, 1).astype(mx.uint32)], 1)
# The logits that chose each generated token but the first (the prompt's pass chose it).
full = m(seq)[:, plen: plen - 1 + gen, :]
dec = mx.stack(step_logits[1:], 1)
a_full, a_dec = mx.argmax(full, -1), mx.argmax(dec, -1)
flips = (a_full != a_dec)
srt = mx.sort(dec.astype(mx.float32), -1); margin = srt[..., -1] - srt[..., -2]
mx.eval(flips, margin)
import numpy as np
f = np.array(flips); mg = np.array(margin)
print(path, 'dtype', dec.dtype, 'positions', f.size, 'argmax differs', int(f.sum()),
      'margins there', sorted(mg[f].round(4).tolist())[:20], 'ties (margin 0) overall', int((mg == 0).sum()),
      'max |logit diff|', float(mx.abs(full.astype(mx.float32) - dec.astype(mx.float32)).max()))

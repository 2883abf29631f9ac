"""Workarounds for known quirks of mlx_lm 0.32.2 with MLX 0.32.2, applied on import by the oracle scripts
(each is described where it is shimmed, below)."""

import mlx.core as mx

# mlx_lm 0.32.2's quantized expert layer always passes `global_scale=` to mx.gather_qmm, which MLX
# 0.32.2 does not take (a known quirk of that pair): drop the keyword when it is None, which
# leaves the computation as it is.
_gather_qmm = mx.gather_qmm


def _gather_qmm_without_global_scale(*args, global_scale=None, **kwargs):
    assert global_scale is None, "a global scale would change the computation"
    return _gather_qmm(*args, **kwargs)


mx.gather_qmm = _gather_qmm_without_global_scale

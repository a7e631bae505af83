"""hybridserve's GGML quantizer against the gguf package's reader (llama.cpp's): the
reader's ``dequantize`` of the blocks written must be within one quantization step of
the input, per block. A wrong layout (a misplaced nibble, scale or bit) decodes to
values far outside that bound, so the reader is the independent oracle of the format."""

import numpy as np
import pytest

from hybridserve.quant.ggml_quantize import quantize, row_bytes

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

IDS = {"q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_k": T.Q4_K, "q5_k": T.Q5_K, "q6_k": T.Q6_K}


def _weights(rows, cols, seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    w[0] += 0.2                      # a row that is all positive (the k-quants' min is 0)
    w[1] = -np.abs(w[1])             # a row that is all negative
    w[2, :64] = 0.0                  # all-zero blocks / sub-blocks
    w[3] *= rng.uniform(0.0, 20.0, cols).astype(np.float32)   # uneven sub-block ranges
    return w


def _step_bound(w, qtype):
    """Largest error each value may have: a function of its block's values only."""
    if qtype in ("q8_0", "q4_0"):
        b = w.reshape(-1, 32)
        amax = np.abs(b).max(axis=1, keepdims=True)
        # q8_0: half a step (amax/127) plus the float16 rounding of the scale;
        # q4_0: one step (amax/8), the clipped side (+8) included.
        bound = amax / 127 * 0.5 + amax * 2e-3 if qtype == "q8_0" else amax / 8 * 1.01
        return np.broadcast_to(bound, b.shape).reshape(w.shape)
    blk = w.reshape(-1, 256)
    if qtype == "q6_k":
        sub = blk.reshape(-1, 16, 16)
        scale = np.abs(sub).max(axis=-1) / 32
        d = scale.max(axis=-1, keepdims=True) / 127
        # One step: the sign opposite the largest magnitude can clip by a step.
        bound = (scale + d) * 1.01
        return np.broadcast_to(bound[..., None], sub.shape).reshape(w.shape)
    qmax = 15 if qtype == "q4_k" else 31
    sub = blk.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0)
    scale = (sub.max(axis=-1) - lo) / qmax
    d = scale.max(axis=-1, keepdims=True) / 63
    dmin = (-lo).max(axis=-1, keepdims=True) / 63
    # Half a step of the (6-bit rounded-up) scale, half the 6-bit min's rounding.
    bound = ((scale + d) / 2 + dmin / 2) * 1.01 + 1e-7
    return np.broadcast_to(bound[..., None], sub.shape).reshape(w.shape)


@pytest.mark.parametrize("qtype", list(IDS))
@pytest.mark.parametrize("shape", [(4, 256), (7, 768), (5, 1024)])
def test_reader_decodes_within_a_step(qtype, shape):
    w = _weights(*shape, seed=list(IDS).index(qtype) * 10 + shape[0])
    q = quantize(w, qtype)
    assert q.dtype == np.uint8 and q.shape == (shape[0], row_bytes(shape[1], qtype))
    back = dequantize(q, IDS[qtype]).reshape(shape)
    err = np.abs(back - w)
    bound = _step_bound(w, qtype)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), f"{qtype}: error {err[worst]} > bound {bound[worst]} at {worst}"
    # Not vacuous: the format's error is a real fraction of the step, not zero.
    assert err.max() > 0


def test_exact_grid_values_round_trip():
    # A weight already on the Q6_K/Q8_0 grid of its own scale comes back exactly.
    rng = np.random.default_rng(1)
    q = rng.integers(-127, 128, (3, 64)).astype(np.float32)
    q[:, ::32] = 127
    w = q * np.float32(2.0 ** -10)
    back = dequantize(quantize(w, "q8_0"), T.Q8_0).reshape(w.shape)
    np.testing.assert_array_equal(back, w)


@pytest.mark.parametrize("bad,msg", [
    (np.zeros((2, 100), np.float32), "multiple"),
    (np.zeros(256, np.float32), "2-D"),
    (np.full((1, 256), np.nan, np.float32), "finite"),
])
def test_bad_input_is_refused(bad, msg):
    with pytest.raises(ValueError, match=msg):
        quantize(bad, "q4_k")
    with pytest.raises(ValueError, match="unknown"):
        quantize(np.zeros((1, 256), np.float32), "q3_k")

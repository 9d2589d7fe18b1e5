"""Test helpers: random GDN-2 inputs (spec §11 distribution) and the RMS-ratio metric.

Nothing here calls the code under test.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

NAMES = ("q", "k", "v", "g", "b", "w")
GRAD_NAMES = NAMES + ("h0",)


def make_inputs(key: int, B: int, T: int, H: int, HV: int, K: int, V: int, dtype=jnp.float32, *,
                N: int | None = None, g_range=(-5.0, -0.1), b_range=(0.0, 1.0), normalize_qk: bool = True,
                as_numpy: bool = False):
    """Fresh random inputs ``dict(q, k, v, g, b, w, h0)`` following spec §11.

    q, k ~ N(0, 1) (L2-normalised over K when ``normalize_qk``), v = 0.5·N(0, 1), g ~ U(g_range),
    b ~ U(b_range), w ~ U(0, 1), h0 ~ N(0, 1) with N = ``N`` (default B) states. Values are drawn in float64
    with ``numpy.random.default_rng(key)``. q, k, v, b, w are cast to ``dtype``; g and h0 to float32, or
    float64 when ``dtype`` is float64 (which needs x64 for a jnp result). ``as_numpy`` returns numpy arrays.
    """
    rng = np.random.default_rng(key)
    N = B if N is None else N
    q = rng.standard_normal((B, T, H, K))
    k = rng.standard_normal((B, T, H, K))
    if normalize_qk:
        q = q / np.sqrt((q * q).sum(-1, keepdims=True))
        k = k / np.sqrt((k * k).sum(-1, keepdims=True))
    out = dict(
        q=q, k=k,
        v=0.5 * rng.standard_normal((B, T, HV, V)),
        g=rng.uniform(*g_range, size=(B, T, HV, K)),
        b=rng.uniform(*b_range, size=(B, T, HV, K)),
        w=rng.uniform(0.0, 1.0, size=(B, T, HV, V)),
        h0=rng.standard_normal((N, HV, K, V)),
    )
    f64 = np.dtype(dtype) == np.float64
    gate_dtype = np.float64 if f64 else np.float32
    conv = np.asarray if as_numpy else jnp.asarray
    return {name: conv(x.astype(gate_dtype if name in ("g", "h0") else np.dtype(dtype)))
            for name, x in out.items()}


def rms_ratio(x, ref) -> float:
    """``RMS(x − ref) / RMS(ref)`` in float64 (FLA's metric, spec §11)."""
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert x.shape == ref.shape, (x.shape, ref.shape)
    den = np.sqrt(np.mean(ref * ref))
    return float(np.sqrt(np.mean((x - ref) ** 2)) / den)

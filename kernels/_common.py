"""Constants and helpers shared by the TileLang kernel factories and their runners (never imports jax).

Part of every kernel's cache key (``kernels/_compile.py`` hashes the ``_common*.py`` files).
"""

from __future__ import annotations

__all__ = ["CHUNK", "LOG2E", "L2NORM_EPS", "drop_params", "tf32_operand"]

#: Chunk length of the chunked (WY) form. FLA fixes 64 for GDN-2 (4 sub-chunks of 16).
CHUNK = 64
#: log2(e): kernels keep the within-chunk cumulative decay in base 2 and use ``exp2`` (FLA's ``RCP_LN2``).
LOG2E = 1.4426950408889634
#: epsilon of the in-kernel q/k L2 norm ``x * rsqrt(sum x^2 + eps)`` (FLA ``l2norm_fwd``; the jnp path uses it too).
L2NORM_EPS = 1e-6


def drop_params(func, keep, order=()):
    """Copy of the prim_func ``func`` with only the parameters whose buffer names are in ``keep``, in order.

    Lets a factory write one kernel with every optional buffer (initial state, cu_seqlens, final state) as a
    parameter and drop the ones a variant does not use; a dropped buffer must not be referenced by the body.
    ``order``: buffer names moved, in this order, behind the other kept parameters (a variant whose outputs
    change must still list what it reads before what it writes: ``_pipeline.launch_io``'s parameter-order rule).
    """
    params = [p for p in func.params if func.buffer_map[p].name in keep]
    rank = {n: i for i, n in enumerate(order)}
    params.sort(key=lambda p: rank.get(func.buffer_map[p].name, -1))  # (stable: the rest keep their order first)
    return type(func)(params, func.body, func.ret_type, {p: func.buffer_map[p] for p in params}, func.attrs)


def rounding_residual(x, dtype: str):
    """``x - round(x)``, the fp32 value ``x``'s rounding to ``dtype`` subtracted from it, stored in ``dtype``
    (TileLang expression, inside a kernel): the second operand of a split product, ``round(x)`` + this residual
    carrying twice the mantissa bits of ``dtype``."""
    import tilelang.language as T

    return T.cast(x - T.cast(T.cast(x, dtype), "float32"), dtype)


def tf32_operand(x, rounded: bool):
    """The fp32 value ``x`` as a TF32 tensor-core operand (TileLang expression, inside a kernel).

    ``mma.sync`` drops the low 13 mantissa bits of raw fp32 (truncation, biased towards zero). With ``rounded``
    the value is rounded to nearest first (add half a TF32 ulp, then clear those bits); otherwise ``x`` unchanged.
    """
    if not rounded:
        return x
    import tilelang.language as T

    return T.reinterpret(T.bitwise_and(T.reinterpret(x, "uint32") + T.uint32(0x1000), T.uint32(0xFFFFE000)),
                         "float32")

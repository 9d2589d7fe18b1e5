"""Constants and helpers shared by the TileLang kernel factories and their runners (never imports jax).

Part of every kernel's cache key (``kernels/_compile.py`` hashes the ``_common*.py`` files).
"""

from __future__ import annotations

__all__ = ["AQKL_WIDTH", "CHUNK", "LOG2E", "L2NORM_EPS", "TF32_DY", "drop_params", "product_residual",
           "residual_blocks_macro", "rounding_residual", "segment_scan_macros", "tf32_nearest", "tf32_operand"]

#: Chunk length of the chunked (WY) form. FLA fixes 64 for GDN-2 (4 sub-chunks of 16).
CHUNK = 64
#: Columns of ``AqkL``, the bf16 rounding residual of Aqk kept for the diagonal 16 x 16 blocks only: row r of a
#: chunk holds the residual of Aqk[r, 16 (r // 16) + c], c < 16. The off-diagonal blocks' residuals move o by 0.1%
#: of its error against fp64 (CPU emulation, session 28), for three times the bytes.
AQKL_WIDTH = 16
#: log2(e): kernels keep the within-chunk cumulative decay in base 2 and use ``exp2`` (FLA's ``RCP_LN2``).
LOG2E = 1.4426950408889634
#: epsilon of the in-kernel q/k L2 norm ``x * rsqrt(sum x^2 + eps)`` (FLA ``l2norm_fwd``; the jnp path uses it too).
L2NORM_EPS = 1e-6
#: the WY launch's ``tf32_round`` values that read S0 (``h``), dR and A (``Akk``) as their producers store them,
#: rounded to nearest TF32 (``kernels.chunk_bwd.chunk_bwd_pipeline``'s ``wy_tf32_round``)
TF32_DY = ("dy", "dy_min")


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


def product_residual(a, b, dtype: str):
    """``a b - round(a b)`` in ``dtype`` (TileLang expression, inside a kernel), where ``round(a b)`` is the fp32
    product ``a b`` rounded to ``dtype`` and the difference is taken from the exact product by one fused
    multiply-add, ``fma(a, b, -round(a b))``: the residual of a split product whose first part is ``round(a b)``.

    Spelled out (``__fmaf_rn``) rather than left to nvcc's contraction of ``rounding_residual(a * b)``, which it
    applies or not depending on the code around it (two launches meant to be bit-identical must not differ in
    it): the forward intra launch without ``fused_slice`` writes QGL as ``rounding_residual(a * b)`` and nvcc
    contracts it into this same fma (its SASS, sm_90a, nvcc 13.0: ``FFMA.FTZ R, a, b, -R``); with ``fused_slice``
    it did not, and QGL differed in 683 of its elements (session 23, first call).
    """
    import tilelang.language as T

    return T.cast(T.call_extern("float32", "__fmaf_rn", a, b, -T.cast(T.cast(a * b, dtype), "float32")), dtype)


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


def tf32_nearest(x):
    """The fp32 value ``x`` rounded to nearest TF32 by arithmetic (TileLang expression, inside a kernel).

    Veltkamp's split: ``t = fma(x, 2^13, x)`` is ``8193 x`` rounded once (``x 2^13`` is exact), and
    ``t - (t - x)`` keeps ``x``'s leading 11 significant bits rounded to nearest (ties to even; ``tf32_operand``'s
    integer form rounds ties away), for normal |x| < 2^114 (subnormals keep some low bits: harmless for an
    operand). Plain float arithmetic, so TileLang keeps a loop's vector loads and stores (the integer form makes
    them scalar). Both ways of writing it without ``T.fma`` compile to ``x``: ``t = x * 8193`` lets ``ptxas`` fuse
    the multiply into both subtractions (session 18), and TVM's simplifier folds ``t = x * 8192 + x`` on the CPU
    already. With the explicit fma the SASS is ``FFMA`` + 2 ``FADD`` per value (``nvdisasm``, session 19);
    ``tests/test_stages.py``'s GPU test checks the stored bits.
    """
    import tilelang.language as T

    from tvm import tirx

    # (x and t bound once: as plain expressions the generated CUDA repeated x's computation, loads included, for
    # every use)
    xv, tv = tirx.Var("tf32_x", "float32"), tirx.Var("tf32_t", "float32")
    return T.Let(T.Let(tv - (tv - xv), {tv: T.fma(xv, T.float32(8192.0), xv)}), {xv: x})


def residual_blocks_macro():
    """TileLang macro ``spread(AsL, AsLc, first)``, inside a chunk loop: the shared tile ``AsLc [64, AQKL_WIDTH]``
    of ``AqkL`` (the residual of Aqk's diagonal 16 x 16 blocks, row r's block at columns ``16 (r // 16)`` on)
    written into the diagonal blocks of the ``[64, 64]`` operand ``AsL`` of the residual product; at the loop's
    ``first`` chunk the whole of ``AsL`` is cleared first, and nothing writes its other blocks later, so they stay
    zero. (Cleared inside the loop: before it, TileLang lays the clear out over the producer warps too and fails.)
    Shared by the forward state pass and the reverse one (``kernels/chunk_bwd.py``)."""
    import tilelang.language as T

    W = AQKL_WIDTH

    @T.macro
    def spread(AsL, AsLc, first):
        if first:
            T.clear(AsL)
        for r, c in T.Parallel(CHUNK, W):
            AsL[r, (r // W) * W + c] = AsLc[r, c]

    return spread


def segment_scan_macros(SEG: int, NSEG: int, DC: int):
    """TileLang macros of the channel-slice cumulative sum over a chunk's rows, thread ``tx`` owning channel
    ``tx % DC`` of segment ``tx // DC`` (rows ``[seg * SEG, seg * SEG + SEG)``, ``NSEG`` segments):

    * ``offset(tot, csum, tx)``: ``csum`` = the sum of the totals ``tot[NSEG, DC]`` of the segments before the
      thread's, added in segment order;
    * ``cumsum(Gc, tot, csum, tx)``: the inclusive cumulative sum of ``Gc [NSEG * SEG, DC]`` in place: each
      segment's prefix, its total into ``tot``, then the segments' offsets (``csum``: an ``alloc_var``).

    Shared by the forward intra launch and version 1 of the backward one (the same additions in the same order).
    """
    import tilelang.language as T

    # (``csum: T.Ref``: the caller's variable itself, which ``csum = ...`` stores to; unannotated, the macro
    # would get its value and rebind the name)
    @T.macro
    def offset(tot, csum: T.Ref, tx):
        csum = 0.0
        for sg in T.serial(NSEG - 1):
            if sg < tx // DC:
                csum = csum + tot[sg, tx % DC]

    @T.macro
    def cumsum(Gc, tot, csum: T.Ref, tx):
        csum = 0.0
        for r in T.serial(SEG):
            csum = csum + Gc[(tx // DC) * SEG + r, tx % DC]
            Gc[(tx // DC) * SEG + r, tx % DC] = csum
        tot[tx // DC, tx % DC] = csum
        offset(tot, csum, tx)
        for r in T.serial(SEG):
            Gc[(tx // DC) * SEG + r, tx % DC] = Gc[(tx // DC) * SEG + r, tx % DC] + csum

    return offset, cumsum

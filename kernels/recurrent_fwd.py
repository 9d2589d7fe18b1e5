"""Fused recurrent GDN-2 forward (decode and short inputs) as a TileLang kernel.

One thread block owns the fp32 state slice ``S[n, hv, :, v0:v0+BV]`` (``[K, BV]``, in registers) of one
(sequence, value head, V-block) and walks the sequence's tokens in order (spec §3)::

    S̄ = exp(g_t)[:, None] * S          u = w_t*v_t − S̄ᵀ(b_t*k_t)
    S  = S̄ + k_t uᵀ                      o_t = scale · Sᵀ q_t

Grid: ``(N*HV, V/BV)`` (the large axis on gridDim.x), BV = min(V, 64), 64 state elements per thread for K >= 128
(H200 tile sweep: 140 us at B=128, H=32, K=V=128 = 90% of the copy bandwidth; docs/performance-notes.md). The two
K-reductions per token are TileLang AllReduces over the block (batched, one barrier round each). Math in fp32.
GVA native: value head ``hv`` reads q/k head ``hv // (HV/H)``. Options: initial state, final state, packed varlen
(``cu_seqlens`` int32), in-kernel q/k L2 norm, and an in-place state variant (``ht`` aliases ``h0``; each block
reads its slice before writing it). Tuning knobs: ``block_v``, ``threads``, ``schedule="vloop"``.
Never imports jax.
"""

# No ``from __future__ import annotations`` here: TileLang's builder evaluates the prim_func's annotations.
import math

from ._common import drop_params
from ._pipeline import Buf, Launch, Pipeline

__all__ = ["fused_recurrent_fwd_pipeline", "SUPPORTED_K", "SUPPORTED_V", "default_block_v"]

#: (block_v, threads, schedule) tried by ``benchmarks/bench.py --decode-sweep``; the first is the default.
TUNING_TILES = ((64, 128, "block"), (32, 128, "block"), (64, 256, "block"), (128, 512, "block"), (128, 256, "block"),
                (32, 64, "block"), (32, 128, "vloop"), (64, 256, "vloop"))
SUPPORTED_K = (16, 32, 64, 128, 256)
SUPPORTED_V = (16, 32, 64, 128, 256)
L2NORM_EPS = 1e-6
_DT = ("bfloat16", "float16", "float32")


def default_block_v(V: int) -> int:
    """V-block width (columns of the state slice one block owns). 64 won the H200 sweep (docs/performance-notes)."""
    return min(V, 64)


def _threads(K: int, BV: int) -> int:
    """Threads per block: 64 state elements per thread for K >= 128 (128 threads for a [128, 64] slice, the H200
    sweep's best), 32 below (the layouts the batched reduction is checked with)."""
    return max(32, min(256, K * BV // (64 if K >= 128 else 32)))


def _build(*, H, HV, K, V, BV, dtype, g_dtype, scale, use_h0, store_ht, varlen, l2norm, threads, schedule="block",
           stages=2):
    import tilelang.language as T

    G = HV // H
    NV = V // BV
    # reduce 4 columns per barrier round (the layout gives each thread 4 adjacent columns at these sizes)
    rb = 4 if K >= 64 and threads >= 64 else 1
    vblocks = tuple(range(NV))
    acc = "float32"
    log2e = 1.4426950408889634
    scale = float(scale)

    Tn = T.dynamic("T")
    N = T.dynamic("N")
    # Dense: one sequence per batch row (the batch dim is N). Varlen: B == 1 and N comes from cu_seqlens.
    B = T.dynamic("B") if varlen else N
    NP1 = T.dynamic("NP1")
    # Sequences in the grid: varlen counts them from cu_seqlens (h0/ht, which also carry N, may be absent).
    n_seq = NP1 - 1 if varlen else N

    @T.macro
    def tile(q, k, v, g, b, w, cu, o, n, hv, v0, S, P, red, q_s, k_s, bk_s, gd_s, z_s, nrm, nrm2, sq, sk):
        """Walk the tokens of sequence n for the state slice S = state[n, hv, :, v0:v0+BV] (in place)."""
        hq = hv // G
        if varlen:
            bos = T.cast(cu[n], "int64")
            eos = T.cast(cu[n + 1], "int64")
            bb = 0
        else:
            bos = T.int64(0)
            eos = T.cast(Tn, "int64")
            bb = n
        for t in T.serial(eos - bos):
            tt = bos + t
            for i in T.Parallel(K):
                q_s[i] = T.cast(q[bb, tt, hq, i], acc)
                k_s[i] = T.cast(k[bb, tt, hq, i], acc)
                gd_s[i] = T.exp2(T.cast(g[bb, tt, hv, i], acc) * log2e)
                bk_s[i] = T.cast(b[bb, tt, hv, i], acc)
            for j in T.Parallel(BV):
                z_s[j] = T.cast(w[bb, tt, hv, v0 + j], acc) * T.cast(v[bb, tt, hv, v0 + j], acc)
            if l2norm:
                for i in T.Parallel(K):
                    sq[i] = q_s[i] * q_s[i]
                    sk[i] = k_s[i] * k_s[i]
                T.reduce_sum(sq, nrm, dim=0)
                T.reduce_sum(sk, nrm2, dim=0)
                for i in T.Parallel(K):
                    q_s[i] = q_s[i] * T.rsqrt(nrm[0] + L2NORM_EPS)
                    k_s[i] = k_s[i] * T.rsqrt(nrm2[0] + L2NORM_EPS)
            for i, j in T.Parallel(K, BV):
                S[i, j] = S[i, j] * gd_s[i]
                P[i, j] = S[i, j] * (bk_s[i] * k_s[i])
            T.reduce_sum(P, red, dim=0, batch=rb)
            for j in T.Parallel(BV):
                red[j] = z_s[j] - red[j]
            for i, j in T.Parallel(K, BV):
                S[i, j] = S[i, j] + k_s[i] * red[j]
                P[i, j] = S[i, j] * q_s[i]
            T.reduce_sum(P, red, dim=0, batch=rb)
            for j in T.Parallel(BV):
                o[bb, tt, hv, v0 + j] = T.cast(red[j] * scale, dtype)

    @T.macro
    def body_block(q, k, v, g, b, w, h0, cu, o, ht):
        # one block per (sequence, value head, V-block)
        with T.Kernel(n_seq * HV, NV, threads=threads) as (bnh, bv):
            n = bnh // HV
            hv = bnh % HV
            v0 = bv * BV
            S = T.alloc_fragment((K, BV), acc)
            P = T.alloc_fragment((K, BV), acc)
            red = T.alloc_fragment((BV,), acc)
            q_s = T.alloc_shared((K,), acc)
            k_s = T.alloc_shared((K,), acc)
            bk_s = T.alloc_shared((K,), acc)
            gd_s = T.alloc_shared((K,), acc)
            z_s = T.alloc_shared((BV,), acc)
            nrm = T.alloc_fragment((1,), acc)
            nrm2 = T.alloc_fragment((1,), acc)
            sq = T.alloc_fragment((K,), acc)
            sk = T.alloc_fragment((K,), acc)
            if use_h0:
                for i, j in T.Parallel(K, BV):
                    S[i, j] = h0[n, hv, i, v0 + j]
            else:
                T.clear(S)
            tile(q, k, v, g, b, w, cu, o, n, hv, v0, S, P, red, q_s, k_s, bk_s, gd_s, z_s, nrm, nrm2, sq, sk)
            if store_ht:
                for i, j in T.Parallel(K, BV):
                    ht[n, hv, i, v0 + j] = S[i, j]

    @T.macro
    def body_vloop(q, k, v, g, b, w, h0, cu, o, ht):
        # One block per (sequence, value head) walking its V-blocks (unrolled): the state slice of V-block j+1 is
        # loaded into a second register tile while V-block j is computed and stored (register double buffering).
        with T.Kernel(n_seq * HV, threads=threads) as bnh:
            n = bnh // HV
            hv = bnh % HV
            Sa = T.alloc_fragment((K, BV), acc)
            Sb = T.alloc_fragment((K, BV), acc)
            P = T.alloc_fragment((K, BV), acc)
            red = T.alloc_fragment((BV,), acc)
            q_s = T.alloc_shared((K,), acc)
            k_s = T.alloc_shared((K,), acc)
            bk_s = T.alloc_shared((K,), acc)
            gd_s = T.alloc_shared((K,), acc)
            z_s = T.alloc_shared((BV,), acc)
            nrm = T.alloc_fragment((1,), acc)
            nrm2 = T.alloc_fragment((1,), acc)
            sq = T.alloc_fragment((K,), acc)
            sk = T.alloc_fragment((K,), acc)
            for i, j in T.Parallel(K, BV):
                Sa[i, j] = h0[n, hv, i, j]
            tiles = [Sa, Sb]
            for jv in vblocks:  # a Python tuple: unrolled at build time
                cur = tiles[jv % 2]
                nxt = tiles[(jv + 1) % 2]
                if jv + 1 < NV:
                    for i, j in T.Parallel(K, BV):
                        nxt[i, j] = h0[n, hv, i, (jv + 1) * BV + j]
                tile(q, k, v, g, b, w, cu, o, n, hv, jv * BV, cur, P, red, q_s, k_s, bk_s, gd_s, z_s, nrm, nrm2,
                     sq, sk)
                if store_ht:
                    for i, j in T.Parallel(K, BV):
                        ht[n, hv, i, jv * BV + j] = cur[i, j]

    body = body_vloop if (schedule == "vloop" and use_h0 and NV > 1) else body_block

    # Build the exact parameter list (only the buffers this variant uses), in the pipeline's arg order.
    sig = {
        "q": T.Tensor((B, Tn, H, K), dtype), "k": T.Tensor((B, Tn, H, K), dtype),
        "v": T.Tensor((B, Tn, HV, V), dtype), "g": T.Tensor((B, Tn, HV, K), g_dtype),
        "b": T.Tensor((B, Tn, HV, K), dtype), "w": T.Tensor((B, Tn, HV, V), dtype),
        "h0": T.Tensor((N, HV, K, V), "float32"), "cu_seqlens": T.Tensor((NP1,), "int32"),
        "o": T.Tensor((B, Tn, HV, V), dtype), "ht": T.Tensor((N, HV, K, V), "float32"),
    }
    return sig, body


def _prim(**kw):
    """The T.prim_func for one variant (parameters: q,k,v,g,b,w[,h0][,cu_seqlens],o[,ht])."""
    import tilelang.language as T

    sig, body = _build(**kw)
    q, k, v, g, b, w, h0, cu, o, ht = (sig[x] for x in ("q", "k", "v", "g", "b", "w", "h0", "cu_seqlens", "o", "ht"))

    @T.prim_func
    def main(q_: q, k_: k, v_: v, g_: g, b_: b, w_: w, h0_: h0, cu_seqlens_: cu, o_: o, ht_: ht):
        body(q_, k_, v_, g_, b_, w_, h0_, cu_seqlens_, o_, ht_)

    keep = ["q_", "k_", "v_", "g_", "b_", "w_"] + (["h0_"] if kw["use_h0"] else []) + (
        ["cu_seqlens_"] if kw["varlen"] else []) + ["o_"] + (["ht_"] if kw["store_ht"] else [])
    return drop_params(main, keep)


def _sizes_fn(varlen: bool):
    def sizes(shapes):
        B, Tn = shapes["q"][0], shapes["q"][1]
        N = shapes["cu_seqlens"][0] - 1 if varlen else B
        return {"B": int(B), "T": int(Tn), "N": int(N)}

    return sizes


def fused_recurrent_fwd_pipeline(*, H: int, HV: int, K: int, V: int, dtype: str, g_dtype: str, scale: float,
                                 use_initial_state: bool, output_final_state: bool, varlen: bool,
                                 use_qk_l2norm: bool, inplace_state: bool = False, block_v: int | None = None,
                                 threads: int | None = None, schedule: str = "block") -> Pipeline:
    """Pipeline of the fused recurrent forward: one launch.

    Inputs ``q,k [B,T,H,K]``, ``v,w [B,T,HV,V]``, ``g,b [B,T,HV,K]`` (+ ``h0 [N,HV,K,V]`` fp32 when
    ``use_initial_state``, + ``cu_seqlens [N+1]`` int32 when ``varlen``). Outputs ``o [B,T,HV,V]`` (dtype) and,
    with ``output_final_state``, ``ht [N,HV,K,V]`` fp32. ``inplace_state`` declares ``ht`` as an alias of ``h0``
    (the runner may pass the same buffer for both: serving decode). ``block_v`` / ``threads`` override the
    tile (V columns per block, threads per block) and ``schedule`` the grid for tuning: ``"block"`` (one block per
    V-block) or ``"vloop"`` (one block per head walking its V-blocks, prefetching the next state slice).
    """
    if dtype not in _DT or g_dtype not in _DT:
        raise ValueError(f"fused_recurrent_fwd_pipeline: unsupported dtype {dtype!r} / g_dtype {g_dtype!r}")
    if H < 1 or HV % H != 0:
        raise ValueError(f"fused_recurrent_fwd_pipeline: HV={HV} must be a positive multiple of H={H}")
    if K not in SUPPORTED_K or V not in SUPPORTED_V:
        raise ValueError(f"fused_recurrent_fwd_pipeline: K={K} must be in {SUPPORTED_K} and V={V} in {SUPPORTED_V}")
    if inplace_state and not (use_initial_state and output_final_state):
        raise ValueError("fused_recurrent_fwd_pipeline: inplace_state needs use_initial_state and output_final_state")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"fused_recurrent_fwd_pipeline: scale must be finite, got {scale}")
    BV = default_block_v(V) if block_v is None else int(block_v)
    if V % BV:
        raise ValueError(f"fused_recurrent_fwd_pipeline: block_v={BV} must divide V={V}")
    threads = _threads(K, BV) if threads is None else int(threads)
    inputs = ("q", "k", "v", "g", "b", "w") + (("h0",) if use_initial_state else ()) + (
        ("cu_seqlens",) if varlen else ())
    outputs = (Buf("o", ("B", "T", HV, V), dtype),) + (
        (Buf("ht", ("N", HV, K, V), "float32"),) if output_final_state else ())
    if schedule not in ("block", "vloop"):
        raise ValueError(f"fused_recurrent_fwd_pipeline: schedule must be 'block' or 'vloop', got {schedule!r}")
    kw = dict(H=H, HV=HV, K=K, V=V, BV=BV, dtype=dtype, g_dtype=g_dtype, scale=scale, use_h0=use_initial_state,
              store_ht=output_final_state, varlen=varlen, l2norm=use_qk_l2norm, threads=threads)
    if schedule != "block":  # keeps the keys (and compiled kernels) of the default schedule unchanged
        kw["schedule"] = schedule
    launch = Launch(
        name="gdn2_recurrent_fwd",
        key=("gdn2_recurrent_fwd", 1) + tuple(sorted(kw.items())),
        build=lambda: _prim(**kw),
        args=inputs + tuple(o.name for o in outputs),
    )
    return Pipeline(inputs=inputs, scratch=(), outputs=outputs, launches=(launch,), sizes=_sizes_fn(varlen),
                    aliases={"ht": "h0"} if inplace_state else {})

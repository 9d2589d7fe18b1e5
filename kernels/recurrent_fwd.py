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
reads its slice before writing it), and a state pool (continuous batching / speculative decoding, FLA's
``ssm_state_indices`` / ``num_accepted_tokens``). Tuning knobs: ``block_v``, ``threads``.
Never imports jax.
"""

# No ``from __future__ import annotations`` here: TileLang's builder evaluates the prim_func's annotations.
from . import registry
from ._common import L2NORM_EPS, LOG2E, drop_params
from ._pipeline import Buf, Launch, Pipeline

__all__ = ["fused_recurrent_fwd_pipeline", "default_block_v", "TUNING_TILES"]

#: (block_v, threads) tried by ``benchmarks/bench.py --decode-sweep``; the first is the default. (A "vloop" schedule,
#: one block per head walking its V-blocks with register double buffering, was measured and removed: it was no
#: faster on the wide tile and slower at small B; docs/performance-notes.md.)
TUNING_TILES = ((64, 128), (32, 128), (64, 256), (128, 512), (128, 256), (32, 64))


def default_block_v(V: int) -> int:
    """V-block width (columns of the state slice one block owns). 64 won the H200 sweep (docs/performance-notes)."""
    return min(V, 64)


def _threads(K: int, BV: int) -> int:
    """Threads per block: 64 state elements per thread for K >= 128 (128 threads for a [128, 64] slice, the H200
    sweep's best), 32 below (the layouts the batched reduction is checked with)."""
    return max(32, min(256, K * BV // (64 if K >= 128 else 32)))


def _build(*, H, HV, K, V, BV, dtype, g_dtype, scale, use_h0, store_ht, varlen, l2norm, threads, pool=None,
           spec=False, poison=False):
    import tilelang.language as T

    G = HV // H
    NV = V // BV
    # reduce 4 columns per barrier round (the layout gives each thread 4 adjacent columns at these sizes)
    rb = 4 if K >= 64 and threads >= 64 else 1
    acc = "float32"
    scale = float(scale)

    Tn = T.dynamic("T")
    N = T.dynamic("N")
    # Dense: one sequence per batch row (the batch dim is N). Varlen: B == 1 and N comes from cu_seqlens.
    B = T.dynamic("B") if varlen else N
    NP1 = T.dynamic("NP1")
    # Sequences in the grid: varlen counts them from cu_seqlens (h0/ht, which also carry N, may be absent).
    n_seq = NP1 - 1 if varlen else N
    # State pool (continuous batching): h0 / ht are one [P, HV, K, V] pool, updated in place; sequence n reads and
    # writes the slots named by state_indices ([NI] per sequence, or [NI, L] per token). A slot outside [0, P)
    # is padding: start from zero, write nothing.
    P_ = T.dynamic("P")
    NI = T.dynamic("NI")
    L = T.dynamic("L")
    SN = P_ if pool else N

    @T.macro
    def store_slot(ht, slot, hv, v0, S, valid):
        # slot: int64; a slot outside [0, P) is padding (nothing written)
        for i, j in T.Parallel(K, BV):
            if slot >= 0 and slot < T.cast(P_, "int64"):
                if poison:
                    ht[slot, hv, i, v0 + j] = S[i, j] * valid[0]
                else:
                    ht[slot, hv, i, v0 + j] = S[i, j]

    @T.macro
    def tile(q, k, v, g, b, w, cu, o, n, hv, v0, S, P, red, q_s, k_s, bk_s, gd_s, z_s, nrm, nrm2, sq, sk, idx=None,
             ht=None, valid=None):
        """Walk the tokens of sequence n for the state slice S = state[n, hv, :, v0:v0+BV] (in place); with a
        per-token pool (``pool="token"``) the state after token t goes to slot ``idx[n, t]`` (t < L)."""
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
                gd_s[i] = T.exp2(T.cast(g[bb, tt, hv, i], acc) * LOG2E)
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
                if poison:  # 1, or NaN for invalid traced arguments (checked by the caller on the device)
                    o[bb, tt, hv, v0 + j] = T.cast(red[j] * scale * valid[0], dtype)
                else:
                    o[bb, tt, hv, v0 + j] = T.cast(red[j] * scale, dtype)
            if pool == "token":
                if t < T.cast(L, "int64"):
                    store_slot(ht, T.cast(idx[n, t], "int64"), hv, v0, S, valid)

    @T.macro
    def body_block(q, k, v, g, b, w, h0, cu, idx, acc_n, valid, o, ht):
        # one block per (sequence, value head, V-block); with a pool, ht is h0 (updated in place)
        with T.Kernel(n_seq * HV, NV, threads=threads) as (bnh, bv):
            n = bnh // HV
            hv = bnh % HV
            v0 = bv * BV
            S, P = (T.alloc_fragment((K, BV), acc) for _ in range(2))
            red = T.alloc_fragment((BV,), acc)
            q_s, k_s, bk_s, gd_s = (T.alloc_shared((K,), acc) for _ in range(4))
            z_s = T.alloc_shared((BV,), acc)
            nrm, nrm2 = (T.alloc_fragment((1,), acc) for _ in range(2))
            sq, sk = (T.alloc_fragment((K,), acc) for _ in range(2))
            if pool:
                # the slot sequence n starts from: idx[n], or idx[n, num_accepted[n] - 1] per token ([1, L])
                if pool == "slot":
                    s0 = T.cast(idx[n], "int64")
                elif spec:
                    s0 = T.cast(idx[n, T.max(T.min(acc_n[n], L), 1) - 1], "int64")
                else:
                    s0 = T.cast(idx[n, 0], "int64")
                inb = s0 >= 0 and s0 < T.cast(P_, "int64")
                sc = T.max(T.min(s0, T.cast(P_, "int64") - 1), T.int64(0))  # clamped: the read stays in bounds
                for i, j in T.Parallel(K, BV):
                    S[i, j] = T.if_then_else(inb, h0[sc, hv, i, v0 + j], 0.0)
            elif use_h0:
                for i, j in T.Parallel(K, BV):
                    S[i, j] = h0[n, hv, i, v0 + j]
            else:
                T.clear(S)
            tile(q, k, v, g, b, w, cu, o, n, hv, v0, S, P, red, q_s, k_s, bk_s, gd_s, z_s, nrm, nrm2, sq, sk,
                 idx=idx, ht=ht, valid=valid)
            if pool == "slot":
                store_slot(ht, s0, hv, v0, S, valid)
            elif store_ht and not pool:
                for i, j in T.Parallel(K, BV):
                    if poison:
                        ht[n, hv, i, v0 + j] = S[i, j] * valid[0]
                    else:
                        ht[n, hv, i, v0 + j] = S[i, j]

    # Build the exact parameter list (only the buffers this variant uses), in the pipeline's arg order.
    sig = {
        "q": T.Tensor((B, Tn, H, K), dtype), "k": T.Tensor((B, Tn, H, K), dtype),
        "v": T.Tensor((B, Tn, HV, V), dtype), "g": T.Tensor((B, Tn, HV, K), g_dtype),
        "b": T.Tensor((B, Tn, HV, K), dtype), "w": T.Tensor((B, Tn, HV, V), dtype),
        "h0": T.Tensor((SN, HV, K, V), "float32"), "cu_seqlens": T.Tensor((NP1,), "int32"),
        "state_indices": T.Tensor((NI, L) if pool == "token" else (NI,), "int32"),
        "num_accepted_tokens": T.Tensor((NI,), "int32"), "valid": T.Tensor((1,), "float32"),
        "o": T.Tensor((B, Tn, HV, V), dtype), "ht": T.Tensor((SN, HV, K, V), "float32"),
    }
    return sig, body_block


def _prim(**kw):
    """The T.prim_func for one variant (parameters: q,k,v,g,b,w[,h0][,cu_seqlens][,state_indices]
    [,num_accepted_tokens],o[,ht])."""
    import tilelang.language as T

    sig, body = _build(**kw)
    q, k, v, g, b, w, h0, cu, idx, acc_n, valid, o, ht = (sig[x] for x in (
        "q", "k", "v", "g", "b", "w", "h0", "cu_seqlens", "state_indices", "num_accepted_tokens", "valid", "o", "ht"))

    @T.prim_func
    def main(q_: q, k_: k, v_: v, g_: g, b_: b, w_: w, h0_: h0, cu_seqlens_: cu, state_indices_: idx,
             num_accepted_tokens_: acc_n, valid_: valid, o_: o, ht_: ht):
        body(q_, k_, v_, g_, b_, w_, h0_, cu_seqlens_, state_indices_, num_accepted_tokens_, valid_, o_, ht_)

    keep = ["q_", "k_", "v_", "g_", "b_", "w_"] + (["h0_"] if kw["use_h0"] else []) + (
        ["cu_seqlens_"] if kw["varlen"] else []) + (["state_indices_"] if kw.get("pool") else []) + (
        ["num_accepted_tokens_"] if kw.get("spec") else []) + (["valid_"] if kw.get("poison") else []) + ["o_"] + (
        ["ht_"] if kw["store_ht"] else [])
    return drop_params(main, keep)


def _sizes_fn(varlen: bool):
    def sizes(shapes):
        B, Tn = shapes["q"][0], shapes["q"][1]
        N = shapes["cu_seqlens"][0] - 1 if varlen else B
        P = shapes["h0"][0] if "h0" in shapes else N
        return {"B": int(B), "T": int(Tn), "N": int(N), "P": int(P)}

    return sizes


def fused_recurrent_fwd_pipeline(*, H: int, HV: int, K: int, V: int, dtype: str, g_dtype: str, scale: float,
                                 use_initial_state: bool, output_final_state: bool, varlen: bool,
                                 use_qk_l2norm: bool, inplace_state: bool = False, block_v: int | None = None,
                                 threads: int | None = None, state_pool: str | None = None,
                                 num_accepted: bool = False, poison: bool = False) -> Pipeline:
    """Pipeline of the fused recurrent forward: one launch.

    Inputs ``q,k [B,T,H,K]``, ``v,w [B,T,HV,V]``, ``g,b [B,T,HV,K]`` (+ ``h0 [N,HV,K,V]`` fp32 when
    ``use_initial_state``, + ``cu_seqlens [N+1]`` int32 when ``varlen``). Outputs ``o [B,T,HV,V]`` (dtype) and,
    with ``output_final_state``, ``ht [N,HV,K,V]`` fp32. ``inplace_state`` declares ``ht`` as an alias of ``h0``
    (the runner may pass the same buffer for both: serving decode). ``block_v`` / ``threads`` override the
    tile (V columns per block, threads per block) for tuning.

    ``state_pool`` (continuous batching, FLA's ``ssm_state_indices``): ``h0`` and ``ht`` are one pool
    ``[P,HV,K,V]`` fp32, updated in place (needs ``inplace_state``), with the input ``state_indices`` int32:
    ``"slot"``: ``[N]``, sequence n starts from slot ``state_indices[n]`` and its final state goes back there;
    ``"token"``: ``[N,L]``, the state after token t of sequence n goes to slot ``state_indices[n,t]`` (t < L) and
    the sequence starts from slot ``state_indices[n,0]``, or with ``num_accepted`` (input ``num_accepted_tokens``
    ``[N]`` int32, FLA's speculative-decoding semantics) from slot ``state_indices[n, num_accepted_tokens[n]-1]``
    (clamped to [1, L]). A slot outside ``[0, P)`` is padding: the sequence starts from zero and writes nothing.

    ``poison`` adds the input ``valid`` ``[1]`` fp32 (1, or NaN when the caller found traced arguments invalid),
    which multiplies every output and stored state: NaN where the answer would be wrong, with no extra pass.
    """
    fn = "fused_recurrent_fwd_pipeline"
    registry.get("fused_recurrent_gdn2").support.check(fn, H=H, HV=HV, K=K, V=V, dtype=dtype, g_dtype=g_dtype,
                                                       scale=scale)
    if inplace_state and not (use_initial_state and output_final_state):
        raise ValueError("fused_recurrent_fwd_pipeline: inplace_state needs use_initial_state and output_final_state")
    if state_pool not in (None, "slot", "token"):
        raise ValueError(f"{fn}: state_pool must be None, 'slot' or 'token', got {state_pool!r}")
    if state_pool and not inplace_state:
        raise ValueError(f"{fn}: state_pool updates the pool in place: it needs inplace_state=True")
    if num_accepted and state_pool != "token":
        raise ValueError(f"{fn}: num_accepted needs state_pool='token'")
    scale = float(scale)
    BV = default_block_v(V) if block_v is None else int(block_v)
    if V % BV:
        raise ValueError(f"fused_recurrent_fwd_pipeline: block_v={BV} must divide V={V}")
    threads = _threads(K, BV) if threads is None else int(threads)
    inputs = ("q", "k", "v", "g", "b", "w") + (("h0",) if use_initial_state else ()) + (
        ("cu_seqlens",) if varlen else ()) + (("state_indices",) if state_pool else ()) + (
        ("num_accepted_tokens",) if num_accepted else ()) + (("valid",) if poison else ())
    outputs = (Buf("o", ("B", "T", HV, V), dtype),) + (
        (Buf("ht", ("P" if state_pool else "N", HV, K, V), "float32"),) if output_final_state else ())
    kw = dict(H=H, HV=HV, K=K, V=V, BV=BV, dtype=dtype, g_dtype=g_dtype, scale=scale, use_h0=use_initial_state,
              store_ht=output_final_state, varlen=varlen, l2norm=use_qk_l2norm, threads=threads)
    if state_pool:
        kw.update(pool=state_pool, spec=bool(num_accepted))
    if poison:
        kw.update(poison=True)
    launch = Launch(
        name="gdn2_recurrent_fwd",
        key=("gdn2_recurrent_fwd", 1) + tuple(sorted(kw.items())),
        build=lambda: _prim(**kw),
        args=inputs + tuple(o.name for o in outputs),
    )
    return Pipeline(inputs=inputs, scratch=(), outputs=outputs, launches=(launch,), sizes=_sizes_fn(varlen),
                    aliases={"ht": "h0"} if inplace_state else {})

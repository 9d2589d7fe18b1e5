"""Chunk backward kernels of GDN-2 (TileLang, framework-neutral: never imports jax). Issue 7, work in progress.

Launch ``gdn2_chunk_dstate`` (FLA ``chunk_gated_delta_rule_bwd_dhu``): the reverse pass of the state gradient.
Per (sequence, value head, V-block of BV columns), chunks from the last to the first, with dS the gradient w.r.t.
the current chunk's end state (``dht`` of the sequence, or 0, before the last chunk)::

    dh[chunk] = dS                                   (end-state gradient of the chunk, fp32 [K, BV])
    dR        = KG dS + Aqk^T dO                     (the gradient w.r.t. R = U - Y S0; FLA ``dv2``, fp32)
    dS       <- Diag(gamC) dS + QG^T dO - Y^T dR     (the start state's gradient; ``dh0`` after the first chunk)

Rows past a sequence's end (the tail of its last chunk, or the next sequence's tokens in packed varlen input) read
as zero dO and get dR = 0. The fp32 dS is the accumulator; its bf16 copy is the operand of the KG dS product (as the
forward's state kernel does with S). Inputs are the forward's scratch (``chunk_fwd.py`` launch 1, token-major:
``Aqk`` (+ its residual ``AqkL``), ``Y``, ``QG`` (+ its residual ``QGL``, option ``qg_split``), ``KG``
``[B, T, HV, .]`` in the input dtype, ``GAM`` fp32 ``[B, NT, HV, K]``) and ``do``
``[B, T, HV, V]``. Outputs: ``dh [B, NT, HV, K, V]`` fp32 (chunk slots as ``GAM``),
``dv [B, T, HV, V]`` fp32 (dR) and ``dh0 [N, HV, K, V]`` fp32.

xla twin: ``gdn2_jax.xla.chunk_delta_h.state_bwd_recurrent`` fed ``chunk_o.o_bwd``'s shares dR_o = Aqk^T dO and
dS0_o = QG^T dO (``tests/test_stages.py::test_gpu_dstate_launch_vs_xla_twin``). ``jax.grad`` through
``backend="tilelang"`` runs it (``gdn2_jax._tilelang._kernel_vjp``, since session 6); the other backward stages are
still jnp (``gdn2_jax.xla.chunk.chunk_backward_from_states``).
"""


from . import registry
from ._common import (AQKL_WIDTH, CHUNK, LOG2E, TF32_DY, drop_params, residual_blocks_macro, rounding_residual,
                      segment_scan_macros, tf32_nearest, tf32_operand)
from ._pipeline import Buf, Launch, Pipeline
from .chunk_fwd import locate_chunk, seq_span, sizes_fn

__all__ = ["chunk_dstate_pipeline", "chunk_bwd_pipeline", "training_forward_options"]

# other kernel sources these kernels inline (``locate_chunk``, ``seq_span``): part of their cache key
SOURCE_DEPENDENCIES = ("chunk_fwd.py",)

_VERSION = 1
#: (intra launch, ``fast_diag``) the largest |G_r - G_a| (base 2) over a 16-row block and its middle row a for
#: which the diagonal block is summed through per-row and per-column factors 2^(G_r - G_a), 2^(G_a - G_s) (all in
#: 2^[-50, 50]: no overflow, no flush to zero for the fp32 gradients), as ``chunk_fwd.DIAG_HALF_RANGE``
BWD_DIAG_RANGE = 50.0


def _dstate_prim(*, HV, K, V, BV, dtype, use_dht, varlen, stages, aqk_split, split_ds=False, split_dr=False,
                 qg_split=False, tf32_dr=False):
    import tilelang.language as T

    C = CHUNK
    threads = 128
    acc = "float32"
    NVB = V // BV
    B = T.dynamic("B")
    Tn = T.dynamic("T")
    NT = T.dynamic("NT")
    NP1 = T.dynamic("NP1")
    N = T.dynamic("N") if varlen else B
    NSEQ = NP1 - 1 if varlen else B
    spread_residual = residual_blocks_macro()
    # one T.Tensor per parameter: parameters annotated with the same object would become one buffer
    tok = lambda D, dt=dtype: T.Tensor((B, Tn, HV, D), dt)  # noqa: E731
    st = lambda: T.Tensor((N, HV, K, V), acc)  # noqa: E731
    sig = dict(Aqk=tok(C), AqkL=tok(AQKL_WIDTH), Y=tok(K), QG=tok(K), KG=tok(K),
               GAM=T.Tensor((B, NT, HV, K), acc), QGL=tok(K), do=tok(V), dht=st(),
               cu_seqlens=T.Tensor((NP1,), "int32"), dh=T.Tensor((B, NT, HV, K, V), acc), dv=tok(V, acc), dh0=st())

    @T.prim_func
    def main(Aqk: sig["Aqk"], AqkL: sig["AqkL"], Y: sig["Y"], QG: sig["QG"], KG: sig["KG"], GAM: sig["GAM"],
             QGL: sig["QGL"], do: sig["do"], dht: sig["dht"], cu_seqlens: sig["cu_seqlens"], dh: sig["dh"],
             dv: sig["dv"],
             dh0: sig["dh0"]):
        with T.Kernel(NSEQ * NVB, HV, threads=threads) as (bx, hv):
            n = bx // NVB
            v0 = (bx % NVB) * BV
            dS = T.alloc_fragment((K, BV), acc)
            Ys, Qs, Ks = (T.alloc_shared((C, K), dtype) for _ in range(3))
            As = T.alloc_shared((C, C), dtype)
            if aqk_split:  # (AqkL's tile, and the residual product's operand it is spread into)
                AsLc = T.alloc_shared((C, AQKL_WIDTH), dtype)
                AsL = T.alloc_shared((C, C), dtype)
            dOs = T.alloc_shared((C, BV), dtype)
            gs = T.alloc_shared((K,), acc)
            Sb = T.alloc_shared((K, BV), dtype)
            dRb = T.alloc_shared((C, BV), dtype)
            dRf = T.alloc_fragment((C, BV), acc)
            if split_ds:  # the bf16 rounding residual of dS: second operand of the KG dS product
                SbL = T.alloc_shared((K, BV), dtype)
            if split_dr:  # the same for dR in the Y^T dR product
                dRbL = T.alloc_shared((C, BV), dtype)
            if qg_split:  # QG's rounding residual (the training forward's QGL)
                QsL = T.alloc_shared((C, K), dtype)

            bb, bos, ln, sbase = seq_span(n, cu_seqlens, Tn, varlen)
            nc = T.ceildiv(ln, C)

            if use_dht:
                for i, j in T.Parallel(K, BV):
                    dS[i, j] = dht[n, hv, i, v0 + j]
            else:
                T.clear(dS)

            for jj in T.Pipelined(nc, num_stages=stages):
                j = nc - 1 - jj
                t0 = bos + j * C
                T.copy(Y[bb, t0:t0 + C, hv, :], Ys)
                T.copy(QG[bb, t0:t0 + C, hv, :], Qs)
                T.copy(KG[bb, t0:t0 + C, hv, :], Ks)
                if qg_split:
                    T.copy(QGL[bb, t0:t0 + C, hv, :], QsL)
                T.copy(Aqk[bb, t0:t0 + C, hv, :], As)
                if aqk_split:
                    T.copy(AqkL[bb, t0:t0 + C, hv, :], AsLc)
                T.copy(GAM[bb, sbase + j, hv, :], gs)
                for r, e in T.Parallel(C, BV):  # rows past the sequence end read as zero
                    dOs[r, e] = T.if_then_else(j * C + r < ln, do[bb, t0 + r, hv, v0 + e], T.cast(0, dtype))
                for i, e in T.Parallel(K, BV):
                    dh[bb, sbase + j, hv, i, v0 + e] = dS[i, e]
                T.copy(dS, Sb)
                if split_ds:
                    for i, e in T.Parallel(K, BV):
                        SbL[i, e] = rounding_residual(dS[i, e], dtype)
                T.gemm(Ks, Sb, dRf, clear_accum=True)            # KG dS
                if split_ds:
                    T.gemm(Ks, SbL, dRf)
                T.gemm(As, dOs, dRf, transpose_A=True)           # + Aqk^T dO
                if aqk_split:
                    spread_residual(AsL, AsLc, jj == 0)
                    T.gemm(AsL, dOs, dRf, transpose_A=True)
                for r, e in T.Parallel(C, BV):
                    if j * C + r < ln:
                        # (rounded as the WY launch reads it with tf32_dr; this pass uses the fp32 value)
                        dv[bb, t0 + r, hv, v0 + e] = tf32_nearest(dRf[r, e]) if tf32_dr else dRf[r, e]
                for r, e in T.Parallel(C, BV):  # -dR (masked) as the operand of the Y^T product
                    dRb[r, e] = T.if_then_else(j * C + r < ln, T.cast(-dRf[r, e], dtype), T.cast(0, dtype))
                if split_dr:
                    for r, e in T.Parallel(C, BV):
                        dRbL[r, e] = T.if_then_else(j * C + r < ln, rounding_residual(-dRf[r, e], dtype),
                                                    T.cast(0, dtype))
                for i, e in T.Parallel(K, BV):
                    dS[i, e] = dS[i, e] * gs[i]
                T.gemm(Qs, dOs, dS, transpose_A=True)            # + QG^T dO
                if qg_split:
                    T.gemm(QsL, dOs, dS, transpose_A=True)
                T.gemm(Ys, dRb, dS, transpose_A=True)            # - Y^T dR
                if split_dr:
                    T.gemm(Ys, dRbL, dS, transpose_A=True)

            for i, e in T.Parallel(K, BV):
                dh0[n, hv, i, v0 + e] = dS[i, e]

    keep = {"Aqk", "Y", "QG", "KG", "GAM", "do", "dh", "dv", "dh0"} | ({"AqkL"} if aqk_split else set())
    keep |= {"QGL"} if qg_split else set()
    keep |= {"dht"} if use_dht else set()
    keep |= {"cu_seqlens"} if varlen else set()
    return drop_params(main, keep)



# ----------------------------------------------------------------------------------------------------------------
# chunk-parallel backward: the WY/state part (gdn2_chunk_bwd_wy) and the intra-chunk part (gdn2_chunk_bwd_intra)
# ----------------------------------------------------------------------------------------------------------------
def _local_signature(*, H, HV, K, V, dtype, g_dtype, cast_dvw=False):
    """Buffer types of the two chunk-parallel backward launches (one ``T.Tensor`` per parameter): the fp32
    gradients and partials, and ``dqo, dko, dbo, dgo``, the intra launch's final gradients in their inputs'
    dtypes (option ``cast_grads``). ``cast_dvw``: dv, dw in the input dtype."""
    import tilelang.language as T

    C = CHUNK
    acc = "float32"
    B, Tn, NT, NP1 = (T.dynamic(n) for n in ("B", "T", "NT", "NP1"))
    tok = lambda D, dt=acc, Hh=HV: T.Tensor((B, Tn, Hh, D), dt)  # noqa: E731
    sig = dict(q=tok(K, dtype, H), k=tok(K, dtype, H), v=tok(V, dtype), g=tok(K, g_dtype), b=tok(K, dtype),
               w=tok(V, dtype), Akk=tok(C), h=T.Tensor((B, NT, HV, K, V), acc), v_new=tok(V),
               dh=T.Tensor((B, NT, HV, K, V), acc), dv_new=tok(V), do=tok(V, dtype),
               cu_seqlens=T.Tensor((NP1,), "int32"), dq=tok(K), dk=tok(K), db=tok(K), dg=tok(K), dAqk=tok(C),
               dT=tok(C), dgc=T.Tensor((B, NT, HV, K), acc), dv=tok(V, dtype if cast_dvw else acc),
               dw=tok(V, dtype if cast_dvw else acc), dqo=tok(K, dtype), dko=tok(K, dtype), dbo=tok(K, dtype),
               dgo=tok(K, g_dtype))
    return sig, (B, Tn, NT, NP1)


def _wy_bwd_prim(*, H, HV, K, V, BV, dtype, g_dtype, scale, varlen, stages=1, threads=256, tf32_round=False,
                 cast_dvw=False):
    """Launch ``gdn2_chunk_bwd_wy`` (one block of ``threads`` per chunk slot and value head; xla twin: the
    output-stage shares ``chunk_o.o_bwd_local``, ``chunk_delta_h.state_bwd_parallel``, ``wy_fast.wy_bwd`` and
    ``chunk_intra.solve_bwd``). Walks V in blocks of BV for the products over V (fp32 operands, TF32 tensor cores,
    fp32 accumulators)::

        dQG = dO S0^T,  dY = -dR S0^T,  dKG = R dS^T,  dAqk = tril(dO R^T),  dA = dR Z^T,  dZ = A^T dR
        dv = dZ * w,  dw = dZ * v                        (final, per V-block)
        dG_C = gamC * rowsum(dS * S0)

    then over K: ``dEbar = A^T dY``, ``dA += dY Ebar^T`` and ``dT = -tril(A^T dA A^T, -1)``, and the partial
    gradients ``dq = scale gam dQG``, ``dk = gam b dEbar + tail dKG``, ``db = gam k dEbar`` and
    ``dG = Ebar dEbar + QG dQG - k tail dKG`` (w.r.t. the cumulative decay G; the chunk's last-row terms
    ``dG_C + sum_r k tail dKG`` go to ``dgc`` per chunk slot). Writes dq, dk, db, dg (partials), dAqk, dT, dgc, dv, dw,
    all fp32, rows of the chunk's sequence only. S0 = ``h``, dS = ``dh`` (end-state gradient), R = ``v_new``,
    dR = ``dv_new``; A = ``Akk`` (forward, fp32). q and k as the forward's kernels read them (normalised when
    the op normalises: the caller passes them so).

    ``stages = 1``: each V-block's tiles are loaded (masked, converted) straight into shared memory, then used.
    ``stages = 2``: ``T.Pipelined`` over the V-blocks: the next block's tiles (h, dh, v_new, dv_new as fp32, do, w,
    v in the input dtype) are copied asynchronously while the current block's products run; a pass over shared
    memory forms dO and Z = w v in fp32 with the rows past the chunk's valid ones as zero. The R and dR tiles are
    used as copied: their rows past the valid ones (the next sequence's tokens in packed input, zeros past T) only
    reach rows and columns of dY, dKG, dAq and dA that are masked or multiplied by zero rows of A^T (A is
    lower-triangular within the chunk's valid rows).
    ``tf32_round``: TF32 operands rounded to nearest in shared memory instead of truncated by the tensor core.
    True (``stages = 1`` only): every operand (``_common.tf32_operand``). ``"dy_min"``: the operands of db's own
    chain, dY = -dR S0^T and dEbar = A^T dY: S0, dR and A as their producers store them (the training forward's
    ``h`` and ``Akk`` with ``tf32_states``, the state pass's dR with ``tf32_dr``), and dY rounded here.
    ``"dy"``: also those behind dT (Z, Ebar, dA, A^T dA), rounded here. R and dS (dKG, dAqk) stay truncated; dO
    in a 16-bit dtype is a TF32 value already. The launch's own rounding is ``_common.tf32_nearest`` (plain
    arithmetic: the loops keep their vector shared-memory stores; session 18's integer form in these loops cost
    ~4% of a training step). The fp32 rowsum dG_C reads the rounded S0.
    ``cast_dvw`` (option ``cast_grads``): dv and dw are stored in the input dtype, rounded to nearest from the same
    fp32 values (bit-identical to casting the fp32 outputs afterwards).
    """
    import tilelang.language as T

    C = CHUNK
    TH = int(threads)
    acc = "float32"
    grp = HV // H
    scale = float(scale)
    if not (isinstance(tf32_round, bool) or tf32_round in TF32_DY):
        raise ValueError(f"_wy_bwd_prim: tf32_round={tf32_round!r} must be False, True, 'dy' or 'dy_min'")
    if tf32_round is True and stages > 1:
        raise ValueError("_wy_bwd_prim: tf32_round=True needs stages=1 (the rounded copies of all four tiles "
                         "would not fit in shared memory)")
    dy = tf32_round in TF32_DY
    # True rounds every operand as loaded or formed (integer form); "dy" / "dy_min" read S0, dR and A as their
    # producers store them (rounded), and leave dO alone (a 16-bit value is a TF32 value: bf16 8, fp16 11
    # significant bits)
    rn_all = lambda x: tf32_operand(x, tf32_round is True)  # noqa: E731
    # the operands the launch forms: dY for both "dy" forms; Z, Ebar, dA, A^T dA (behind dT) for "dy" only
    rn_dy = tf32_nearest if dy else rn_all
    rn_dt = tf32_nearest if tf32_round == "dy" else rn_all
    sig, (B, Tn, NT, NP1) = _local_signature(H=H, HV=HV, K=K, V=V, dtype=dtype, g_dtype=g_dtype, cast_dvw=cast_dvw)
    out = (lambda x: T.cast(x, dtype)) if cast_dvw else (lambda x: x)  # noqa: E731

    @T.prim_func
    def main(q: sig["q"], k: sig["k"], v: sig["v"], g: sig["g"], b: sig["b"], w: sig["w"], Akk: sig["Akk"],
             h: sig["h"], v_new: sig["v_new"], dh: sig["dh"], dv_new: sig["dv_new"], do: sig["do"],
             cu_seqlens: sig["cu_seqlens"], dq: sig["dq"], dk: sig["dk"], db: sig["db"], dg: sig["dg"],
             dAqk: sig["dAqk"], dT: sig["dT"], dgc: sig["dgc"], dv: sig["dv"], dw: sig["dw"]):
        with T.Kernel(NT * B, HV, threads=TH) as (bx, hv):
            tx = T.get_thread_binding()
            hq = hv // grp
            Gs = T.alloc_shared((C, K), acc)          # within-chunk cumulative decay, base 2
            AT = T.alloc_shared((C, C), acc)          # A^T
            if stages > 1:  # the V-block's tiles as copied (h, dh, v_new, dv_new fp32; dO, w, v in the input dtype)
                S0c, dSc = (T.alloc_shared((K, BV), acc) for _ in range(2))
                Rc, dRc = (T.alloc_shared((C, BV), acc) for _ in range(2))
                dOb, wb, vb_ = (T.alloc_shared((C, BV), dtype) for _ in range(3))
            if stages == 1:
                S0s, dSs = (T.alloc_shared((K, BV), acc) for _ in range(2))
                Rs, dRs = (T.alloc_shared((C, BV), acc) for _ in range(2))
            else:  # the products read the copies
                S0s, dSs, Rs, dRs = S0c, dSc, Rc, dRc
            dOs, Zs = (T.alloc_shared((C, BV), acc) for _ in range(2))
            dYs, Ebs = (T.alloc_shared((C, K), acc) for _ in range(2))
            dAs, F1s = (T.alloc_shared((C, C), acc) for _ in range(2))
            gC = T.alloc_shared((K,), acc)
            dQG, dY, dKG, dEb = (T.alloc_fragment((C, K), acc) for _ in range(4))
            dAq, dA, F = (T.alloc_fragment((C, C), acc) for _ in range(3))
            dZ = T.alloc_fragment((C, BV), acc)
            csum = T.alloc_var(acc)
            loc = T.alloc_local((4,), "int32")
            t0a = T.alloc_local((1,), "int64")
            locate_chunk(bx, cu_seqlens, Tn, NT, NP1, loc, t0a, varlen)
            bb, slot, valid, t0 = loc[1], loc[2], loc[3], t0a[0]

            if valid > 0:
                for r, d in T.Parallel(C, K):
                    Gs[r, d] = T.if_then_else(r < valid, T.cast(g[bb, t0 + r, hv, d], acc), 0.0) * LOG2E
                for r, c in T.Parallel(C, C):
                    AT[c, r] = rn_all(T.if_then_else(r < valid, Akk[bb, t0 + r, hv, c], 0.0))
                if tx < K:
                    csum = 0.0
                    for r in T.serial(C):
                        csum = csum + Gs[r, tx]
                        Gs[r, tx] = csum
                    gC[tx] = 0.0
                T.clear(dQG)
                T.clear(dY)
                T.clear(dKG)
                T.clear(dAq)
                T.clear(dA)
                for vb in (T.Pipelined(V // BV, num_stages=stages) if stages > 1 else T.serial(V // BV)):
                    if stages > 1:
                        T.copy(h[bb, slot, hv, :, vb * BV:(vb + 1) * BV], S0c)
                        T.copy(dh[bb, slot, hv, :, vb * BV:(vb + 1) * BV], dSc)
                        T.copy(v_new[bb, t0:t0 + C, hv, vb * BV:(vb + 1) * BV], Rc)
                        T.copy(dv_new[bb, t0:t0 + C, hv, vb * BV:(vb + 1) * BV], dRc)
                        T.copy(do[bb, t0:t0 + C, hv, vb * BV:(vb + 1) * BV], dOb)
                        T.copy(w[bb, t0:t0 + C, hv, vb * BV:(vb + 1) * BV], wb)
                        T.copy(v[bb, t0:t0 + C, hv, vb * BV:(vb + 1) * BV], vb_)
                        for r, e in T.Parallel(C, BV):
                            dOs[r, e] = rn_all(T.if_then_else(r < valid, T.cast(dOb[r, e], acc), 0.0))
                            Zs[r, e] = rn_dt(T.if_then_else(r < valid, T.cast(wb[r, e], acc) * T.cast(vb_[r, e], acc),
                                                         0.0))
                    else:
                        for i, e in T.Parallel(K, BV):
                            S0s[i, e] = rn_all(h[bb, slot, hv, i, vb * BV + e])
                            dSs[i, e] = rn_all(dh[bb, slot, hv, i, vb * BV + e])
                        for r, e in T.Parallel(C, BV):
                            Rs[r, e] = rn_all(T.if_then_else(r < valid, v_new[bb, t0 + r, hv, vb * BV + e], 0.0))
                            dRs[r, e] = rn_all(T.if_then_else(r < valid, dv_new[bb, t0 + r, hv, vb * BV + e], 0.0))
                            dOs[r, e] = rn_all(T.if_then_else(r < valid, T.cast(do[bb, t0 + r, hv, vb * BV + e], acc),
                                                          0.0))
                            Zs[r, e] = rn_dt(T.if_then_else(r < valid, T.cast(w[bb, t0 + r, hv, vb * BV + e], acc)
                                                         * T.cast(v[bb, t0 + r, hv, vb * BV + e], acc), 0.0))
                    T.gemm(dOs, S0s, dQG, transpose_B=True)      # dO S0^T
                    T.gemm(dRs, S0s, dY, transpose_B=True)       # dR S0^T (= -dY)
                    T.gemm(Rs, dSs, dKG, transpose_B=True)       # R dS^T
                    T.gemm(dOs, Rs, dAq, transpose_B=True)       # dO R^T
                    T.gemm(dRs, Zs, dA, transpose_B=True)        # dR Z^T
                    T.gemm(AT, dRs, dZ, clear_accum=True)        # A^T dR
                    for r, e in T.Parallel(C, BV):  # w, v: the pipeline's copies, else from global memory
                        if r < valid:
                            dv[bb, t0 + r, hv, vb * BV + e] = out(dZ[r, e] * T.cast(
                                wb[r, e] if stages > 1 else w[bb, t0 + r, hv, vb * BV + e], acc))
                            dw[bb, t0 + r, hv, vb * BV + e] = out(dZ[r, e] * T.cast(
                                vb_[r, e] if stages > 1 else v[bb, t0 + r, hv, vb * BV + e], acc))
                    if tx < K:  # sum_e dS * S0 of row tx (columns visited in a rotated order: no bank conflicts)
                        csum = 0.0
                        for e in T.serial(BV):
                            csum = csum + dSs[tx, (e + tx) % BV] * S0s[tx, (e + tx) % BV]
                        gC[tx] = gC[tx] + csum
                for r, d in T.Parallel(C, K):
                    Ebs[r, d] = rn_dt(T.if_then_else(r < valid, T.exp2(Gs[r, d]) * T.cast(b[bb, t0 + r, hv, d], acc)
                                                  * T.cast(k[bb, t0 + r, hq, d], acc), 0.0))
                    dYs[r, d] = rn_dy(-dY[r, d])
                T.gemm(AT, dYs, dEb, clear_accum=True)          # dEbar = A^T dY
                T.gemm(dYs, Ebs, dA, transpose_B=True)          # dA += dY Ebar^T
                for r, d in T.Parallel(C, K):
                    if r < valid:
                        dq[bb, t0 + r, hv, d] = scale * T.exp2(Gs[r, d]) * dQG[r, d]
                        dk[bb, t0 + r, hv, d] = (dEb[r, d] * T.exp2(Gs[r, d]) * T.cast(b[bb, t0 + r, hv, d], acc)
                                                 + T.exp2(Gs[C - 1, d] - Gs[r, d]) * dKG[r, d])
                        db[bb, t0 + r, hv, d] = dEb[r, d] * T.exp2(Gs[r, d]) * T.cast(k[bb, t0 + r, hq, d], acc)
                        dg[bb, t0 + r, hv, d] = (Ebs[r, d] * dEb[r, d]
                                                 + scale * T.exp2(Gs[r, d]) * T.cast(q[bb, t0 + r, hq, d], acc)
                                                 * dQG[r, d]
                                                 - T.cast(k[bb, t0 + r, hq, d], acc)
                                                 * T.exp2(Gs[C - 1, d] - Gs[r, d]) * dKG[r, d])
                    # k tail dKG, for the column sums of the last row's term (dY is no longer needed)
                    dYs[r, d] = T.if_then_else(r < valid, T.cast(k[bb, t0 + r, hq, d], acc)
                                               * T.exp2(Gs[C - 1, d] - Gs[r, d]) * dKG[r, d], 0.0)
                if tx < K:
                    csum = 0.0
                    for r in T.serial(C):
                        csum = csum + dYs[r, tx]
                    dgc[bb, slot, hv, tx] = T.exp2(Gs[C - 1, tx]) * gC[tx] + csum
                # dT = -tril(A^T dA A^T, -1);  dAqk = tril(dO R^T)
                for r, c in T.Parallel(C, C):
                    dAs[r, c] = rn_dt(dA[r, c])
                T.gemm(AT, dAs, F, clear_accum=True)            # A^T dA
                for r, c in T.Parallel(C, C):
                    F1s[r, c] = rn_dt(F[r, c])
                T.gemm(F1s, AT, F, clear_accum=True)            # (A^T dA) A^T
                for r, c in T.Parallel(C, C):
                    if r < valid:
                        dT[bb, t0 + r, hv, c] = T.if_then_else(c < r, -F[r, c], 0.0)
                        dAqk[bb, t0 + r, hv, c] = T.if_then_else(c <= r, dAq[r, c], 0.0)

    keep = {"q", "k", "v", "g", "b", "w", "Akk", "h", "v_new", "dh", "dv_new", "do", "dq", "dk", "db", "dg",
            "dAqk", "dT", "dgc", "dv", "dw"} | ({"cu_seqlens"} if varlen else set())
    return drop_params(main, keep)


def _intra_bwd_prim(*, H, HV, K, dtype, g_dtype, scale, varlen, reg_diag=False):
    """Launch ``gdn2_chunk_bwd_intra`` (one block of 256 threads per chunk slot and value head; xla twin:
    ``chunk_intra.intra_bwd`` and ``cumsum.chunk_local_cumsum_bwd``). From ``dAqk`` and ``dT`` of
    ``gdn2_chunk_bwd_wy``, per channel slice of DC = 32 (the products are independent per channel)::

        dq_r += scale sum_s dAqk_rs k_s Gam_rs,   P_r = sum_s dT_rs k_s Gam_rs       (rows)
        CS_s  = sum_r (scale dAqk_rs q_r + dT_rs b_r k_r) Gam_rs                      (columns)
        db += k P,   dk += b P + CS,   dG += q dq_scores + b k P - k CS,   Gam_rs = exp(G_r - G_s)

    The blocks below the diagonal (row sub-chunk i of 16 rows against the columns before it) are TF32 products
    anchored at the sub-chunk's first row n: ``[dAqk; dT]_i (k_s 2^(G_n - G_s))`` for the rows and
    ``[dAqk; dT]_i^T ([scale q; b k]_r 2^(G_r - G_n))`` for the columns (every exponent <= 0); the 16 x 16 diagonal
    blocks are exact fp32 sums. Then the partials of ``gdn2_chunk_bwd_wy`` are added (dq, dk, db updated in
    place), the last-row term ``dgc`` joins the chunk's last row, and dg is the reverse cumsum of dG within the
    chunk (in place in ``dg``).
    """
    import tilelang.language as T

    C, BC = CHUNK, 16
    TH = 256
    acc = "float32"
    grp = HV // H
    DC = 32
    NDC = K // DC
    NSEG = TH // DC
    SEG = C // NSEG
    slice_cumsum = segment_scan_macros(SEG, NSEG, DC)[1]
    RPT = C * DC // TH  # rows per thread of the register-sum diagonal path (8: within one 16-row block)
    scale = float(scale)
    sig, (B, Tn, NT, NP1) = _local_signature(H=H, HV=HV, K=K, V=K, dtype=dtype, g_dtype=g_dtype)

    @T.macro
    def off_diag(i, M, MT, Kf, Xf, kc, qc, bc, Gc, Ro, Co, dqs, Ps, CSs):
        # row sub-chunk i (rows n .. n+15, n = i*BC) against the columns s < n, anchored at row n
        for s_, d in T.Parallel(C, DC):
            Kf[s_, d] = T.if_then_else(s_ < i * BC, kc[s_, d] * T.exp2(T.min(Gc[i * BC, d] - Gc[s_, d], 0.0)),
                                       0.0)
        for r, d in T.Parallel(2 * BC, DC):
            Xf[r, d] = T.if_then_else(r < BC, scale * qc[i * BC + r % BC, d], bc[i * BC + r % BC, d]
                                      * kc[i * BC + r % BC, d]) * T.exp2(
                T.min(Gc[i * BC + r % BC, d] - Gc[i * BC, d], 0.0))
        T.gemm(M, Kf, Ro, clear_accum=True)
        T.gemm(MT, Xf, Co, clear_accum=True)
        for r, d in T.Parallel(2 * BC, DC):
            if r < BC:
                dqs[i * BC + r, d] = dqs[i * BC + r, d] + scale * Ro[r, d] * T.exp2(
                    T.min(Gc[i * BC + r, d] - Gc[i * BC, d], 0.0))
            else:
                Ps[i * BC + r - BC, d] = Ps[i * BC + r - BC, d] + Ro[r, d] * T.exp2(
                    T.min(Gc[i * BC + r - BC, d] - Gc[i * BC, d], 0.0))
        for s_, d in T.Parallel(C, DC):
            if s_ < i * BC:
                CSs[s_, d] = CSs[s_, d] + Co[s_, d] * T.exp2(T.min(Gc[i * BC, d] - Gc[s_, d], 0.0))

    @T.prim_func
    def main(dAqk: sig["dAqk"], dT: sig["dT"], dgc: sig["dgc"], q: sig["q"], k: sig["k"], g: sig["g"],
             b: sig["b"], cu_seqlens: sig["cu_seqlens"], dq: sig["dq"], dk: sig["dk"], db: sig["db"],
             dg: sig["dg"]):
        with T.Kernel(NT * B, HV, threads=TH) as (bx, hv):
            tx = T.get_thread_binding()
            hq = hv // grp
            dAs, dTs = (T.alloc_shared((C, C), acc) for _ in range(2))
            # sub-chunk i's rows of [dAqk; dT] against the columns before it (i = 1..3), and their transposes
            M1, M2, M3 = (T.alloc_shared((2 * BC, C), acc) for _ in range(3))
            MT1, MT2, MT3 = (T.alloc_shared((C, 2 * BC), acc) for _ in range(3))
            Gc, qc, kc, bc = (T.alloc_shared((C, DC), acc) for _ in range(4))
            Kf = T.alloc_shared((C, DC), acc)
            Xf = T.alloc_shared((2 * BC, DC), acc)
            dqs, Ps, CSs = (T.alloc_shared((C, DC), acc) for _ in range(3))
            tot = T.alloc_shared((NSEG, DC), acc)
            Ro = T.alloc_fragment((2 * BC, DC), acc)
            Co = T.alloc_fragment((C, DC), acc)
            csum = T.alloc_var(acc)
            if reg_diag:
                gr, aq, ap, cs = (T.alloc_local((RPT,), acc) for _ in range(4))
                r0 = (tx // DC) * RPT       # the thread's first row (its RPT rows lie in one 16-row block)
                nb = r0 // BC * BC          # that block's first row
            loc = T.alloc_local((4,), "int32")
            t0a = T.alloc_local((1,), "int64")
            locate_chunk(bx, cu_seqlens, Tn, NT, NP1, loc, t0a, varlen)
            bb, slot, valid, t0 = loc[1], loc[2], loc[3], t0a[0]

            if valid > 0:
                for r, c in T.Parallel(C, C):
                    dAs[r, c] = T.if_then_else(r < valid, dAqk[bb, t0 + r, hv, c], 0.0)
                    dTs[r, c] = T.if_then_else(r < valid, dT[bb, t0 + r, hv, c], 0.0)
                for r, c in T.Parallel(2 * BC, C):
                    M1[r, c] = T.if_then_else(c < BC, T.if_then_else(r < BC, dAs[BC + r, c], dTs[r, c]), 0.0)
                    M2[r, c] = T.if_then_else(c < 2 * BC, T.if_then_else(r < BC, dAs[2 * BC + r, c],
                                                                          dTs[BC + r, c]), 0.0)
                    M3[r, c] = T.if_then_else(c < 3 * BC, T.if_then_else(r < BC, dAs[3 * BC + r, c],
                                                                          dTs[2 * BC + r, c]), 0.0)
                for c, r in T.Parallel(C, 2 * BC):
                    MT1[c, r] = M1[r, c]
                    MT2[c, r] = M2[r, c]
                    MT3[c, r] = M3[r, c]
                for dcb in T.serial(NDC):
                    for r, d in T.Parallel(C, DC):
                        Gc[r, d] = T.if_then_else(r < valid, T.cast(g[bb, t0 + r, hv, dcb * DC + d], acc), 0.0) * LOG2E
                        qc[r, d] = T.if_then_else(r < valid, T.cast(q[bb, t0 + r, hq, dcb * DC + d], acc), 0.0)
                        kc[r, d] = T.if_then_else(r < valid, T.cast(k[bb, t0 + r, hq, dcb * DC + d], acc), 0.0)
                        bc[r, d] = T.if_then_else(r < valid, T.cast(b[bb, t0 + r, hv, dcb * DC + d], acc), 0.0)
                    slice_cumsum(Gc, tot, csum, tx)  # (segment prefix, then segment offsets)
                    # the 16 x 16 diagonal blocks, exact: rows (dq, P) and columns (CS)
                    if reg_diag:
                        # thread = (RPT rows inside one block, channel d), sums in registers; one exponent per pair:
                        # x = G_r - G_s, 2^min(x, 0) (rows, s <= r) and 2^min(-x, 0) (columns, s >= r) from
                        # 2^-|x| (the entries above / below the diagonal of dAqk and dT are zero)
                        for i in T.unroll(RPT):
                            gr[i] = Gc[r0 + i, tx % DC]
                            aq[i] = 0.0
                            ap[i] = 0.0
                            cs[i] = 0.0
                        for j in T.serial(BC):
                            gj = Gc[nb + j, tx % DC]
                            kj = kc[nb + j, tx % DC]
                            qj = scale * qc[nb + j, tx % DC]
                            bkj = bc[nb + j, tx % DC] * kj
                            for i in T.unroll(RPT):
                                ex = T.exp2(-T.abs(gr[i] - gj))
                                er = T.if_then_else(gr[i] <= gj, ex, 1.0) * kj
                                aq[i] = aq[i] + dAs[r0 + i, nb + j] * er
                                ap[i] = ap[i] + dTs[r0 + i, nb + j] * er
                                cs[i] = cs[i] + (dAs[nb + j, r0 + i] * qj + dTs[nb + j, r0 + i] * bkj) * T.if_then_else(
                                    gj <= gr[i], ex, 1.0)
                        for i in T.unroll(RPT):
                            dqs[r0 + i, tx % DC] = aq[i] * scale
                            Ps[r0 + i, tx % DC] = ap[i]
                            CSs[r0 + i, tx % DC] = cs[i]
                    else:
                        for r, d in T.Parallel(C, DC):
                            dqs[r, d] = 0.0
                            Ps[r, d] = 0.0
                            CSs[r, d] = 0.0
                            for j in T.serial(BC):
                                dqs[r, d] = dqs[r, d] + dAs[r, (r // BC) * BC + j] * kc[(r // BC) * BC + j, d] * T.exp2(
                                    T.min(Gc[r, d] - Gc[(r // BC) * BC + j, d], 0.0))
                                Ps[r, d] = Ps[r, d] + dTs[r, (r // BC) * BC + j] * kc[(r // BC) * BC + j, d] * T.exp2(
                                    T.min(Gc[r, d] - Gc[(r // BC) * BC + j, d], 0.0))
                                CSs[r, d] = CSs[r, d] + (
                                    scale * dAs[(r // BC) * BC + j, r] * qc[(r // BC) * BC + j, d]
                                    + dTs[(r // BC) * BC + j, r] * bc[(r // BC) * BC + j, d] * kc[(r // BC) * BC + j, d]
                                ) * T.exp2(T.min(Gc[(r // BC) * BC + j, d] - Gc[r, d], 0.0))
                            dqs[r, d] = dqs[r, d] * scale
                    off_diag(1, M1, MT1, Kf, Xf, kc, qc, bc, Gc, Ro, Co, dqs, Ps, CSs)
                    off_diag(2, M2, MT2, Kf, Xf, kc, qc, bc, Gc, Ro, Co, dqs, Ps, CSs)
                    off_diag(3, M3, MT3, Kf, Xf, kc, qc, bc, Gc, Ro, Co, dqs, Ps, CSs)
                    # combine with the WY partials; dG into Kf (free now)
                    for r, d in T.Parallel(C, DC):
                        if r < valid:
                            dq[bb, t0 + r, hv, dcb * DC + d] = dq[bb, t0 + r, hv, dcb * DC + d] + dqs[r, d]
                            dk[bb, t0 + r, hv, dcb * DC + d] = (dk[bb, t0 + r, hv, dcb * DC + d]
                                                                + bc[r, d] * Ps[r, d] + CSs[r, d])
                            db[bb, t0 + r, hv, dcb * DC + d] = db[bb, t0 + r, hv, dcb * DC + d] + kc[r, d] * Ps[r, d]
                        Kf[r, d] = T.if_then_else(
                            r < valid, dg[bb, t0 + r, hv, dcb * DC + d] + qc[r, d] * dqs[r, d]
                            + bc[r, d] * kc[r, d] * Ps[r, d] - kc[r, d] * CSs[r, d]
                            + T.if_then_else(r == valid - 1, dgc[bb, slot, hv, dcb * DC + d], 0.0), 0.0)
                    # dg = reverse cumsum of dG: segment suffix sums, then the later segments' totals
                    csum = 0.0
                    for r in T.serial(SEG):
                        csum = csum + Kf[(tx // DC) * SEG + SEG - 1 - r, tx % DC]
                        Kf[(tx // DC) * SEG + SEG - 1 - r, tx % DC] = csum
                    tot[tx // DC, tx % DC] = csum
                    csum = 0.0
                    for sg in T.serial(NSEG):
                        if sg > tx // DC:
                            csum = csum + tot[sg, tx % DC]
                    for r in T.serial(SEG):
                        if (tx // DC) * SEG + r < valid:
                            dg[bb, t0 + (tx // DC) * SEG + r, hv, dcb * DC + tx % DC] = (
                                Kf[(tx // DC) * SEG + r, tx % DC] + csum)

    keep = {"q", "k", "g", "b", "dAqk", "dT", "dgc", "dq", "dk", "db", "dg"} | ({"cu_seqlens"} if varlen else set())
    return drop_params(main, keep)


def intra_grad_order(cast=()) -> tuple:
    """Parameter order of the intra launch's gradient buffers for option ``cast_grads`` (``cast``: the gradients
    among dq, dk, db, dg stored in their inputs' dtypes): the fp32 partials of the cast ones (read only), their
    final outputs ``dqo, ...`` (new buffers), then the gradients updated in place. ``_pipeline.launch_io`` takes
    every parameter before the first new buffer as read only, so an in-place gradient must come after it (else
    XLA, seeing a read, may schedule its consumers before the launch that updates it)."""
    names = ("dq", "dk", "db", "dg")
    return (tuple(n for n in names if n in cast) + tuple(n + "o" for n in names if n in cast)
            + tuple(n for n in names if n not in cast))


def _intra_bwd_v2_prim(*, H, HV, K, dtype, g_dtype, scale, varlen, tc=False, fast_diag=False, cast=()):
    """Launch ``gdn2_chunk_bwd_intra``, version 2 (the default, option ``intra_v2``): the same sums as
    :func:`_intra_bwd_prim` with one block of 128 threads per chunk slot, value head and channel slice of DC = 32
    (grid ``NT * B * K/32`` by HV, three blocks per SM), every sum in fp32 registers. The chunk's dAqk and dT and
    the slice's G, k, scale q, b k and dg partials come in through shared memory (coalesced, vectorised loads), and
    the four results go out the same way (72.5 KB). Thread (warp w, lane d) owns channel d of the rows
    n = 16 w .. n + 15 and of the same columns:

    - rows, columns s < n (anchored at row n): ``dq_r, P_r += 2^(G_r - G_n) sum_s [dAqk; dT]_rs (k_s 2^(G_n - G_s))``;
    - columns, rows r > m = n + 15 (anchored at row m): ``CS_s += 2^(G_m - G_s) sum_r (dAqk_rs scale q_r
      + dT_rs b_r k_r) 2^(G_r - G_m)``;
    - the 16 x 16 diagonal block: exact pairs, one exponent per pair shared by rows and columns.

    Every exponent is <= 0 (``min(., 0)``). Then the WY partials are added as in :func:`_intra_bwd_prim` and dg is
    the reverse cumsum of dG within the chunk (thread-serial over its 16 rows, then the later warps' totals).

    ``tc`` (option ``intra_tc``): the off-diagonal sums as TF32 tensor-core products (``T.gemm``, ``mma.sync``) with
    the same anchors: for row block i (rows n = 16 i ..), ``[dAqk; dT][rows, :n] @ (k 2^(G_n - G))[:n]``; for
    column block j (anchor m = 16 j + 15), ``dAqk[m+1:, cols]^T @ (scale q 2^(G - G_m))[m+1:] + dT[m+1:, cols]^T @
    (b k 2^(G - G_m))[m+1:]``. The anchored operands are built in shared memory (rows past the chunk's valid ones
    are zero), the products' fragments are scaled to their rows / columns and handed to the owning threads through
    the same shared memory; the diagonal blocks stay exact fp32 pairs. ``fast_diag`` (option ``intra_fast_diag``):
    when every channel's decay in every 16-row block stays within ``BWD_DIAG_RANGE`` of the block's middle row a and
    does not increase (block-uniform, ``__syncthreads_or``), the diagonal block is summed through the factors
    2^(G_r - G_a) and 2^(G_a - G_s) (32 exponents per thread instead of 136); otherwise exactly.

    ``cast`` (option ``cast_grads``): the gradients among ``dq, dk, db, dg`` whose final values are stored in their
    inputs' dtypes (q, k, b: ``dtype``; g: ``g_dtype``), rounded to nearest from the same fp32 sums (bit-identical
    to casting fp32 outputs afterwards), into the separate outputs ``dqo, dko, dbo, dgo``; the others are
    updated in place in fp32.

    Every global load and store is masked by the chunk's valid rows in the kernel itself, so the launch is compiled
    with TileLang's bounds checks off (``tl.disable_safe_memory_legalize``; checked on the generated CUDA by
    ``tests/test_tilelang_cpu.py::test_backward_intra_masks_every_global_access_itself``).
    """
    import tilelang.language as T

    C, BC, DC, SR = CHUNK, 16, 32, 4   # SR: columns per step of the row part
    NW = C // BC
    TH = NW * DC
    NSUM = NW * (NW - 1) // 2          # (tc) 16-row blocks of the anchored operands: 1 + 2 + 3
    KO = [BC * i * (i - 1) // 2 for i in range(NW)]             # KA rows of row block i (i = 1..3)
    QO = [BC * (NSUM - (NW - j) * (NW - 1 - j) // 2) for j in range(NW - 1)]  # QA / BA rows of column block j
    NDC = K // DC
    acc = "float32"
    grp = HV // H
    scale = float(scale)
    sig, (B, Tn, NT, NP1) = _local_signature(H=H, HV=HV, K=K, V=K, dtype=dtype, g_dtype=g_dtype)
    if set(cast) - {"dq", "dk", "db", "dg"}:
        raise ValueError(f"_intra_bwd_v2_prim: cast={cast!r} must name some of dq, dk, db, dg")
    cq, ck, cb, cg = (n in cast for n in ("dq", "dk", "db", "dg"))

    @T.macro
    def diag_exact(n0, ln, gr, kr, aq, ap, cs, a16, t16, kt, dAs, dTs, qs, bks):
        # the diagonal block, one exponent per pair
        for i in T.unroll(BC):
            for j in T.vectorized(BC):
                a16[j] = dAs[n0 + i, n0 + j]
            for j in T.vectorized(BC):
                t16[j] = dTs[n0 + i, n0 + j]
            kt[1] = qs[n0 + i, ln]
            kt[2] = bks[n0 + i, ln]
            for j in T.unroll(BC):
                if j <= i:
                    kt[0] = T.exp2(T.min(gr[i] - gr[j], 0.0))
                    aq[i] = aq[i] + a16[j] * kr[j] * kt[0]
                    ap[i] = ap[i] + t16[j] * kr[j] * kt[0]
                    cs[j] = cs[j] + (a16[j] * kt[1] + t16[j] * kt[2]) * kt[0]

    @T.macro
    def off_diagonal_simt(w, n0, ln, gr, aq, ap, cs, a4, t4, a16, t16, kt, dAs, dTs, Gs, ks, qs, bks):
        # rows against the columns s < n0, anchored at row n0 (SR columns per step)
        for s4 in T.serial(w * (BC // SR)):
            for u in T.unroll(SR):
                a4[u] = ks[s4 * SR + u, ln] * T.exp2(T.min(gr[0] - Gs[s4 * SR + u, ln], 0.0))
            for i in T.unroll(BC):
                for u in T.vectorized(SR):
                    t4[u] = dAs[n0 + i, s4 * SR + u]
                for u in T.unroll(SR):
                    aq[i] = aq[i] + t4[u] * a4[u]
                for u in T.vectorized(SR):
                    t4[u] = dTs[n0 + i, s4 * SR + u]
                for u in T.unroll(SR):
                    ap[i] = ap[i] + t4[u] * a4[u]
        for i in T.unroll(BC):
            aq[i] = aq[i] * T.exp2(T.min(gr[i] - gr[0], 0.0))
            ap[i] = ap[i] * T.exp2(T.min(gr[i] - gr[0], 0.0))
        # columns against the rows r > n0 + 15, anchored at row n0 + 15
        for r_ in T.serial((NW - 1 - w) * BC):
            for j in T.vectorized(BC):
                a16[j] = dAs[n0 + BC + r_, n0 + j]
            for j in T.vectorized(BC):
                t16[j] = dTs[n0 + BC + r_, n0 + j]
            kt[0] = T.exp2(T.min(Gs[n0 + BC + r_, ln] - gr[BC - 1], 0.0))
            kt[1] = qs[n0 + BC + r_, ln] * kt[0]
            kt[2] = bks[n0 + BC + r_, ln] * kt[0]
            for j in T.unroll(BC):
                cs[j] = cs[j] + a16[j] * kt[1] + t16[j] * kt[2]
        for j in T.unroll(BC):
            cs[j] = cs[j] * T.exp2(T.min(gr[BC - 1] - gr[j], 0.0))
    # (tc) the three row blocks' and column blocks' pieces; ib, jb are Python ints
    @T.macro
    def fill_row(ib, KA, Gs, ks):
        for s_, d in T.Parallel(ib * BC, DC):
            KA[KO[ib] + s_, d] = ks[s_, d] * T.exp2(T.min(Gs[ib * BC, d] - Gs[s_, d], 0.0))

    @T.macro
    def fill_col(jb, QA, BA, Gs, qs, bks):
        for r_, d in T.Parallel(C - (jb + 1) * BC, DC):
            QA[QO[jb] + r_, d] = qs[(jb + 1) * BC + r_, d] * T.exp2(
                T.min(Gs[(jb + 1) * BC + r_, d] - Gs[jb * BC + BC - 1, d], 0.0))
            BA[QO[jb] + r_, d] = bks[(jb + 1) * BC + r_, d] * T.exp2(
                T.min(Gs[(jb + 1) * BC + r_, d] - Gs[jb * BC + BC - 1, d], 0.0))

    @T.macro
    def gemm_row(ib, Fq_, Fp_, KA, dAs, dTs):
        T.gemm(dAs[ib * BC:ib * BC + BC, 0:ib * BC], KA[KO[ib]:KO[ib] + ib * BC, 0:DC], Fq_, clear_accum=True)
        T.gemm(dTs[ib * BC:ib * BC + BC, 0:ib * BC], KA[KO[ib]:KO[ib] + ib * BC, 0:DC], Fp_, clear_accum=True)

    @T.macro
    def gemm_col(jb, Fc_, QA, BA, dAs, dTs):
        T.gemm(dAs[(jb + 1) * BC:C, jb * BC:jb * BC + BC], QA[QO[jb]:QO[jb] + C - (jb + 1) * BC, 0:DC], Fc_,
               transpose_A=True, clear_accum=True)
        T.gemm(dTs[(jb + 1) * BC:C, jb * BC:jb * BC + BC], BA[QO[jb]:QO[jb] + C - (jb + 1) * BC, 0:DC], Fc_,
               transpose_A=True)

    @T.macro
    def store_row(ib, Fq_, Fp_, KA, Gs):
        for r_, d in T.Parallel(BC, DC):
            KA[(ib - 1) * BC + r_, d] = Fq_[r_, d] * T.exp2(T.min(Gs[ib * BC + r_, d] - Gs[ib * BC, d], 0.0))
            KA[(NW - 2 + ib) * BC + r_, d] = Fp_[r_, d] * T.exp2(T.min(Gs[ib * BC + r_, d] - Gs[ib * BC, d], 0.0))

    @T.macro
    def store_col(jb, Fc_, QA, Gs):
        for s_, d in T.Parallel(BC, DC):
            QA[jb * BC + s_, d] = Fc_[s_, d] * T.exp2(T.min(Gs[jb * BC + BC - 1, d] - Gs[jb * BC + s_, d], 0.0))

    @T.macro
    def off_diagonal_tc(KA, QA, BA, Fq0, Fq1, Fq2, Fp0, Fp1, Fp2, Fc0, Fc1, Fc2, dAs, dTs, Gs, ks, qs, bks):
        fill_row(1, KA, Gs, ks)
        fill_row(2, KA, Gs, ks)
        fill_row(3, KA, Gs, ks)
        fill_col(0, QA, BA, Gs, qs, bks)
        fill_col(1, QA, BA, Gs, qs, bks)
        fill_col(2, QA, BA, Gs, qs, bks)
        gemm_row(1, Fq0, Fp0, KA, dAs, dTs)
        gemm_row(2, Fq1, Fp1, KA, dAs, dTs)
        gemm_row(3, Fq2, Fp2, KA, dAs, dTs)
        gemm_col(0, Fc0, QA, BA, dAs, dTs)
        gemm_col(1, Fc1, QA, BA, dAs, dTs)
        gemm_col(2, Fc2, QA, BA, dAs, dTs)
        store_row(1, Fq0, Fp0, KA, Gs)
        store_row(2, Fq1, Fp1, KA, Gs)
        store_row(3, Fq2, Fp2, KA, Gs)
        store_col(0, Fc0, QA, Gs)
        store_col(1, Fc1, QA, Gs)
        store_col(2, Fc2, QA, Gs)

    @T.prim_func
    def main(dAqk: sig["dAqk"], dT: sig["dT"], dgc: sig["dgc"], q: sig["q"], k: sig["k"], g: sig["g"],
             b: sig["b"], cu_seqlens: sig["cu_seqlens"], dq: sig["dq"], dk: sig["dk"], db: sig["db"],
             dg: sig["dg"], dqo: sig["dqo"], dko: sig["dko"], dbo: sig["dbo"], dgo: sig["dgo"]):
        with T.Kernel(NT * B * NDC, HV, threads=TH) as (bx, hv):
            T.annotate_min_blocks_per_sm(2 if tc else 3)
            tx = T.get_thread_binding()
            hq = hv // grp
            c0 = (bx % NDC) * DC
            ln = tx % DC                       # the thread's channel (c0 + ln)
            w = tx // DC
            n0 = w * BC                        # the thread's first row
            dAs, dTs = (T.alloc_shared((C, C), acc) for _ in range(2))
            Gs, ks, qs, bks, dgs = (T.alloc_shared((C, DC), acc) for _ in range(5))
            Oq, Op, Oc, Og = (T.alloc_shared((C, DC), acc) for _ in range(4))
            tot, tot2 = (T.alloc_shared((NW, DC), acc) for _ in range(2))
            if tc:
                # anchored operands: KA row block i at rows KO[i] (i rows blocks of k), QA / BA column block j at
                # rows QO[j] (3 - j blocks of scale q / b k); after the products KA holds the row results (dq, P:
                # row blocks 1..3) and QA the column results (column blocks 0..2)
                KA, QA, BA = (T.alloc_shared((NSUM * BC, DC), acc) for _ in range(3))
                Fq, Fp, Fc = ([T.alloc_fragment((BC, DC), acc) for _ in range(NW - 1)] for _ in range(3))
            gr, kr, aq, ap, cs = (T.alloc_local((BC,), acc) for _ in range(5))
            kt = T.alloc_local((3,), acc)
            a4, t4 = (T.alloc_local((SR,), acc) for _ in range(2))
            a16, t16 = (T.alloc_local((BC,), acc) for _ in range(2))
            csum = T.alloc_var(acc)
            if fast_diag:
                fast = T.alloc_var("int32")
                ie, kre, cd = (T.alloc_local((BC,), acc) for _ in range(3))
                sa, sp, ga = (T.alloc_var(acc) for _ in range(3))
            loc = T.alloc_local((4,), "int32")
            t0a = T.alloc_local((1,), "int64")
            locate_chunk(bx // NDC, cu_seqlens, Tn, NT, NP1, loc, t0a, varlen)
            bb, slot, valid, t0 = loc[1], loc[2], loc[3], t0a[0]

            if valid > 0:
                for r, c in T.Parallel(C, C):
                    dAs[r, c] = T.if_then_else(r < valid, dAqk[bb, t0 + r, hv, c], 0.0)
                    dTs[r, c] = T.if_then_else(r < valid, dT[bb, t0 + r, hv, c], 0.0)
                # the slice: k, scale q, b k, the WY launch's dg partials and the decay (base 2), rows past the
                # chunk's valid ones as zero
                for r, d in T.Parallel(C, DC):
                    Gs[r, d] = T.if_then_else(r < valid, T.cast(g[bb, t0 + r, hv, c0 + d], acc), 0.0) * LOG2E
                    ks[r, d] = T.if_then_else(r < valid, T.cast(k[bb, t0 + r, hq, c0 + d], acc), 0.0)
                    qs[r, d] = T.if_then_else(r < valid, T.cast(q[bb, t0 + r, hq, c0 + d], acc), 0.0) * scale
                    bks[r, d] = T.if_then_else(r < valid, T.cast(b[bb, t0 + r, hv, c0 + d], acc)
                                               * T.cast(k[bb, t0 + r, hq, c0 + d], acc), 0.0)
                    dgs[r, d] = T.if_then_else(r < valid, dg[bb, t0 + r, hv, c0 + d], 0.0)
                # within-chunk cumulative decay: the thread's 16 rows, then the earlier warps' totals
                csum = 0.0
                for i in T.unroll(BC):
                    kr[i] = ks[n0 + i, ln]
                    csum = csum + Gs[n0 + i, ln]
                    gr[i] = csum
                tot[w, ln] = csum
                T.sync_threads()
                csum = 0.0
                for w2 in T.serial(NW - 1):
                    if w2 < w:
                        csum = csum + tot[w2, ln]
                for i in T.unroll(BC):
                    gr[i] = gr[i] + csum
                    Gs[n0 + i, ln] = gr[i]
                    aq[i] = 0.0
                    ap[i] = 0.0
                    cs[i] = 0.0
                T.sync_threads()
                if tc:
                    off_diagonal_tc(KA, QA, BA, Fq[0], Fq[1], Fq[2], Fp[0], Fp[1], Fp[2], Fc[0], Fc[1], Fc[2], dAs, dTs,
                                    Gs, ks, qs, bks)
                    for i in T.unroll(BC):
                        aq[i] = T.if_then_else(w > 0, KA[T.max(w - 1, 0) * BC + i, ln], 0.0)
                        ap[i] = T.if_then_else(w > 0, KA[(NW - 1 + T.max(w - 1, 0)) * BC + i, ln], 0.0)
                        cs[i] = T.if_then_else(w < NW - 1, QA[T.min(w, NW - 2) * BC + i, ln], 0.0)
                else:
                    off_diagonal_simt(w, n0, ln, gr, aq, ap, cs, a4, t4, a16, t16, kt, dAs, dTs, Gs, ks, qs, bks)
                # the diagonal block (dAqk and dT vanish above the diagonal: pairs j <= i only)
                if fast_diag:
                    # anchored at the block's middle row when every channel's decay stays within BWD_DIAG_RANGE of it
                    # and does not increase (block-uniform): two exponents per row and column instead of one per pair
                    csum = 0.0
                    for i in T.unroll(BC):
                        csum = T.max(csum, T.abs(gr[i] - gr[BC // 2]))
                        if i > 0:
                            csum = T.max(csum, T.if_then_else(gr[i] > gr[i - 1], 2.0 * BWD_DIAG_RANGE, 0.0))
                    fast = 1 - T.syncthreads_or(T.if_then_else(csum > BWD_DIAG_RANGE, 1, 0))
                    if fast > 0:
                        ga = gr[BC // 2]
                        for j in T.unroll(BC):
                            ie[j] = T.exp2(ga - gr[j])
                            kre[j] = kr[j] * ie[j]
                            cd[j] = 0.0
                        for i in T.unroll(BC):
                            for j in T.vectorized(BC):
                                a16[j] = dAs[n0 + i, n0 + j]
                            for j in T.vectorized(BC):
                                t16[j] = dTs[n0 + i, n0 + j]
                            kt[0] = T.exp2(gr[i] - ga)
                            kt[1] = qs[n0 + i, ln] * kt[0]
                            kt[2] = bks[n0 + i, ln] * kt[0]
                            sa = 0.0
                            sp = 0.0
                            for j in T.unroll(BC):
                                if j <= i:
                                    sa = sa + a16[j] * kre[j]
                                    sp = sp + t16[j] * kre[j]
                                    cd[j] = cd[j] + a16[j] * kt[1] + t16[j] * kt[2]
                            aq[i] = aq[i] + kt[0] * sa
                            ap[i] = ap[i] + kt[0] * sp
                        for j in T.unroll(BC):
                            cs[j] = cs[j] + ie[j] * cd[j]
                    else:
                        diag_exact(n0, ln, gr, kr, aq, ap, cs, a16, t16, kt, dAs, dTs, qs, bks)
                else:
                    diag_exact(n0, ln, gr, kr, aq, ap, cs, a16, t16, kt, dAs, dTs, qs, bks)
                # combine with the WY partials: dG into gr, rows past the chunk's valid ones as zero
                for i in T.unroll(BC):
                    gr[i] = T.if_then_else(
                        n0 + i < valid, dgs[n0 + i, ln] + qs[n0 + i, ln] * aq[i] + bks[n0 + i, ln] * ap[i]
                        - kr[i] * cs[i] + T.if_then_else(n0 + i == valid - 1, dgc[bb, slot, hv, c0 + ln], 0.0), 0.0)
                # dg = reverse cumsum of dG: the thread's rows, then the later warps' totals
                csum = 0.0
                for i in T.unroll(BC):
                    csum = csum + gr[BC - 1 - i]
                    gr[BC - 1 - i] = csum
                tot2[w, ln] = csum
                T.sync_threads()
                csum = 0.0
                for w2 in T.serial(NW):
                    if w2 > w:
                        csum = csum + tot2[w2, ln]
                for i in T.unroll(BC):
                    Oq[n0 + i, ln] = scale * aq[i]
                    Op[n0 + i, ln] = ap[i]
                    Oc[n0 + i, ln] = cs[i]
                    Og[n0 + i, ln] = gr[i] + csum
                for r, d in T.Parallel(C, DC):
                    if r < valid:
                        if cq:
                            dqo[bb, t0 + r, hv, c0 + d] = T.cast(dq[bb, t0 + r, hv, c0 + d] + Oq[r, d], dtype)
                        else:
                            dq[bb, t0 + r, hv, c0 + d] = dq[bb, t0 + r, hv, c0 + d] + Oq[r, d]
                        if ck:
                            dko[bb, t0 + r, hv, c0 + d] = T.cast(
                                dk[bb, t0 + r, hv, c0 + d] + T.cast(b[bb, t0 + r, hv, c0 + d], acc) * Op[r, d]
                                + Oc[r, d], dtype)
                        else:
                            dk[bb, t0 + r, hv, c0 + d] = (dk[bb, t0 + r, hv, c0 + d]
                                                          + T.cast(b[bb, t0 + r, hv, c0 + d], acc) * Op[r, d]
                                                          + Oc[r, d])
                        if cb:
                            dbo[bb, t0 + r, hv, c0 + d] = T.cast(
                                db[bb, t0 + r, hv, c0 + d] + ks[r, d] * Op[r, d], dtype)
                        else:
                            db[bb, t0 + r, hv, c0 + d] = db[bb, t0 + r, hv, c0 + d] + ks[r, d] * Op[r, d]
                        if cg:
                            dgo[bb, t0 + r, hv, c0 + d] = T.cast(Og[r, d], g_dtype)
                        else:
                            dg[bb, t0 + r, hv, c0 + d] = Og[r, d]

    keep = ({"q", "k", "g", "b", "dAqk", "dT", "dgc", "dq", "dk", "db", "dg"} | ({"cu_seqlens"} if varlen else set())
            | {n + "o" for n in cast})
    return drop_params(main, keep, order=intra_grad_order(cast))


def chunk_dstate_pipeline(*, HV: int, K: int, V: int, dtype: str, use_dht: bool, varlen: bool,
                          aqk_split: bool = True, block_v: int | None = None, stages: int = 2,
                          split_ds: bool = False, split_dr: bool = False, qg_split: bool = False,
                          tf32_dr: bool = False, dv_name: str = "dv") -> Pipeline:
    """Pipeline of the reverse state-gradient pass (one launch, see the module docstring).

    Inputs: the forward's scratch ``Aqk`` (and ``AqkL [B, T, HV, 16]`` when ``aqk_split``, as
    ``chunk_fwd_pipeline`` stores them), ``Y``, ``QG``, ``KG`` ``[B, T, HV, .]`` (``dtype``: bfloat16 | float16),
    ``GAM [B, NT, HV, K]`` fp32, ``do [B, T, HV, V]`` (``dtype``), ``dht [N, HV, K, V]`` fp32 when ``use_dht``,
    ``cu_seqlens [N+1]`` int32 when ``varlen`` (then B == 1). Outputs ``dh [B, NT, HV, K, V]``,
    ``dv [B, T, HV, V]``, ``dh0 [N, HV, K, V]``, all fp32. K, V in {64, 128}; ``block_v`` (default 16 for HV < 32,
    else 32, as the forward's state kernel) divides V.
    The options are off here (:func:`chunk_bwd_pipeline` takes its defaults from ``kernels.defaults.BACKWARD``):
    ``split_ds``: dS enters the KG dS product in the input dtype plus its rounding residual (two products), so
    that dR carries no rounding of dS; ``split_dr``: the same for dR in the Y^T dR product; ``qg_split``: an
    input ``QGL`` (after ``GAM``; the training forward's rounding residual of QG, ``chunk_fwd_pipeline``'s
    ``qg_split``) makes QG^T dO two products, so that dS and dh0 carry no rounding of QG, the largest rounding
    point of this pass (``docs/performance-notes.md``, session 16); ``tf32_dr``: dR is stored rounded to nearest
    TF32 (``_common.tf32_nearest``; the WY launch's ``tf32_round="dy"`` / ``"dy_min"`` reads it as a TF32 operand;
    the pass itself uses the fp32 value).
    ``dv_name`` names the dR output (``chunk_bwd_pipeline`` calls it ``dv_new``, as FLA's gradient of ``v_new``).
    Raises ``ValueError`` for unsupported configurations.
    """
    fn = "chunk_dstate_pipeline"
    registry.get("chunk_gdn2").support.check(fn, H=HV, HV=HV, K=K, V=V, dtype=dtype, g_dtype="float32",
                                             scale=K ** -0.5)
    BV = min(V, 16 if HV < 32 else 32) if block_v is None else int(block_v)
    if BV not in (16, 32, 64, 128) or V % BV != 0:
        raise ValueError(f"{fn}: block_v={BV} must be 16, 32, 64 or 128 and divide V={V}")
    inputs = (("Aqk",) + (("AqkL",) if aqk_split else ()) + ("Y", "QG", "KG", "GAM")
              + (("QGL",) if qg_split else ()) + ("do",)
              + (("dht",) if use_dht else ()) + (("cu_seqlens",) if varlen else ()))
    outputs = (Buf("dh", ("B", "NT", HV, K, V), "float32"), Buf(dv_name, ("B", "T", HV, V), "float32"),
               Buf("dh0", ("N", HV, K, V), "float32"))
    kw = dict(HV=HV, K=K, V=V, BV=BV, dtype=dtype, use_dht=bool(use_dht), varlen=bool(varlen), stages=int(stages),
              aqk_split=bool(aqk_split))
    kw.update({n: True for n, on in (("split_ds", split_ds), ("split_dr", split_dr), ("qg_split", qg_split),
                                     ("tf32_dr", tf32_dr)) if on})  # (in the key only when on)
    launch = Launch(name="gdn2_chunk_dstate", key=("gdn2_chunk_dstate", _VERSION) + tuple(sorted(kw.items())),
                    build=lambda: _dstate_prim(**kw), args=inputs + tuple(b.name for b in outputs))
    return Pipeline(inputs=inputs, scratch=(), outputs=outputs, launches=(launch,), sizes=sizes_fn(varlen, "do"))


def training_forward_options(bwd: Pipeline) -> dict:
    """The options of ``chunk_fwd_pipeline(save_states=True)`` that the backward pipeline ``bwd`` (of
    :func:`chunk_bwd_pipeline`) expects from the training forward: ``qg_split`` (QG's residual ``QGL`` is among
    its inputs) and ``tf32_states`` (its WY launch's ``wy_tf32_round="dy"`` / ``"dy_min"`` reads S0 and A as
    stored: ``h`` and ``Akk`` stored rounded). Without them the backward still runs (``KeyError`` for a missing
    QGL; truncated S0 and A otherwise)."""
    wy = [la for la in bwd.launches if la.name == "gdn2_chunk_bwd_wy"]
    return dict(qg_split="QGL" in bwd.inputs,
                tf32_states=bool(wy) and dict(wy[0].key[3:]).get("tf32_round", False) in TF32_DY)


def chunk_bwd_pipeline(*, H: int, HV: int, K: int, V: int, dtype: str, g_dtype: str, scale: float,
                       use_initial_state: bool, output_final_state: bool, varlen: bool, use_qk_l2norm: bool,
                       aqk_split: bool = True, split_ds: bool | None = None, split_dr: bool | None = None,
                       qg_split: bool | None = None, block_v: int | None = None,
                       stages: int = 2, local_bwd: bool = True, reg_diag: bool = False, intra_v2: bool | None = None,
                       intra_tc: bool | None = None, intra_fast_diag: bool | None = None, wy_load: str | None = None, wy_threads: int | None = None,
                       wy_tf32_round: bool | None = None, cast_grads: bool | None = None,
                       **_forward_options) -> Pipeline:
    """The backward kernels of ``chunk_gdn2`` for the forward configuration ``registry.config(...)`` (the same
    keyword arguments as ``chunk_fwd_pipeline``; ``block_v`` and ``stages`` apply to both state passes, the
    forward's other tuning options are ignored; ``use_qk_l2norm`` does not change the kernels: the caller passes
    the normalised q, k and applies the norm's backward).

    Launches: the reverse state pass (``gdn2_chunk_dstate``, with the final state's cotangent ``dht`` as an input
    when the forward outputs ``ht``), then the chunk-parallel ``gdn2_chunk_bwd_wy`` and ``gdn2_chunk_bwd_intra``
    (module docstring). Inputs: the forward's scratch (``Aqk`` (+ ``AqkL``), ``Y``, ``QG`` (+ ``QGL``), ``KG``,
    ``GAM``, ``Akk``) and states (``h``, ``v_new``), ``do``, ``dht``, ``cu_seqlens`` and the op's q, k, v, g, b, w.
    Outputs: ``dh0 [N, HV, K, V]``; ``dq, dk, dg, db [B, T, HV, K]`` (dq, dk per *value* head: the caller
    sums GVA groups) and ``dv, dw [B, T, HV, V]``, fp32 or, with ``cast_grads``, in their inputs' dtypes (below). ``local_bwd=False``: the state pass only (outputs ``dh``,
    ``dv`` = dR and ``dh0``), the rest left to the caller (``gdn2_jax.xla.chunk.chunk_backward_from_states``).

    Options left as None take their value from ``kernels.defaults.BACKWARD`` (``wy_threads`` is 256 and
    ``wy_tf32_round`` False when ``wy_load="tma"`` is given). ``split_ds``, ``split_dr``, ``qg_split``: as in
    :func:`chunk_dstate_pipeline` (``qg_split``: the training forward must store ``QGL``, which
    ``chunk_fwd_pipeline(save_states=True)`` does by default when this default is on).
    Options of the chunk-parallel launches: ``intra_v2``: the intra launch's version 2
    (:func:`_intra_bwd_v2_prim`); False: version 1 (:func:`_intra_bwd_prim`), where ``reg_diag`` (experimental)
    sums its 16 x 16 diagonal blocks in registers. ``intra_tc`` (version 2 only): its off-diagonal 16 x 16 blocks as
    anchored TF32 tensor-core products instead of fp32 register sums. ``intra_fast_diag`` (version 2 only): its
    16 x 16 diagonal blocks through per-row and per-column factors anchored at the block's middle row where the
    decay allows (``BWD_DIAG_RANGE``; exact pairs elsewhere). ``wy_load``: how the WY launch's V-block loop loads its tiles:
    ``"sync"`` (masked loads straight into shared memory, BV = 32), ``"async"`` (a two-stage ``cp.async``
    pipeline) or ``"tma"`` (two stages of TMA copies from a producer warpgroup, warp-specialised).
    ``wy_threads`` (256 or 512): the WY launch's block size (512: the same tiles over 16 warps, half the
    accumulator registers per thread; not with ``"tma"``). ``wy_tf32_round``: the WY launch rounds TF32
    operands to nearest instead of letting the tensor core truncate them: True, all of them (``"sync"`` only: the
    pipelines' rounded copies would not fit in shared memory); ``"dy_min"`` (``"sync"`` or ``"async"``), those
    of db's chain (dY = -dR S0^T, dEbar = A^T dY; S0, dR and A stored rounded by the state pass and the
    training forward, which :func:`training_forward_options` asks for); ``"dy"``, also those behind dT (dA +=
    dY Ebar^T, dT = -tril(A^T dA A^T)); R and dS stay truncated (:func:`_wy_bwd_prim`).
    ``cast_grads``: the launches store the gradients they finish in their inputs' dtypes instead of fp32, rounded
    to nearest from the same fp32 values (bit-identical to ``astype`` on the fp32 outputs, minus that pass over
    memory): dv, dw and db in ``dtype`` always; dg in ``g_dtype`` and dq, dk in ``dtype`` from version 2 of the
    intra launch, dq and dk only when no jnp step follows (HV == H and not ``use_qk_l2norm``: the GVA group sum
    and the norm's backward stay in fp32). The WY launch's partials of the cast gradients become fp32 scratch
    (``dq_wy``, ``dk_wy``, ``db_wy``, ``dg_wy``).
    Raises ``ValueError`` for option combinations that do not exist, non-bool flags and unknown options.
    """
    import inspect

    from .chunk_fwd import chunk_fwd_pipeline
    from .defaults import BACKWARD

    fn = "chunk_bwd_pipeline"
    unknown = sorted(set(_forward_options) - set(inspect.signature(chunk_fwd_pipeline).parameters))
    if unknown:
        raise ValueError(f"{fn}: unknown option(s) {', '.join(unknown)} (neither a backward option nor one of "
                         "chunk_fwd_pipeline's)")
    if wy_load == "tma":  # (the TMA pipeline exists with 256 threads and truncated TF32 operands only)
        wy_threads = 256 if wy_threads is None else wy_threads
        wy_tf32_round = False if wy_tf32_round is None else wy_tf32_round
    given = dict(split_ds=split_ds, split_dr=split_dr, qg_split=qg_split, intra_v2=intra_v2, intra_tc=intra_tc,
                 intra_fast_diag=intra_fast_diag,
                 wy_load=wy_load, wy_threads=wy_threads, wy_tf32_round=wy_tf32_round, cast_grads=cast_grads)
    src = {n: "" if v is not None else " (from kernels.defaults.BACKWARD)" for n, v in given.items()}
    (split_ds, split_dr, qg_split, intra_v2, intra_tc, intra_fast_diag, wy_load, wy_threads, wy_tf32_round,
     cast_grads) = (BACKWARD[n] if v is None else v for n, v in given.items())
    for name, value in (("split_ds", split_ds), ("split_dr", split_dr), ("qg_split", qg_split),
                        ("intra_v2", intra_v2), ("intra_tc", intra_tc),
                        ("intra_fast_diag", intra_fast_diag), ("cast_grads", cast_grads)):
        if not isinstance(value, bool):
            raise ValueError(f"{fn}: {name}={value!r}{src[name]} must be True or False")
    if reg_diag and intra_v2:
        raise ValueError(f"{fn}: reg_diag=True needs intra_v2=False (it is an option of version 1){src['intra_v2']}")
    for name, value in (("intra_tc", intra_tc), ("intra_fast_diag", intra_fast_diag)):
        if value and not intra_v2:
            raise ValueError(f"{fn}: {name}=True{src[name]} needs intra_v2=True (it is an option of version 2)"
                             f"{src['intra_v2']}")
    if wy_load not in ("sync", "async", "tma"):
        raise ValueError(f"{fn}: wy_load={wy_load!r}{src['wy_load']} must be 'sync', 'async' or 'tma'")
    if wy_threads not in (256, 512):
        raise ValueError(f"{fn}: wy_threads={wy_threads!r}{src['wy_threads']} must be 256 or 512")
    if not (isinstance(wy_tf32_round, bool) or wy_tf32_round in TF32_DY):
        raise ValueError(f"{fn}: wy_tf32_round={wy_tf32_round!r}{src['wy_tf32_round']} must be False, True, 'dy' "
                         "or 'dy_min'")
    if wy_tf32_round is True and wy_load != "sync":
        raise ValueError(f"{fn}: wy_tf32_round=True needs wy_load='sync', got {wy_load!r}{src['wy_load']} (the "
                         "pipelines' rounded copies of all four tiles would not fit in shared memory; 'dy' does)")
    if wy_tf32_round in TF32_DY and wy_load == "tma":
        raise ValueError(f"{fn}: wy_tf32_round={wy_tf32_round!r}{src['wy_tf32_round']} needs wy_load='sync' or "
                         f"'async', got 'tma'{src['wy_load']}")
    if wy_threads == 512 and wy_load == "tma":
        raise ValueError(f"{fn}: wy_threads=512{src['wy_threads']} needs wy_load='sync' or 'async' (with 'tma' "
                         "the kernel would not fit in shared memory and registers)")
    kw = dict(HV=HV, K=K, V=V, dtype=dtype, use_dht=output_final_state, varlen=varlen, aqk_split=aqk_split,
              split_ds=split_ds, split_dr=split_dr, qg_split=qg_split, block_v=block_v, stages=stages)
    if not local_bwd:
        return chunk_dstate_pipeline(**kw)
    state = chunk_dstate_pipeline(**kw, dv_name="dv_new", tf32_dr=wy_tf32_round in TF32_DY)
    cu = ("cu_seqlens",) if varlen else ()
    kl = dict(H=H, HV=HV, K=K, dtype=dtype, g_dtype=g_dtype, scale=float(scale), varlen=bool(varlen))
    # V-block: 32, or 16 for the 256-thread pipelines (TMA: two stages of 32 would not fit in shared memory;
    # cp.async: chosen with TMA's tile, BV = 32 there not tried)
    kw_wy = dict(kl, V=V, BV=32 if wy_load == "sync" or wy_threads == 512 else 16,
                 stages=1 if wy_load == "sync" else 2, threads=int(wy_threads), tf32_round=wy_tf32_round)
    # cast_grads: which gradients leave the kernels in their inputs' dtypes (name -> dtype), the rest fp32
    cast = {}
    if cast_grads:
        kw_wy["cast_dvw"] = True
        cast = dict(dv=dtype, dw=dtype)
        if intra_v2:
            kl["cast"] = tuple(n for n, ok in (("dq", HV == H and not use_qk_l2norm),
                                               ("dk", HV == H and not use_qk_l2norm),
                                               ("db", True), ("dg", g_dtype != "float32")) if ok)
            cast.update({n: g_dtype if n == "dg" else dtype for n in kl["cast"]})
    part = {n: n + "_wy" if n in cast else n for n in ("dq", "dk", "db", "dg")}  # the WY launch's partials
    # the cp.async pipeline: TileLang's default on Hopper (TMA copies, warp specialisation) switched off
    wy_pc = (("tl.disable_tma_lower", True), ("tl.disable_warp_specialized", True)) if wy_load == "async" else ()
    if reg_diag:
        kl["reg_diag"] = True
    if intra_tc:
        kl["tc"] = True
    if intra_fast_diag:
        kl["fast_diag"] = True
    wy = Launch(name="gdn2_chunk_bwd_wy",
                key=("gdn2_chunk_bwd_wy", _VERSION, wy_load) + tuple(sorted(kw_wy.items())),
                build=lambda: _wy_bwd_prim(**kw_wy), pass_configs=wy_pc,
                args=("q", "k", "v", "g", "b", "w", "Akk", "h", "v_new", "dh", "dv_new", "do") + cu
                + tuple(part.values()) + ("dAqk", "dT", "dgc", "dv", "dw"))
    intra_prim = _intra_bwd_v2_prim if intra_v2 else _intra_bwd_prim
    bufs = dict(part, **{n + "o": n for n in kl.get("cast", ())})  # intra launch parameter -> pipeline buffer
    # version 2 masks every global access by the chunk's valid rows itself: TileLang's bounds checks (int64 index
    # arithmetic and compares on each load and store) are switched off
    intra_pc = (("tl.disable_safe_memory_legalize", True),) if intra_v2 else ()
    intra = Launch(name="gdn2_chunk_bwd_intra",
                   key=("gdn2_chunk_bwd_intra", _VERSION, "v2" if intra_v2 else "v1") + tuple(sorted(kl.items())),
                   build=lambda: intra_prim(**kl), pass_configs=intra_pc,
                   args=("dAqk", "dT", "dgc", "q", "k", "g", "b") + cu
                   + tuple(bufs[n] for n in intra_grad_order(kl.get("cast", ()))))
    f32 = "float32"
    tok = lambda n, D: Buf(n, ("B", "T", HV, D), cast.get(n, f32))  # noqa: E731
    inputs = state.inputs + ("q", "k", "v", "g", "b", "w", "Akk", "h", "v_new")
    scratch = (Buf("dh", ("B", "NT", HV, K, V), f32), tok("dv_new", V), tok("dAqk", CHUNK), tok("dT", CHUNK),
               Buf("dgc", ("B", "NT", HV, K), f32)) + tuple(tok(p, K) for n, p in part.items() if p != n)
    outputs = (Buf("dh0", ("N", HV, K, V), f32), tok("dq", K), tok("dk", K), tok("db", K), tok("dg", K),
               tok("dv", V), tok("dw", V))
    return Pipeline(inputs=inputs, scratch=scratch, outputs=outputs, launches=state.launches + (wy, intra),
                    sizes=sizes_fn(varlen, "do"))

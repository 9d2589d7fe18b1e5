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
``Aqk`` (+ its residual ``AqkL``), ``Y``, ``QG``, ``KG`` ``[B, T, HV, .]`` in the input dtype, ``GAM`` fp32
``[B, NT, HV, K]``) and ``do`` ``[B, T, HV, V]``. Outputs: ``dh [B, NT, HV, K, V]`` fp32 (chunk slots as ``GAM``),
``dv [B, T, HV, V]`` fp32 (dR) and ``dh0 [N, HV, K, V]`` fp32.

xla twin: ``gdn2_jax.xla.chunk_delta_h.state_bwd_recurrent`` fed ``chunk_o.o_bwd``'s shares dR_o = Aqk^T dO and
dS0_o = QG^T dO (``tests/test_stages.py::test_gpu_dstate_launch_vs_xla_twin``). ``jax.grad`` through
``backend="tilelang"`` runs it (``gdn2_jax._tilelang._kernel_vjp``, since session 6); the other backward stages are
still jnp (``gdn2_jax.xla.chunk.chunk_backward_from_states``).
"""


from . import registry
from ._common import CHUNK, drop_params
from ._pipeline import Buf, Launch, Pipeline
from .chunk_fwd import seq_span, sizes_fn

__all__ = ["chunk_dstate_pipeline", "chunk_bwd_pipeline"]

_VERSION = 1


def _dstate_prim(*, HV, K, V, BV, dtype, use_dht, varlen, stages, aqk_split, split_ds=False):
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
    # one T.Tensor per parameter: parameters annotated with the same object would become one buffer
    tok = lambda D, dt=dtype: T.Tensor((B, Tn, HV, D), dt)  # noqa: E731
    st = lambda: T.Tensor((N, HV, K, V), acc)  # noqa: E731
    sig = dict(Aqk=tok(C), AqkL=tok(C), Y=tok(K), QG=tok(K), KG=tok(K), GAM=T.Tensor((B, NT, HV, K), acc),
               do=tok(V), dht=st(), cu_seqlens=T.Tensor((NP1,), "int32"), dh=T.Tensor((B, NT, HV, K, V), acc),
               dv=tok(V, acc), dh0=st())

    @T.prim_func
    def main(Aqk: sig["Aqk"], AqkL: sig["AqkL"], Y: sig["Y"], QG: sig["QG"], KG: sig["KG"], GAM: sig["GAM"],
             do: sig["do"], dht: sig["dht"], cu_seqlens: sig["cu_seqlens"], dh: sig["dh"], dv: sig["dv"],
             dh0: sig["dh0"]):
        with T.Kernel(NSEQ * NVB, HV, threads=threads) as (bx, hv):
            n = bx // NVB
            v0 = (bx % NVB) * BV
            dS = T.alloc_fragment((K, BV), acc)
            Ys, Qs, Ks = (T.alloc_shared((C, K), dtype) for _ in range(3))
            As = T.alloc_shared((C, C), dtype)
            if aqk_split:
                AsL = T.alloc_shared((C, C), dtype)
            dOs = T.alloc_shared((C, BV), dtype)
            gs = T.alloc_shared((K,), acc)
            Sb = T.alloc_shared((K, BV), dtype)
            dRb = T.alloc_shared((C, BV), dtype)
            dRf = T.alloc_fragment((C, BV), acc)
            if split_ds:  # the bf16 rounding residuals of dS and dR: second operands of their products
                SbL = T.alloc_shared((K, BV), dtype)
                dRbL = T.alloc_shared((C, BV), dtype)

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
                T.copy(Aqk[bb, t0:t0 + C, hv, :], As)
                if aqk_split:
                    T.copy(AqkL[bb, t0:t0 + C, hv, :], AsL)
                T.copy(GAM[bb, sbase + j, hv, :], gs)
                for r, e in T.Parallel(C, BV):  # rows past the sequence end read as zero
                    dOs[r, e] = T.if_then_else(j * C + r < ln, do[bb, t0 + r, hv, v0 + e], T.cast(0, dtype))
                for i, e in T.Parallel(K, BV):
                    dh[bb, sbase + j, hv, i, v0 + e] = dS[i, e]
                T.copy(dS, Sb)
                if split_ds:
                    for i, e in T.Parallel(K, BV):
                        SbL[i, e] = T.cast(dS[i, e] - T.cast(T.cast(dS[i, e], dtype), acc), dtype)
                T.gemm(Ks, Sb, dRf, clear_accum=True)            # KG dS
                if split_ds:
                    T.gemm(Ks, SbL, dRf)
                T.gemm(As, dOs, dRf, transpose_A=True)           # + Aqk^T dO
                if aqk_split:
                    T.gemm(AsL, dOs, dRf, transpose_A=True)
                for r, e in T.Parallel(C, BV):
                    if j * C + r < ln:
                        dv[bb, t0 + r, hv, v0 + e] = dRf[r, e]
                for r, e in T.Parallel(C, BV):  # -dR (masked) as the operand of the Y^T product
                    dRb[r, e] = T.if_then_else(j * C + r < ln, T.cast(-dRf[r, e], dtype), T.cast(0, dtype))
                if split_ds:
                    for r, e in T.Parallel(C, BV):
                        dRbL[r, e] = T.if_then_else(j * C + r < ln,
                                                    T.cast(-dRf[r, e] - T.cast(T.cast(-dRf[r, e], dtype), acc),
                                                           dtype),
                                                    T.cast(0, dtype))
                for i, e in T.Parallel(K, BV):
                    dS[i, e] = dS[i, e] * gs[i]
                T.gemm(Qs, dOs, dS, transpose_A=True)            # + QG^T dO
                T.gemm(Ys, dRb, dS, transpose_A=True)            # - Y^T dR
                if split_ds:
                    T.gemm(Ys, dRbL, dS, transpose_A=True)

            for i, e in T.Parallel(K, BV):
                dh0[n, hv, i, v0 + e] = dS[i, e]

    keep = {"Aqk", "Y", "QG", "KG", "GAM", "do", "dh", "dv", "dh0"} | ({"AqkL"} if aqk_split else set())
    keep |= {"dht"} if use_dht else set()
    keep |= {"cu_seqlens"} if varlen else set()
    return drop_params(main, keep)


def chunk_dstate_pipeline(*, HV: int, K: int, V: int, dtype: str, use_dht: bool, varlen: bool,
                          aqk_split: bool = True, block_v: int | None = None, stages: int = 2,
                          split_ds: bool = False) -> Pipeline:
    """Pipeline of the reverse state-gradient pass (one launch, see the module docstring).

    Inputs: the forward's scratch ``Aqk`` (and ``AqkL`` when ``aqk_split``, as ``chunk_fwd_pipeline`` stores
    them), ``Y``, ``QG``, ``KG`` ``[B, T, HV, .]`` (``dtype``: bfloat16 | float16), ``GAM [B, NT, HV, K]`` fp32,
    ``do [B, T, HV, V]`` (``dtype``), ``dht [N, HV, K, V]`` fp32 when ``use_dht``, ``cu_seqlens [N+1]`` int32 when
    ``varlen`` (then B == 1). Outputs ``dh [B, NT, HV, K, V]``, ``dv [B, T, HV, V]``, ``dh0 [N, HV, K, V]``, all
    fp32. K, V in {64, 128}; ``block_v`` (default 16 for HV < 32, else 32, as the forward's state kernel) divides V.
    ``split_ds`` (experimental): dS and dR enter their products in the input dtype plus their rounding residuals
    (two products each), so only the forward's scratch carries 16-bit rounding.
    Raises ``ValueError`` for unsupported configurations.
    """
    fn = "chunk_dstate_pipeline"
    registry.get("chunk_gdn2").support.check(fn, H=HV, HV=HV, K=K, V=V, dtype=dtype, g_dtype="float32",
                                             scale=K ** -0.5)
    BV = min(V, 16 if HV < 32 else 32) if block_v is None else int(block_v)
    if BV not in (16, 32, 64, 128) or V % BV != 0:
        raise ValueError(f"{fn}: block_v={BV} must be 16, 32, 64 or 128 and divide V={V}")
    inputs = (("Aqk",) + (("AqkL",) if aqk_split else ()) + ("Y", "QG", "KG", "GAM", "do")
              + (("dht",) if use_dht else ()) + (("cu_seqlens",) if varlen else ()))
    outputs = (Buf("dh", ("B", "NT", HV, K, V), "float32"), Buf("dv", ("B", "T", HV, V), "float32"),
               Buf("dh0", ("N", HV, K, V), "float32"))
    kw = dict(HV=HV, K=K, V=V, BV=BV, dtype=dtype, use_dht=bool(use_dht), varlen=bool(varlen), stages=int(stages),
              aqk_split=bool(aqk_split))
    if split_ds:  # (in the key only when on: the default kernel keeps its key)
        kw.update(split_ds=True)
    launch = Launch(name="gdn2_chunk_dstate", key=("gdn2_chunk_dstate", _VERSION) + tuple(sorted(kw.items())),
                    build=lambda: _dstate_prim(**kw), args=inputs + tuple(b.name for b in outputs))
    return Pipeline(inputs=inputs, scratch=(), outputs=outputs, launches=(launch,), sizes=sizes_fn(varlen, "do"))


def chunk_bwd_pipeline(*, H: int, HV: int, K: int, V: int, dtype: str, g_dtype: str, scale: float,
                       use_initial_state: bool, output_final_state: bool, varlen: bool, use_qk_l2norm: bool,
                       aqk_split: bool = True, split_ds: bool = False, block_v: int | None = None, stages: int = 2,
                       **_forward_options) -> Pipeline:
    """The backward kernels of ``chunk_gdn2`` for the forward configuration ``registry.config(...)`` (the same
    keyword arguments as ``chunk_fwd_pipeline``; ``block_v`` and ``stages`` apply to both state passes, the
    forward's other tuning options are ignored). Today one launch, the
    reverse state pass (:func:`chunk_dstate_pipeline`, with the final state's cotangent ``dht`` as an input when the
    forward outputs ``ht``); the other stages of the backward run in the caller (``gdn2_jax.xla.chunk``)."""
    return chunk_dstate_pipeline(HV=HV, K=K, V=V, dtype=dtype, use_dht=output_final_state, varlen=varlen,
                                 aqk_split=aqk_split, split_ds=split_ds, block_v=block_v, stages=stages)

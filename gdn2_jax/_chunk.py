"""Chunked WY form of GDN-2 in jnp: ``naive_chunk_gdn2`` and the custom_vjp xla backend of ``chunk_gdn2``.

Math (spec §5, paper arXiv:2605.22791 §C / App. A, FLA ``fla/ops/gdn2``), per chunk of C rows with start
state ``S0`` and within-chunk cumulative log-decay ``G_r = Σ_{i≤r} g_i``::

    Γ_rs   = exp(G_r − G_s)            for s ≤ r only (exponent masked BEFORE exp, then multiplied by the mask)
    T_rs   = Σ_d b_rd k_rd k_sd Γ_rsd   (s < r)          Aqk_rs = scale Σ_d q_rd k_sd Γ_rsd   (s ≤ r)
    A      = (I + T)^-1                 (unit lower triangular; block inversion by matmuls, ``_unit_lower_inverse``)
    Y      = A Ē,  Ē_r = exp(G_r)⊙b_r⊙k_r                U = A Z,  Z_r = w_r⊙v_r
    R      = U − Y S0                   (FLA ``v_new``)
    O      = scale (exp(G)⊙Q) S0 + Aqk R
    S_next = Diag(exp G_C) S0 + K_tailᵀ R,  K_tail,r = exp(G_C − G_r)⊙k_r

No factor ``exp(−G)`` is ever formed, so g down to −60 per token (G ≈ −thousands within a chunk) neither
overflows nor produces NaN gradients. The exponents ``G_r − G_s`` (and ``G_C − G_r``) are evaluated as segment
sums ``Σ_{s<i≤r} g_i``, not as differences of cumulative sums: under strong decay the difference form loses
~|G|·eps in the exponent, which measured 1e-5 relative error in float32 (segment sums: ~1e-7, like the token
loop). A partial chunk is zero padded (g = 0, k = 0, b = w = 0), which is exact.

Layout: everything runs on *chunk-major* arrays ``[NC, B, HV, C, D]`` (scan over NC, the B sequences and HV
heads in parallel). Dense input is padded to a multiple of C. Varlen input (``cu_seqlens``, B == 1) is
gathered into chunks aligned to each sequence start, for an upper-bound chunk count computed from static
shapes only, so traced ``cu_seqlens`` work under ``jit``; every chunk carries the index of its sequence and a
"start from ``h0[seq]``" flag, and ``o`` is gathered back token by token.

``chunk_forward_xla`` wraps the chunk scan in a ``jax.custom_vjp`` whose backward is the hand-written
chunk-level VJP of spec §7.2 (a forward state pass recomputes the chunk start states, then a reverse scan
over chunks), so its residuals are the inputs only: O(T/C) states at most, never per-token states.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._validation import Dims, check_inputs, run_poisoned_if_invalid_cu_seqlens

__all__ = ["naive_chunk_gdn2", "chunk_forward_xla", "CHUNK_SIZE"]

CHUNK_SIZE = 64
_HI = lax.Precision.HIGHEST


def _ein(spec, *operands):
    return jnp.einsum(spec, *operands, precision=_HI)


def _masks(C: int):
    r = jnp.arange(C)
    return r[:, None] >= r[None, :], r[:, None] > r[None, :]  # (s ≤ r, s < r)


def _segment_sums(g):
    """D[..., r, s, d] = G_rd − G_sd = Σ_{s<i≤r} g_id for s ≤ r, and exactly 0 for s > r.

    Summed segment by segment (a cumsum over i of g_i·[i > s]) rather than as a difference of two cumulative
    sums: under strong decay G reaches −thousands within a chunk, and ``G_r − G_s`` would lose ~|G|·eps of
    absolute accuracy in the exponent (a 1e-5 relative error of Γ in float32); a segment sum of same-sign
    terms loses only ~|D|·eps.
    """
    C = g.shape[-2]
    later = _masks(C)[1][:, :, None]  # [i, s, 1]: i > s
    terms = jnp.where(later, g[..., :, None, :], 0.0)
    # associative_scan, not jnp.cumsum: XLA lowers cumsum to a reduce_window, quadratic in C (4x slower here).
    return lax.associative_scan(jnp.add, terms, axis=terms.ndim - 3)


def _unit_lower_inverse(T):
    """(I + T)^-1 for strictly lower-triangular T ``[..., C, C]``, by recursive 2x2 block inversion.

    ``[[A, 0], [X, B]]^-1 = [[A^-1, 0], [-B^-1 X A^-1, B^-1]]``, merged level by level from 1x1 diagonal blocks
    (each 1) up to C x C: log2(C) rounds of two batched matmuls, the same products forward substitution forms,
    in a different order. Used instead of ``lax.linalg.triangular_solve`` because jaxlib's CPU triangular
    solve (``TriMatrixEquationSolverKernel``, jaxlib 0.10) fans out into the XLA intra-op thread pool it
    already runs on and waits there: two such solves in parallel on a 2-thread pool deadlock (seen here twice,
    every thread parked on a futex). Matmuls also suit accelerators better than a 64-step substitution.
    C need not be a power of two: the matrix is padded with an identity block, whose inverse is itself.
    """
    C = T.shape[-1]
    P = 1 << max(0, (C - 1).bit_length())
    M = jnp.eye(P, dtype=T.dtype) + jnp.pad(T, [(0, 0)] * (T.ndim - 2) + [(0, P - C), (0, P - C)])
    batch = M.shape[:-2]
    inv = jnp.ones(batch + (P, 1, 1), T.dtype)  # inverses of the 1x1 diagonal blocks
    s = 1
    while s < P:
        n = P // (2 * s)
        Mb = M.reshape(batch + (n, 2 * s, n, 2 * s))
        diag = jnp.moveaxis(jnp.diagonal(Mb, axis1=-4, axis2=-2), -1, -3)  # [..., n, 2s, 2s]
        X = diag[..., s:, :s]
        Ai, Bi = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        lower = -_ein("...ij,...jk,...kl->...il", Bi, X, Ai)
        top = jnp.concatenate([Ai, jnp.zeros_like(Ai)], axis=-1)
        bottom = jnp.concatenate([lower, Bi], axis=-1)
        inv = jnp.concatenate([top, bottom], axis=-2)
        s *= 2
    return inv[..., 0, :C, :C]


def _pairwise_decay(D):
    """Γ[..., r, s, d] = exp(D[..., r, s, d]) for s ≤ r, else exactly 0 (exponent masked first)."""
    incl = _masks(D.shape[-3])[0][:, :, None]
    return jnp.exp(jnp.where(incl, D, 0.0)) * incl.astype(D.dtype)


# --------------------------------------------------------------------------------------------------
# One chunk: shared intra-chunk quantities (forward and backward use the same code)
# --------------------------------------------------------------------------------------------------

class _Intra(NamedTuple):
    G: jax.Array      # [..., C, K] within-chunk cumulative log decay
    gam: jax.Array    # exp(G)
    gamC: jax.Array   # [..., K] exp(G_C), G_C = last row (padding rows have g = 0)
    tail: jax.Array   # [..., C, K] exp(G_C − G_r)
    Gam: jax.Array    # [..., C, C, K] Γ (zero above the diagonal)
    Aqk: jax.Array    # [..., C, C] scaled, diagonal included
    A: jax.Array      # [..., C, C] (I + T)^-1
    Ebar: jax.Array   # [..., C, K] exp(G)⊙b⊙k
    Z: jax.Array      # [..., C, V] w⊙v
    Y: jax.Array      # [..., C, K] A Ē   (FLA buffer "w")
    U: jax.Array      # [..., C, V] A Z   (FLA "u")
    Ktail: jax.Array  # [..., C, K] exp(G_C − G)⊙k (FLA "kg")


def _intra(q, k, v, g, b, w, scale):
    C = q.shape[-2]
    strict = _masks(C)[1]
    G = jnp.cumsum(g, axis=-2)
    D = _segment_sums(g)
    Gam = _pairwise_decay(D)
    Aqk = scale * _ein("...rd,...sd,...rsd->...rs", q, k, Gam)
    T = _ein("...rd,...sd,...rsd->...rs", b * k, k, Gam) * strict.astype(G.dtype)
    A = _unit_lower_inverse(T)
    gam = jnp.exp(G)
    GC = G[..., -1, :]
    tail = jnp.exp(D[..., -1, :, :])  # exp(G_C − G_r), as a segment sum
    Ebar = gam * b * k
    Z = w * v
    return _Intra(G=G, gam=gam, gamC=jnp.exp(GC), tail=tail, Gam=Gam, Aqk=Aqk, A=A, Ebar=Ebar, Z=Z,
                  Y=_ein("...rs,...sk->...rk", A, Ebar), U=_ein("...rs,...sv->...rv", A, Z),
                  Ktail=tail * k)


def _chunk_fwd(q, k, v, g, b, w, S0, scale, with_output=True):
    """One chunk forward: returns (O [..., C, V] or None, S_next [..., K, V])."""
    it = _intra(q, k, v, g, b, w, scale)
    R = it.U - _ein("...rk,...kv->...rv", it.Y, S0)
    S_next = it.gamC[..., :, None] * S0 + _ein("...rk,...rv->...kv", it.Ktail, R)
    if not with_output:
        return None, S_next
    O = scale * _ein("...rk,...kv->...rv", it.gam * q, S0) + _ein("...rs,...sv->...rv", it.Aqk, R)
    return O, S_next


def _chunk_bwd(q, k, v, g, b, w, S0, dO, dS_end, scale):
    """Chunk-level VJP of spec §7.2 for one chunk.

    Inputs: chunk tensors ``[..., C, ·]``, its start state S0 ``[..., K, V]``, the output cotangent dO and the
    cotangent dS_end of the state at the chunk end. Returns ``(dq, dk, dv, dg, db, dw), dS0``.
    """
    C = q.shape[-2]
    incl, strict = (m.astype(q.dtype) for m in _masks(C))
    it = _intra(q, k, v, g, b, w, scale)
    R = it.U - _ein("...rk,...kv->...rv", it.Y, S0)                 # v_new
    # output / state-passing part (FLA chunk_kda_bwd_dAv + chunk_gated_delta_rule_bwd_dhu)
    dAqk = _ein("...rv,...sv->...rs", dO, R) * incl                  # grad of the scaled score Aqk
    dR = _ein("...rs,...rv->...sv", it.Aqk, dO) + _ein("...rk,...kv->...rv", it.Ktail, dS_end)
    dS0 = (it.gamC[..., :, None] * dS_end + scale * _ein("...rk,...rv->...kv", it.gam * q, dO)
           - _ein("...rk,...rv->...kv", it.Y, dR))
    # WY part (FLA chunk_gdn2_bwd_wy_dqkg_fused)
    dU = dR
    dY = -_ein("...rv,...kv->...rk", dR, S0)
    dZ = _ein("...rs,...rv->...sv", it.A, dU)                         # Aᵀ dU
    dEbar = _ein("...rs,...rk->...sk", it.A, dY)                      # Aᵀ dY
    dA = _ein("...rv,...sv->...rs", dU, it.Z) + _ein("...rk,...sk->...rs", dY, it.Ebar)
    AtdA = _ein("...ir,...is->...rs", it.A, dA)                       # Aᵀ dA
    dT = -_ein("...rj,...sj->...rs", AtdA, it.A) * strict             # −tril(Aᵀ dA Aᵀ, −1)
    dv = dZ * w
    dw = dZ * v
    # intra-chunk score part (FLA chunk_gdn2_bwd_intra); every Γ is ≤ 1
    dq = (scale * it.gam * _ein("...rv,...kv->...rk", dO, S0)
          + scale * _ein("...rs,...sd,...rsd->...rd", dAqk, k, it.Gam))
    dk_aqk = scale * _ein("...rs,...rd,...rsd->...sd", dAqk, q, it.Gam)
    P = _ein("...rs,...sd,...rsd->...rd", dT, k, it.Gam)             # row side of T
    Qcol = _ein("...rs,...rd,...rsd->...sd", dT, b * k, it.Gam)      # column side of T
    dKtail = _ein("...rv,...kv->...rk", R, dS_end)
    dk_tail = it.tail * dKtail
    db = dEbar * it.gam * k + k * P
    dk = dEbar * it.gam * b + b * P + dk_aqk + Qcol + dk_tail
    dG = q * dq + it.Ebar * dEbar + b * k * P - k * (dk_aqk + Qcol + dk_tail)
    dG_last = it.gamC * jnp.sum(dS_end * S0, axis=-1) + jnp.sum(k * dk_tail, axis=-2)
    dG = dG.at[..., -1, :].add(dG_last)
    dg = jnp.flip(jnp.cumsum(jnp.flip(dG, -2), axis=-2), -2)          # reverse cumsum within the chunk
    return (dq, dk, dv, dg, db, dw), dS0


# --------------------------------------------------------------------------------------------------
# Scan over chunks (chunk-major layout [NC, B, HV, C, D]; seq/reset [NC, B])
# --------------------------------------------------------------------------------------------------

def _start_state(h0, sq, rs, S):
    return jnp.where(rs[:, None, None, None], h0[sq], S)


def _scan_forward(scale, q, k, v, g, b, w, h0, seq, reset, *, states_only=False, remat=False):
    """Forward over all chunks. Returns (O [NC,B,HV,C,V], S_end [NC,B,HV,K,V]); with ``states_only``
    returns the chunk START states S0 [NC,B,HV,K,V] (the backward's state pass) and skips the outputs."""
    def body(S, xs):
        qc, kc, vc, gc, bc, wc, sq, rs = xs
        S0 = _start_state(h0, sq, rs, S)
        O, S_next = _chunk_fwd(qc, kc, vc, gc, bc, wc, S0, scale, with_output=not states_only)
        return S_next, (S0 if states_only else (O, S_next))

    if remat:
        body = jax.checkpoint(body)
    NC, B, HV, _, K = q.shape
    S_init = jnp.zeros((B, HV, K, v.shape[-1]), h0.dtype)
    _, ys = lax.scan(body, S_init, (q, k, v, g, b, w, seq, reset))
    return ys


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunk_core(scale, q, k, v, g, b, w, h0, seq, reset):
    return _scan_forward(scale, q, k, v, g, b, w, h0, seq, reset)


def _chunk_core_fwd(scale, q, k, v, g, b, w, h0, seq, reset):
    out = _scan_forward(scale, q, k, v, g, b, w, h0, seq, reset)
    # Residuals: the (chunk-major) inputs only; states are recomputed in the backward.
    return out, (q, k, v, g, b, w, h0, seq, reset)


def _chunk_core_bwd(scale, res, cts):
    q, k, v, g, b, w, h0, seq, reset = res
    dO, dS_end_all = cts
    # 1. state pass: chunk start states S0 (= FLA's h), O(T/C) states
    S0s = _scan_forward(scale, q, k, v, g, b, w, h0, seq, reset, states_only=True)
    # 2. reverse pass over chunks. Chunk c's end-state gradient is the next chunk's dS0 unless the next chunk
    #    restarts from h0 (sequence boundary), plus any cotangent on S_end[c] itself (final states).
    reset_next = jnp.concatenate([reset[1:], jnp.ones_like(reset[:1])], axis=0)

    def body(dS_next, xs):
        qc, kc, vc, gc, bc, wc, S0, dOc, dSc, rn, rs = xs
        dS_end = jnp.where(rn[:, None, None, None], jnp.zeros_like(dS_next), dS_next) + dSc
        grads, dS0 = _chunk_bwd(qc, kc, vc, gc, bc, wc, S0, dOc, dS_end, scale)
        return dS0, (grads, jnp.where(rs[:, None, None, None], dS0, jnp.zeros_like(dS0)))

    zero = jnp.zeros(S0s.shape[1:], S0s.dtype)
    _, (grads, dh0_chunks) = lax.scan(body, zero, (q, k, v, g, b, w, S0s, dO, dS_end_all, reset_next, reset),
                                      reverse=True)
    dh0 = jnp.zeros_like(h0).at[seq.reshape(-1)].add(dh0_chunks.reshape((-1,) + h0.shape[1:]))
    return (*grads, dh0, None, None)


_chunk_core.defvjp(_chunk_core_fwd, _chunk_core_bwd)


def _naive_core(scale, q, k, v, g, b, w, h0, seq, reset):
    return _scan_forward(scale, q, k, v, g, b, w, h0, seq, reset, remat=True)


# --------------------------------------------------------------------------------------------------
# Layout: tokens <-> chunk-major
# --------------------------------------------------------------------------------------------------

def _dense_to_chunks(x, C):
    """[B, T, Hh, D] -> [NC, B, Hh, C, D], zero padded to NC·C tokens."""
    B, T, Hh, D = x.shape
    NC = max(1, -(-T // C))
    x = jnp.pad(x, ((0, 0), (0, NC * C - T), (0, 0), (0, 0)))
    return x.reshape(B, NC, C, Hh, D).transpose(1, 0, 3, 2, 4)


def _dense_from_chunks(o, T):
    NC, B, Hh, C, D = o.shape
    return o.transpose(1, 0, 3, 2, 4).reshape(B, NC * C, Hh, D)[:, :T]


class _VarlenPlan(NamedTuple):
    tok: jax.Array    # [NC, C] token read by each chunk row (clamped)
    valid: jax.Array  # [NC, C] row holds a real token
    seq: jax.Array    # [NC] sequence of each chunk (clamped to N-1 for unused chunks)
    reset: jax.Array  # [NC] chunk starts from h0[seq] (first chunk of a sequence, and unused chunks)
    slot: jax.Array   # [T] flat chunk-row (c·C + r) of each token
    last: jax.Array   # [N] last chunk of each sequence (clamped)
    has: jax.Array    # [N] sequence has at least one token


def _varlen_plan(cu_seqlens, T: int, C: int) -> _VarlenPlan:
    """Chunks aligned to every sequence start, from possibly traced ``cu_seqlens`` (static count)."""
    from .reference import sequence_ids

    cu = jnp.asarray(cu_seqlens, jnp.int32)  # numpy offsets too (indexed with traced values below)
    N = cu.shape[0] - 1
    lens = cu[1:] - cu[:-1]
    nch = (lens + C - 1) // C
    cch = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(nch).astype(jnp.int32)])
    NC = max(1, (T + N * (C - 1)) // C)  # >= Σ ceil(len_n / C) for any split of T tokens into N sequences
    c = jnp.arange(NC, dtype=jnp.int32)
    s = jnp.searchsorted(cch[1:], c, side="right").astype(jnp.int32)
    real = s < N
    sc = jnp.minimum(s, N - 1)
    j = c - cch[sc]
    pos = j[:, None] * C + jnp.arange(C, dtype=jnp.int32)[None, :]
    valid = real[:, None] & (pos < lens[sc][:, None])
    tok = jnp.clip(cu[sc][:, None] + pos, 0, max(T - 1, 0))
    st, _ = sequence_ids(cu, T)
    p = jnp.arange(T, dtype=jnp.int32) - cu[st]
    slot = (cch[st] + p // C) * C + p % C
    return _VarlenPlan(tok=tok, valid=valid, seq=sc, reset=(j == 0) | ~real, slot=slot,
                       last=jnp.clip(cch[1:] - 1, 0, NC - 1), has=lens > 0)


def _varlen_to_chunks(x, plan: _VarlenPlan):
    """[1, T, Hh, D] -> [NC, 1, Hh, C, D]."""
    if x.shape[1] == 0:  # no tokens at all (every sequence empty): nothing to gather
        return jnp.zeros((plan.tok.shape[0], 1, x.shape[2], plan.tok.shape[1], x.shape[3]), x.dtype)
    xc = jnp.where(plan.valid[:, :, None, None], x[0][plan.tok], jnp.zeros((), x.dtype))
    return xc.transpose(0, 2, 1, 3)[:, None]


def _varlen_from_chunks(o, plan: _VarlenPlan):
    NC, _, Hh, C, D = o.shape
    return o[:, 0].transpose(0, 2, 1, 3).reshape(NC * C, Hh, D)[plan.slot][None]


def _chunked(core, q, k, v, g, b, w, dims: Dims, initial_state, cu_seqlens, output_final_state: bool,
             use_qk_l2norm_in_kernel: bool, chunk_size: int):
    """L2 norm + GVA repeat (plain autodiff), layout to chunks, ``core``, layout back."""
    from .reference import prepare_qk

    cdt = dims.compute_dtype
    out_dtype = jax.dtypes.canonicalize_dtype(q.dtype)  # numpy float64 without x64 -> float32
    q, k = prepare_qk(q, k, dims, use_qk_l2norm_in_kernel)
    h0 = (jnp.zeros((dims.N, dims.HV, dims.K, dims.V), cdt) if initial_state is None
          else jnp.asarray(initial_state).astype(cdt))
    xs = [jnp.asarray(x).astype(cdt) for x in (q, k, v, g, b, w)]
    C = chunk_size
    if cu_seqlens is None:
        xs = [_dense_to_chunks(x, C) for x in xs]
        NC = xs[0].shape[0]
        seq = jnp.broadcast_to(jnp.arange(dims.B, dtype=jnp.int32)[None], (NC, dims.B))
        reset = jnp.broadcast_to((jnp.arange(NC) == 0)[:, None], (NC, dims.B))
        o, S_end = core(dims.scale, *xs, h0, seq, reset)
        o = _dense_from_chunks(o, dims.T)
        final = S_end[-1]
    else:
        plan = _varlen_plan(cu_seqlens, dims.T, C)
        xs = [_varlen_to_chunks(x, plan) for x in xs]
        o, S_end = core(dims.scale, *xs, h0, plan.seq[:, None], plan.reset[:, None])
        o = _varlen_from_chunks(o, plan)
        final = jnp.where(plan.has[:, None, None, None], S_end[plan.last, 0], h0)
    return o.astype(out_dtype), (final if output_final_state else None)


def chunk_forward_xla(q, k, v, g, b, w, dims: Dims, initial_state, cu_seqlens, output_final_state: bool,
                      use_qk_l2norm_in_kernel: bool):
    """xla backend of ``chunk_gdn2`` (after validation): chunk scan with the hand-written §7.2 VJP."""
    return _chunked(_chunk_core, q, k, v, g, b, w, dims, initial_state, cu_seqlens, output_final_state,
                    use_qk_l2norm_in_kernel, CHUNK_SIZE)


def naive_chunk_gdn2(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    b: jax.Array,
    w: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: jax.Array | None = None,
    chunk_size: int = CHUNK_SIZE,
):
    """Chunked (WY form) GDN-2 reference in pure jnp, differentiable by plain autodiff.

    Same operator as :func:`naive_recurrent_gdn2` (paper arXiv:2605.22791 eq. 10; FLA
    ``fla/ops/gdn2/naive.py::naive_chunk_gdn2``), evaluated chunk by chunk with the Γ-form of the WY
    representation (module docstring). Pairwise decays are only exponentiated for s ≤ r (masked before
    ``exp``), so strong decay (g ≈ −60 per token) gives finite outputs and gradients. Math in float32
    (float64 when any input is float64, which needs ``jax_enable_x64``). Each chunk is rematerialised
    (``jax.checkpoint``) in the backward.

    Args:
      q, k: ``[B, T, H, K]`` queries and keys.
      v: ``[B, T, HV, V]`` values; HV must be a multiple of H (value head j reads qk head j // (HV/H)).
      g: ``[B, T, HV, K]`` natural-log per-key-channel decay (decay factor ``exp(g)``, g <= 0 in practice).
      b: ``[B, T, HV, K]`` activated erase gate in [0, 1] ([0, 2] with negative eigenvalues).
      w: ``[B, T, HV, V]`` activated write gate in [0, 1].
      scale: multiplies q; default ``K ** -0.5``.
      initial_state: ``[N, HV, K, V]`` float32 (float64 under x64); N = B or len(cu_seqlens) - 1. Default zeros.
      output_final_state: also return the final state ``[N, HV, K, V]``.
      use_qk_l2norm_in_kernel: L2-normalise q and k over K first (``x / sqrt(sum x^2 + 1e-6)``).
      cu_seqlens: ``[N + 1]`` int offsets of sequences packed along T (requires B == 1); may be traced.
      chunk_size: chunk length C (a positive int; FLA fixes 64).

    Returns:
      ``(o, final_state)``: o ``[B, T, HV, V]`` in q's dtype; final_state in float32 (float64 under x64 when
      any input is float64), or None when ``output_final_state`` is False.

    Raises:
      ValueError / TypeError naming the argument for bad shapes, dtypes or values (``chunk_size`` included).
    """
    fn = "naive_chunk_gdn2"
    dims = check_inputs(fn, q, k, v, g, b, w, scale=scale, initial_state=initial_state,
                        cu_seqlens=cu_seqlens, output_final_state=output_final_state,
                        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    if isinstance(chunk_size, (bool, np.bool_)) or not isinstance(chunk_size, (int, np.integer)):
        raise TypeError(f"{fn}: `chunk_size` must be a positive int, got {type(chunk_size).__name__} {chunk_size!r}")
    if chunk_size < 1:
        raise ValueError(f"{fn}: `chunk_size` must be a positive int, got {chunk_size!r}")
    # a chunk longer than the input is only zero padding (exact); clamping keeps memory O(T^2), not O(chunk_size^2)
    C = min(int(chunk_size), max(dims.T, 1))

    def run(q, k, v, g, b, w, h0):
        return _chunked(_naive_core, q, k, v, g, b, w, dims, h0, cu_seqlens, output_final_state,
                        use_qk_l2norm_in_kernel, C)

    return run_poisoned_if_invalid_cu_seqlens(cu_seqlens, dims.T, run, q, k, v, g, b, w, initial_state)

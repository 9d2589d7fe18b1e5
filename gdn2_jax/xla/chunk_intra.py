"""Stage 2 of the chunk form: intra-chunk scores ``Aqk``, ``T`` and the solve ``A = (I + T)^-1``, with their backward.

FLA ``fla/ops/gdn2/chunk_intra.py`` (``chunk_gdn2_fwd_intra``, ``chunk_gdn2_bwd_intra``). Per chunk of C rows r, s::

    Aqk_rs = scale sum_d q_rd k_sd Gam_rsd                 s <= r   (the scaled score, diagonal included)
    T_rs   =       sum_d b_rd k_rd k_sd Gam_rsd           s <  r   (FLA ``Akk`` before the solve)
    A      = (I + T)^-1                                            (unit lower triangular)

Backward, from the cotangents dAqk (of the scaled score) and dT::

    dq_r += scale sum_s dAqk_rs k_s Gam_rs        dk_s += scale sum_r dAqk_rs q_r Gam_rs
    P_r   = sum_s dT_rs k_s Gam_rs                 db_r += k_r P_r,   dk_r += b_r P_r
    Qc_s  = sum_r dT_rs b_r k_r Gam_rs             dk_s += Qc_s
    dG_r += q_r dq_r(scores) + b_r k_r P_r - k_r (dk_r(Aqk) + Qc_r)   (Gam_rs = exp(G_r - G_s))

and the solve's: ``dT = -tril(A^T dA A^T, -1)``.

With ``cumsum.chunk_gates(g, factored=True)`` the three decay-weighted products run in FLA's sub-chunk form (two
matmuls per 16-row sub-chunk below the diagonal, exact 16 x 16 diagonal blocks) instead of over a dense
``[C, C, K]`` factor; same values up to rounding.

Kernel twin: ``kernels/chunk_fwd.py`` launch 1 (``gdn2_chunk_intra``) stores ``Aqk`` ``[B, T, HV, 64]`` (input
dtype) and keeps T and A on chip. Shapes below: leading ``...`` are batch dims (chunks, sequences, heads).
"""

from __future__ import annotations

import jax.numpy as jnp

from .common import ein, masks
from .cumsum import Gates, SubGates

__all__ = ["intra_fwd", "intra_bwd", "solve_fwd", "solve_bwd", "unit_lower_inverse"]


# ------------------------------------------------------------------------------------------------------------------
# The three decay-weighted pairwise products, dense (Gam [..., C, C, K]) or sub-chunk factored (cumsum.SubGates):
#   scores(X, Y)_rs = sum_d X_rd Y_sd Gam_rsd,  rows(M, Y)_rd = sum_s M_rs Y_sd Gam_rsd,  cols(M, X)_sd = sum_r ...
# The factored form is two matmuls per sub-chunk for the blocks below the diagonal plus exact S x S blocks.
# ------------------------------------------------------------------------------------------------------------------
def _blocks(x, NS):
    """[..., C, D] -> [..., NS, S, D]."""
    return x.reshape(x.shape[:-2] + (NS, x.shape[-2] // NS, x.shape[-1]))


def _embed(NS, S, dtype):
    """One-hot E [NS, S, C]: E[i, s, c] = (c == i S + s) (places / picks the diagonal S x S blocks)."""
    return (jnp.arange(NS * S)[None, None, :] == (S * jnp.arange(NS)[:, None, None] + jnp.arange(S)[None, :, None])
            ).astype(dtype)


def _split(Gam):
    """(NS, S) of a :class:`SubGates` (back ``[..., NS, C, K]``)."""
    NS, C = Gam.back.shape[-3:-1]
    return NS, C // NS


def _diag_blocks(M, NS, S):
    """The S x S diagonal blocks ``[..., NS, S, S]`` of M ``[..., C, C]``, and M by row blocks ``[..., NS, S, C]``."""
    Mb = _blocks(M, NS)
    return ein("...irc,isc->...irs", Mb, _embed(NS, S, M.dtype)), Mb


# The diagonal blocks recurse: with nested SubGates (``levels`` > 1) they are the same products over each
# sub-chunk's block (batch dims [..., NS]); at the last level, exact elementwise sums.
def _scores(X, Y, Gam):
    if not isinstance(Gam, SubGates):
        return ein("...rd,...sd,...rsd->...rs", X, Y, Gam)
    NS, S = _split(Gam)
    off = ein("...irk,...isk->...irs", _blocks(X * Gam.lead, NS), Y[..., None, :, :] * Gam.back)
    diag = _scores(_blocks(X, NS), _blocks(Y, NS), Gam.diag)
    full = off + ein("...irs,isc->...irc", diag, _embed(NS, S, X.dtype))
    return full.reshape(X.shape[:-1] + (NS * S,))


def _rows(M, Y, Gam):
    if not isinstance(Gam, SubGates):
        return ein("...rs,...sd,...rsd->...rd", M, Y, Gam)
    NS, S = _split(Gam)
    Md, Mb = _diag_blocks(M, NS, S)
    off = ein("...irs,...isk->...irk", Mb, Y[..., None, :, :] * Gam.back) * _blocks(Gam.lead, NS)
    return (off + _rows(Md, _blocks(Y, NS), Gam.diag)).reshape(Y.shape)


def _cols(M, X, Gam):
    if not isinstance(Gam, SubGates):
        return ein("...rs,...rd,...rsd->...sd", M, X, Gam)
    NS, S = _split(Gam)
    Md, Mb = _diag_blocks(M, NS, S)
    off = jnp.sum(ein("...irs,...irk->...isk", Mb, _blocks(X * Gam.lead, NS)) * Gam.back, axis=-3)
    return off + _cols(Md, _blocks(X, NS), Gam.diag).reshape(X.shape)


def intra_fwd(q, k, b, gates: Gates, scale: float):
    """Scores of one chunk: q, k, b ``[..., C, K]`` (compute dtype), ``gates`` from ``cumsum.chunk_gates``.

    Returns ``(Aqk, T)``, each ``[..., C, C]``: Aqk scaled and lower triangular with its diagonal, T strictly
    lower triangular.
    """
    strict = masks(q.shape[-2])[1]
    Aqk = scale * _scores(q, k, gates.Gam)
    T = _scores(b * k, k, gates.Gam) * strict.astype(q.dtype)
    return Aqk, T


def intra_bwd(q, k, b, gates: Gates, dAqk, dT, scale: float):
    """Backward of :func:`intra_fwd`: cotangents dAqk, dT ``[..., C, C]`` (dAqk of the *scaled* score, masked to
    s <= r; dT strictly lower). Returns ``(dq, dk, db, dG)`` ``[..., C, K]``: the scores' shares of the gradients
    w.r.t. q, k, b and the cumulative decay G."""
    dq = scale * _rows(dAqk, k, gates.Gam)
    dk_aqk = scale * _cols(dAqk, q, gates.Gam)
    P = _rows(dT, k, gates.Gam)          # row side of T
    Qcol = _cols(dT, b * k, gates.Gam)   # column side of T
    db = k * P
    dk = b * P + dk_aqk + Qcol
    dG = q * dq + b * k * P - k * (dk_aqk + Qcol)
    return dq, dk, db, dG


def unit_lower_inverse(T):
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
        lower = -ein("...ij,...jk,...kl->...il", Bi, X, Ai)
        top = jnp.concatenate([Ai, jnp.zeros_like(Ai)], axis=-1)
        bottom = jnp.concatenate([lower, Bi], axis=-1)
        inv = jnp.concatenate([top, bottom], axis=-2)
        s *= 2
    return inv[..., 0, :C, :C]


def solve_fwd(T):
    """``A = (I + T)^-1`` ``[..., C, C]`` for the strictly lower T of :func:`intra_fwd` (FLA ``solve_tril``)."""
    return unit_lower_inverse(T)


def solve_bwd(A, dA):
    """Backward of :func:`solve_fwd`: ``dT = -tril(A^T dA A^T, -1)`` ``[..., C, C]`` (T is strictly lower)."""
    strict = masks(A.shape[-1])[1].astype(A.dtype)
    AtdA = ein("...ir,...is->...rs", A, dA)
    return -ein("...rj,...sj->...rs", AtdA, A) * strict

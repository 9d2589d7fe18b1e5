"""Stage 1 of the chunk form: the gate cumsum (FLA ``chunk_local_cumsum``) and its reverse (the dg of the backward).

Per chunk of C rows, with g ``[..., C, K]`` the natural-log decay (float32, or float64 under x64)::

    G_r   = sum_{i<=r} g_i                        within-chunk cumulative log decay
    D_rs  = G_r - G_s = sum_{s<i<=r} g_i          for s <= r (0 above the diagonal), as a segment sum
    Gam   = exp(D) (s <= r, else 0),  gam = exp(G),  gamC = exp(G_C),  tail = exp(G_C - G)

Backward: ``dg_t = sum_{r >= t} dG_r`` within the chunk (``chunk_local_cumsum(..., reverse=True)``).

``chunk_gates(g, factored=True)`` replaces the dense ``[..., C, C, K]`` Gam by its sub-chunk factorisation
(:class:`SubGates`, FLA's sub-chunk form; chunks of C = NS * S rows, sub-chunks of S = 16): for r in sub-chunk i and
s in an earlier one, with a = iS - 1 the last row before sub-chunk i::

    Gam_rs = exp(G_r - G_a) * exp(G_a - G_s) = lead_r * back[i]_s       (both factors <= 1)

and the S x S diagonal blocks stay exact (``diag``). Each exponent is a same-sign sum from the anchor (a cumulative
sum within the sub-chunk, a reverse one before it), never a difference of chunk-level cumulative sums.

Kernel twin: the cumsum inside ``kernels/chunk_fwd.py`` launch 1 (``gdn2_chunk_intra``), which stores
``GAM = gamC`` (float32, ``[B, NT, HV, K]``). FLA keeps G in base 2 (times log2 e) and uses ``exp2``; here base e.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .common import masks

__all__ = ["Gates", "SubGates", "SUB", "chunk_gates", "sub_gates", "segment_sums", "chunk_local_cumsum_bwd"]

SUB = 16  # rows per sub-chunk of the factored pairwise decays


class Gates(NamedTuple):
    """Decay factors of one chunk (every factor is exp of a non-positive number when g <= 0)."""

    G: jax.Array     # [..., C, K] within-chunk cumulative log decay
    gam: jax.Array   # [..., C, K] exp(G)
    gamC: jax.Array  # [..., K] exp(G_C), G_C the last row (padding rows have g = 0)
    tail: jax.Array  # [..., C, K] exp(G_C - G_r)
    Gam: object      # [..., C, C, K] exp(G_r - G_s) for s <= r, exactly 0 above the diagonal; or its SubGates


class SubGates(NamedTuple):
    """Sub-chunk factorisation of Gam (module docstring); NS = C / S sub-chunks of S rows."""

    lead: jax.Array  # [..., C, K] exp(G_r - G_a(r)), a(r) the last row before r's sub-chunk
    back: jax.Array  # [..., NS, C, K] exp(G_a - G_s) for s <= a = iS - 1 (s before sub-chunk i), else exactly 0
    diag: object     # [..., NS, S, S, K] exp(G_r - G_s) within sub-chunk i for s <= r, else exactly 0; or (nested
    #                  levels) the SubGates of each sub-chunk's own S x S block, batch dims [..., NS]


def segment_sums(g):
    """D[..., r, s, d] = G_rd - G_sd = sum_{s<i<=r} g_id for s <= r, and exactly 0 for s > r. ``[..., C, C, K]``.

    Summed segment by segment (a cumsum over i of g_i [i > s]) rather than as a difference of two cumulative
    sums: under strong decay G reaches -thousands within a chunk, and ``G_r - G_s`` would lose ~|G| eps of
    absolute accuracy in the exponent (a 1e-5 relative error of Gam in float32); a segment sum of same-sign
    terms loses only ~|D| eps.
    """
    C = g.shape[-2]
    later = masks(C)[1][:, :, None]  # [i, s, 1]: i > s
    terms = jnp.where(later, g[..., :, None, :], 0.0)
    # associative_scan, not jnp.cumsum: XLA lowers cumsum to a reduce_window, quadratic in C (4x slower on CPU).
    return lax.associative_scan(jnp.add, terms, axis=terms.ndim - 3)


def _masked_exp(mask, x):
    """exp(x) where ``mask``, exactly 0 elsewhere; the exponent is masked before exp (no exp of a positive)."""
    return jnp.exp(jnp.where(mask, x, 0.0)) * mask.astype(x.dtype)


def sub_gates(g, S: int = SUB, levels: int = 1) -> SubGates:
    """The :class:`SubGates` of g ``[..., C, K]`` (C a multiple of S). ``levels`` > 1 factors each S x S diagonal
    block the same way again (sub-chunks of S / 4 rows, nested ``diag``), so that only 4 x 4 blocks (two levels)
    stay elementwise; each level's exponents are same-sign sums from its own anchors."""
    C, K = g.shape[-2:]
    NS = C // S
    gs = g.reshape(g.shape[:-2] + (NS, S, K))
    lead = jnp.exp(jnp.cumsum(gs, axis=-2)).reshape(g.shape)
    before = (jnp.arange(C)[None, :] < S * jnp.arange(NS)[:, None])[:, :, None]  # [NS, C, 1]: t before sub-chunk i
    terms = jnp.where(before, g[..., None, :, :], 0.0)                            # [..., NS, C, K]
    excl = _suffix_sums(terms)                                                     # sum_{s < t < iS} g_t
    incl = masks(S)[0][:, :, None]
    if levels > 1 and S % 4 == 0 and S >= 8:
        diag = sub_gates(gs, S // 4, levels - 1)
    else:
        diag = _masked_exp(incl, segment_sums(gs))
    return SubGates(lead=lead, back=_masked_exp(before, excl), diag=diag)


def _suffix_sums(x):
    """Exclusive reverse cumsum along the rows (axis -2): ``out_r = sum_{t > r} x_t`` (a same-sign sum)."""
    incl = chunk_local_cumsum_bwd(x)
    return jnp.concatenate([incl[..., 1:, :], jnp.zeros_like(incl[..., :1, :])], axis=-2)


def chunk_gates(g, factored: bool = False, levels: int = 1) -> Gates:
    """Forward of the stage: every decay factor of one chunk from g ``[..., C, K]`` (see the module docstring).

    The pairwise exponent is masked *before* ``exp`` (never ``exp`` of a positive number), so g down to -60 per
    token neither overflows nor produces NaN gradients. ``factored`` (used when C is a multiple of :data:`SUB`)
    gives ``Gam`` as :class:`SubGates` instead of the dense ``[..., C, C, K]`` factor, with ``levels`` levels of
    sub-chunks (:func:`sub_gates`).
    """
    G = jnp.cumsum(g, axis=-2)
    C = g.shape[-2]
    if factored and C % SUB == 0:
        # tail_r = exp(G_C - G_r), a reverse same-sign sum (no difference of cumulative sums)
        tail = jnp.exp(_suffix_sums(g))
        return Gates(G=G, gam=jnp.exp(G), gamC=jnp.exp(G[..., -1, :]), tail=tail, Gam=sub_gates(g, SUB, levels))
    D = segment_sums(g)
    incl = masks(C)[0][:, :, None]
    return Gates(G=G, gam=jnp.exp(G), gamC=jnp.exp(G[..., -1, :]), tail=jnp.exp(D[..., -1, :, :]),
                 Gam=_masked_exp(incl, D))


def chunk_local_cumsum_bwd(dG):
    """Backward of the stage: ``dg[..., t, :] = sum_{r >= t} dG[..., r, :]`` (reverse cumsum within the chunk).

    dG ``[..., C, K]`` is the gradient w.r.t. the cumulative decay G; returns the gradient w.r.t. g, same shape.
    """
    return jnp.flip(jnp.cumsum(jnp.flip(dG, -2), axis=-2), -2)

"""Stage 1 of the chunk form: the gate cumsum (FLA ``chunk_local_cumsum``) and its reverse (the dg of the backward).

Per chunk of C rows, with g ``[..., C, K]`` the natural-log decay (float32, or float64 under x64)::

    G_r   = sum_{i<=r} g_i                        within-chunk cumulative log decay
    D_rs  = G_r - G_s = sum_{s<i<=r} g_i          for s <= r (0 above the diagonal), as a segment sum
    Gam   = exp(D) (s <= r, else 0),  gam = exp(G),  gamC = exp(G_C),  tail = exp(G_C - G)

Backward: ``dg_t = sum_{r >= t} dG_r`` within the chunk (``chunk_local_cumsum(..., reverse=True)``).

Kernel twin: the cumsum inside ``kernels/chunk_fwd.py`` launch 1 (``gdn2_chunk_intra``), which stores
``GAM = gamC`` (float32, ``[B, NT, HV, K]``). FLA keeps G in base 2 (times log2 e) and uses ``exp2``; here base e.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .common import masks

__all__ = ["Gates", "chunk_gates", "segment_sums", "chunk_local_cumsum_bwd"]


class Gates(NamedTuple):
    """Decay factors of one chunk (every factor is exp of a non-positive number when g <= 0)."""

    G: jax.Array     # [..., C, K] within-chunk cumulative log decay
    gam: jax.Array   # [..., C, K] exp(G)
    gamC: jax.Array  # [..., K] exp(G_C), G_C the last row (padding rows have g = 0)
    tail: jax.Array  # [..., C, K] exp(G_C - G_r)
    Gam: jax.Array   # [..., C, C, K] exp(G_r - G_s) for s <= r, exactly 0 above the diagonal


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


def chunk_gates(g) -> Gates:
    """Forward of the stage: every decay factor of one chunk from g ``[..., C, K]`` (see the module docstring).

    The pairwise exponent is masked *before* ``exp`` (never ``exp`` of a positive number), so g down to -60 per
    token neither overflows nor produces NaN gradients.
    """
    G = jnp.cumsum(g, axis=-2)
    D = segment_sums(g)
    incl = masks(g.shape[-2])[0][:, :, None]
    Gam = jnp.exp(jnp.where(incl, D, 0.0)) * incl.astype(D.dtype)
    return Gates(G=G, gam=jnp.exp(G), gamC=jnp.exp(G[..., -1, :]), tail=jnp.exp(D[..., -1, :, :]), Gam=Gam)


def chunk_local_cumsum_bwd(dG):
    """Backward of the stage: ``dg[..., t, :] = sum_{r >= t} dG[..., r, :]`` (reverse cumsum within the chunk).

    dG ``[..., C, K]`` is the gradient w.r.t. the cumulative decay G; returns the gradient w.r.t. g, same shape.
    """
    return jnp.flip(jnp.cumsum(jnp.flip(dG, -2), axis=-2), -2)

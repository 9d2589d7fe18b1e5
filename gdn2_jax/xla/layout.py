"""Token-major ``[B, T, Hh, D]`` <-> chunk-major ``[NC, B, Hh, C, D]`` layouts of the chunk form.

Dense input is zero padded to a multiple of C (exact: g = 0, k = 0, b = w = 0 rows change nothing). Varlen input
(``cu_seqlens``, B == 1) is gathered into chunks aligned to each sequence start, for an upper-bound chunk count
computed from static shapes only, so traced ``cu_seqlens`` work under ``jit``; every chunk carries the index of
its sequence and a "start from ``h0[seq]``" flag, and ``o`` is gathered back token by token.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from .common import sequence_ids

__all__ = ["dense_to_chunks", "dense_from_chunks", "VarlenPlan", "varlen_plan", "varlen_to_chunks",
           "varlen_from_chunks", "to_chunks", "slots_to_chunks"]


def dense_to_chunks(x, C):
    """[B, T, Hh, D] -> [NC, B, Hh, C, D], zero padded to NC*C tokens (NC >= 1)."""
    B, T, Hh, D = x.shape
    NC = max(1, -(-T // C))
    x = jnp.pad(x, ((0, 0), (0, NC * C - T), (0, 0), (0, 0)))
    return x.reshape(B, NC, C, Hh, D).transpose(1, 0, 3, 2, 4)


def dense_from_chunks(o, T):
    """[NC, B, Hh, C, D] -> [B, T, Hh, D] (drops the padding)."""
    NC, B, Hh, C, D = o.shape
    return o.transpose(1, 0, 3, 2, 4).reshape(B, NC * C, Hh, D)[:, :T]


class VarlenPlan(NamedTuple):
    tok: jax.Array    # [NC, C] token read by each chunk row (clamped)
    valid: jax.Array  # [NC, C] row holds a real token
    seq: jax.Array    # [NC] sequence of each chunk (clamped to N-1 for unused chunks)
    reset: jax.Array  # [NC] chunk starts from h0[seq] (first chunk of a sequence, and unused chunks)
    slot: jax.Array   # [T] flat chunk-row (c*C + r) of each token
    last: jax.Array   # [N] last chunk of each sequence (clamped)
    has: jax.Array    # [N] sequence has at least one token
    kslot: jax.Array  # [NC] the kernels' chunk slot of each chunk (``seq + cu[seq] // C + j``; 0 when unused)
    real: jax.Array   # [NC] chunk belongs to a sequence (the plan's count is an upper bound)


def varlen_plan(cu_seqlens, T: int, C: int) -> VarlenPlan:
    """Chunks aligned to every sequence start, from possibly traced ``cu_seqlens`` ``[N + 1]`` (static count)."""
    cu = jnp.asarray(cu_seqlens, jnp.int32)  # numpy offsets too (indexed with traced values below)
    N = cu.shape[0] - 1
    lens = cu[1:] - cu[:-1]
    nch = (lens + C - 1) // C
    cch = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(nch).astype(jnp.int32)])
    NC = max(1, (T + N * (C - 1)) // C)  # >= sum ceil(len_n / C) for any split of T tokens into N sequences
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
    return VarlenPlan(tok=tok, valid=valid, seq=sc, reset=(j == 0) | ~real, slot=slot,
                      last=jnp.clip(cch[1:] - 1, 0, NC - 1), has=lens > 0,
                      kslot=jnp.where(real, sc + cu[sc] // C + j, 0), real=real)


def varlen_to_chunks(x, plan: VarlenPlan):
    """[1, T, Hh, D] -> [NC, 1, Hh, C, D] (rows past a sequence's end are zero)."""
    if x.shape[1] == 0:  # no tokens at all (every sequence empty): nothing to gather
        return jnp.zeros((plan.tok.shape[0], 1, x.shape[2], plan.tok.shape[1], x.shape[3]), x.dtype)
    xc = jnp.where(plan.valid[:, :, None, None], x[0][plan.tok], jnp.zeros((), x.dtype))
    return xc.transpose(0, 2, 1, 3)[:, None]


def varlen_from_chunks(o, plan: VarlenPlan):
    """[NC, 1, Hh, C, D] -> [1, T, Hh, D]."""
    NC, _, Hh, C, D = o.shape
    return o[:, 0].transpose(0, 2, 1, 3).reshape(NC * C, Hh, D)[plan.slot][None]


def to_chunks(x, plan: VarlenPlan | None, C: int):
    """Token-major -> chunk-major: :func:`dense_to_chunks` without a plan, :func:`varlen_to_chunks` with one."""
    return dense_to_chunks(x, C) if plan is None else varlen_to_chunks(x, plan)


def slots_to_chunks(x, plan: VarlenPlan | None):
    """The kernels' per-chunk-slot arrays ``[B, NT, Hh, ...]`` (``kernels.chunk_fwd.num_chunk_slots``) in this
    module's chunk order ``[NC, B, Hh, ...]``: dense slots are the chunks (T = 0: no slot, one zero chunk, as
    :func:`dense_to_chunks` pads); varlen chunks read their slot (``plan.kslot``) and unused chunks are zero."""
    if plan is None:
        if x.shape[1] == 0:
            return jnp.zeros((1, x.shape[0]) + x.shape[2:], x.dtype)
        return jnp.moveaxis(x, 1, 0)
    xc = x[0][plan.kslot]
    return jnp.where(plan.real.reshape((-1,) + (1,) * (xc.ndim - 1)), xc, jnp.zeros((), x.dtype))[:, None]

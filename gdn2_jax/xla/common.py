"""Helpers shared by the xla (pure jnp) stages: einsum precision, masks, q/k L2 norm, GVA repeat, sequence ids."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels._common import L2NORM_EPS

from ..validation import _is_float

__all__ = ["ein", "masks", "l2norm", "prepare_qk", "sequence_ids", "L2NORM_EPS"]

_HI = lax.Precision.HIGHEST


def ein(spec, *operands):
    """``jnp.einsum`` at full precision (no TF32 / bf16 passes on accelerators)."""
    return jnp.einsum(spec, *operands, precision=_HI)


def masks(C: int):
    """``(incl, strict)``: boolean ``[C, C]`` masks of s <= r and s < r (row r, column s)."""
    r = jnp.arange(C)
    return r[:, None] >= r[None, :], r[:, None] > r[None, :]


def l2norm(x: jax.Array) -> jax.Array:
    """``x / sqrt(sum(x**2, -1) + 1e-6)`` over the last axis, computed in float32 (float64 for float64 input) and
    cast back to ``x.dtype`` (FLA ``l2norm_fwd``; the kernels use the same epsilon).

    Raises ``TypeError`` for an ``x`` that is not a jax or numpy array (a list, tuple, Python scalar or
    ``jax.ShapeDtypeStruct``, as the ops refuse them) or whose dtype is not float16, bfloat16, float32 or float64, and
    ``ValueError`` for a 0-d one.
    """
    if not isinstance(x, (jax.Array, np.ndarray, np.generic)):
        raise TypeError(f"l2norm: `x` must be a jax or numpy array, got {type(x).__name__}")
    if not _is_float(x):  # (the ops' dtype check of q, k, ...)
        raise TypeError(f"l2norm: `x` must be a float16, bfloat16, float32 or float64 array, got dtype {x.dtype}")
    x = jnp.asarray(x)  # canonical dtype (numpy float64 without x64 -> float32)
    if x.ndim == 0:
        raise ValueError("l2norm: `x` must have at least one axis (normalised over the last one)")
    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    return (xf * lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + L2NORM_EPS)).astype(x.dtype)


def prepare_qk(q, k, group: int, use_qk_l2norm_in_kernel: bool):
    """Optional L2 norm of q/k ``[B, T, H, K]``, then repeat over value-head groups (value head j reads qk head
    j // group) to ``[B, T, H * group, K]``. Plain jnp: differentiated by autodiff (the group sum of dq/dk)."""
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if group > 1:
        q = jnp.repeat(q, group, axis=2)
        k = jnp.repeat(k, group, axis=2)
    return q, k


def sequence_ids(cu_seqlens: jax.Array, T: int):
    """For packed varlen input: per-token sequence index ``[T]`` int32 and whether the token starts its
    sequence ``[T]`` bool. Works with traced ``cu_seqlens`` ``[N + 1]``; zero-length sequences own no token."""
    cu = jnp.asarray(cu_seqlens, jnp.int32)  # numpy offsets too (indexed with traced values below)
    t = jnp.arange(T, dtype=jnp.int32)
    seq = jnp.searchsorted(cu[1:], t, side="right").astype(jnp.int32)
    start = t == cu[seq]
    return seq, start

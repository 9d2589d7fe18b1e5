"""Pure-jnp GDN-2 references.

``naive_recurrent_gdn2`` is the ground truth: a token loop (``lax.scan``) over the recurrence of
Gated DeltaNet-2 (Hatamizadeh, Choi, Kautz, arXiv:2605.22791, eq. 10; FLA ``fla/ops/gdn2/naive.py``)::

    S̄_t = Diag(exp g_t) S_{t-1}
    u_t = w_t ⊙ v_t − S̄_tᵀ (b_t ⊙ k_t)
    S_t = S̄_t + k_t u_tᵀ
    o_t = scale · S_tᵀ q_t

Math runs in float32 (float64 when any input is float64, which needs ``jax_enable_x64``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ._chunk import naive_chunk_gdn2  # re-export (the chunked reference lives in _chunk.py)
from ._validation import Dims, check_inputs, run_poisoned_if_invalid_cu_seqlens

__all__ = ["naive_recurrent_gdn2", "naive_chunk_gdn2", "l2norm"]

L2NORM_EPS = 1e-6


def l2norm(x: jax.Array) -> jax.Array:
    """``x / sqrt(sum(x**2, -1) + 1e-6)`` computed in fp32 (fp64 for fp64 input), cast back to x.dtype."""
    x = jnp.asarray(x)  # canonical dtype (numpy float64 without x64 -> float32)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"l2norm: `x` must be a real floating-point array, got dtype {x.dtype}")
    if x.ndim == 0:
        raise ValueError("l2norm: `x` must have at least one axis (normalised over the last one)")
    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    return (xf * lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + L2NORM_EPS)).astype(x.dtype)


def prepare_qk(q, k, dims: Dims, use_qk_l2norm_in_kernel: bool):
    """Optional L2 norm of q/k, then repeat them over value-head groups (value head j reads qk head j // G)."""
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if dims.group > 1:
        q = jnp.repeat(q, dims.group, axis=2)
        k = jnp.repeat(k, dims.group, axis=2)
    return q, k


def sequence_ids(cu_seqlens: jax.Array, T: int):
    """For packed varlen input: per-token sequence index and whether the token starts its sequence.

    Works with traced ``cu_seqlens``. Zero-length sequences own no token.
    """
    cu = jnp.asarray(cu_seqlens, jnp.int32)  # numpy offsets too (indexed with traced values below)
    t = jnp.arange(T, dtype=jnp.int32)
    seq = jnp.searchsorted(cu[1:], t, side="right").astype(jnp.int32)
    start = t == cu[seq]
    return seq, start


def _recurrent(q, k, v, g, b, w, scale, h0, cu_seqlens, dims: Dims):
    """Token loop on head-aligned fp32/fp64 inputs. q,k,g,b: [B,T,HV,K]; v,w: [B,T,HV,V]; h0: [N,HV,K,V].

    Returns o [B,T,HV,V] (compute dtype) and the final states [N,HV,K,V].
    """
    def step(S, x):
        qt, kt, vt, gt, bt, wt = x  # [B,HV,K] / [B,HV,V]
        Sbar = jnp.exp(gt)[..., None] * S
        u = wt * vt - jnp.einsum("bhk,bhkv->bhv", bt * kt, Sbar)
        S = Sbar + kt[..., :, None] * u[..., None, :]
        o = scale * jnp.einsum("bhk,bhkv->bhv", qt, S)
        return S, o

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, b, w))  # time-major
    if cu_seqlens is None:
        S, o = lax.scan(step, h0, xs)
        return jnp.moveaxis(o, 0, 1), S

    seq, start = sequence_ids(cu_seqlens, dims.T)

    def vstep(carry, x):
        S, final = carry
        sq, st, *rest = x
        S = jnp.where(st, h0[sq][None], S)
        S, o = step(S, tuple(rest))
        final = lax.dynamic_update_index_in_dim(final, S[0], sq, axis=0)
        return (S, final), o

    S_init = jnp.zeros((1, dims.HV, dims.K, dims.V), h0.dtype)
    (_, final), o = lax.scan(vstep, (S_init, h0), (seq, start) + xs)
    return jnp.moveaxis(o, 0, 1), final


def naive_recurrent_gdn2(
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
):
    """Token-by-token GDN-2 recurrence (the ground truth), differentiable by ``jax.grad``.

    Args:
      q, k: ``[B, T, H, K]`` queries and keys (float16/bfloat16/float32/float64).
      v: ``[B, T, HV, V]`` values; HV must be a multiple of H (value head j reads qk head j // (HV/H)).
      g: ``[B, T, HV, K]`` natural-log per-key-channel decay (<= 0 in practice; decay is ``exp(g)``).
      b: ``[B, T, HV, K]`` activated erase gate (sigmoid output in [0, 1]; [0, 2] with negative eigenvalues).
      w: ``[B, T, HV, V]`` activated write gate in [0, 1].
      scale: multiplies q; default ``K ** -0.5``. Must be > 0.
      initial_state: ``[N, HV, K, V]`` float32 (float64 under x64); N = B, or len(cu_seqlens) - 1. Default zeros.
      output_final_state: also return the final state ``[N, HV, K, V]``.
      use_qk_l2norm_in_kernel: L2-normalise q and k over K first (``x / sqrt(sum x^2 + 1e-6)``).
      cu_seqlens: ``[N + 1]`` int offsets of sequences packed along T (requires B == 1); the state resets to
        ``initial_state[n]`` (or zero) at every sequence start.

    Returns:
      ``(o, final_state)``: o ``[B, T, HV, V]`` in q's dtype; final_state in float32 (float64 under x64 when
      any input is float64), or None when ``output_final_state`` is False.

    Raises:
      ValueError / TypeError naming the argument for bad shapes, dtypes or values.
    """
    dims = check_inputs(
        "naive_recurrent_gdn2", q, k, v, g, b, w, scale=scale, initial_state=initial_state,
        cu_seqlens=cu_seqlens, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )
    def run(q, k, v, g, b, w, h0):
        return recurrent_forward(q, k, v, g, b, w, dims, h0, cu_seqlens, output_final_state,
                                 use_qk_l2norm_in_kernel)

    return run_poisoned_if_invalid_cu_seqlens(cu_seqlens, dims.T, run, q, k, v, g, b, w, initial_state)


def recurrent_forward(q, k, v, g, b, w, dims: Dims, initial_state, cu_seqlens,
                      output_final_state: bool, use_qk_l2norm_in_kernel: bool):
    """``naive_recurrent_gdn2`` after validation (also the xla backend of ``fused_recurrent_gdn2``)."""
    cdt = dims.compute_dtype
    out_dtype = jax.dtypes.canonicalize_dtype(q.dtype)  # numpy float64 without x64 -> float32, no warning
    q, k = prepare_qk(q, k, dims, use_qk_l2norm_in_kernel)
    h0 = (jnp.zeros((dims.N, dims.HV, dims.K, dims.V), cdt) if initial_state is None
          else jnp.asarray(initial_state).astype(cdt))  # numpy h0 must be indexable by traced ids
    o, final = _recurrent(*(x.astype(cdt) for x in (q, k, v, g, b, w)), dims.scale, h0,
                          cu_seqlens, dims)
    return o.astype(out_dtype), (final if output_final_state else None)

"""The token loop: the ground truth ``naive_recurrent_gdn2`` and the xla backend of ``fused_recurrent_gdn2``.

Per token, for each sequence and value head (paper arXiv:2605.22791 eq. 10; FLA ``fla/ops/gdn2/naive.py``)::

    S̄_t = Diag(exp g_t) S_{t-1}
    u_t = w_t ⊙ v_t − S̄_tᵀ (b_t ⊙ k_t)
    S_t = S̄_t + k_t u_tᵀ
    o_t = scale · S_tᵀ q_t

A ``lax.scan`` over T, differentiated by JAX autodiff. Kernel twin: ``kernels/recurrent_fwd.py``. With a state pool
(FLA's continuous batching, ``ssm_state_indices``) the start states are gathered from the pool and the final (or
per-token) states scattered back into it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .common import prepare_qk, sequence_ids

__all__ = ["recurrent_forward"]


def _recurrent(q, k, v, g, b, w, scale, h0, cu_seqlens, T: int, states=False):
    """Token loop on head-aligned inputs (compute dtype). q,k,g,b: [B,T,HV,K]; v,w: [B,T,HV,V]; h0: [N,HV,K,V].

    Returns o [B,T,HV,V] and the final states [N,HV,K,V]; with ``states`` also the state after every token,
    ``[T, B, HV, K, V]`` (dense) or ``[T, HV, K, V]`` (packed varlen).
    """
    def step(S, x):
        qt, kt, vt, gt, bt, wt = x  # [B,HV,K] / [B,HV,V]
        Sbar = jnp.exp(gt)[..., None] * S
        u = wt * vt - jnp.einsum("bhk,bhkv->bhv", bt * kt, Sbar)
        S = Sbar + kt[..., :, None] * u[..., None, :]
        o = scale * jnp.einsum("bhk,bhkv->bhv", qt, S)
        return S, o

    def step_s(S, x):
        S, o = step(S, x)
        return S, (o, S) if states else o

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, b, w))  # time-major
    if cu_seqlens is None:
        S, ys = lax.scan(step_s, h0, xs)
        return (jnp.moveaxis(ys[0], 0, 1), S, ys[1]) if states else (jnp.moveaxis(ys, 0, 1), S)

    seq, start = sequence_ids(cu_seqlens, T)

    def vstep(carry, x):
        S, final = carry
        sq, st, *rest = x
        S = jnp.where(st, h0[sq][None], S)
        S, o = step(S, tuple(rest))
        final = lax.dynamic_update_index_in_dim(final, S[0], sq, axis=0)
        return (S, final), ((o, S[0]) if states else o)

    S_init = jnp.zeros((1,) + h0.shape[1:], h0.dtype)
    (_, final), ys = lax.scan(vstep, (S_init, h0), (seq, start) + xs)
    return (jnp.moveaxis(ys[0], 0, 1), final, ys[1]) if states else (jnp.moveaxis(ys, 0, 1), final)


def _pool_slot(idx, P):
    """Slot indices for a scatter: padding (negative) and out-of-range slots become P, which ``mode="drop"``
    drops (a negative index would otherwise wrap around)."""
    idx = jnp.asarray(idx, jnp.int32)
    return jnp.where((idx >= 0) & (idx < P), idx, P)


def recurrent_forward(p, q, k, v, g, b, w, initial_state, cu_seqlens, poison=None, ssm_state_indices=None,
                      num_accepted_tokens=None):
    """Token loop for a validated call ``p`` (``gdn2_jax.validation.Problem``). Returns ``(o in q's dtype,
    final state [N, HV, K, V] in the compute dtype, or None)``.

    With ``ssm_state_indices`` (``p.options["state_pool"]`` = ``"slot"`` for ``[N]``, ``"token"`` for ``[N, L]``)
    ``initial_state`` is a pool ``[P, HV, K, V]`` and the returned state is the updated pool: sequence n starts
    from slot ``idx[n]`` (``idx[n, num_accepted_tokens[n] - 1]``, or ``idx[n, 0]``, per token) and writes its final
    state to ``idx[n]`` (per token: the state after its token t to ``idx[n, t]``); padding slots (< 0) start from
    zero and are not written. ``poison`` (a float32 scalar 1 / NaN, ``validation.run_poisoned``) multiplies o and
    every state written.
    """
    f = (lambda x: x) if poison is None else (lambda x: x * poison.astype(x.dtype))  # noqa: E731
    dims = p.dims
    cdt = dims.compute_dtype
    out_dtype = jax.dtypes.canonicalize_dtype(q.dtype)  # numpy float64 without x64 -> float32, no warning
    # normalise in the compute dtype: no rounding of the normalised q / k back to a 16-bit input dtype
    q, k = prepare_qk(jnp.asarray(q).astype(cdt), jnp.asarray(k).astype(cdt), dims.group, p.use_qk_l2norm_in_kernel)
    xs = tuple(jnp.asarray(x).astype(cdt) for x in (q, k, v, g, b, w))
    if ssm_state_indices is None:
        h0 = (jnp.zeros((dims.N, dims.HV, dims.K, dims.V), cdt) if initial_state is None
              else jnp.asarray(initial_state).astype(cdt))  # numpy h0 must be indexable by traced ids
        o, final = _recurrent(*xs, dims.scale, h0, cu_seqlens, dims.T)
        return f(o).astype(out_dtype), (f(final) if p.output_final_state else None)

    pool = jnp.asarray(initial_state).astype(cdt)
    P = pool.shape[0]
    idx = jnp.asarray(ssm_state_indices, jnp.int32)
    per_token = p.option("state_pool") == "token"
    if not per_token:
        s0 = idx
    else:
        L = idx.shape[1]
        first = (jnp.zeros((dims.N,), jnp.int32) if num_accepted_tokens is None
                 else jnp.clip(jnp.asarray(num_accepted_tokens, jnp.int32), 1, L) - 1)
        s0 = jnp.take_along_axis(idx, first[:, None], axis=1)[:, 0]
    inb = (s0 >= 0) & (s0 < P)
    h0 = jnp.where(inb[:, None, None, None], pool[jnp.clip(s0, 0, P - 1)], jnp.zeros((), cdt))
    o, final, *states = _recurrent(*xs, dims.scale, h0, cu_seqlens, dims.T, states=per_token)
    if not per_token:
        pool = pool.at[_pool_slot(idx, P)].set(f(final), mode="drop")
    elif cu_seqlens is None:  # states [T, N, ...]: token t of sequence n -> slot idx[n, t]
        pool = pool.at[_pool_slot(idx[:, :dims.T].T, P)].set(f(states[0]), mode="drop")
    else:  # packed: token t is token pos of sequence seq; no slot beyond column L
        seq, _ = sequence_ids(cu_seqlens, dims.T)
        pos = jnp.arange(dims.T, dtype=jnp.int32) - jnp.asarray(cu_seqlens, jnp.int32)[seq]
        slot = jnp.where(pos < L, idx[seq, jnp.minimum(pos, L - 1)], -1)
        pool = pool.at[_pool_slot(slot, P)].set(f(states[0]), mode="drop")
    return f(o).astype(out_dtype), (pool if p.output_final_state else None)

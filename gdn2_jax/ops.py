"""Public GDN-2 ops: ``chunk_gdn2`` (prefill / training) and ``fused_recurrent_gdn2`` (decode).

Names, shapes and semantics follow FLA's ``fla.ops.gdn2`` (flash-linear-attention 0.6.0) and the paper
(Hatamizadeh, Choi, Kautz, "Gated DeltaNet-2", arXiv:2605.22791), with two deliberate differences:
everything after ``w`` is keyword-only, and grouped value heads (HV a multiple of H) are accepted by
both ops. Each op is validated, dispatched to a backend and poisoned by the one entry path (``_entry.call``).
"""

from __future__ import annotations

import jax

from ._entry import ARGS_DOC, BACKEND_DOC, OPS_RETURNS_DOC, call

__all__ = ["chunk_gdn2", "fused_recurrent_gdn2"]

Array = jax.Array


def chunk_gdn2(q: Array, k: Array, v: Array, g: Array, b: Array, w: Array, *, scale: float | None = None,
               initial_state: Array | None = None, output_final_state: bool = False,
               use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Array | None = None, backend: str = "auto"):
    """Chunked (C = 64, WY form) GDN-2 for prefill and training.

    Computes, per sequence and value head, ``S_t = (I − k_t (b_t⊙k_t)ᵀ) Diag(exp g_t) S_{t−1} + k_t (w_t⊙v_t)ᵀ``
    and ``o_t = scale · S_tᵀ q_t`` (paper eq. 10; FLA ``chunk_gdn2``). Works under ``jax.jit``, ``jax.grad``
    (hand-written chunk-level VJP for all seven inputs q, k, v, g, b, w, initial_state), ``jax.vmap`` and
    ``jax.checkpoint``. Reverse mode only (the VJP is a ``jax.custom_vjp``): for ``jax.jvp`` / ``jax.jacfwd`` use
    :func:`naive_chunk_gdn2` or ``fused_recurrent_gdn2(..., backend="xla")``.
    """
    return call("chunk_gdn2", locals())


def fused_recurrent_gdn2(q: Array, k: Array, v: Array, g: Array, b: Array, w: Array, *, scale: float | None = None,
                         initial_state: Array | None = None, output_final_state: bool = False,
                         use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Array | None = None,
                         inplace_final_state: bool = False, ssm_state_indices: Array | None = None,
                         num_accepted_tokens: Array | None = None, backend: str = "auto"):
    """Token-recurrent GDN-2 for decode and short inputs (one token, or a few).

    Same operator and arguments as :func:`chunk_gdn2`; cost is linear in T with a sequential loop, so use
    it for T up to ~64. FLA's version takes ``A_log`` as its 7th positional argument; here everything after
    ``w`` is keyword-only. The xla backend is differentiable (autodiff through the token loop).

    ``inplace_final_state=True`` (FLA's serving argument) returns the final state in ``initial_state``'s buffer
    and dtype (it implies ``output_final_state=True``): donate the state to ``jax.jit`` or carry it through
    ``lax.scan`` / ``fori_loop`` and the kernel updates it in place, with no copy of the state per step. The call
    stays functional (a caller's array is never modified): where XLA cannot reuse the buffer (a state that is not
    donated), it copies it first.

    Serving (FLA's continuous batching and speculative decoding): with ``ssm_state_indices`` the ``initial_state``
    is a state pool ``[P, HV, K, V]`` and the returned final state is always that pool (whatever
    ``output_final_state`` / ``inplace_final_state`` say), in the pool's buffer when it is donated or loop-carried
    (as with ``inplace_final_state``; otherwise XLA copies it first): sequence n reads and writes only its slots.
    ``ssm_state_indices [N]``: start from slot ``[n]``, write the final state there. ``ssm_state_indices [N, L]``
    (one slot per draft token, L >= the tokens of every sequence): the state after token t goes to slot ``[n, t]``,
    and the sequence starts from slot ``[n, num_accepted_tokens[n] - 1]`` (slot ``[n, 0]`` without
    ``num_accepted_tokens``), i.e. from the state after the draft tokens the previous step accepted. A negative slot
    is padding: start from zero, write nothing.
    """
    return call("fused_recurrent_gdn2", locals())


chunk_gdn2.__doc__ += ARGS_DOC + BACKEND_DOC + OPS_RETURNS_DOC
fused_recurrent_gdn2.__doc__ += ARGS_DOC + """
      inplace_final_state: let the final state reuse ``initial_state``'s buffer (required then); see above.
      ssm_state_indices: ``[N]`` or ``[N, L]`` int32/int64 pool slots (see above); slots must be < P and the
        non-negative ones distinct (concrete: ValueError; traced: checked on the device, invalid ones make the
        outputs and the written slots NaN).
      num_accepted_tokens: ``[N]`` int, in [1, L]: how many draft tokens of sequence n the last step accepted
        (needs ``ssm_state_indices [N, L]``).""" + \
    BACKEND_DOC + OPS_RETURNS_DOC

"""Pure-jnp GDN-2 references, differentiable by plain autodiff.

``naive_recurrent_gdn2`` is the ground truth: a token loop (``lax.scan``) over the recurrence of
Gated DeltaNet-2 (Hatamizadeh, Choi, Kautz, arXiv:2605.22791, eq. 10; FLA ``fla/ops/gdn2/naive.py``)::

    S̄_t = Diag(exp g_t) S_{t-1}
    u_t = w_t ⊙ v_t − S̄_tᵀ (b_t ⊙ k_t)
    S_t = S̄_t + k_t u_tᵀ
    o_t = scale · S_tᵀ q_t

``naive_chunk_gdn2`` evaluates the same operator chunk by chunk in the WY form (``gdn2_jax.xla``). Math runs in
float32 (float64 when any input is float64, which needs ``jax_enable_x64``).
"""

from __future__ import annotations

import jax

from ._entry import ARGS_DOC, RETURNS_DOC, call
from .xla.chunk import CHUNK_SIZE
from .xla.common import l2norm

__all__ = ["naive_recurrent_gdn2", "naive_chunk_gdn2", "l2norm"]

Array = jax.Array


def naive_recurrent_gdn2(q: Array, k: Array, v: Array, g: Array, b: Array, w: Array, *, scale: float | None = None,
                         initial_state: Array | None = None, output_final_state: bool = False,
                         use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Array | None = None):
    """Token-by-token GDN-2 recurrence (the ground truth), differentiable by ``jax.grad``.
    """
    return call("naive_recurrent_gdn2", locals())


def naive_chunk_gdn2(q: Array, k: Array, v: Array, g: Array, b: Array, w: Array, *, scale: float | None = None,
                     initial_state: Array | None = None, output_final_state: bool = False,
                     use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Array | None = None,
                     chunk_size: int = CHUNK_SIZE):
    """Chunked (WY form) GDN-2 reference in pure jnp, differentiable by plain autodiff.

    Same operator as :func:`naive_recurrent_gdn2` (FLA ``fla/ops/gdn2/naive.py::naive_chunk_gdn2``), evaluated
    chunk by chunk with the Γ-form of the WY representation (``gdn2_jax.xla``). Pairwise decays are only
    exponentiated for s ≤ r (masked before ``exp``), so strong decay (g ≈ −60 per token) gives finite outputs and
    gradients. Each chunk is rematerialised (``jax.checkpoint``) in the backward.
    """
    return call("naive_chunk_gdn2", locals())


naive_recurrent_gdn2.__doc__ += ARGS_DOC + RETURNS_DOC
naive_chunk_gdn2.__doc__ += ARGS_DOC + """
      chunk_size: chunk length C, a positive int (FLA fixes 64); a longer chunk than T is clamped to T.""" + \
    RETURNS_DOC

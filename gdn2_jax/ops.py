"""Public GDN-2 ops: ``chunk_gdn2`` (prefill / training) and ``fused_recurrent_gdn2`` (decode).

Names, shapes and semantics follow FLA's ``fla.ops.gdn2`` (flash-linear-attention 0.6.0) and the paper
(Hatamizadeh, Choi, Kautz, "Gated DeltaNet-2", arXiv:2605.22791), with two deliberate differences:
everything after ``w`` is keyword-only, and grouped value heads (HV a multiple of H) are accepted by
both ops.
"""

from __future__ import annotations

import jax

from . import _backend, _tilelang_ops
from ._chunk import chunk_forward_xla
from ._validation import check_inputs, run_poisoned_if_invalid_cu_seqlens
from .reference import recurrent_forward

__all__ = ["chunk_gdn2", "fused_recurrent_gdn2"]


def _pick_backend(backend, fn, q, k, v, g, b, w, dims, initial_state) -> str:
    """Resolve ``backend``; ``"auto"`` falls back to xla when the kernels cannot take these inputs
    (e.g. float32 inputs or an unsupported head dim), instead of raising the kernels' error."""
    be = _backend.resolve(backend, fn)
    if be == "tilelang" and backend == "auto":
        try:
            _tilelang_ops._check_supported(fn, q, k, v, g, b, w, dims, initial_state)
        except (TypeError, ValueError):
            return "xla"
    return be


_DOC_ARGS = """
    Args:
      q, k: ``[B, T, H, K]`` queries and keys; float16, bfloat16, float32 (float64 under x64, xla only).
      v: ``[B, T, HV, V]`` values. HV must be a positive multiple of H; value head j reads qk head j // (HV/H).
      g: ``[B, T, HV, K]`` per-key-channel decay in natural-log units (decay factor ``exp(g)``, so g <= 0 in
        practice; float32 recommended, bfloat16 accepted).
      b: ``[B, T, HV, K]`` activated erase gate, in [0, 1] (sigmoid), or [0, 2] for negative eigenvalues.
      w: ``[B, T, HV, V]`` activated write gate, in [0, 1].
      scale: positive float multiplying q; default ``K ** -0.5``.
      initial_state: ``[N, HV, K, V]`` float32 state per sequence (N = B, or ``len(cu_seqlens) - 1``);
        default zeros. float64 is accepted; under x64 it makes the math float64 (without x64, float32).
      output_final_state: if True also return the final state ``[N, HV, K, V]`` (in the compute dtype, below).
      use_qk_l2norm_in_kernel: L2-normalise q and k over K first (``x * rsqrt(sum x^2 + 1e-6)`` in fp32).
      cu_seqlens: ``[N + 1]`` int32/int64 offsets of sequences packed along T (requires B == 1). Each sequence
        starts from ``initial_state[n]`` (or zero); zero-length sequences are allowed. Concrete offsets are
        checked in Python (ValueError); traced ones are checked on the device, and invalid ones (not starting
        at 0, decreasing, or not ending at T) make ``o`` and ``final_state`` NaN, and every gradient through
        them (an input the loss does not depend on at all, e.g. q for a loss on the final state alone, keeps
        its exact zero gradient). numpy offsets count as concrete, also under ``jax.jit``.
      backend: ``"xla"`` (pure jnp, any device, differentiable), ``"tilelang"`` (TileLang kernels on NVIDIA
        Hopper GPUs), or ``"auto"`` (tilelang where it is available and supports the inputs' dtypes and head
        dims, else xla).

    Returns:
      ``(o, final_state)``: o ``[B, T, HV, V]`` in q's dtype; final_state ``[N, HV, K, V]`` float32, or float64
      when x64 is enabled and any input (``initial_state`` included) is float64; None when
      ``output_final_state`` is False.

    Raises:
      TypeError / ValueError, naming the argument, for wrong shapes, dtypes or values (checked in Python
      before anything runs); NotImplementedError for a backend that cannot serve the call.
"""


def chunk_gdn2(
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
    backend: str = "auto",
):
    """Chunked (C = 64, WY form) GDN-2 for prefill and training.

    Computes, per sequence and value head, ``S_t = (I − k_t (b_t⊙k_t)ᵀ) Diag(exp g_t) S_{t−1} + k_t (w_t⊙v_t)ᵀ``
    and ``o_t = scale · S_tᵀ q_t`` (paper eq. 10; FLA ``chunk_gdn2``). Works under ``jax.jit``, ``jax.grad``
    (hand-written chunk-level VJP for all seven inputs q, k, v, g, b, w, initial_state), ``jax.vmap`` and
    ``jax.checkpoint``.
    """
    return _run("chunk_gdn2", _tilelang_ops.chunk_gdn2, chunk_forward_xla, q, k, v, g, b, w, scale=scale,
                initial_state=initial_state, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, backend=backend)


def fused_recurrent_gdn2(
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
    backend: str = "auto",
):
    """Token-recurrent GDN-2 for decode and short inputs (one token, or a few).

    Same operator and arguments as :func:`chunk_gdn2`; cost is linear in T with a sequential loop, so use
    it for T up to ~64. FLA's version takes ``A_log`` as its 7th positional argument; here everything after
    ``w`` is keyword-only. The xla backend is differentiable (autodiff through the token loop).
    """
    return _run("fused_recurrent_gdn2", _tilelang_ops.fused_recurrent_gdn2, recurrent_forward, q, k, v, g, b, w,
                scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, backend=backend)


def _run(fn, tilelang_impl, xla_impl, q, k, v, g, b, w, *, scale, initial_state, output_final_state,
         use_qk_l2norm_in_kernel, cu_seqlens, backend):
    """Shared body of the public ops: validate, pick the backend, run, poison on invalid traced cu_seqlens."""
    _backend.check_backend(backend, fn)
    dims = check_inputs(fn, q, k, v, g, b, w, scale=scale, initial_state=initial_state,
                        cu_seqlens=cu_seqlens, output_final_state=output_final_state,
                        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    if _pick_backend(backend, fn, q, k, v, g, b, w, dims, initial_state) == "tilelang":
        def run(q, k, v, g, b, w, h0):
            return tilelang_impl(q, k, v, g, b, w, dims=dims, initial_state=h0,
                                 output_final_state=output_final_state,
                                 use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)
    else:
        def run(q, k, v, g, b, w, h0):
            return xla_impl(q, k, v, g, b, w, dims, h0, cu_seqlens, output_final_state, use_qk_l2norm_in_kernel)
    return run_poisoned_if_invalid_cu_seqlens(cu_seqlens, dims.T, run, q, k, v, g, b, w, initial_state)


chunk_gdn2.__doc__ += _DOC_ARGS
fused_recurrent_gdn2.__doc__ += _DOC_ARGS

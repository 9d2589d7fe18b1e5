"""The one entry path of every public op: validate -> dispatch -> poison, and the shared parts of their docstrings.

A public op is a plain function with its own signature whose body is ``return call("<op>", locals())``. Here:

1. **validate** (``validation.check_inputs`` and the op's own options), in Python, before anything is staged;
2. **dispatch**: the references (``naive_*``) to their jnp implementation; ops with kernels (``kernels.registry``)
   to ``backend="tilelang"`` (``_tilelang.forward``) or their xla fallback (the registry's ``xla`` entry), where
   ``"auto"`` takes the kernels when they can run *and* support the inputs;
3. **poison**: invalid traced ``cu_seqlens`` / pool indices turn the outputs and the gradients into NaN
   (``validation.run_poisoned``).
"""

from __future__ import annotations

import functools

import jax

from kernels import registry

from . import backends
from .validation import (SCALE_RANGE, Problem, _is_concrete, canonical_slots, check_bool, check_inputs,
                         check_positive_int, check_state_pool, run_poisoned, traced_cu_seqlens_valid,
                         traced_state_pool_valid)

__all__ = ["call", "ARGS_DOC", "RETURNS_DOC", "OPS_RETURNS_DOC"]

# Implementations of the references (ops without a backend argument).
_REFERENCES = {
    "naive_recurrent_gdn2": "gdn2_jax.xla.recurrent:recurrent_forward",
    "naive_chunk_gdn2": "gdn2_jax.xla.chunk:naive_chunk_forward",
}
_ARRAYS = ("q", "k", "v", "g", "b", "w")


@functools.lru_cache(maxsize=None)
def _impl(path: str):
    return registry.resolve(path)


def _choose(p: Problem, backend, arrays, initial_state):
    """The implementation ``impl(p, q, k, v, g, b, w, initial_state, cu_seqlens)`` of this call."""
    if p.op in _REFERENCES:
        return _impl(_REFERENCES[p.op])
    be = backends.resolve(backend, p.op)
    if be == "tilelang":
        from . import _tilelang

        if backend == "auto":  # fall back to xla for inputs the kernels do not take, instead of raising
            try:
                _tilelang.check_supported(p, *arrays, initial_state)
            except (TypeError, ValueError):
                return _impl(registry.get(p.op).xla)
        return _tilelang.forward
    return _impl(registry.get(p.op).xla)


def call(op: str, args: dict):
    """Run public op ``op`` on its arguments ``args`` (the op's ``locals()``). Returns ``(o, final_state)``."""
    a = dict(args)
    backend = a.pop("backend", None)
    if backend is not None:
        backend = backends.check_backend(backend, op)
    arrays = [a.pop(n) for n in _ARRAYS]
    initial_state, cu_seqlens = a.pop("initial_state"), a.pop("cu_seqlens")
    output_final_state, use_l2 = a.pop("output_final_state"), a.pop("use_qk_l2norm_in_kernel")
    idx, acc = a.pop("ssm_state_indices", None), a.pop("num_accepted_tokens", None)
    if acc is not None and idx is None:
        raise ValueError(f"{op}: `num_accepted_tokens` needs `ssm_state_indices`")
    dims = check_inputs(op, *arrays, scale=a.pop("scale"), initial_state=initial_state, cu_seqlens=cu_seqlens,
                        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_l2,
                        state_pool=idx is not None)
    options, serving = {}, {}
    inplace = "inplace_final_state" in a and check_bool(op, "inplace_final_state", a.pop("inplace_final_state"))
    if idx is not None:
        options["state_pool"] = check_state_pool(op, initial_state, idx, acc, N=dims.N, T=dims.T,
                                                 cu_seqlens=cu_seqlens)
        serving = dict(ssm_state_indices=canonical_slots(idx, initial_state.shape[0]), num_accepted_tokens=acc)
        inplace = True  # a pool is always returned, updated where it lies (XLA copies it unless donated)
    if inplace:
        if initial_state is None:
            raise ValueError(f"{op}: `inplace_final_state=True` needs an `initial_state` to update")
        options["inplace_final_state"] = True
        output_final_state = True
    if "chunk_size" in a:
        options["chunk_size"] = check_positive_int(op, "chunk_size", a.pop("chunk_size"))
    if a:
        raise TypeError(f"{op}: unexpected arguments {sorted(a)}")
    p = Problem(op, dims, bool(output_final_state), bool(use_l2), tuple(sorted(options.items())))
    impl = _choose(p, backend, arrays, initial_state)

    def run(q, k, v, g, b, w, h0, poison):
        return impl(p, q, k, v, g, b, w, h0, cu_seqlens, poison=poison, **serving)

    valid = None  # device-side validity of traced arguments (concrete ones were checked above)
    if cu_seqlens is not None and not _is_concrete(cu_seqlens):
        valid = traced_cu_seqlens_valid(cu_seqlens, dims.T)
    if idx is not None and not all(x is None or _is_concrete(x) for x in (idx, acc, cu_seqlens)):
        ok = traced_state_pool_valid(idx, acc, initial_state.shape[0], cu_seqlens)
        valid = ok if valid is None else valid & ok
    o, final_state = run_poisoned(valid, run, *arrays, initial_state)
    if inplace and final_state is not None:
        # the in-place state keeps its buffer's dtype (float64 inputs under x64 compute in float64): a loop carrying
        # it sees the same type in and out (as JAX stores it: a NumPy float64 state is float32 without x64)
        state_dtype = jax.dtypes.canonicalize_dtype(initial_state.dtype)
        if final_state.dtype != state_dtype:
            final_state = final_state.astype(state_dtype)
    return o, final_state


ARGS_DOC = f"""
    Args:
      q, k: ``[B, T, H, K]`` queries and keys; float16, bfloat16, float32 (float64 under x64, not on the kernels).
        The erase step ``I - k (b*k)^T`` keeps the state bounded only while ``sum_i b_i k_i^2 <= 2``: pass unit-norm
        keys, or ``use_qk_l2norm_in_kernel=True`` (which the Flax layer always sets), with b in [0, 2]. Larger
        keys make the state grow exponentially in T, as in FLA's ``fla/ops/gdn2``.
      v: ``[B, T, HV, V]`` values. HV must be a positive multiple of H; value head j reads qk head j // (HV/H).
      g: ``[B, T, HV, K]`` per-key-channel decay in natural-log units (decay factor ``exp(g)``, so g <= 0 in
        practice; float32 recommended, bfloat16 accepted).
      b: ``[B, T, HV, K]`` activated erase gate, in [0, 1] (sigmoid), or [0, 2] for negative eigenvalues.
      w: ``[B, T, HV, V]`` activated write gate, in [0, 1].
      scale: real number multiplying q (a Python or NumPy int or float, or a 0-d array; static, not traced);
        default ``K ** -0.5``. It must lie in {SCALE_RANGE} (ValueError outside it, also for float64
        math under x64). The range only makes the scale representable: near either end o can still overflow or
        lose precision, depending on the data.
      initial_state: ``[N, HV, K, V]`` float32 state per sequence (N = B, or ``len(cu_seqlens) - 1``);
        default zeros. float64 is accepted; under x64 it makes the math float64 (without x64, float32).
      output_final_state: if True also return the final state ``[N, HV, K, V]`` (in the compute dtype, below).
      use_qk_l2norm_in_kernel: L2-normalise q and k over K first (``x * rsqrt(sum x^2 + 1e-6)`` in the compute
        dtype: float32, or float64 for float64 inputs under x64).
      cu_seqlens: ``[N + 1]`` integer (int32 / int64) offsets of sequences packed along T (requires B == 1).
        Each sequence starts from ``initial_state[n]`` (or zero); zero-length sequences are allowed. Concrete
        offsets are checked in Python (ValueError); traced ones are checked on the device, and invalid ones (not
        starting at 0, decreasing, or not ending at T) make ``o`` and ``final_state`` NaN, and every gradient through
        them (an input the loss does not depend on at all, e.g. q for a loss on the final state alone, keeps
        its exact zero gradient). numpy offsets count as concrete, also under ``jax.jit``."""

BACKEND_DOC = """
      backend: ``"xla"`` (pure jnp, any device, differentiable), ``"tilelang"`` (TileLang kernels on NVIDIA
        Hopper GPUs), or ``"auto"`` (default: tilelang where it is available and supports the inputs' dtypes and
        head dims, else xla)."""

_RETURNS_TEMPLATE = """

    Returns:
      ``(o, final_state)``: o ``[B, T, HV, V]`` in q's dtype; final_state ``[N, HV, K, V]`` float32, or float64
      when x64 is enabled and any input (``initial_state`` included) is float64; None when
      ``output_final_state`` is False.

    Raises:
      TypeError / ValueError, naming the argument, for wrong shapes, dtypes or values (checked in Python
      before anything runs){backend_error}.
"""
# the jnp references take no backend; the public ops' Raises section also names the backend error
RETURNS_DOC = _RETURNS_TEMPLATE.format(backend_error="")
OPS_RETURNS_DOC = _RETURNS_TEMPLATE.format(
    backend_error="; NotImplementedError for a backend that cannot serve the call")

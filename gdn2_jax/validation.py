"""Argument checks shared by every GDN-2 entry point (public: layers built on the ops use them too).

Every check here runs in Python at trace time, before any computation is staged, and raises a
``ValueError`` or ``TypeError`` whose message names the offending argument. The only checks that look
at values are those of *concrete* arrays (NaN/inf gates, ``cu_seqlens`` offsets; numpy on the host, one
reduction for jax arrays). Traced ``cu_seqlens`` are checked on the device instead: see
:func:`run_poisoned`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Dims", "Problem", "check_inputs", "check_cu_seqlens", "check_state_pool", "canonical_slots", "check_bool",
           "check_option", "check_positive_int", "check_positive_float", "check_f32_normal", "check_finite_gates",
           "concrete_all", "traced_cu_seqlens_valid", "traced_state_pool_valid", "run_poisoned"]

_FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)


@dataclasses.dataclass(frozen=True)
class Dims:
    """Static problem description derived from validated inputs."""

    B: int
    T: int
    H: int  # query/key heads
    HV: int  # value heads (a multiple of H)
    K: int
    V: int
    N: int  # number of sequences (B, or len(cu_seqlens) - 1)
    scale: float
    compute_dtype: Any  # jnp.float32, or jnp.float64 when any input is float64 and x64 is enabled
    varlen: bool

    @property
    def group(self) -> int:
        """Value heads per query/key head (HV // H)."""
        return self.HV // self.H


@dataclasses.dataclass(frozen=True)
class Problem:
    """One validated call of a public op: what every implementation (xla, tilelang, reference) receives, with
    the arrays passed positionally as ``impl(problem, q, k, v, g, b, w, initial_state, cu_seqlens)``."""

    op: str                         # public op name, e.g. "chunk_gdn2"
    dims: Dims
    output_final_state: bool
    use_qk_l2norm_in_kernel: bool
    options: tuple = ()             # op-specific statics as sorted (name, value) pairs, e.g. (("chunk_size", 16),)

    def option(self, name, default=None):
        return dict(self.options).get(name, default)


_LAYOUT = dict(q="[B, T, H, K]", k="[B, T, H, K]", v="[B, T, HV, V]", w="[B, T, HV, V]",
               g="[B, T, HV, K]", b="[B, T, HV, K]")


def _is_float(x) -> bool:
    return any(np.dtype(x.dtype) == np.dtype(d) for d in _FLOAT_DTYPES)


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_inputs(
    fn: str,
    q,
    k,
    v,
    g,
    b,
    w,
    *,
    scale,
    initial_state,
    cu_seqlens,
    output_final_state,
    use_qk_l2norm_in_kernel,
    state_pool: bool = False,
) -> Dims:
    """Validate the arguments of ``chunk_gdn2`` / ``fused_recurrent_gdn2`` and friends.

    With ``state_pool`` the ``initial_state`` is a pool ``[P, HV, K, V]`` of any P >= 1 (checked further by
    :func:`check_state_pool`). Returns the static :class:`Dims`. Raises ``TypeError`` for wrong dtypes or non-array
    inputs and ``ValueError`` for wrong shapes or values (including NaN/inf in concrete g, b, w, and concrete
    ``cu_seqlens`` that do not run from 0 to T without decreasing); every message starts with ``fn`` and
    names the argument.
    """
    named = dict(q=q, k=k, v=v, g=g, b=b, w=w)
    for name, x in named.items():
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{fn}: `{name}` must be an array, got {type(x).__name__}")
        if len(x.shape) != 4:
            raise ValueError(
                f"{fn}: `{name}` must be 4-D {_LAYOUT[name]}, got shape {tuple(x.shape)} "
                f"({len(x.shape)}-D)"
            )
        if not _is_float(x):
            raise TypeError(
                f"{fn}: `{name}` must be a floating-point array (float16, bfloat16, float32 or "
                f"float64), got dtype {x.dtype}"
            )
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"{fn}: `k` must have the shape of `q` {tuple(q.shape)} [B, T, H, K], got {tuple(k.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if v.shape[:2] != (B, T):
        raise ValueError(
            f"{fn}: `v` must share B and T with `q` ({B}, {T}), got shape {tuple(v.shape)}"
        )
    if w.shape != v.shape:
        raise ValueError(f"{fn}: `w` must have the shape of `v` {tuple(v.shape)} [B, T, HV, V], got {tuple(w.shape)}")
    for name in ("g", "b"):
        x = named[name]
        if x.shape != (B, T, HV, K):
            raise ValueError(
                f"{fn}: `{name}` must have shape [B, T, HV, K] = {(B, T, HV, K)}, got {tuple(x.shape)}"
            )
    if H == 0 or HV % H != 0:
        raise ValueError(
            f"{fn}: the number of value heads HV={HV} (from `v`) must be a positive multiple of the "
            f"number of query/key heads H={H} (from `q`)"
        )
    if K < 1:
        raise ValueError(f"{fn}: unsupported key head dim K={K} (from `q`); K must be >= 1")
    if V < 1:
        raise ValueError(f"{fn}: unsupported value head dim V={V} (from `v`); V must be >= 1")
    if HV < 1:
        raise ValueError(f"{fn}: `v` must have at least one head, got shape {tuple(v.shape)}")

    use_f64 = any(np.dtype(x.dtype) == np.float64 for x in named.values())

    scale = _check_scale(fn, scale, K)

    varlen = cu_seqlens is not None
    N = check_cu_seqlens(fn, cu_seqlens, B, T) if varlen else B

    if initial_state is not None:
        if not hasattr(initial_state, "shape") or not hasattr(initial_state, "dtype"):
            raise TypeError(f"{fn}: `initial_state` must be an array, got {type(initial_state).__name__}")
        shape = tuple(initial_state.shape)
        if state_pool and (len(shape) != 4 or shape[0] < 1 or shape[1:] != (HV, K, V)):
            raise ValueError(f"{fn}: with `ssm_state_indices`, `initial_state` is the state pool and must have shape "
                             f"[P, HV, K, V] = [P, {HV}, {K}, {V}] with P >= 1, got {shape}")
        if not state_pool and shape != (N, HV, K, V):
            raise ValueError(
                f"{fn}: `initial_state` must have shape [N, HV, K, V] = {(N, HV, K, V)}, "
                f"got {tuple(initial_state.shape)}"
            )
        sdt = np.dtype(initial_state.dtype)
        if sdt == np.float64:
            use_f64 = True
        elif sdt != np.float32:
            raise TypeError(
                f"{fn}: `initial_state` must be float32 (or float64 with jax_enable_x64), got {initial_state.dtype}"
            )

    check_bool(fn, "output_final_state", output_final_state)
    check_bool(fn, "use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)

    check_finite_gates(fn, g, b, w)

    return Dims(
        B=B, T=T, H=H, HV=HV, K=K, V=V, N=N, scale=scale,
        # float64 math only where JAX has float64 (x64); numpy float64 input otherwise computes in float32
        compute_dtype=jnp.float64 if use_f64 and jax.config.jax_enable_x64 else jnp.float32, varlen=varlen,
    )


def check_cu_seqlens(fn: str, cu_seqlens, B: int, T: int) -> int:
    """Check packed-sequence offsets ``cu_seqlens`` ``[N + 1]`` for input of batch B and length T; return N.

    Static checks (an integer 1-D array of at least two offsets, B == 1) always; the values (start at 0,
    non-decreasing, end at T) only of concrete offsets (numpy arrays count as concrete under ``jax.jit``).
    """
    if not hasattr(cu_seqlens, "shape") or not hasattr(cu_seqlens, "dtype"):
        raise TypeError(f"{fn}: `cu_seqlens` must be a 1-D integer array [N + 1], got {type(cu_seqlens).__name__}")
    if len(cu_seqlens.shape) != 1:
        raise ValueError(f"{fn}: `cu_seqlens` must be 1-D [N + 1], got shape {tuple(cu_seqlens.shape)}")
    if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
        raise TypeError(f"{fn}: `cu_seqlens` must have an integer dtype, got {cu_seqlens.dtype}")
    if cu_seqlens.shape[0] < 2:
        raise ValueError(f"{fn}: `cu_seqlens` must hold at least two offsets [0, ..., T], got {cu_seqlens.shape[0]}")
    if B != 1:
        raise ValueError(f"{fn}: with `cu_seqlens` the batch size must be 1 (sequences packed along T), got B={B}")
    if _is_concrete(cu_seqlens):
        cu = np.asarray(cu_seqlens)
        if cu[0] != 0:
            raise ValueError(f"{fn}: `cu_seqlens` must start at 0, got {cu[0]}")
        if np.any(np.diff(cu) < 0):
            raise ValueError(f"{fn}: `cu_seqlens` must be non-decreasing, got {cu.tolist()}")
        if cu[-1] != T:
            raise ValueError(f"{fn}: `cu_seqlens` must end at T={T}, got {cu[-1]}")
    return cu_seqlens.shape[0] - 1


_INT64_MAX = int(np.iinfo(np.int64).max)


def _got(value, as_what: str) -> str:
    """What a TypeError for an argument that must be static says it got: for a traced value, how to pass one
    (``as_what``: the form it takes, e.g. "a Python bool"); else the value's type and repr."""
    if not isinstance(value, jax.core.Tracer):
        return f"{type(value).__name__} {value!r}"
    return (f"a traced value (it must be known when the function is traced: under jax.jit pass it as a static "
            f"argument, static_argnums / static_argnames, and as {as_what}, since a static argument must be hashable, "
            "which an array, even a 0-d one, is not; under jax.vmap or jax.grad close over it rather than map or "
            "differentiate it (under vmap, in_axes=None for it also keeps it static))")


def check_option(fn: str, name: str, value, choices: tuple, also: str = "") -> str:
    """``value`` as a plain str, an option string: ``TypeError`` naming ``name`` if it is not a str (an array holding
    a valid name passes an ``in`` test), ``ValueError`` if it is not one of ``choices`` (``also``: other values the
    caller takes, for the message). A str subclass is compared and returned as its plain str value."""
    if not isinstance(value, str):
        raise TypeError(f"{fn}: `{name}` must be a str, one of {choices}{also}, got {_got(value, 'a Python str')}")
    value = str.__str__(value)  # (a plain str: a subclass's __eq__ / __hash__ decide neither the test nor a jit key)
    if value not in choices:
        raise ValueError(f"{fn}: `{name}` must be one of {choices}{also}, got {value!r}")
    return value


def check_bool(fn: str, name: str, value) -> bool:
    """``value`` as a Python bool (numpy bool accepted); ``TypeError`` naming ``name`` otherwise."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{fn}: `{name}` must be a bool (Python or NumPy), got "
                        f"{_got(value, 'a Python bool')}")
    return bool(value)


def check_positive_int(fn: str, name: str, value) -> int:
    """``value`` as a Python int: a Python or numpy integer in [1, 2**63 - 1] (bool refused); ``TypeError`` /
    ``ValueError``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{fn}: `{name}` must be a positive int (a Python or NumPy integer, not a bool), "
                        f"got {_got(value, 'a Python int')}")
    if value < 1:
        raise ValueError(f"{fn}: `{name}` must be a positive int (>= 1), got {value!r}")
    if value > _INT64_MAX:  # (a size no array can have; 10**30 failed inside MLIR)
        raise ValueError(f"{fn}: `{name}` must be at most 2**63 - 1 (an int64 array dimension), got {value!r}")
    return int(value)


def check_positive_float(fn: str, name: str, value) -> float:
    """``value`` as a Python float: a static real number (a Python or NumPy int or float, or a 0-d integer or
    floating-point array; not bool), finite and > 0 (TypeError / ValueError)."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(f"{fn}: `{name}` must be a static real number, got "
                        f"{_got(value, 'a number such as float(x)')}")
    is_real_array = (isinstance(value, (np.ndarray, jax.Array)) and value.shape == ()
                     and (jnp.issubdtype(value.dtype, jnp.floating) or jnp.issubdtype(value.dtype, jnp.integer)))
    # (numpy's timedelta64 is a subclass of np.signedinteger: refused as a duration, not a number)
    is_timedelta = getattr(getattr(value, "dtype", None), "kind", "") == "m"  # (np.timedelta64 or its arrays)
    if (isinstance(value, (bool, np.bool_)) or is_timedelta
            or not (isinstance(value, (int, float, np.integer, np.floating)) or is_real_array)):
        raise TypeError(f"{fn}: `{name}` must be a real number (a Python or NumPy int or float, or a 0-d integer or "
                        f"floating-point array), got {_got(value, 'a number')}")
    try:
        as_float = float(value)
    except OverflowError:  # (a Python int beyond float's range)
        raise ValueError(f"{fn}: `{name}` must be a finite number > 0, got an integer too large for a float") \
            from None
    if not math.isfinite(as_float) or as_float <= 0:
        raise ValueError(f"{fn}: `{name}` must be a finite number > 0, got {as_float}")
    return as_float


# the range of ``scale`` (and of the Flax layer's ``norm_eps``): float32's normal numbers. float32 is the kernels' dtype
# and the default compute dtype: a larger value is inf there (inf / NaN in o), a smaller one is flushed or rounded to
# zero (o all zeros). The range is the same for float64 math under x64, so that whether a value is valid does not
# depend on the inputs' dtype. It only makes the value itself representable: near either end, o can still overflow
# or lose precision, depending on the data. The bounds are printed exactly (repr), so the printed ones are accepted.
F32_NORMAL_MIN = float(np.finfo(np.float32).tiny)  # 1.1754943508222875e-38
F32_NORMAL_MAX = float(np.finfo(np.float32).max)   # 3.4028234663852886e+38
F32_NORMAL_RANGE = f"float32's normal range [{F32_NORMAL_MIN!r}, {F32_NORMAL_MAX!r}]"
SCALE_RANGE = F32_NORMAL_RANGE  # (as the ops' messages and docstrings say it)


def check_f32_normal(fn: str, name: str, value) -> float:
    """``value`` as a Python float: :func:`check_positive_float`, and within [``F32_NORMAL_MIN``,
    ``F32_NORMAL_MAX``], float32's normal range (TypeError / ValueError)."""
    as_float = check_positive_float(fn, name, value)
    if not F32_NORMAL_MIN <= as_float <= F32_NORMAL_MAX:
        raise ValueError(f"{fn}: `{name}` must lie in {F32_NORMAL_RANGE} (float32 is the kernels' and the "
                         f"default compute dtype), got {as_float!r}")
    return as_float


def _check_scale(fn: str, scale, K: int) -> float:
    """``scale`` as a Python float (default ``K ** -0.5``); must be a real number in float32's normal range
    (:func:`check_f32_normal`; TypeError / ValueError)."""
    return K ** -0.5 if scale is None else check_f32_normal(fn, "scale", scale)


def concrete_all(a, pred) -> bool:
    """``all(pred(xp, a))`` for a concrete array: numpy on the host (no device transfer), a jax array by one
    reduction where it lives (also when closed over inside a jit trace). True for traced arrays and non-arrays
    (e.g. ``jax.ShapeDtypeStruct``), which cannot be inspected."""
    if isinstance(a, np.ndarray):
        return bool(pred(np, a).all())
    if not isinstance(a, jax.Array) or isinstance(a, jax.core.Tracer):
        return True
    with jax.ensure_compile_time_eval():  # evaluate now rather than stage into the surrounding trace
        return bool(jnp.all(pred(jnp, a)))


def check_finite_gates(fn: str, g, b, w) -> None:
    """Raise ``ValueError`` if a *concrete* gate holds NaN/inf. Traced gates are not inspected.
    Called by :func:`check_inputs`."""
    for name, x in (("g", g), ("b", b), ("w", w)):
        if not concrete_all(x, lambda xp, a: xp.isfinite(a)):
            raise ValueError(f"{fn}: `{name}` contains NaN or inf")


@jax.custom_jvp
def _nan_gradient_unless(x, factor):
    """``x`` unchanged (no copy in the forward); its tangents, and so its cotangents, are multiplied by ``factor``."""
    return x


@_nan_gradient_unless.defjvp
def _nan_gradient_unless_jvp(primals, tangents):
    x, factor = primals
    return x, tangents[0] * factor.astype(x.dtype)


def check_state_pool(fn: str, initial_state, ssm_state_indices, num_accepted_tokens, *, N: int, T: int,
                     cu_seqlens=None) -> str:
    """Check the continuous-batching arguments (FLA's ``ssm_state_indices`` / ``num_accepted_tokens``); return the
    pool mode, ``"slot"`` (indices ``[N]``) or ``"token"`` (``[N, L]``).

    ``initial_state`` must be the pool ``[P, HV, K, V]`` (shape checked by :func:`check_inputs`). Slot indices must
    be integers; a negative slot is padding (nothing read or written). Concrete indices must be ``< P`` and the
    non-negative ones distinct; with ``[N, L]`` indices, L must cover every sequence's tokens (L >= T dense, L >=
    the longest sequence with concrete ``cu_seqlens``). ``num_accepted_tokens`` ``[N]`` needs ``[N, L]`` indices and
    concrete values in [1, L]. Traced values are checked on the device (:func:`traced_state_pool_valid`).
    """
    if initial_state is None:
        raise ValueError(f"{fn}: `ssm_state_indices` needs the state pool as `initial_state` [P, HV, K, V]")
    idx = ssm_state_indices
    if not hasattr(idx, "shape") or not hasattr(idx, "dtype"):
        raise TypeError(f"{fn}: `ssm_state_indices` must be an integer array [N] or [N, L], got {type(idx).__name__}")
    if not jnp.issubdtype(idx.dtype, jnp.integer):
        raise TypeError(f"{fn}: `ssm_state_indices` must have an integer dtype, got {idx.dtype}")
    if len(idx.shape) not in (1, 2) or idx.shape[0] != N:
        raise ValueError(f"{fn}: `ssm_state_indices` must have shape [N] or [N, L] with N={N} sequences, "
                         f"got {tuple(idx.shape)}")
    mode = "slot" if len(idx.shape) == 1 else "token"
    L = idx.shape[1] if mode == "token" else 1
    if mode == "token" and L < 1:
        raise ValueError(f"{fn}: `ssm_state_indices` [N, L] needs L >= 1, got {tuple(idx.shape)}")
    if mode == "token" and cu_seqlens is None and L < T:
        raise ValueError(f"{fn}: `ssm_state_indices` [N, L] needs a slot per token, L >= T={T}, got L={L}")
    if mode == "token" and cu_seqlens is not None and _is_concrete(cu_seqlens):
        longest = int(np.max(np.diff(np.asarray(cu_seqlens)), initial=0))
        if L < longest:
            raise ValueError(f"{fn}: `ssm_state_indices` [N, L] needs a slot per token, L >= the longest sequence "
                             f"of `cu_seqlens` ({longest}), got L={L}")
    P = initial_state.shape[0]
    if _is_concrete(idx):
        a = np.asarray(idx)
        if np.any(a >= P):
            raise ValueError(f"{fn}: `ssm_state_indices` must be < P={P} (the pool size of `initial_state`), "
                             f"got max {int(a.max())}")
        used = a[a >= 0]
        if np.unique(used).size != used.size:
            raise ValueError(f"{fn}: `ssm_state_indices` must not repeat a slot (negative slots are padding)")
    if num_accepted_tokens is not None:
        acc = num_accepted_tokens
        if mode != "token":
            raise ValueError(f"{fn}: `num_accepted_tokens` needs per-token `ssm_state_indices` [N, L]")
        if not hasattr(acc, "shape") or not hasattr(acc, "dtype") or not jnp.issubdtype(acc.dtype, jnp.integer):
            raise TypeError(f"{fn}: `num_accepted_tokens` must be an integer array [N]")
        if tuple(acc.shape) != (N,):
            raise ValueError(f"{fn}: `num_accepted_tokens` must have shape [N] = ({N},), got {tuple(acc.shape)}")
        if _is_concrete(acc):
            a = np.asarray(acc)
            if np.any(a < 1) or np.any(a > L):
                raise ValueError(f"{fn}: `num_accepted_tokens` must lie in [1, L={L}], got {a.tolist()}")
    return mode


def traced_cu_seqlens_valid(cu_seqlens, T: int):
    """Device-side validity (a bool scalar) of traced ``cu_seqlens``: starts at 0, non-decreasing, ends at T."""
    cu = cu_seqlens.astype(jnp.int64 if jax.config.jax_enable_x64 else jnp.int32)
    return (cu[0] == 0) & jnp.all(cu[1:] >= cu[:-1]) & (cu[-1] == T)


def canonical_slots(ssm_state_indices, P: int):
    """Slot indices as int32 without wrap-around: negative (padding, in any integer dtype) -> -1, >= P (invalid:
    the kernels skip it, :func:`traced_state_pool_valid` poisons the call) -> P, others unchanged."""
    xp = jnp if isinstance(ssm_state_indices, jax.Array) else np  # numpy int64 first: jnp would wrap it without x64
    idx = xp.asarray(ssm_state_indices)
    big = xp.minimum(idx, xp.asarray(P, idx.dtype))  # compared in the indices' own dtype (uint32, int64, ...)
    if xp.issubdtype(idx.dtype, xp.signedinteger):
        big = xp.where(idx < 0, xp.asarray(-1, idx.dtype), big)
    return jnp.asarray(big.astype(np.int32))


def traced_state_pool_valid(ssm_state_indices, num_accepted_tokens, P: int, cu_seqlens=None):
    """Device-side validity (a bool scalar) of traced pool arguments: slots < P, non-negative slots distinct,
    ``num_accepted_tokens`` in [1, L], and per-token slots ``[N, L]`` for every token of packed ``cu_seqlens``.
    Compared in the arguments' own integer dtypes (no wrap-around through a narrower cast)."""
    idx = canonical_slots(ssm_state_indices, P).reshape(-1)
    s = jnp.sort(jnp.where(idx < 0, -1 - jnp.arange(idx.size, dtype=jnp.int32), idx))  # padding slots stay distinct
    ok = jnp.all(idx < P) & jnp.all(s[1:] != s[:-1])
    if num_accepted_tokens is not None:
        acc = num_accepted_tokens
        ok = ok & jnp.all((acc >= 1) & (acc <= ssm_state_indices.shape[1]))
    if cu_seqlens is not None and ssm_state_indices.ndim == 2:
        cu = jnp.asarray(cu_seqlens)
        ok = ok & jnp.all(cu[1:] - cu[:-1] <= ssm_state_indices.shape[1])
    return ok


def run_poisoned(valid, run, q, k, v, g, b, w, initial_state):
    """``run(q, k, v, g, b, w, initial_state, poison) -> (o, final_state)``, NaN where a *traced* argument is invalid.

    ``valid`` is None (nothing traced to check: ``run`` as is, ``poison=None``) or a device bool scalar. Concrete
    arguments were already checked in Python (a ``ValueError`` before anything runs); traced ones (under
    ``jit``/``vmap``) cannot be inspected there, so their validity becomes a float32 factor ``poison``, 1 or NaN,
    on the device. The implementation multiplies ``o`` and every state it writes by it (the decode kernel does so
    as it stores: no extra pass over the state, which stays in place; a state pool gets NaN only in the slots
    written), and the derivatives with respect to the inputs are multiplied by it too (a ``jnp.where`` on the
    outputs alone would pass zero cotangents back, a silently all-zero gradient; scaling each input's cotangent
    also reaches tokens that no sequence reads). The inputs themselves are not touched in the forward. An input the
    loss does not depend on at all (q, for a loss on the final state alone) keeps its exact, structural zero
    gradient.
    """
    if valid is None:
        return run(q, k, v, g, b, w, initial_state, None)
    factor = jnp.where(valid, 1.0, jnp.nan).astype(jnp.float32)
    return run(*(None if x is None else _nan_gradient_unless(x, factor) for x in (q, k, v, g, b, w, initial_state)),
               factor)

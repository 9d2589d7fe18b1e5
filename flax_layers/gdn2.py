"""Flax NNX Gated DeltaNet-2 (GDN-2) token-mixing layer with an explicit prefill/decode cache.

Structure and parameterisation follow the reference layers: NVlabs ``lit_gpt/gdn2.py`` (the paper's
code, Hatamizadeh, Choi, Kautz, arXiv:2605.22791) and FLA's ``fla/layers/gdn2.py`` (flash-linear-attention
0.6.0), which differ only in the output-gate activation (SiLU in the paper / NVlabs, sigmoid in FLA) and the
initialisation. Per token ``x`` (``[hidden_size]``):

* ``q, k, v = SiLU(ShortConv_4(W_q x)), ...`` (depthwise causal convolution, kernel 4, no bias);
* ``g = -exp(A_log)[h] * softplus(f_proj(x) + dt_bias)`` in float32 (natural-log decay per key channel),
  with the low-rank ``f_proj = Linear(hidden -> head_v_dim) -> Linear(head_v_dim -> H*K)``;
* ``b = sigmoid(b_proj(x))`` (times 2 with ``allow_neg_eigval``), ``w = sigmoid(w_proj(x))``;
* ``o = chunk_gdn2 / fused_recurrent_gdn2(q, k, v, g, b, w, use_qk_l2norm_in_kernel=True)``;
* ``y = o_proj(RMSNorm(o) * act(g_proj(x)))`` per value head, ``act`` = SiLU (default) or sigmoid.

The cache (:class:`GDN2Cache`) uses FLA's layouts: conv windows ``[N, D, W]`` holding the last W projected
inputs (newest last) and the float32 recurrent state ``[N, HV, K, V]``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdn2_jax import backends, chunk_gdn2, fused_recurrent_gdn2
from gdn2_jax.validation import (check_bool, check_cu_seqlens, check_f32_normal, check_option, check_positive_float,
                                 check_positive_int, concrete_all)
from gdn2_jax.xla import sequence_ids

__all__ = ["GatedDeltaNet2", "GDN2Cache", "ShortConvolution", "GatedRMSNorm", "nvlabs_kernel_init"]

GATE_ACTIVATIONS = ("silu", "swish", "sigmoid")
MODES = ("chunk", "fused_recurrent")  # (the layer's `mode` / `train_mode`)

# NVlabs initialises every Linear with Xavier-uniform, gain 2**-2.5, and zero biases:
# variance_scaling(gain**2, fan_avg, uniform) has limit gain * sqrt(6 / (fan_in + fan_out)).
nvlabs_kernel_init = nnx.initializers.variance_scaling(2.0 ** -5, "fan_avg", "uniform")
# PyTorch's Conv1d default (kaiming_uniform, a=sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = W for a
# depthwise kernel. Both reference layers keep it for the short convolutions.
_torch_conv_init = nnx.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform", in_axis=0, out_axis=1)


class GDN2Cache(NamedTuple):
    """Decode cache of one :class:`GatedDeltaNet2` layer (a pytree; donate it between decode steps).

    Attributes:
      recurrent_state: ``[N, HV, K, V]`` float32 GDN-2 state (N = batch size, or number of packed sequences).
      conv_state: ``(q, k, v)`` windows ``[N, D, W]`` (D = key_dim, key_dim, value_dim; W = conv_size) with the
        last W projected inputs, newest at index W - 1 (FLA's ShortConvolution layout), or None without
        short convolutions.
    """

    recurrent_state: jax.Array
    conv_state: tuple[jax.Array, jax.Array, jax.Array] | None


# ---- argument checks (Python-level: types, shapes, dtypes; values only of concrete arrays, never traced ones) ----
_FN = "GatedDeltaNet2"


def _check_int(name, value):
    """A Python/numpy int >= 1 (bool refused) as a Python int."""
    return check_positive_int(_FN, name, value)


#: the most elements an array of the layer (a parameter or a cache array) may have: 2**56 float32 are 256 PiB, which
#: no device holds; far larger sizes overflowed inside XLA (a process abort: "overflow in static extent product")
MAX_ARRAY_ELEMENTS = 2**56


def _check_elements(sizes: str, arrays: dict, owner: str = _FN) -> None:
    """ValueError naming ``sizes`` if any of ``arrays`` (name -> shape) would hold more than MAX_ARRAY_ELEMENTS."""
    for what, shape in arrays.items():
        n = math.prod(shape)
        if n > MAX_ARRAY_ELEMENTS:
            raise ValueError(f"{owner}: {sizes} give the {what} {n} elements, more than the {MAX_ARRAY_ELEMENTS} "
                             "(2**56) any array of the layer may have")


def _check_bool(name, value):
    """Python bool or numpy bool_ (strings, ints, None refused: they would be read as truthy/falsy)."""
    return check_bool(_FN, name, value)


def _check_float_dtype(name, value):
    """A floating dtype (anything ``jnp.dtype`` reads: jnp.bfloat16, "float32", np.dtype, ...); returned as given."""
    try:
        ok = value is not None and jnp.issubdtype(jnp.dtype(value), jnp.floating)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise TypeError(f"{_FN}: `{name}` must be a floating-point dtype (e.g. jnp.float32, jnp.bfloat16), "
                        f"got {value!r}")
    return value


def _check_array(name, a, expected, layout, kinds):
    """``a`` must be an array of shape ``expected`` (ints must match, str entries are free) and a dtype of ``kinds``."""
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        raise TypeError(f"{_FN}: `{name}` must be an array {layout}, got {type(a).__name__}")
    shape = tuple(a.shape)
    if len(shape) != len(expected) or any(isinstance(e, int) and s != e for s, e in zip(shape, expected)):
        want = "(" + ", ".join(map(str, expected)) + ")"
        raise ValueError(f"{_FN}: `{name}` must have shape {layout} = {want}, got {shape}")
    if not any(jnp.issubdtype(a.dtype, kind) for kind in kinds):
        raise TypeError(f"{_FN}: `{name}` must have a {' or '.join(k.__name__ for k in kinds)} dtype, got {a.dtype}")


def _meta(sharding, *axes):
    """``out_sharding`` metadata for a parameter, naming mesh axes by role ("embed", "heads", None)."""
    if sharding is None:
        return {}
    embed, heads = sharding
    names = {"embed": embed, "heads": heads, None: None}
    return {"out_sharding": tuple(names[a] for a in axes)}


def _linear(din, dout, *, use_bias=False, axes, sharding, kernel_init, dtype, param_dtype, rngs):
    return nnx.Linear(din, dout, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                      kernel_init=kernel_init, bias_init=nnx.initializers.zeros, rngs=rngs,
                      kernel_metadata=_meta(sharding, *axes), bias_metadata=_meta(sharding, axes[1]))


class ShortConvolution(nnx.Module):
    """Depthwise causal 1-D convolution + SiLU with a cached window (FLA ``ShortConvolution`` semantics).

    ``y_t = SiLU(bias + sum_j kernel[j] * x_{t - (W-1) + j})``, where inputs before the start of a sequence
    come from the cache (zeros without one). Computed in float32, returned in the input's dtype.

    Args:
      features: channels D.
      kernel_size: window W (default 4).
      use_bias: add a per-channel bias (default False, as in both reference layers).
      activation: ``"silu"`` (default; ``"swish"`` is the same) or None.
      param_dtype: dtype of ``kernel`` ``[W, D]`` (and ``bias`` ``[D]``).
      kernel_init: default PyTorch's Conv1d init ``U(-1/sqrt(W), 1/sqrt(W))``.

    Raises:
      TypeError: ``features`` / ``kernel_size`` not Python or NumPy ints (bools refused), ``use_bias`` not a bool,
        ``activation`` neither a str nor None.
      ValueError: ``features`` / ``kernel_size`` < 1 or a kernel of more than 2**56 elements, an unknown
        ``activation``.
      The call checks ``activation`` again (it may have been reassigned): the same errors.
    """

    def __init__(self, features: int, kernel_size: int = 4, *, use_bias: bool = False,
                 activation: str | None = "silu", param_dtype=jnp.float32, kernel_init=None,
                 sharding=None, rngs: nnx.Rngs):
        own = "ShortConvolution"
        features, kernel_size = (check_positive_int(own, n, v) for n, v in (("features", features),
                                                                             ("kernel_size", kernel_size)))
        _check_elements(f"`features`={features}, `kernel_size`={kernel_size}", {"kernel": (kernel_size, features)},
                        own)
        use_bias = check_bool(own, "use_bias", use_bias)
        activation = self._checked_activation(activation)
        init = _torch_conv_init if kernel_init is None else kernel_init
        self.kernel = nnx.Param(init(rngs.params(), (kernel_size, features), param_dtype),
                                **_meta(sharding, None, "heads"))
        if use_bias:
            bound = 1.0 / math.sqrt(kernel_size)
            self.bias = nnx.Param(jax.random.uniform(rngs.params(), (features,), param_dtype, -bound, bound),
                                  **_meta(sharding, "heads"))
        else:
            self.bias = nnx.data(None)
        self.features = features
        self.kernel_size = kernel_size
        self.activation = activation

    @staticmethod
    def _checked_activation(activation):
        """``activation``: None, or ``"silu"`` / ``"swish"`` as a plain str (TypeError / ValueError)."""
        if activation is None:
            return None
        return check_option("ShortConvolution", "activation", activation, ("silu", "swish"), " or None")

    def _check_reassignable(self) -> None:
        """Check ``activation`` again (it may have been reassigned after construction)."""
        self._checked_activation(self.activation)

    def __call__(self, x: jax.Array, *, cache: jax.Array | None = None, lengths: jax.Array | None = None,
                 cu_seqlens: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """Convolve ``x`` ``[B, T, D]``; return ``(y [B, T, D], new_window [N, D, W])``.

        ``cache`` ``[N, D, W]`` holds the inputs preceding each sequence. ``lengths`` ``[B]``: only the first
        ``lengths[b]`` tokens of row b are real (the window ends there; later outputs are don't-care).
        ``cu_seqlens`` ``[N + 1]`` (B == 1): packed sequences, each with its own window, reset at every start.
        """
        self._check_reassignable()
        W = self.kernel_size
        kernel = self.kernel[...].astype(jnp.float32)
        xf = x.astype(jnp.float32)
        prev = None if cache is None else jnp.swapaxes(cache, 1, 2).astype(jnp.float32)  # [N, W, D]
        if cu_seqlens is None:
            y, window = _conv_rows(xf, kernel, prev, lengths)
        else:
            y, window = _conv_packed(xf, kernel, prev, cu_seqlens)
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        if self.activation is not None:
            y = jax.nn.silu(y)
        out_dtype = x.dtype if cache is None else cache.dtype
        return y.astype(x.dtype), jnp.swapaxes(window, 1, 2).astype(out_dtype)


def _conv_rows(x, kernel, prev, lengths):
    """One sequence per row. x [B,T,D] f32, kernel [W,D], prev [B,W,D] or None -> (y [B,T,D], window [B,W,D])."""
    B, T, D = x.shape
    W = kernel.shape[0]
    if prev is None:
        prev = jnp.zeros((B, W, D), x.dtype)
    full = jnp.concatenate([prev, x], axis=1)  # [B, W + T, D]; token t sits at W + t
    # kernel[j] multiplies the input at t - (W-1) + j, i.e. full[:, t + 1 + j].
    y = sum(kernel[j] * full[:, 1 + j:1 + j + T] for j in range(W))
    if lengths is None:
        window = full[:, T:]
    else:  # the W inputs ending at the last real token of each row
        idx = lengths.astype(jnp.int32)[:, None] + jnp.arange(W, dtype=jnp.int32)
        window = jnp.take_along_axis(full, idx[..., None], axis=1)
    return y, window


def _conv_packed(x, kernel, prev, cu_seqlens):
    """Packed sequences (B == 1): reads never cross a ``cu_seqlens`` boundary; each sequence n starts from prev[n]."""
    _, T, D = x.shape
    W = kernel.shape[0]
    N = cu_seqlens.shape[0] - 1
    cu = jnp.asarray(cu_seqlens, jnp.int32)  # numpy offsets too (indexed with traced values below)
    if prev is None:
        prev = jnp.zeros((N, W, D), x.dtype)
    # One pool of rows: the N cached windows (slot n, position j at n*W + j), then the T tokens (at N*W + t).
    pool = jnp.concatenate([prev.reshape(N * W, D), x[0]], axis=0)
    t = jnp.arange(T, dtype=jnp.int32)
    seq, _ = sequence_ids(cu, T)
    pos = t - cu[seq]  # position inside its own sequence

    def source(n, start, p):  # row of the input p tokens into sequence n (p < 0: from its window)
        return jnp.where(p >= 0, N * W + start + p, n * W + W + p)

    y = sum(kernel[j] * pool[source(seq, cu[seq], pos - (W - 1 - j))] for j in range(W))
    n = jnp.arange(N, dtype=jnp.int32)
    p = (cu[1:] - cu[:-1])[:, None] - W + jnp.arange(W, dtype=jnp.int32)  # [N, W]
    window = pool[source(n[:, None], cu[:-1, None], p)]
    return y[None], window


class GatedRMSNorm(nnx.Module):
    """``RMSNorm(x) * scale * act(gate)`` over the last axis, in float32 (FLA ``FusedRMSNormGated`` math).

    ``act`` is SiLU (``"silu"``/``"swish"``; NVlabs ``FusedRMSNormSwishGate``, the paper) or ``"sigmoid"``
    (FLA's GDN-2 layer). ``rms = sqrt(mean(x^2) + eps)``. Returns x's dtype.

    Raises:
      TypeError: ``features`` not a Python or NumPy int, ``eps`` not a real number, ``activation`` not a str.
      ValueError: ``features`` < 1 (or above 2**56), ``eps`` outside float32's normal range (a negative one gave
        NaN), an unknown ``activation``.
      The call checks ``activation`` and a Python or NumPy scalar ``eps`` again (they may have been reassigned):
      the same errors. An ``eps`` stored as array data (e.g. ``nnx.data(jnp.float32(1e-3))``) is used as it is.
    """

    def __init__(self, features: int, *, eps: float = 1e-5, activation: str = "silu", param_dtype=jnp.float32,
                 sharding=None):
        features = check_positive_int("GatedRMSNorm", "features", features)
        _check_elements(f"`features`={features}", {"scale": (features,)}, "GatedRMSNorm")
        eps = check_f32_normal("GatedRMSNorm", "eps", eps)
        activation = check_option("GatedRMSNorm", "activation", activation, GATE_ACTIVATIONS)
        self.scale = nnx.Param(jnp.ones((features,), param_dtype), **_meta(sharding, None))
        self.eps = eps
        self.activation = activation

    def _check_reassignable(self) -> str:
        """Check ``activation`` and a scalar ``eps`` again (they may have been reassigned); return the activation."""
        if not isinstance(self.eps, (jax.Array, jax.core.Tracer, np.ndarray, nnx.Variable)):  # (data: used as it is)
            check_f32_normal("GatedRMSNorm", "eps", self.eps)
        return check_option("GatedRMSNorm", "activation", self.activation, GATE_ACTIVATIONS)

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        activation = self._check_reassignable()
        eps = self.eps
        xf = x.astype(jnp.float32)
        gf = gate.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
        y = y * self.scale[...].astype(jnp.float32)
        y = y * (jax.nn.sigmoid(gf) if activation == "sigmoid" else jax.nn.silu(gf))
        return y.astype(x.dtype)


class GatedDeltaNet2(nnx.Module):
    """Gated DeltaNet-2 layer (Flax NNX) with an explicit cache for chunked prefill and token decode.

    Args:
      hidden_size: model width d.
      head_dim: key head dim K (default 128). Value head dim is ``V = int(head_dim * expand_v)``.
      num_heads: query/key heads H (default 16).
      num_v_heads: value heads HV (grouped value attention when HV > H; HV must be a multiple of H).
        Default: ``num_heads``.
      expand_v: value expansion (default 1.0).
      use_short_conv: depthwise causal conv + SiLU on q, k, v (default True); otherwise SiLU only.
      conv_size: conv window W (default 4). conv_bias: bias in the convs (default False).
      allow_neg_eigval: ``b = 2 * sigmoid(...)`` in [0, 2] (default False).
      norm_eps: eps of the gated output RMSNorm (default 1e-5), in float32's normal range.
      gate_activation: output gate, ``"silu"`` (default; paper / NVlabs) or ``"sigmoid"`` (FLA's layer; use it
        for weights converted from FLA, see :mod:`flax_layers.convert`).
      mode: ``"chunk"`` (default) or ``"fused_recurrent"``: the op used for inputs longer than 64 tokens in
        inference. As in FLA, inference calls with ``T <= 64`` use ``fused_recurrent_gdn2``.
      train_mode: the op used in training (``deterministic=False``): ``"chunk"`` (default, as FLA) or
        ``"fused_recurrent"`` (differentiable with the xla backend: autodiff through the token loop, which on
        a CPU is often faster than the chunked form for small heads).
      backend: backend of the ops in inference (``deterministic=True``): ``"auto"`` (default; the TileLang
        kernels on a Hopper GPU where they exist and take the inputs, e.g. bfloat16 with head dims 64/128,
        else ``"xla"``), ``"xla"`` or ``"tilelang"``.
      train_backend: backend of the op when training (``deterministic=False``). Default ``"xla"``: forward and
        backward in jnp. ``"auto"``/``"tilelang"`` run the TileLang kernels where they exist: for
        ``train_mode="chunk"`` the forward saves its states and the whole backward runs as kernels (faster than
        FLA's forward + backward on every shape of the benchmark grid on an H200, with less extra memory than
        FLA: the README's GPU table and ``benchmarks/results/latest.json``);
        ``"fused_recurrent"``'s backward is the xla VJP, recomputing the forward.
      deterministic: inference mode. Default False (training), as for ``nnx.Dropout``; ``model.eval()`` sets it
        to True and ``model.train()`` back to False; ``__call__`` may override it per call.
      dtype: computation dtype of the projections, convs and op inputs (default: promote input and params).
        The decay ``g``, the norm and the recurrent state are always float32 (a float64 cache passed in under x64
        keeps its dtype).
      param_dtype: dtype of every parameter (default float32), including ``A_log`` and ``dt_bias``.
      kernel_init: initialiser of every Linear kernel. Default: NVlabs' Xavier-uniform with gain ``2**-2.5``
        (:data:`nvlabs_kernel_init`); FLA's layer keeps PyTorch's default Linear init instead. Biases start
        at zero, conv kernels at PyTorch's Conv1d default, ``A_log = log U(1, 16)``,
        ``dt_bias = softplus^-1(dt)`` with ``dt ~ logU(1e-3, 1e-1)`` clamped >= 1e-4 (both references).
      sharding: optional ``(embed_axis, heads_axis)`` mesh-axis names; every parameter gets ``out_sharding``
        metadata (input projections ``(embed, heads)``, ``o_proj`` ``(heads, embed)``, low-rank inner dims and
        conv windows unsharded, ``A_log``/``dt_bias``/conv kernels on heads). Flax shards such parameters
        eagerly: build the layer inside ``jax.set_mesh(mesh)`` (a mesh with ``AxisType.Auto`` axes; meshes with
        explicit axis types are not supported).
      rngs: ``nnx.Rngs`` for the initialisation.

    Parameters (state paths) mirror FLA's state_dict names: ``q_proj``, ``k_proj``, ``v_proj``,
    ``q_conv1d``/``k_conv1d``/``v_conv1d`` (kernel ``[W, D]``), ``f_proj.layers.{0,1}``, ``b_proj``, ``w_proj``,
    ``A_log`` ``[H]``, ``dt_bias`` ``[H*K]``, ``g_proj.layers.{0,1}`` (second with bias), ``o_norm.scale``
    ``[V]``, ``o_proj``.

    Raises:
      TypeError: for an argument of the wrong type: sizes must be Python or NumPy ints (not bools), flags Python
        or NumPy bools, ``expand_v``/``norm_eps`` real numbers, ``dtype``/``param_dtype`` floating dtypes,
        ``kernel_init`` a callable, ``rngs`` an ``nnx.Rngs``, ``sharding`` None or a 2-tuple of axis names, the
        option arguments strs.
      ValueError: for sizes < 1, sizes that give a parameter more than 2**56 elements (:data:`MAX_ARRAY_ELEMENTS`),
        ``expand_v`` not finite and > 0, ``norm_eps`` outside float32's normal range
        (1e-40 became 0 in the float32 norm: NaN on an all-zero row), inconsistent sizes, or an unknown option
        string (``gate_activation``, ``mode``, ``train_mode``, ``backend``, ``train_backend``; one that is not a
        str at all is a TypeError).

    Examples::

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from flax_layers import GatedDeltaNet2
        >>> layer = GatedDeltaNet2(64, head_dim=16, num_heads=2, num_v_heads=4, rngs=nnx.Rngs(0))
        >>> layer.eval()                                   # inference dispatch (deterministic=True)
        >>> x = jnp.ones((2, 10, 64))
        >>> y, cache = layer(x[:, :9])                     # prefill, fills the cache
        >>> y_t, cache = layer(x[:, 9:], cache=cache)      # one decode step
        >>> y.shape, cache.recurrent_state.shape
        ((2, 9, 64), (2, 4, 16, 16))
    """

    def __init__(self, hidden_size: int, *, head_dim: int = 128, num_heads: int = 16, num_v_heads: int | None = None,
                 expand_v: float = 1.0, use_short_conv: bool = True, conv_size: int = 4, conv_bias: bool = False,
                 allow_neg_eigval: bool = False, norm_eps: float = 1e-5, gate_activation: str = "silu",
                 mode: str = "chunk", train_mode: str = "chunk", backend: str = "auto", train_backend: str = "xla",
                 deterministic: bool = False, dtype: Any = None, param_dtype: Any = jnp.float32,
                 kernel_init=None, sharding: tuple[str | None, str | None] | None = None, rngs: nnx.Rngs):
        hidden_size, head_dim, num_heads, conv_size = (
            _check_int(n, v) for n, v in (("hidden_size", hidden_size), ("head_dim", head_dim),
                                          ("num_heads", num_heads), ("conv_size", conv_size)))
        num_v_heads = num_heads if num_v_heads is None else _check_int("num_v_heads", num_v_heads)
        expand_v = check_positive_float(_FN, "expand_v", expand_v)
        norm_eps = check_f32_normal(_FN, "norm_eps", norm_eps)
        use_short_conv, conv_bias, allow_neg_eigval, deterministic = (
            _check_bool(n, v) for n, v in (("use_short_conv", use_short_conv), ("conv_bias", conv_bias),
                                           ("allow_neg_eigval", allow_neg_eigval), ("deterministic", deterministic)))
        if dtype is not None:
            _check_float_dtype("dtype", dtype)
        _check_float_dtype("param_dtype", param_dtype)
        if kernel_init is not None and not callable(kernel_init):
            raise TypeError(f"{_FN}: `kernel_init` must be a callable initialiser (key, shape, dtype) -> array "
                            f"or None, got {type(kernel_init).__name__} {kernel_init!r}")
        if not isinstance(rngs, nnx.Rngs):
            raise TypeError(f"{_FN}: `rngs` must be an nnx.Rngs, got {type(rngs).__name__}")
        axes = sharding if isinstance(sharding, (tuple, list)) else ()
        if sharding is not None and (len(axes) != 2 or not all(
                a is None or isinstance(a, str) or (isinstance(a, tuple) and all(isinstance(n, str) for n in a))
                for a in axes)):
            raise TypeError(f"{_FN}: `sharding` must be None or a 2-tuple (embed_axis, heads_axis) of mesh-axis "
                            f"names (str, tuple of str or None), got {sharding!r}")
        head_v_dim = int(head_dim * expand_v)
        if not math.isclose(head_dim * expand_v, head_v_dim, rel_tol=1e-5) or head_v_dim < 1:
            raise ValueError(f"GatedDeltaNet2: `expand_v`={expand_v} times head_dim={head_dim} "
                             "is not a positive integer")
        if num_v_heads < num_heads or num_v_heads % num_heads:
            raise ValueError(f"GatedDeltaNet2: `num_v_heads`={num_v_heads} must be a multiple of num_heads={num_heads}")
        gate_activation = check_option(_FN, "gate_activation", gate_activation, GATE_ACTIVATIONS)
        mode, train_mode = (check_option(_FN, name, md, MODES)
                            for name, md in (("mode", mode), ("train_mode", train_mode)))
        backend, train_backend = (check_option(_FN, name, be, backends.BACKENDS)
                                  for name, be in (("backend", backend), ("train_backend", train_backend)))

        dk, dv = num_heads * head_dim, num_v_heads * head_v_dim
        _check_elements(f"`hidden_size`={hidden_size}, `head_dim`={head_dim}, `num_heads`={num_heads}, "
                        f"`num_v_heads`={num_v_heads}, `expand_v`={expand_v}, `conv_size`={conv_size}",
                        {"q_proj / k_proj / b_proj kernels": (hidden_size, dk), "v_proj / w_proj kernels":
                         (hidden_size, dv), "q_conv1d / k_conv1d kernels": (conv_size, dk), "v_conv1d kernel":
                         (conv_size, dv), "f_proj / g_proj inner kernels": (hidden_size, head_v_dim),
                         "f_proj outer kernel": (head_v_dim, dk), "g_proj outer kernel": (head_v_dim, dv)})

        self.hidden_size = hidden_size
        self.head_dim = self.head_k_dim = head_dim
        self.head_v_dim = head_v_dim
        self.num_heads = num_heads
        self.num_v_heads = num_v_heads
        self.expand_v = expand_v
        self.key_dim, self.value_dim = dk, dv
        self.use_short_conv = use_short_conv
        self.conv_size = conv_size
        self.conv_bias = conv_bias
        self.allow_neg_eigval = allow_neg_eigval
        self.mode = mode
        self.train_mode = train_mode
        self.backend = backend
        self.train_backend = train_backend
        self.deterministic = deterministic
        self.dtype = dtype
        self.param_dtype = param_dtype

        kinit = nvlabs_kernel_init if kernel_init is None else kernel_init
        lin = dict(sharding=sharding, kernel_init=kinit, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        d, r = hidden_size, head_v_dim
        self.q_proj = _linear(d, dk, axes=("embed", "heads"), **lin)
        self.k_proj = _linear(d, dk, axes=("embed", "heads"), **lin)
        self.v_proj = _linear(d, dv, axes=("embed", "heads"), **lin)
        if use_short_conv:
            conv = dict(kernel_size=conv_size, use_bias=conv_bias, param_dtype=param_dtype, sharding=sharding,
                        rngs=rngs)
            self.q_conv1d = ShortConvolution(dk, **conv)
            self.k_conv1d = ShortConvolution(dk, **conv)
            self.v_conv1d = ShortConvolution(dv, **conv)
        self.f_proj = nnx.Sequential(_linear(d, r, axes=("embed", None), **lin),
                                     _linear(r, dk, axes=(None, "heads"), **lin))
        self.b_proj = _linear(d, dk, axes=("embed", "heads"), **lin)
        self.w_proj = _linear(d, dv, axes=("embed", "heads"), **lin)

        key_a, key_dt = rngs.params(), rngs.params()
        a = jax.random.uniform(key_a, (num_heads,), jnp.float32, 1.0, 16.0)
        self.A_log = nnx.Param(jnp.log(a).astype(param_dtype), **_meta(sharding, "heads"))
        dt = jnp.exp(jax.random.uniform(key_dt, (dk,), jnp.float32, math.log(1e-3), math.log(1e-1)))
        dt = jnp.maximum(dt, 1e-4)
        self.dt_bias = nnx.Param((dt + jnp.log(-jnp.expm1(-dt))).astype(param_dtype), **_meta(sharding, "heads"))

        self.g_proj = nnx.Sequential(_linear(d, r, axes=("embed", None), **lin),
                                     _linear(r, dv, use_bias=True, axes=(None, "heads"), **lin))
        self.o_norm = GatedRMSNorm(r, eps=norm_eps, activation=gate_activation, param_dtype=param_dtype,
                                   sharding=sharding)
        self.o_proj = _linear(dv, d, axes=("heads", "embed"), **lin)

    # ------------------------------------------------------------------------------------------------------
    @property
    def gate_activation(self) -> str:
        """The output gate's activation, one of ``"silu"``, ``"swish"`` (the same) or ``"sigmoid"``: that of
        ``o_norm``, which applies it, so that assigning it after construction changes what the layer computes (the
        value is checked as the constructor checks it: ``TypeError`` for a non-str, ``ValueError`` otherwise)."""
        return self.o_norm.activation

    @gate_activation.setter
    def gate_activation(self, value: str) -> None:
        self.o_norm.activation = check_option(_FN, "gate_activation", value, GATE_ACTIVATIONS)

    @property
    def norm_eps(self) -> float:
        """The output RMSNorm's eps: that of ``o_norm``, which applies it (assignable, checked as the constructor
        checks it: a real number in float32's normal range)."""
        return self.o_norm.eps

    @norm_eps.setter
    def norm_eps(self, value: float) -> None:
        self.o_norm.eps = check_f32_normal(_FN, "norm_eps", value)

    def init_cache(self, batch_size: int, dtype: Any = None) -> GDN2Cache:
        """An empty cache for ``batch_size`` sequences (zeros: the state every sequence starts from).

        Conv windows use ``dtype`` (default: the layer's ``dtype``, else ``param_dtype``); the recurrent state is
        float32 ``[batch_size, HV, K, V]``.

        Raises:
          TypeError: ``batch_size`` not a Python or NumPy int (bools refused) or ``dtype`` not a floating dtype.
          ValueError: ``batch_size`` < 1, or so large that a cache array would have more than 2**56 elements.
        """
        batch_size = _check_int("batch_size", batch_size)
        _check_elements(f"`batch_size`={batch_size}", {
            "recurrent_state [batch_size, HV, K, V]": (batch_size, self.num_v_heads, self.head_k_dim, self.head_v_dim),
            "conv_state windows [batch_size, D, W]": (batch_size, max(self.key_dim, self.value_dim), self.conv_size)})
        if dtype is None:
            dtype = self.param_dtype if self.dtype is None else self.dtype
        _check_float_dtype("dtype", dtype)
        state = jnp.zeros((batch_size, self.num_v_heads, self.head_k_dim, self.head_v_dim), jnp.float32)
        conv = None
        if self.use_short_conv:
            conv = tuple(jnp.zeros((batch_size, dim, self.conv_size), dtype)
                         for dim in (self.key_dim, self.key_dim, self.value_dim))
        return GDN2Cache(state, conv)

    def _check_cache(self, cache, N: int) -> None:
        """``cache`` must be a :class:`GDN2Cache` made for this layer's sizes and N sequences."""
        if not isinstance(cache, GDN2Cache):
            raise TypeError(f"{_FN}: `cache` must be a GDN2Cache (from init_cache or a previous call), "
                            f"got {type(cache).__name__}")
        _check_array("cache.recurrent_state", cache.recurrent_state,
                     (N, self.num_v_heads, self.head_k_dim, self.head_v_dim),
                     "[N, HV, K, V] (N = sequences in the input)", (jnp.float32, jnp.float64))
        conv = cache.conv_state
        if not self.use_short_conv:
            if conv is not None:
                raise ValueError(f"{_FN}: `cache.conv_state` must be None: this layer has no short convolutions")
            return
        if conv is None:
            raise ValueError(f"{_FN}: `cache.conv_state` is None, but this layer has short convolutions: pass "
                             "the (q, k, v) windows (init_cache gives zeros)")
        if not isinstance(conv, (tuple, list)) or len(conv) != 3:
            raise TypeError(f"{_FN}: `cache.conv_state` must be a (q, k, v) tuple of windows [N, D, W], "
                            f"got {type(conv).__name__}")
        for i, dim in enumerate((self.key_dim, self.key_dim, self.value_dim)):
            _check_array(f"cache.conv_state[{i}]", conv[i], (N, dim, self.conv_size),
                         "[N, D, W] (D = channels, W = conv_size)", (jnp.floating,))

    def __call__(self, x: jax.Array, *, cache: GDN2Cache | None = None, attention_mask: jax.Array | None = None,
                 cu_seqlens: jax.Array | None = None, deterministic: bool | None = None):
        """Apply the layer to ``x`` ``[B, T, hidden_size]``; return ``(y [B, T, hidden_size], new_cache)``.

        Args:
          x: input, a floating jax or numpy array (a list raises TypeError: convert it yourself); T may be
            anything >= 0 (also shorter than the conv window; T = 0 gives an empty y and the cache unchanged).
          cache: state to continue from (:meth:`init_cache` or a previous call's ``new_cache``), batch N;
            None starts every sequence from zeros. A call with T > 1 on a filled cache continues it (chunked
            prefill); T == 1 is a decode step.
          attention_mask: ``[B, T]`` bool or integer array, 1/True for real tokens, 0/False for padding (left,
            right or anywhere).
            Padded positions leave the recurrent state and the conv window untouched (their decay, erase and
            write gates are zeroed and the convolution skips them) and return y = 0.
          cu_seqlens: ``[N + 1]`` int offsets of sequences packed along T (B == 1). Both the recurrent state and
            the conv window reset at every boundary (to ``cache[n]`` when a cache of batch N is given).
          deterministic: a bool overriding ``self.deterministic`` for this call (True: inference dispatch with
            ``backend``; False: training, the ``train_mode`` op with ``train_backend``); None (default) uses
            ``self.deterministic``.

        Returns:
          ``(y, new_cache)``: y in the computation dtype; new_cache a :class:`GDN2Cache` of batch N (B, or
          ``len(cu_seqlens) - 1``).

        Raises:
          TypeError: ``x`` not a floating array (lists are refused, not converted); ``attention_mask`` not a
            bool/integer array; ``cu_seqlens`` not an integer array; ``cache`` not a :class:`GDN2Cache` or with
            a recurrent state that is not float32 (float64 under x64) or non-floating conv windows;
            ``deterministic`` (or ``self.deterministic``) not a bool; attributes reassigned after construction:
            the options this call uses (``self.mode`` and ``self.backend``, or ``self.train_mode`` and
            ``self.train_backend`` when training) not strs, ``self.allow_neg_eigval`` not a bool.
          ValueError: a wrong ``x`` rank/width; a mask of the wrong shape or, when concrete, with values other
            than 0/1; ``attention_mask`` together with ``cu_seqlens``; ``cu_seqlens`` not 1-D, with B != 1 or,
            when concrete, not running from 0 to T without decreasing; a cache whose shapes do not fit this layer
            and input (the message gives the expected and actual shapes), or without conv windows on a layer
            with short convolutions; NaN/inf in a concrete ``x``; an option this call uses (or the submodules'
            ``activation`` / ``eps``) reassigned to an unknown or invalid value, or ``self.use_short_conv``
            reassigned (it is fixed at construction). Traced values are not inspected; under ``jit`` only the
            shape/dtype checks run.
          NotImplementedError: the backend this call uses (``backend``, or ``train_backend`` when training) is
            ``"tilelang"`` and its kernels cannot run here (no cuda extra or no Hopper GPU); raised before any
            computation.
        """
        _check_array("x", x, ("B", "T", self.hidden_size), "[B, T, hidden_size]", (jnp.floating,))
        B, T, _ = x.shape
        if attention_mask is not None and cu_seqlens is not None:
            raise ValueError(f"{_FN}: pass either `attention_mask` or `cu_seqlens`, not both")
        H, HV, K, V = self.num_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        # the ops' own checks (type, 1-D, integer, B == 1, concrete 0 <= ... <= T)
        N = B if cu_seqlens is None else check_cu_seqlens(_FN, cu_seqlens, B, T)
        det = _check_bool("deterministic", self.deterministic if deterministic is None else deterministic)
        # the options this call uses, checked again here (as `deterministic`): they may have been reassigned
        mode_arg, backend_arg = ("mode", "backend") if det else ("train_mode", "train_backend")
        mode = check_option(_FN, mode_arg, getattr(self, mode_arg), MODES)
        backend = check_option(_FN, backend_arg, getattr(self, backend_arg), backends.BACKENDS)
        allow_neg_eigval = _check_bool("allow_neg_eigval", self.allow_neg_eigval)
        built_with_conv = hasattr(self, "q_conv1d")
        if _check_bool("use_short_conv", self.use_short_conv) != built_with_conv:
            raise ValueError(f"{_FN}: `use_short_conv` cannot change after construction (the layer was built "
                             f"{'with' if built_with_conv else 'without'} short convolutions)")
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d) if self.use_short_conv else ()
        for module in (self.o_norm, *convs):  # (their own calls check again, after the projections)
            module._check_reassignable()
        use_recurrent = (det and T <= 64) or mode == "fused_recurrent"
        op = fused_recurrent_gdn2 if use_recurrent else chunk_gdn2
        if attention_mask is not None:
            _check_array("attention_mask", attention_mask, (B, T), "[B, T]", (jnp.bool_, jnp.integer))
            if not concrete_all(attention_mask, lambda xp, m: (m == 0) | (m == 1)):
                raise ValueError(f"{_FN}: `attention_mask` must hold only 0 (padding) and 1 (real token)")
        if cache is not None:
            self._check_cache(cache, N)
        if not concrete_all(x, lambda xp, a: xp.isfinite(a)):
            raise ValueError(f"{_FN}: `x` contains NaN or inf")
        if backend == "tilelang":  # fail before the projections run, naming the layer's argument
            why = backends.tilelang_unavailable_reason(op.__name__)
            if why is not None:
                raise NotImplementedError(f"{_FN}: `{backend_arg}`='tilelang' cannot run here ({op.__name__}): "
                                          f"{why}; use 'xla' or 'auto'")

        lengths = restore = None
        if attention_mask is not None:
            # Move each row's real tokens to its front (stable), so the conv reads only real tokens and the
            # padded tail can be disabled with zero gates; the outputs are moved back at the end.
            mask = attention_mask.astype(bool)
            order = jnp.argsort(~mask, axis=1, stable=True)
            x = jnp.take_along_axis(x, order[..., None], axis=1)
            lengths = mask.sum(axis=1, dtype=jnp.int32)
            restore = (mask, jnp.maximum(jnp.cumsum(mask, axis=1, dtype=jnp.int32) - 1, 0))

        conv_cache = (None,) * 3 if cache is None or cache.conv_state is None else cache.conv_state
        conv_state = None
        if self.use_short_conv:
            outs = [conv(proj(x), cache=c, lengths=lengths, cu_seqlens=cu_seqlens) for conv, proj, c in
                    zip((self.q_conv1d, self.k_conv1d, self.v_conv1d), (self.q_proj, self.k_proj, self.v_proj),
                        conv_cache)]
            (q, cq), (k, ck), (v, cv) = outs
            conv_state = (cq, ck, cv)
        else:
            q, k, v = (jax.nn.silu(p(x)) for p in (self.q_proj, self.k_proj, self.v_proj))

        f = self.f_proj(x).astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32))[:, None] * jax.nn.softplus(f).reshape(B, T, H, K)
        b = jax.nn.sigmoid(self.b_proj(x)).reshape(B, T, H, K)
        w = jax.nn.sigmoid(self.w_proj(x)).reshape(B, T, HV, V)
        q, k = q.reshape(B, T, H, K), k.reshape(B, T, H, K)
        v = v.reshape(B, T, HV, V)
        if HV > H:  # value head j reads qk head j // (HV / H): repeat the qk-side gates over value groups
            g, b = (jnp.repeat(z, HV // H, axis=2) for z in (g, b))
        if allow_neg_eigval:
            b = b * 2.0
        if lengths is not None:  # padded tail: exp(0) = 1, no erase, no write -> state untouched
            live = (jnp.arange(T, dtype=jnp.int32)[None, :] < lengths[:, None])[..., None, None]
            g = jnp.where(live, g, 0.0)
            b = jnp.where(live, b, jnp.zeros_like(b))
            w = jnp.where(live, w, jnp.zeros_like(w))

        # decode with a cache: the new state reuses the cache's buffer (in place when the cache is donated or
        # carried through a loop; XLA copies it otherwise)
        inplace = {"inplace_final_state": True} if cache is not None and op is fused_recurrent_gdn2 else {}
        o, state = op(q, k, v, g, b, w, initial_state=None if cache is None else cache.recurrent_state,
                      output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens,
                      backend=backend, **inplace)

        gate = self.g_proj(x).reshape(B, T, HV, V)
        y = self.o_proj(self.o_norm(o, gate).reshape(B, T, HV * V))
        if restore is not None:
            mask, rank = restore
            y = jnp.where(mask[..., None], jnp.take_along_axis(y, rank[..., None], axis=1), jnp.zeros_like(y))
        # (the state's dtype is the cache's, float32 without one, whatever the op computed in: a float64 layer under
        # x64 returns the same state dtype from prefill as from init_cache and decode)
        state_dtype = jnp.float32 if cache is None else cache.recurrent_state.dtype
        return y, GDN2Cache(state.astype(state_dtype), conv_state)

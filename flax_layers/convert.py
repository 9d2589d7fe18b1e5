"""Weights and caches between FLA's torch ``GatedDeltaNet2`` layer and :class:`flax_layers.GatedDeltaNet2`.

FLA (flash-linear-attention 0.6.0, ``fla/layers/gdn2.py``) names and shapes, with ``d = hidden_size``,
``Dk = num_heads * head_dim``, ``Dv = num_v_heads * head_v_dim``, ``r = head_v_dim``, ``W = conv_size``:

===========================  =================  ===========================================
FLA state_dict key           FLA shape          NNX parameter (shape)
===========================  =================  ===========================================
``q_proj.weight``            ``[Dk, d]``        ``q_proj.kernel`` ``[d, Dk]`` (transposed)
``k_proj.weight``            ``[Dk, d]``        ``k_proj.kernel``
``v_proj.weight``            ``[Dv, d]``        ``v_proj.kernel``
``{q,k,v}_conv1d.weight``    ``[D, 1, W]``      ``{q,k,v}_conv1d.kernel`` ``[W, D]``
``{q,k,v}_conv1d.bias``      ``[D]``            ``{q,k,v}_conv1d.bias`` (only with conv_bias)
``f_proj.0.weight``          ``[r, d]``         ``f_proj.layers[0].kernel`` ``[d, r]``
``f_proj.1.weight``          ``[Dk, r]``        ``f_proj.layers[1].kernel`` ``[r, Dk]``
``b_proj.weight``            ``[Dk, d]``        ``b_proj.kernel``
``w_proj.weight``            ``[Dv, d]``        ``w_proj.kernel``
``A_log``                    ``[H]``            ``A_log``
``dt_bias``                  ``[Dk]``           ``dt_bias``
``g_proj.0.weight``          ``[r, d]``         ``g_proj.layers[0].kernel``
``g_proj.1.weight``          ``[Dv, r]``        ``g_proj.layers[1].kernel``
``g_proj.1.bias``            ``[Dv]``           ``g_proj.layers[1].bias``
``o_norm.weight``            ``[r]``            ``o_norm.scale``
``o_proj.weight``            ``[d, Dv]``        ``o_proj.kernel`` ``[Dv, d]``
===========================  =================  ===========================================

Everything here takes and returns numpy arrays (no torch import). FLA's layer gates its output with a
**sigmoid**, so :func:`from_fla_state_dict` builds the layer with ``gate_activation="sigmoid"``. The caches
share FLA's layouts (conv windows ``[N, D, W]``, recurrent state ``[N, HV, K, V]`` float32), as in FLA's
per-layer cache dict ``{"recurrent_state": ..., "conv_state": (q, k, v)}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdn2_jax.validation import check_bool, check_option

from .gdn2 import MODES, GatedDeltaNet2, GDN2Cache

__all__ = ["to_fla_state_dict", "load_fla_state_dict", "from_fla_state_dict", "fla_layer_kwargs",
           "cache_to_fla", "cache_from_fla"]


def _key_map(layer: GatedDeltaNet2) -> dict[str, tuple[tuple, str]]:
    """FLA key -> (attribute path of the NNX parameter, layout kind)."""
    m: dict[str, tuple[tuple, str]] = {}
    for n in ("q", "k", "v", "b", "w", "o"):
        m[f"{n}_proj.weight"] = ((f"{n}_proj", "kernel"), "linear")
    if layer.use_short_conv:
        for n in ("q", "k", "v"):
            m[f"{n}_conv1d.weight"] = ((f"{n}_conv1d", "kernel"), "conv")
            if layer.conv_bias:
                m[f"{n}_conv1d.bias"] = ((f"{n}_conv1d", "bias"), "vector")
    for n in ("f", "g"):
        for i in (0, 1):
            m[f"{n}_proj.{i}.weight"] = ((f"{n}_proj", "layers", i, "kernel"), "linear")
    m["g_proj.1.bias"] = (("g_proj", "layers", 1, "bias"), "vector")
    m["A_log"] = (("A_log",), "vector")
    m["dt_bias"] = (("dt_bias",), "vector")
    m["o_norm.weight"] = (("o_norm", "scale"), "vector")
    return m


def _param(layer, path) -> nnx.Variable:
    node = layer
    for p in path:
        node = node[p] if isinstance(p, int) else getattr(node, p)
    return node


def _to_fla(x: np.ndarray, kind: str) -> np.ndarray:
    if kind == "linear":
        return x.T
    if kind == "conv":
        return x.T[:, None, :]
    return x


def _from_fla(x: np.ndarray, kind: str) -> np.ndarray:
    if kind == "linear":
        return x.T
    if kind == "conv":
        return x[:, 0, :].T
    return x


def to_fla_state_dict(layer: GatedDeltaNet2, dtype: Any = None) -> dict[str, np.ndarray]:
    """FLA ``GatedDeltaNet2.state_dict()`` of ``layer`` as numpy arrays (in ``dtype``, default param dtype).

    Load it into torch with ``fla_layer.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()})``
    (bfloat16 numpy arrays need ``dtype=np.float32`` here and ``.to(torch.bfloat16)`` there).

    The weights are exported whatever ``layer.gate_activation`` is. FLA's layer gates its output with a sigmoid,
    so an FLA layer loaded with a SiLU-gated layer's weights computes a different output; build FLA's layer with
    :func:`fla_layer_kwargs`, which refuses such a layer.
    """
    out = {}
    for key, (path, kind) in _key_map(layer).items():
        x = np.asarray(_param(layer, path)[...])
        out[key] = np.ascontiguousarray(_to_fla(x, kind).astype(dtype or x.dtype))
    return out


def load_fla_state_dict(layer: GatedDeltaNet2, state_dict: Mapping[str, Any]) -> GatedDeltaNet2:
    """Copy an FLA state_dict (numpy arrays, or anything ``np.asarray`` takes) into ``layer``, in place.

    Values are cast to each parameter's dtype. Returns ``layer``.

    Raises:
      ValueError: naming the keys that are missing or unexpected, or a key whose shape does not match.
    """
    kmap = _key_map(layer)
    missing = sorted(set(kmap) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(kmap))
    if missing or unexpected:
        raise ValueError(f"load_fla_state_dict: missing keys {missing}, unexpected keys {unexpected}")
    new = {}
    for key, (path, kind) in kmap.items():
        var = _param(layer, path)
        x = _from_fla(np.asarray(state_dict[key]), kind)
        if x.shape != var.shape:
            want = _to_fla(np.empty(var.shape), kind).shape
            raise ValueError(f"load_fla_state_dict: `{key}` must have shape {want}, "
                             f"got {np.asarray(state_dict[key]).shape}")
        new[path] = jnp.asarray(x, dtype=var.dtype)
    for path, x in new.items():  # all checks passed: now write
        _param(layer, path).set_value(x)
    return layer


def fla_layer_kwargs(layer: GatedDeltaNet2) -> dict[str, Any]:
    """Constructor arguments of FLA's ``GatedDeltaNet2`` describing the same layer as ``layer``.

    Raises:
      ValueError: ``layer.gate_activation`` is not ``"sigmoid"``: FLA's layer always gates its output with a
        sigmoid (``fla/layers/gdn2.py``), so no FLA layer computes what a SiLU-gated layer does.
      TypeError / ValueError: ``layer.mode`` or ``layer.allow_neg_eigval`` reassigned to a bad value (as the
        layer's call checks them).
    """
    fn = "fla_layer_kwargs"
    if layer.gate_activation != "sigmoid":
        raise ValueError(f"{fn}: FLA's GatedDeltaNet2 gates its output with a sigmoid, so it cannot describe this "
                         f"layer (`gate_activation`={layer.gate_activation!r}); build the layer with "
                         "gate_activation='sigmoid' (as from_fla_state_dict does)")
    return dict(hidden_size=layer.hidden_size, expand_v=layer.expand_v, head_dim=layer.head_dim,
                num_heads=layer.num_heads, num_v_heads=layer.num_v_heads,
                mode=check_option(fn, "layer.mode", layer.mode, MODES), use_short_conv=layer.use_short_conv,
                allow_neg_eigval=check_bool(fn, "layer.allow_neg_eigval", layer.allow_neg_eigval),
                conv_size=layer.conv_size, conv_bias=layer.conv_bias, norm_eps=layer.norm_eps)


def from_fla_state_dict(state_dict: Mapping[str, Any], *, allow_neg_eigval: bool = False, norm_eps: float = 1e-5,
                        rngs: nnx.Rngs | None = None, **layer_kwargs) -> GatedDeltaNet2:
    """Build a :class:`GatedDeltaNet2` from an FLA state_dict, inferring the sizes from the shapes.

    ``allow_neg_eigval`` and ``norm_eps`` are not stored in FLA's state_dict: pass the values the FLA layer was
    built with. ``gate_activation`` is ``"sigmoid"`` (FLA's output gate). Other keyword arguments (``dtype``,
    ``param_dtype``, ``backend``, ...) go to the constructor.
    """
    sd = {k: np.asarray(v) for k, v in state_dict.items()}
    try:
        key_dim, hidden = sd["q_proj.weight"].shape
        num_heads = sd["A_log"].shape[0]
        head_v_dim = sd["f_proj.0.weight"].shape[0]
        value_dim = sd["v_proj.weight"].shape[0]
    except KeyError as e:
        raise ValueError(f"from_fla_state_dict: missing key {e}") from None
    head_dim = key_dim // num_heads
    use_short_conv = "q_conv1d.weight" in sd
    kwargs = dict(head_dim=head_dim, num_heads=num_heads, num_v_heads=value_dim // head_v_dim,
                  expand_v=head_v_dim / head_dim, use_short_conv=use_short_conv,
                  conv_size=sd["q_conv1d.weight"].shape[-1] if use_short_conv else 4,
                  conv_bias="q_conv1d.bias" in sd, allow_neg_eigval=allow_neg_eigval, norm_eps=norm_eps,
                  gate_activation="sigmoid")
    kwargs.update(layer_kwargs)
    layer = GatedDeltaNet2(hidden, rngs=rngs or nnx.Rngs(0), **kwargs)
    return load_fla_state_dict(layer, sd)


def cache_to_fla(cache: GDN2Cache) -> dict[str, Any]:
    """FLA's per-layer cache dict ``{"recurrent_state": [N,HV,K,V] f32, "conv_state": (q, k, v) [N,D,W]}`` (numpy)."""
    conv = None if cache.conv_state is None else tuple(np.asarray(c) for c in cache.conv_state)
    return {"recurrent_state": np.asarray(cache.recurrent_state), "conv_state": conv}


def cache_from_fla(state: Mapping[str, Any], dtype: Any = None) -> GDN2Cache:
    """:class:`GDN2Cache` from FLA's per-layer cache dict (numpy arrays); conv windows cast to ``dtype`` if given."""
    conv = state.get("conv_state")
    if conv is not None:
        conv = tuple(jnp.asarray(np.asarray(c), dtype=dtype) for c in conv)
    return GDN2Cache(jnp.asarray(np.asarray(state["recurrent_state"]), jnp.float32), conv)

"""Flax NNX layers built on :mod:`gdn2_jax`.

* :class:`GatedDeltaNet2` — the GDN-2 token mixer (NVlabs / FLA structure) with an explicit prefill/decode
  cache (:class:`GDN2Cache`), padding masks and packed sequences.
* :mod:`flax_layers.convert` — weights and caches to and from FLA's torch ``GatedDeltaNet2`` (numpy only).
"""

from .convert import (cache_from_fla, cache_to_fla, fla_layer_kwargs, from_fla_state_dict, load_fla_state_dict,
                      to_fla_state_dict)
from .gdn2 import GatedDeltaNet2, GatedRMSNorm, GDN2Cache, ShortConvolution, nvlabs_kernel_init

__all__ = [
    "GatedDeltaNet2",
    "GDN2Cache",
    "ShortConvolution",
    "GatedRMSNorm",
    "nvlabs_kernel_init",
    "to_fla_state_dict",
    "load_fla_state_dict",
    "from_fla_state_dict",
    "fla_layer_kwargs",
    "cache_to_fla",
    "cache_from_fla",
]

"""gdn2-jax: Gated DeltaNet-2 (GDN-2) linear attention for JAX.

Public API (FLA names): :func:`chunk_gdn2` (prefill / training), :func:`fused_recurrent_gdn2` (decode),
and the pure-jnp references :func:`naive_recurrent_gdn2` (ground truth) and :func:`naive_chunk_gdn2`.
Public modules: ``gdn2_jax.backends`` (backend selection), ``gdn2_jax.validation`` (argument checks) and
``gdn2_jax.xla`` (the pure-jnp stages, one file per stage). Importing this package imports neither TileLang
nor torch and does not initialise a GPU.
"""

from .ops import chunk_gdn2, fused_recurrent_gdn2
from .reference import l2norm, naive_chunk_gdn2, naive_recurrent_gdn2

__version__ = "0.1.0"

__all__ = [
    "chunk_gdn2",
    "fused_recurrent_gdn2",
    "naive_recurrent_gdn2",
    "naive_chunk_gdn2",
    "l2norm",
    "__version__",
]

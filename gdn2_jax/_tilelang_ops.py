"""JAX entry points of the TileLang kernels (XLA FFI custom calls). Filled in by the kernel work."""

from __future__ import annotations

# Names of the public ops whose TileLang path exists.
IMPLEMENTED: frozenset[str] = frozenset()


def chunk_gdn2(*args, **kwargs):
    raise NotImplementedError(
        "chunk_gdn2: backend='tilelang' is not implemented yet; use backend='xla' or 'auto'"
    )


def fused_recurrent_gdn2(*args, **kwargs):
    raise NotImplementedError(
        "fused_recurrent_gdn2: backend='tilelang' is not implemented yet; use backend='xla' or 'auto'"
    )

"""Backend selection for the public ops (``"auto"``, ``"xla"``, ``"tilelang"``)."""

from __future__ import annotations

import functools
import importlib.util

import jax

BACKENDS = ("auto", "xla", "tilelang")


@functools.lru_cache(maxsize=None)
def cuda_extra_installed() -> bool:
    """True when the packages of the ``cuda`` extra are importable (nothing is imported)."""
    return all(importlib.util.find_spec(m) is not None for m in ("tilelang", "tvm_ffi", "jax_tvm_ffi"))


def tilelang_supported_device() -> bool:
    """True when JAX's default device is an NVIDIA GPU the TileLang kernels are built for (Hopper, sm_90)."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return False
    if dev.platform != "gpu" or "cuda" not in str(getattr(dev.client, "platform_version", "")).lower():
        return False
    return str(getattr(dev, "compute_capability", "")).split(".")[0] == "9"


def tilelang_available(op: str) -> bool:
    """Whether the TileLang kernels of ``op`` exist and can run here."""
    from . import _tilelang_ops  # noqa: F401  (kernels registered per op as they are implemented)

    return op in _tilelang_ops.IMPLEMENTED and cuda_extra_installed() and tilelang_supported_device()


def resolve(backend: str, op: str) -> str:
    """Map the user's ``backend`` argument to ``"xla"`` or ``"tilelang"``."""
    if backend not in BACKENDS:
        raise ValueError(f"{op}: `backend` must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "tilelang" if tilelang_available(op) else "xla"
    return backend

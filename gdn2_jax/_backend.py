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
    return tilelang_unavailable_reason(op) is None


def check_backend(backend: str, op: str) -> None:
    """Raise ``TypeError`` / ``ValueError`` naming ``backend`` unless it is one of :data:`BACKENDS`."""
    if not isinstance(backend, str):
        raise TypeError(f"{op}: `backend` must be a str, one of {BACKENDS}, got {type(backend).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"{op}: `backend` must be one of {BACKENDS}, got {backend!r}")


def tilelang_unavailable_reason(op: str) -> str | None:
    """Why the TileLang path of ``op`` cannot run here, or None when it can."""
    from . import _tilelang_ops

    if op not in _tilelang_ops.IMPLEMENTED:
        return "its TileLang kernels are not implemented yet"
    if not cuda_extra_installed():
        return "the `cuda` extra (tilelang, apache-tvm-ffi, jax-tvm-ffi) is not installed"
    if not tilelang_supported_device():
        return "JAX's default device is not an NVIDIA Hopper (sm_90) GPU"
    return None


def resolve(backend: str, op: str) -> str:
    """Map the user's ``backend`` argument to ``"xla"`` or ``"tilelang"``.

    Raises ``NotImplementedError`` for ``backend="tilelang"`` where the kernels cannot run (no kernels for
    ``op`` yet, no cuda extra, or no supported GPU), before anything is staged.
    """
    check_backend(backend, op)
    if backend == "auto":
        return "tilelang" if tilelang_available(op) else "xla"
    if backend == "tilelang":
        why = tilelang_unavailable_reason(op)
        if why is not None:
            raise NotImplementedError(
                f"{op}: backend='tilelang' cannot run here: {why}; use backend='xla' (or 'auto')"
            )
    return backend

"""Backend selection for the public ops (``"auto"``, ``"xla"``, ``"tilelang"``) and the one CUDA device probe.

Public so that layers built on the ops can check a backend before they compute anything (``flax_layers`` does).
Nothing here imports tilelang, tvm_ffi or torch.
"""

from __future__ import annotations

import functools
import importlib.util

import jax

from kernels import registry

from .validation import check_option

__all__ = ["BACKENDS", "check_backend", "resolve", "tilelang_available", "tilelang_unavailable_reason",
           "cuda_extra_installed", "cuda_capability", "tilelang_supported_device"]

BACKENDS = ("auto", "xla", "tilelang")


@functools.lru_cache(maxsize=None)
def cuda_extra_installed() -> bool:
    """True when the packages of the ``cuda`` extra are importable (nothing is imported)."""
    return all(importlib.util.find_spec(m) is not None for m in ("tilelang", "tvm_ffi", "jax_tvm_ffi"))


def cuda_capability() -> tuple[int, int] | None:
    """Compute capability ``(major, minor)`` of JAX's first CUDA device, or None when JAX has no CUDA device."""
    try:
        devs = jax.devices("gpu")
    except RuntimeError:
        return None
    devs = [d for d in devs if "cuda" in str(getattr(d.client, "platform_version", "")).lower()]
    if not devs:
        return None
    major, _, minor = str(getattr(devs[0], "compute_capability", "0")).partition(".")
    return int(major), int(minor or 0)


def tilelang_supported_device() -> bool:
    """True when JAX's default device is an NVIDIA GPU the TileLang kernels are built for (Hopper, sm_90)."""
    try:
        if jax.devices()[0].platform != "gpu":
            return False
    except RuntimeError:
        return False
    cc = cuda_capability()
    return cc is not None and cc[0] == 9


def tilelang_unavailable_reason(op: str) -> str | None:
    """Why the TileLang path of ``op`` (a public op name) cannot run here, or None when it can."""
    if op not in registry.OPS:
        return f"{op} has no TileLang kernels (ops with kernels: {', '.join(registry.OPS)})"
    if not cuda_extra_installed():
        return "the `cuda` extra (tilelang, apache-tvm-ffi, jax-tvm-ffi) is not installed"
    if not tilelang_supported_device():
        return "JAX's default device is not an NVIDIA Hopper (sm_90) GPU"
    return None


def tilelang_available(op: str) -> bool:
    """Whether the TileLang kernels of ``op`` exist and can run here."""
    return tilelang_unavailable_reason(op) is None


def check_backend(backend: str, op: str) -> str:
    """``backend`` as a plain str; raise ``TypeError`` / ``ValueError`` naming it unless it is one of
    :data:`BACKENDS`."""
    return check_option(op, "backend", backend, BACKENDS)


def resolve(backend: str, op: str) -> str:
    """Map the user's ``backend`` argument to ``"xla"`` or ``"tilelang"``.

    ``"auto"`` gives ``"tilelang"`` where :func:`tilelang_available`, else ``"xla"`` (the caller may still fall
    back to ``"xla"`` for inputs the kernels do not support). Raises ``NotImplementedError`` for
    ``backend="tilelang"`` where the kernels cannot run (no kernels for ``op``, no cuda extra, or no supported
    GPU), before anything is staged.
    """
    backend = check_backend(backend, op)
    if backend == "auto":
        return "tilelang" if tilelang_available(op) else "xla"
    if backend == "tilelang":
        why = tilelang_unavailable_reason(op)
        if why is not None:
            raise NotImplementedError(
                f"{op}: backend='tilelang' cannot run here: {why}; use backend='xla' (or 'auto')"
            )
    return backend

"""Shared pytest setup.

* ``@pytest.mark.cuda`` tests are skipped unless JAX sees an NVIDIA GPU *and* the ``cuda`` extra
  (tilelang, tvm_ffi, jax_tvm_ffi) is installed. The device query only happens when a collected test
  carries the marker, so a CPU run never touches the GPU stack.
* 64-bit mode never leaks between tests or modules. Use the ``x64`` fixture (a ``jax.enable_x64(True)``
  context around one test). A test that flips ``jax_enable_x64`` globally gets the flag restored after it;
  a test *module* that flips it at import time is a collection error (it would silently change every
  module collected after it).
"""

from __future__ import annotations

import os

# XLA's CPU runtime can wedge in its multi-threaded Eigen pool while materialising a result (a public report,
# PyAutoLabs/PyAutoFit#1528, found this flag as the cure for Eigen ops that re-enter the pool). Single-threaded
# Eigen; set before JAX initialises its CPU backend. (The other wedge seen here, jaxlib's CPU triangular-solve
# custom call re-entering the intra-op pool, is not covered by this flag; the library no longer emits it, see
# test_chunk.py::test_cpu_program_has_no_custom_calls.)
if "xla_cpu_multi_thread_eigen" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()

import jax  # noqa: E402
import pytest

_X64_AT_START: bool | None = None


def pytest_configure(config):
    global _X64_AT_START
    _X64_AT_START = bool(jax.config.jax_enable_x64)


def pytest_collection_finish(session):
    if bool(jax.config.jax_enable_x64) != _X64_AT_START:
        jax.config.update("jax_enable_x64", _X64_AT_START)
        raise pytest.UsageError(
            "a test module changed jax_enable_x64 at import time; use the `x64` fixture "
            "(tests/conftest.py) or `with jax.enable_x64(True):` inside the test instead"
        )


def nvidia_gpu_present() -> bool:
    """True when JAX's devices include an NVIDIA (CUDA) GPU. Initialises JAX's backends."""
    try:
        devices = jax.devices()
    except RuntimeError:
        return False
    return any(
        d.platform == "gpu" and "cuda" in str(getattr(d.client, "platform_version", "")).lower()
        for d in devices
    )


def cuda_ready() -> tuple[bool, str]:
    from gdn2_jax import backends

    if not backends.cuda_extra_installed():
        return False, "the cuda extra (tilelang, apache-tvm-ffi, jax-tvm-ffi) is not installed"
    if not nvidia_gpu_present():
        return False, "no NVIDIA GPU visible to JAX"
    return True, ""


def pytest_collection_modifyitems(config, items):
    cuda_items = [it for it in items if it.get_closest_marker("cuda") is not None]
    if not cuda_items:
        return
    ok, why = cuda_ready()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"cuda test skipped: {why}")
    for it in cuda_items:
        it.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_x64_flag():
    before = bool(jax.config.jax_enable_x64)
    yield
    if bool(jax.config.jax_enable_x64) != before:
        jax.config.update("jax_enable_x64", before)


@pytest.fixture
def x64():
    """Run one test with ``jax_enable_x64`` on (restored afterwards, whatever happens)."""
    with jax.enable_x64(True):
        yield

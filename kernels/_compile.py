"""Compile TileLang launches for an explicit CUDA arch, with a memory + disk cache safe across processes.

* Arch: ``sm_90a`` for compute capability 9.0 (Hopper; the only family the kernels are written and tested
  for). :func:`device_arch` reads the capability of a CUDA device (torch, else the CUDA driver); a CPU-only
  host passes ``arch=`` explicitly (the compiler itself needs no GPU).
* Cache key: sha256 of (launch key, arch, TileLang version, hash of the kernel sources). The compiled module is
  exported as a shared library to ``$GDN2_JAX_CACHE_DIR`` (default ``~/.cache/gdn2-jax/kernels``) with an
  atomic write (temp file + ``os.replace``) under an exclusive file lock, so several processes compiling the
  same kernel at once produce one valid file. Loading uses ``tvm_ffi.load_module`` (after ``import tilelang``,
  which loads TileLang's runtime library).
* FFI target names are stable content hashes: ``gdn2_<launch name>_<hash12>``.

Never imports jax.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import inspect
import os
import threading
from pathlib import Path

from ._pipeline import Launch

__all__ = [
    "SUPPORTED_CAPABILITIES", "arch_for_capability", "device_arch", "cache_dir", "cache_key", "target_name",
    "compile_launch", "get_function", "UnsupportedGPUError",
]

#: compute capability -> TileLang arch string. Hopper GEMMs need the "a" (arch-specific) variant.
SUPPORTED_CAPABILITIES = {(9, 0): "sm_90a"}
_ENV_CACHE = "GDN2_JAX_CACHE_DIR"
_SUFFIX = ".so"
_lock = threading.Lock()
_functions: dict[str, object] = {}  # cache key -> tvm_ffi.Function (one per process, shared by JAX and torch)
_fast: dict[tuple, tuple] = {}  # (id(launch), arch) -> (launch, function): the torch path's per-call lookup


class UnsupportedGPUError(RuntimeError):
    """The GPU's compute capability has no kernel build (only Hopper, sm_90a, is supported)."""


def arch_for_capability(major: int, minor: int) -> str:
    """TileLang arch for a CUDA compute capability; raises :class:`UnsupportedGPUError` for others."""
    try:
        return SUPPORTED_CAPABILITIES[(int(major), int(minor))]
    except KeyError:
        raise UnsupportedGPUError(
            f"gdn2-jax TileLang kernels support NVIDIA Hopper (compute capability 9.0, sm_90a) only; this GPU has "
            f"compute capability {major}.{minor}. Use backend='xla'."
        ) from None


def _driver_capability(ordinal: int) -> tuple[int, int]:
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    if cuda.cuInit(0) != 0:
        raise RuntimeError("cuInit failed: no usable CUDA driver")
    dev = ctypes.c_int()
    if cuda.cuDeviceGet(ctypes.byref(dev), ordinal) != 0:
        raise RuntimeError(f"no CUDA device {ordinal}")
    major, minor = ctypes.c_int(), ctypes.c_int()
    # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75, _MINOR = 76
    cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)
    cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)
    return major.value, minor.value


@functools.lru_cache(maxsize=None)
def device_arch(ordinal: int = 0) -> str:
    """Arch string of CUDA device ``ordinal`` (torch if it sees CUDA, else the driver API)."""
    try:
        import torch

        if torch.cuda.is_available():
            return arch_for_capability(*torch.cuda.get_device_capability(ordinal))
    except ImportError:
        pass
    try:
        cap = _driver_capability(ordinal)
    except OSError as e:
        raise RuntimeError(f"cannot query the CUDA device ({e}); pass arch= explicitly (e.g. 'sm_90a')") from None
    return arch_for_capability(*cap)


def target(arch: str) -> dict:
    """TileLang compile target for ``arch`` (an explicit dict: 'auto' picks wrong archs on CPU hosts)."""
    if arch not in SUPPORTED_CAPABILITIES.values():
        raise UnsupportedGPUError(f"unsupported arch {arch!r}; supported: {sorted(SUPPORTED_CAPABILITIES.values())}")
    return {"kind": "cuda", "arch": arch}


def cache_dir() -> Path:
    d = os.environ.get(_ENV_CACHE)
    return Path(d).expanduser() if d else Path.home() / ".cache" / "gdn2-jax" / "kernels"


@functools.lru_cache(maxsize=None)
def _file_digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _source_digest(launch: Launch) -> str:
    """Hash of the file defining ``launch.build``, the files its module names in ``SOURCE_DEPENDENCIES`` and the
    shared kernel modules it may use."""
    files = set()
    here = Path(__file__).resolve().parent
    try:
        src = os.path.realpath(inspect.getsourcefile(launch.build))
        files.add(src)
        module = inspect.getmodule(launch.build)
        for name in getattr(module, "SOURCE_DEPENDENCIES", ()):  # kernel code the module inlines from others
            files.add(str(Path(src).parent / name))
    except TypeError:
        pass
    files.add(str(here / "_pipeline.py"))
    files.add(str(here / "_compile.py"))
    for p in here.glob("_common*.py"):
        files.add(str(p))
    return hashlib.sha256("".join(f"{Path(f).name}:{_file_digest(f)}" for f in sorted(files)).encode()).hexdigest()


@functools.lru_cache(maxsize=None)
def _tilelang_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tilelang")
    except PackageNotFoundError:
        return "none"


def cache_key(launch: Launch, arch: str) -> str:
    """Hex sha256 over everything that changes the compiled code (memoised per launch and arch)."""
    return _cache_key(launch, _build_file(launch), arch)


def _build_file(launch: Launch) -> str:
    try:
        return inspect.getsourcefile(launch.build) or ""
    except TypeError:
        return ""


@functools.lru_cache(maxsize=4096)
def _cache_key(launch: Launch, build_file: str, arch: str) -> str:
    payload = repr((launch.name, launch.key, arch, _tilelang_version(), _source_digest(launch))
                   + ((launch.pass_configs,) if launch.pass_configs else ()))
    return hashlib.sha256(payload.encode()).hexdigest()


def target_name(launch: Launch, arch: str) -> str:
    """Stable, content-hashed FFI target name, e.g. ``gdn2_gdn2_recurrent_fwd_1a2b3c4d5e6f``."""
    base = launch.name[5:] if launch.name.startswith("gdn2_") else launch.name
    return f"gdn2_{base}_{cache_key(launch, arch)[:12]}"


@contextlib.contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def library_path(launch: Launch, arch: str) -> Path:
    return cache_dir() / arch / f"{launch.name}-{cache_key(launch, arch)}{_SUFFIX}"


def compile_launch(launch: Launch, arch: str) -> Path:
    """Make sure the compiled library of ``launch`` for ``arch`` is on disk; return its path (no GPU needed)."""
    path = library_path(launch, arch)
    if path.exists():
        return path
    with _file_lock(path.with_suffix(".lock")):
        if path.exists():  # another process finished it while we waited
            return path
        import tilelang

        kernel = tilelang.compile(launch.build(), target=target(arch), execution_backend="tvm_ffi",
                                  pass_configs=dict(launch.pass_configs) or None)
        tmp = path.with_name(f".tmp-{os.getpid()}-{threading.get_ident()}-{path.name}")
        try:
            kernel.export_library(str(tmp))
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()
    return path


def get_function(launch: Launch, arch: str):
    """The ``tvm_ffi.Function`` of ``launch`` (compiled on first use, loaded from the disk cache afterwards).

    One object per (launch, arch) per process: the JAX and torch runners call the same function.
    """
    hit = _fast.get((id(launch), arch))
    if hit is not None and hit[0] is launch:
        return hit[1]
    key = cache_key(launch, arch)
    fn = _functions.get(key)
    if fn is not None:
        _fast[(id(launch), arch)] = (launch, fn)
        return fn
    with _lock:
        fn = _functions.get(key)
        if fn is None:
            path = compile_launch(launch, arch)
            import tilelang  # noqa: F401  (loads libtilelang.so, which the exported module links against)
            import tvm_ffi

            fn = tvm_ffi.load_module(str(path))["main"]
            _functions[key] = fn
    _fast[(id(launch), arch)] = (launch, fn)
    return fn

"""Run a kernel :class:`~kernels._pipeline.Pipeline` under JAX as XLA FFI custom calls (jax-tvm-ffi).

Each launch becomes one ``jax.ffi.ffi_call`` to a target named by the content hash of its compiled code
(``gdn2_<kernel>_<hash12>``, see ``kernels._compile.target_name``); a target is registered once per process
with ``jax_tvm_ffi.register_ffi_target`` and reused. Scratch buffers are ordinary extra results of the call (XLA
allocates them; the FFI handler never allocates device memory). An output that the pipeline declares as an
alias of an input (in-place decode state) is passed with ``input_output_aliases`` when ``inplace=True``: with a
donated input (or a loop-carried state) XLA then writes in place, otherwise it copies first.

Compilation and registration happen at trace time, only when JAX has a CUDA backend; on a CPU-only host the
custom calls still lower (``lowering_platforms=("cuda",)``) for CI, with the same target names.
Imports tilelang / tvm_ffi lazily.
"""

from __future__ import annotations

import functools
import threading

import jax
import numpy as np

from kernels import _compile
from kernels._pipeline import Pipeline, launch_io

__all__ = ["cuda_backend_present", "default_arch", "register", "run_pipeline", "target_name"]

_registered: dict[str, object] = {}
_reg_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def cuda_backend_present() -> bool:
    """True when JAX has CUDA devices (then kernels are compiled and registered at trace time)."""
    try:
        return any("cuda" in str(getattr(d.client, "platform_version", "")).lower() for d in jax.devices("gpu"))
    except RuntimeError:
        return False


@functools.lru_cache(maxsize=None)
def default_arch() -> str:
    """Arch of JAX's first CUDA device; ``sm_90a`` when there is none (CPU-only lowering)."""
    if not cuda_backend_present():
        return "sm_90a"
    cc = str(getattr(jax.devices("gpu")[0], "compute_capability", ""))
    major, _, minor = cc.partition(".")
    return _compile.arch_for_capability(int(major), int(minor or 0))


def target_name(launch, arch: str, *, drop: tuple = (), cuda_graph: bool = False) -> str:
    """FFI target name: the kernel's content hash, plus suffixes for dropped operands / CUDA-graph registration."""
    return (_compile.target_name(launch, arch) + (f"_d{'_'.join(map(str, drop))}" if drop else "")
            + ("_cg" if cuda_graph else ""))


def register(launch, arch: str, *, drop: tuple = (), cuda_graph: bool = False) -> str:
    """Compile (or load) ``launch`` for ``arch`` and register it as an XLA FFI target; return the target name.

    ``drop`` lists operand positions the kernel does not take (buffers passed only so that they can be aliased
    to a result); they are removed by a thin tvm-ffi wrapper. ``cuda_graph`` registers a second target (suffix
    ``_cg``) that XLA may capture into CUDA graphs / command buffers (experimental: the kernel must have run once
    outside capture first). Registration is once per name per process.
    """
    name = target_name(launch, arch, drop=drop, cuda_graph=cuda_graph)
    if name in _registered:
        return name
    with _reg_lock:
        if name not in _registered:
            import jax_tvm_ffi

            fn = _compile.get_function(launch, arch)
            if drop:
                import tvm_ffi

                keep = lambda args: [a for i, a in enumerate(args) if i not in drop]  # noqa: E731
                inner = fn
                fn = tvm_ffi.convert(lambda *args: inner(*keep(args)))
            jax_tvm_ffi.register_ffi_target(name, fn, ["args", "rets"], platform="gpu",
                                            allow_cuda_graph=bool(cuda_graph))
            _registered[name] = fn
    return name


def _np_dtype(name: str):
    import jax.numpy as jnp

    return {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32, "int32": jnp.int32}[name]


def run_pipeline(pipe: Pipeline, inputs: dict, *, arch: str | None = None, inplace: bool = False,
                 register_targets: bool | None = None, cuda_graph: bool = False) -> dict:
    """Stage ``pipe`` on JAX arrays ``inputs`` (name -> array); return ``{output name: array}``.

    Shapes are static at trace time; everything runs as custom calls on XLA's stream. ``inplace`` passes the
    pipeline's aliases (output -> input) as ``input_output_aliases``.
    """
    arch = arch or default_arch()
    if register_targets is None:
        register_targets = cuda_backend_present()
    shapes = {n: tuple(inputs[n].shape) for n in pipe.inputs}
    buf_shapes = pipe.buffer_shapes(shapes)
    dtypes = {b.name: _np_dtype(b.dtype) for b in tuple(pipe.scratch) + tuple(pipe.outputs)}
    vals = dict(inputs)
    for i, la in enumerate(pipe.launches):
        operands, results, fresh = launch_io(pipe, i)
        ops = [vals[a] for a in operands]
        aliases = {}
        drop = []
        for r_idx, r in enumerate(results):
            if r not in fresh:  # produced by an earlier launch: pass it in and alias it (updated in place)
                drop.append(len(ops))
                aliases[len(ops)] = r_idx
                ops.append(vals[r])
            elif inplace and r in pipe.aliases and pipe.aliases[r] in operands:
                aliases[operands.index(pipe.aliases[r])] = r_idx
        drop = tuple(drop)
        if register_targets:
            name = register(la, arch, drop=drop, cuda_graph=cuda_graph)
        else:
            name = target_name(la, arch, drop=drop, cuda_graph=cuda_graph)
        out_specs = [jax.ShapeDtypeStruct(buf_shapes[r], dtypes[r]) for r in results]
        outs = jax.ffi.ffi_call(name, out_specs, vmap_method="sequential",
                                input_output_aliases=aliases or None)(*ops)
        for r, val in zip(results, outs):
            vals[r] = val
    return {b.name: vals[b.name] for b in pipe.outputs}


def as_dtype_name(x) -> str:
    return np.dtype(x.dtype).name

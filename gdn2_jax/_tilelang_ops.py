"""JAX entry points of the TileLang kernels (XLA FFI custom calls): the ``backend="tilelang"`` paths.

``chunk_gdn2`` runs the chunked prefill pipeline (``kernels.chunk_fwd``), ``fused_recurrent_gdn2`` the fused
recurrent decode pipeline (``kernels.recurrent_fwd``). Both:

* check everything the kernels need in Python before any ``ffi_call`` (dtypes, head dims), with errors naming
  the argument;
* fold ``jax.vmap`` into the kernels' batch axis (``jax.custom_batching.custom_vmap``; packed-varlen inputs are
  folded into one longer packed sequence with shifted ``cu_seqlens``);
* are differentiable: the forward runs the kernels, the backward is the VJP of the pure-jnp (xla) path
  (recomputing its forward), so ``backend="auto"`` never breaks ``jax.grad``.

Nothing here imports tilelang, tvm_ffi or torch at module import time (``import gdn2_jax`` stays light).
"""

from __future__ import annotations

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np

from ._validation import Dims

__all__ = ["IMPLEMENTED", "chunk_gdn2", "fused_recurrent_gdn2", "fused_recurrent_gdn2_inplace"]


def _chunk_kernels_present() -> bool:
    try:
        return importlib.util.find_spec("kernels.chunk_fwd") is not None
    except (ImportError, ValueError):
        return False


# Names of the public ops whose TileLang path exists.
IMPLEMENTED: frozenset[str] = frozenset(
    {"fused_recurrent_gdn2"} | ({"chunk_gdn2"} if _chunk_kernels_present() else set())
)

_QKV_DTYPES = ("bfloat16", "float16")
_G_DTYPES = ("float32", "bfloat16")


def _supported_dims(op: str):
    if op == "chunk_gdn2":
        from kernels import chunk_fwd as mod
    else:
        from kernels import recurrent_fwd as mod
    return tuple(getattr(mod, "SUPPORTED_K", (64, 128))), tuple(getattr(mod, "SUPPORTED_V", (64, 128)))


def _check_supported(fn: str, q, k, v, g, b, w, dims: Dims, initial_state):
    """Raise (naming the argument) for anything the TileLang kernels cannot run. Returns (dtype, g_dtype)."""
    dt = np.dtype(q.dtype).name
    if dt not in _QKV_DTYPES:
        raise TypeError(f"{fn}: backend='tilelang' needs `q` in bfloat16 or float16, got {q.dtype}; "
                        "use backend='xla' for float32/float64")
    for name, x in dict(k=k, v=v, b=b, w=w).items():
        if np.dtype(x.dtype) != np.dtype(q.dtype):
            raise TypeError(f"{fn}: backend='tilelang' needs `{name}` in q's dtype {q.dtype}, got {x.dtype}")
    gdt = np.dtype(g.dtype).name
    if gdt not in _G_DTYPES:
        raise TypeError(f"{fn}: backend='tilelang' needs `g` in float32 or bfloat16, got {g.dtype}")
    if initial_state is not None and np.dtype(initial_state.dtype) != np.float32:
        raise TypeError(f"{fn}: backend='tilelang' needs `initial_state` in float32, got {initial_state.dtype}")
    ks, vs = _supported_dims(fn)
    if dims.K not in ks:
        raise ValueError(f"{fn}: backend='tilelang' supports key head dim K in {ks} (from `q`), got K={dims.K}")
    if dims.V not in vs:
        raise ValueError(f"{fn}: backend='tilelang' supports value head dim V in {vs} (from `v`), got V={dims.V}")
    return dt, gdt


def _pipeline(op: str, **kw):
    from kernels import torch_api  # pure Python: the pipeline factories (no torch import at module level)

    return (torch_api.chunk_pipeline if op == "chunk_gdn2" else torch_api.recurrent_pipeline)(**kw)


def _fold_vmap(core, names: tuple, varlen: bool, out_names: tuple):
    """custom_vmap rule: fold the mapped axis into the kernels' batch (or packed-sequence) axis."""

    def rule(axis_size, in_batched, *arrays):
        M = axis_size
        arrs = [x if bt else jnp.broadcast_to(x, (M,) + x.shape) for x, bt in zip(arrays, in_batched)]
        ins = dict(zip(names, arrs))
        folded = {}
        if not varlen:
            for n, x in ins.items():
                folded[n] = x.reshape((M * x.shape[1],) + x.shape[2:])
        else:
            T = ins["q"].shape[2]
            for n, x in ins.items():
                if n == "cu_seqlens":
                    cu = x  # [M, N+1]
                    starts = cu[:, :-1] + (jnp.arange(M, dtype=cu.dtype) * T)[:, None]
                    folded[n] = jnp.concatenate([starts.reshape(-1), jnp.array([M * T], cu.dtype)])
                elif n == "h0":
                    folded[n] = x.reshape((M * x.shape[1],) + x.shape[2:])
                else:  # [M, 1, T, ...] -> [1, M*T, ...]
                    folded[n] = x.reshape((1, M * T) + x.shape[3:])
        outs = core(*(folded[n] for n in names))
        res = []
        for n, y in zip(out_names, outs):
            if n == "o" and varlen:
                res.append(y.reshape((M, 1, y.shape[1] // M) + y.shape[2:]))
            else:
                res.append(y.reshape((M, y.shape[0] // M) + y.shape[1:]))
        return tuple(res), (True,) * len(res)

    return rule


@functools.lru_cache(maxsize=256)
def _make_op(op: str, names: tuple, pipe_kw: tuple, inplace: bool, cuda_graph: bool = False):
    """Differentiable, vmappable array function ``f(*arrays) -> (o, ht?)`` for one static configuration."""
    from . import _ffi

    kw = dict(pipe_kw)
    if inplace:
        kw["inplace_state"] = True
    pipe = _pipeline(op, **kw)
    out_names = tuple(b.name for b in pipe.outputs)
    varlen = kw["varlen"]

    @jax.custom_batching.custom_vmap
    def core(*arrays):
        res = _ffi.run_pipeline(pipe, dict(zip(names, arrays)), inplace=inplace, cuda_graph=cuda_graph)
        return tuple(res[n] for n in out_names)

    core.def_vmap(_fold_vmap(core, names, varlen, out_names))

    def xla_ref(*arrays):
        from .reference import recurrent_forward

        a = dict(zip(names, arrays))
        q = a["q"]
        dims = Dims(B=q.shape[0], T=q.shape[1], H=q.shape[2], HV=a["v"].shape[2], K=q.shape[3],
                    V=a["v"].shape[3], N=(a["cu_seqlens"].shape[0] - 1) if varlen else q.shape[0],
                    scale=kw["scale"], compute_dtype=jnp.float32, varlen=varlen)
        if op == "chunk_gdn2":
            from ._chunk import chunk_forward_xla as f
        else:
            f = recurrent_forward
        o, ht = f(a["q"], a["k"], a["v"], a["g"], a["b"], a["w"], dims, a.get("h0"), a.get("cu_seqlens"),
                  kw["output_final_state"], kw["use_qk_l2norm"])
        return (o,) + ((ht,) if kw["output_final_state"] else ())

    @jax.custom_vjp
    def f(*arrays):
        return core(*arrays)

    def f_fwd(*arrays):
        return core(*arrays), arrays

    def f_bwd(arrays, cts):
        diff = [i for i, n in enumerate(names) if n != "cu_seqlens"]

        def g(*d):
            full = list(arrays)
            for i, x in zip(diff, d):
                full[i] = x
            return xla_ref(*full)

        _, vjp = jax.vjp(g, *(arrays[i] for i in diff))
        grads = vjp(tuple(cts))
        out = [None] * len(arrays)
        for i, gr in zip(diff, grads):
            out[i] = gr
        for i, n in enumerate(names):
            if n == "cu_seqlens":
                out[i] = np.zeros(arrays[i].shape, jax.dtypes.float0)
        return tuple(out)

    f.defvjp(f_fwd, f_bwd)
    return f


def _call(op, q, k, v, g, b, w, *, dims: Dims, initial_state, output_final_state, use_qk_l2norm_in_kernel,
          cu_seqlens, inplace=False, cuda_graph=False):
    dt, gdt = _check_supported(op, q, k, v, g, b, w, dims, initial_state)
    names = ("q", "k", "v", "g", "b", "w") + (("h0",) if initial_state is not None else ()) + (
        ("cu_seqlens",) if cu_seqlens is not None else ())
    arrays = [q, k, v, g, b, w]
    if initial_state is not None:
        arrays.append(initial_state)
    if cu_seqlens is not None:
        cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
        if isinstance(cu_seqlens, jax.core.Tracer):
            # Traced offsets are unchecked here: keep the kernels' reads in bounds (clip to [0, T], monotone);
            # ops._run turns the outputs into NaN when the offsets were invalid.
            cu = jax.lax.cummax(jnp.clip(cu, 0, dims.T), axis=0)
        arrays.append(cu)
    pipe_kw = (("H", dims.H), ("HV", dims.HV), ("K", dims.K), ("V", dims.V), ("dtype", dt), ("g_dtype", gdt),
               ("scale", float(dims.scale)), ("use_initial_state", initial_state is not None),
               ("output_final_state", bool(output_final_state)), ("varlen", cu_seqlens is not None),
               ("use_qk_l2norm", bool(use_qk_l2norm_in_kernel)))
    outs = _make_op(op, names, pipe_kw, inplace, cuda_graph)(*arrays)
    return outs[0], (outs[1] if output_final_state else None)


def chunk_gdn2(q, k, v, g, b, w, *, dims: Dims, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """TileLang chunked prefill forward (validated arguments from ``ops.chunk_gdn2``). Returns (o, ht | None)."""
    if "chunk_gdn2" not in IMPLEMENTED:
        raise NotImplementedError("chunk_gdn2: the TileLang chunk kernels (kernels/chunk_fwd.py) are not present; "
                                  "use backend='xla'")
    return _call("chunk_gdn2", q, k, v, g, b, w, dims=dims, initial_state=initial_state,
                 output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                 cu_seqlens=cu_seqlens)


def fused_recurrent_gdn2(q, k, v, g, b, w, *, dims: Dims, initial_state=None, output_final_state=False,
                         use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """TileLang fused recurrent (decode) forward (validated arguments). Returns (o, ht | None)."""
    return _call("fused_recurrent_gdn2", q, k, v, g, b, w, dims=dims, initial_state=initial_state,
                 output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                 cu_seqlens=cu_seqlens)


def fused_recurrent_gdn2_inplace(q, k, v, g, b, w, initial_state, *, scale=None, use_qk_l2norm_in_kernel=False,
                                 cu_seqlens=None, cuda_graph=False):
    """Serving decode step: like ``fused_recurrent_gdn2(..., output_final_state=True)`` but the new state is
    aliased to ``initial_state`` (``input_output_aliases``). Donate ``initial_state`` to ``jax.jit`` (or carry it
    in a loop) so XLA updates it in place; otherwise XLA copies it first. Returns ``(o, new_state)``.
    ``cuda_graph=True`` (experimental) uses a target XLA may capture into CUDA graphs; run the same step once with
    ``cuda_graph=False`` first so the kernel module is loaded outside any capture.
    """
    from ._validation import check_inputs

    fn = "fused_recurrent_gdn2_inplace"
    if initial_state is None:
        raise ValueError(f"{fn}: `initial_state` is required")
    dims = check_inputs(fn, q, k, v, g, b, w, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                        output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return _call("fused_recurrent_gdn2", q, k, v, g, b, w, dims=dims, initial_state=initial_state,
                 output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                 inplace=True, cuda_graph=bool(cuda_graph))

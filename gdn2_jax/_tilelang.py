"""The ``backend="tilelang"`` implementation: kernel pipelines (``kernels.registry``) as XLA FFI custom calls.

* :func:`forward` is the implementation every public op with kernels dispatches to (``gdn2_jax.ops``). It checks
  what the kernels need with the op's support rule (errors name the argument), builds the pipeline for the static
  configuration, folds ``jax.vmap`` of the forward into the kernels' batch axis (``jax.custom_batching.custom_vmap``; packed
  varlen inputs become one longer packed sequence) and is differentiable: ops with backward kernels
  (``chunk_gdn2``, :data:`KERNEL_BACKWARD`) save their forward states and run the reverse state pass as a kernel
  and the rest of the backward in jnp; the others use the VJP of the op's xla fallback (the registry's ``xla``
  entry) at the same inputs, so ``jax.grad`` works with either backend.
* :func:`run_pipeline` stages any pipeline: each launch is one ``jax.ffi.ffi_call`` to a target named by the
  content hash of its compiled code (``gdn2_<kernel>_<hash12>``, ``kernels._compile.target_name``), registered
  once per process with ``jax_tvm_ffi.register_ffi_target``. Scratch buffers are ordinary extra results (XLA
  allocates them; the FFI handler never allocates device memory). With ``inplace=True`` an output the pipeline
  declares as an alias of an input is passed with ``input_output_aliases``: XLA then writes it in place when the
  input is donated (or loop-carried), and copies the input first otherwise.

Compilation and registration happen at trace time, only when JAX has a CUDA device; on a CPU-only host the custom
calls still lower (``lowering_platforms=("cuda",)``) for CI, with the same target names. Nothing here imports
tilelang, tvm_ffi or torch at module import time.
"""

from __future__ import annotations

import functools
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np

from kernels import _compile, registry
from kernels._pipeline import Pipeline, launch_io

from . import backends
from .validation import Dims, Problem

__all__ = ["forward", "check_supported", "run_pipeline", "register", "target_name", "default_arch"]

_registered: dict[str, object] = {}
_reg_lock = threading.Lock()
_primed: set = set()
_DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32, "int32": jnp.int32}


# --------------------------------------------------------------------------------------------------- FFI runner
@functools.lru_cache(maxsize=None)
def default_arch() -> str:
    """Arch of JAX's first CUDA device; ``sm_90a`` when there is none (CPU-only lowering)."""
    cc = backends.cuda_capability()
    return "sm_90a" if cc is None else _compile.arch_for_capability(*cc)


def target_name(launch, arch: str, *, drop: tuple = (), cuda_graph: bool = False) -> str:
    """FFI target name: the kernel's content hash, plus suffixes for dropped operands / CUDA-graph registration."""
    return (_compile.target_name(launch, arch) + (f"_d{'_'.join(map(str, drop))}" if drop else "")
            + ("_cg" if cuda_graph else ""))


def register(launch, arch: str, *, drop: tuple = (), cuda_graph: bool = False) -> str:
    """Compile (or load) ``launch`` for ``arch`` and register it as an XLA FFI target; return the target name.

    ``drop`` lists operand positions the kernel does not take (buffers passed only so that they can be aliased
    to a result); they are removed by a thin tvm-ffi wrapper. ``cuda_graph`` registers a second target (suffix
    ``_cg``) that XLA may capture into CUDA graphs / command buffers (:func:`_prime` loads its CUDA module before
    any capture). Registration is once per name per process.
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


def _prime(pipe: Pipeline, inputs: dict, arch: str) -> None:
    """Run every launch of ``pipe`` once, outside XLA, on a minimal problem (one sequence of one token, zeros).

    TVM loads a kernel's CUDA module on its first call, which is not allowed while a stream is being captured
    into a CUDA graph; XLA records graph-capturable custom calls exactly that way. Called once per pipeline
    before its graph-capturable targets are first used.
    """
    if pipe.key in _primed:
        return
    with jax.ensure_compile_time_eval():  # called while tracing: make concrete device arrays, not tracers
        _prime_run(pipe, inputs, arch)
    _primed.add(pipe.key)


def _prime_run(pipe: Pipeline, inputs: dict, arch: str) -> None:
    small = {}
    for n, x in inputs.items():
        shape = tuple(x.shape)
        if n in ("q", "k", "v", "g", "b", "w"):
            shape = (1, 1) + shape[2:]
        elif n in ("h0", "state_indices", "num_accepted_tokens"):
            shape = (1,) + shape[1:]
        small[n] = (jnp.asarray([0, 1], jnp.int32) if n == "cu_seqlens" else
                    jnp.ones(shape, x.dtype) if n == "num_accepted_tokens" else jnp.zeros(shape, x.dtype))
    bufs = dict(small)
    for name, shape in pipe.buffer_shapes({n: a.shape for n, a in small.items()}).items():
        bufs[name] = jnp.zeros(shape, _DTYPES[next(b.dtype for b in pipe.scratch + pipe.outputs if b.name == name)])
    jax.block_until_ready(list(bufs.values()))
    for la in pipe.launches:
        _compile.get_function(la, arch)(*[bufs[a] for a in la.args])
    import ctypes

    ctypes.CDLL("libcuda.so.1").cuCtxSynchronize()  # the kernels ran on the default stream: wait before freeing


def run_pipeline(pipe: Pipeline, inputs: dict, *, arch: str | None = None, inplace: bool = False,
                 register_targets: bool | None = None, cuda_graph: bool = False,
                 return_scratch: bool = False) -> dict:
    """Stage ``pipe`` on JAX arrays ``inputs`` (name -> array); return ``{output name: array}``.

    Shapes are static at trace time; everything runs as custom calls on XLA's stream. ``inplace`` passes the
    pipeline's aliases (output -> input) as ``input_output_aliases``. ``return_scratch`` also returns the scratch
    buffers (the training forward keeps them as residuals for the backward kernels).
    """
    arch = arch or default_arch()
    if register_targets is None:
        register_targets = backends.cuda_capability() is not None
    shapes = {n: tuple(inputs[n].shape) for n in pipe.inputs}
    buf_shapes = pipe.buffer_shapes(shapes)
    dtypes = {b.name: _DTYPES[b.dtype] for b in tuple(pipe.scratch) + tuple(pipe.outputs)}
    if cuda_graph and register_targets:
        _prime(pipe, inputs, arch)
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
    return {b.name: vals[b.name] for b in tuple(pipe.outputs) + (tuple(pipe.scratch) if return_scratch else ())}


# ------------------------------------------------------------------------------------------ the op implementation
def check_supported(p: Problem, q, k, v, g, b, w, initial_state) -> None:
    """Raise ``TypeError`` / ``ValueError`` naming the argument when the op's kernels cannot take these inputs
    (the registry's support rule: dtypes, head dims)."""
    err = registry.get(p.op).support.problem(
        dtypes={n: np.dtype(x.dtype).name for n, x in (("q", q), ("k", k), ("v", v), ("b", b), ("w", w))},
        g_dtype=np.dtype(g.dtype).name, K=p.dims.K, V=p.dims.V,
        state_dtype=None if initial_state is None else np.dtype(initial_state.dtype).name)
    if err is not None:
        hint = "; use backend='xla' for float32/float64" if "`q` in" in str(err) else ""
        raise type(err)(f"{p.op}: backend='tilelang' {err}{hint}")


def _fold_vmap(core, names: tuple, varlen: bool, out_names: tuple):
    """custom_vmap rule: fold the mapped axis into the kernels' batch (or packed-sequence) axis."""

    def rule(axis_size, in_batched, *arrays):
        M = axis_size
        arrs = [x if bt else jnp.broadcast_to(x, (M,) + x.shape) for x, bt in zip(arrays, in_batched)]
        ins = dict(zip(names, arrs))
        folded = {}
        factor = ins.pop("valid", None)  # per-problem poison factor [M, 1]: applied below, per problem
        if factor is not None:
            folded["valid"] = jnp.ones((1,), factor.dtype)
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
                y = y.reshape((M, 1, y.shape[1] // M) + y.shape[2:])
            else:
                y = y.reshape((M, y.shape[0] // M) + y.shape[1:])
            if factor is not None:
                y = y * factor.reshape((M,) + (1,) * (y.ndim - 1)).astype(y.dtype)
            res.append(y)
        return tuple(res), (True,) * len(res)

    return rule


@functools.lru_cache(maxsize=256)
def _make_op(p: Problem, names: tuple, cfg: tuple, inplace: bool, cuda_graph: bool):
    """Differentiable, vmappable array function ``f(*arrays) -> (o, ht?)`` for one static configuration.

    The inference launches add the op's per-call options (``registry.KernelOp.options_for_call``), chosen from the
    shapes each call of ``run`` receives: under ``jax.vmap`` those of the folded batch (:func:`_fold_vmap`). The
    training path (:func:`_kernel_vjp`) builds its pipelines from ``cfg`` alone."""
    op = registry.get(p.op)
    cfg_d = dict(cfg)
    pipe = op.pipeline(**cfg_d)
    out_names = tuple(b.name for b in pipe.outputs)
    varlen = "cu_seqlens" in names

    def run(*arrays):
        a = dict(zip(names, arrays))
        n_seq = a["cu_seqlens"].shape[0] - 1 if varlen else a["q"].shape[0]
        call = op.options_for_call(N=n_seq, HV=cfg_d["HV"], V=cfg_d["V"], varlen=varlen)
        res = run_pipeline(op.pipeline(**cfg_d, **call) if call else pipe, a, inplace=inplace, cuda_graph=cuda_graph)
        return tuple(res[n] for n in out_names)

    if "state_indices" in names:  # a shared state pool: vmap runs the kernel once per mapped problem
        core = run
    else:
        core = jax.custom_batching.custom_vmap(run)
        core.def_vmap(_fold_vmap(core, names, varlen, out_names))
    xla_impl = registry.resolve(op.xla)
    serving = {"state_indices": "ssm_state_indices", "num_accepted_tokens": "num_accepted_tokens"}

    def xla_ref(*arrays):
        a = dict(zip(names, arrays))
        q, v = a["q"], a["v"]
        dims = Dims(B=q.shape[0], T=q.shape[1], H=q.shape[2], HV=v.shape[2], K=q.shape[3], V=v.shape[3],
                    N=(a["cu_seqlens"].shape[0] - 1) if varlen else q.shape[0], scale=p.dims.scale,
                    compute_dtype=jnp.float32, varlen=varlen)
        o, ht = xla_impl(Problem(p.op, dims, p.output_final_state, p.use_qk_l2norm_in_kernel, p.options), a["q"],
                         a["k"], a["v"], a["g"], a["b"], a["w"], a.get("h0"), a.get("cu_seqlens"),
                         poison=a["valid"][0] if "valid" in a else None,
                         **{serving[n]: a[n] for n in serving if n in a})
        return (o,) + ((ht,) if p.output_final_state else ())

    @jax.custom_vjp
    def f(*arrays):
        return core(*arrays)

    def f_fwd(*arrays):
        return core(*arrays), arrays

    def f_bwd(arrays, cts):
        ints = ("cu_seqlens", "state_indices", "num_accepted_tokens")
        diff = [i for i, n in enumerate(names) if n not in ints and n != "valid"]

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
            if n in ints:
                out[i] = np.zeros(arrays[i].shape, jax.dtypes.float0)
            elif n == "valid":  # the poison factor: the inputs' cotangents already carry it
                out[i] = jnp.zeros_like(arrays[i])
        return tuple(out)

    if op.backward is not None and KERNEL_BACKWARD and not inplace:
        f_fwd, f_bwd = _kernel_vjp(p, op, names, dict(cfg), out_names)
    f.defvjp(f_fwd, f_bwd)
    return f


# Whether ops with backward kernels (``registry.KernelOp.backward``) train through them: the forward saves its
# states and scratch, then the backward kernels run (the reverse state pass and, since session 7, the
# chunk-parallel WY and intra-chunk launches; with ``KERNEL_BACKWARD_OPTIONS = {"local_bwd": False}`` the
# session-6 split: the state pass as a kernel, the rest in jnp, ``gdn2_jax.xla.chunk.chunk_backward_from_states``).
# False: the xla VJP recomputing the forward (sessions 1-5; ``benchmarks/profile_chunk.py --train`` compares them). Read when an op's function is built (``_make_op`` is
# memoised: clear its cache after changing this).
KERNEL_BACKWARD = True
# Extra options of the backward pipeline (``kernels.chunk_bwd.chunk_bwd_pipeline``), for measurements
# (``benchmarks/profile_chunk.py --grad-accuracy``); read like KERNEL_BACKWARD.
KERNEL_BACKWARD_OPTIONS: dict = {}


def _kernel_vjp(p: Problem, op, names: tuple, cfg: dict, out_names: tuple):
    """``(f_fwd, f_bwd)`` of ``chunk_gdn2`` with its backward kernels (see :data:`KERNEL_BACKWARD`).

    Residuals: the inputs, the forward's scratch that the backward kernels read (Aqk (+ AqkL), Y, QG (+ QGL), KG,
    GAM and the solve Akk) and the chunk start states ``h`` and ``v_new`` (fp32). The backward kernels
    (``kernels/chunk_bwd.py``) give dq, dk per value head, db, dg, dv, dw and dh0, each in its input's dtype
    where no jnp step follows (option ``cast_grads``, default on), else in fp32; jnp sums the GVA groups, applies
    the L2 norm's backward and casts what is still fp32. Under ``jax.vmap`` the training custom calls run once per mapped
    problem (``vmap_method="sequential"``, not folded into the kernels' batch as the inference path is).
    """
    from kernels.chunk_bwd import training_forward_options

    from .xla import chunk as xla_chunk
    from .xla.common import l2norm

    bwd = op.backward_pipeline(**cfg, **KERNEL_BACKWARD_OPTIONS)
    # (the forward stores QG's rounding residual exactly when the backward's state pass reads it, and h and Akk
    # rounded to TF32 when its WY launch expects that)
    train = op.pipeline(**dict(cfg, save_states=True, **training_forward_options(bwd)))
    local = "dq" in {b.name for b in bwd.outputs}  # False: the state pass only, the rest in jnp
    made = {b.name for b in tuple(train.scratch) + tuple(train.outputs)}
    sc = tuple(n for n in bwd.inputs if n in made)
    if not local:
        sc = tuple(dict.fromkeys(sc + ("h", "v_new")))
    varlen = "cu_seqlens" in names
    d = p.dims
    group = d.HV // d.H
    l2 = p.use_qk_l2norm_in_kernel

    def f_fwd(*arrays):  # (never CUDA-graph targets: graph capture is for decode, _prime only knows its inputs)
        res = run_pipeline(train, dict(zip(names, arrays)), return_scratch=True)
        return tuple(res[n] for n in out_names), (arrays, {n: res[n] for n in sc})

    def f_bwd(resid, cts):
        arrays, saved = resid
        a = dict(zip(names, arrays))
        ins = {n: saved[n] for n in sc if n in bwd.inputs}
        ins["do"] = cts[0]
        if "dht" in bwd.inputs:
            ins["dht"] = cts[1]
        if varlen:
            ins["cu_seqlens"] = a["cu_seqlens"]
        if local:
            q32, k32 = (a[n].astype(jnp.float32) for n in ("q", "k"))
            if l2:  # the kernels see the normalised q, k as the forward's kernels made them (input dtype)
                (qn, kn), pull = jax.vjp(lambda x, y: (l2norm(x), l2norm(y)), q32, k32)
            ins.update({n: a[n] for n in ("v", "g", "b", "w")})
            ins["q"], ins["k"] = ((qn.astype(a["q"].dtype), kn.astype(a["k"].dtype)) if l2 else (a["q"], a["k"]))
            r = run_pipeline(bwd, ins)
            dq, dk = r["dq"], r["dk"]
            if group > 1:  # value head j read q/k head j // group
                dq, dk = (x.reshape(x.shape[:2] + (d.H, group, d.K)).sum(axis=3) for x in (dq, dk))
            if l2:
                dq, dk = pull((dq, dk))
            grads = (dq, dk, r["dv"], r["dg"], r["db"], r["dw"])
            full = {n: x.astype(a[n].dtype) for n, x in zip(("q", "k", "v", "g", "b", "w"), grads)}
        else:
            r = run_pipeline(bwd, ins)
            grads = xla_chunk.chunk_backward_from_states(
                d.scale, group, l2, a["q"], a["k"], a["v"], a["g"], a["b"], a["w"], a.get("cu_seqlens"),
                saved["h"], saved["v_new"], r["dh"], r["dv"], cts[0])
            full = dict(zip(("q", "k", "v", "g", "b", "w"), grads))
        if "h0" in a:
            full["h0"] = r["dh0"].astype(a["h0"].dtype)
        if varlen:
            full["cu_seqlens"] = np.zeros(a["cu_seqlens"].shape, jax.dtypes.float0)
        return tuple(full[n] for n in names)

    return f_fwd, f_bwd


def forward(p: Problem, q, k, v, g, b, w, initial_state, cu_seqlens, poison=None, ssm_state_indices=None,
            num_accepted_tokens=None):
    """``backend="tilelang"`` implementation of op ``p.op`` for a validated call. Returns ``(o, ht or None)``.

    ``p.options["inplace_final_state"]`` makes the final state an alias of ``initial_state``;
    ``p.options["state_pool"]`` (with ``ssm_state_indices`` and ``num_accepted_tokens``) selects the pool kernels.
    ``poison`` (float32 scalar, 1 or NaN) multiplies the outputs: inside the decode kernel (an input ``valid``: no
    extra pass over the state), after the chunk kernels. The environment
    variable ``GDN2_JAX_CUDA_GRAPH=1`` (read at trace time) registers the targets as CUDA-graph capturable, so that
    XLA may put them into command buffers (experimental).
    """
    check_supported(p, q, k, v, g, b, w, initial_state)
    inplace = bool(p.option("inplace_final_state", False))
    names = ("q", "k", "v", "g", "b", "w") + (("h0",) if initial_state is not None else ()) + (
        ("cu_seqlens",) if cu_seqlens is not None else ())
    arrays = [q, k, v, g, b, w]
    if initial_state is not None:
        arrays.append(initial_state)
    if cu_seqlens is not None:
        cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
        if isinstance(cu_seqlens, jax.core.Tracer):
            # Traced offsets are unchecked here: keep the kernels' reads in bounds (clip to [0, T], monotone) and
            # inside this problem's T tokens (first 0, last T: under vmap the problems are packed end to end, and
            # an invalid problem must not lend tokens to a neighbour); the entry path turns the outputs of invalid
            # offsets into NaN.
            cu = jax.lax.cummax(jnp.clip(cu, 0, p.dims.T), axis=0).at[0].set(0).at[-1].set(p.dims.T)
        arrays.append(cu)
    pool = p.option("state_pool")
    serving = {}
    if pool:
        names += ("state_indices",)
        arrays.append(jnp.asarray(ssm_state_indices).astype(jnp.int32))
        serving = dict(state_pool=pool, num_accepted=num_accepted_tokens is not None)
        if num_accepted_tokens is not None:
            names += ("num_accepted_tokens",)
            arrays.append(jnp.asarray(num_accepted_tokens).astype(jnp.int32))
    in_kernel_poison = poison is not None and p.op == "fused_recurrent_gdn2"
    if in_kernel_poison:
        names += ("valid",)
        arrays.append(jnp.reshape(poison, (1,)).astype(jnp.float32))
        serving["poison"] = True
    d = p.dims
    cfg = registry.config(H=d.H, HV=d.HV, K=d.K, V=d.V, dtype=np.dtype(q.dtype).name, g_dtype=np.dtype(g.dtype).name,
                          scale=d.scale, use_initial_state=initial_state is not None,
                          output_final_state=p.output_final_state, varlen=cu_seqlens is not None,
                          use_qk_l2norm=p.use_qk_l2norm_in_kernel, **({"inplace_state": True} if inplace else {}),
                          **serving)
    key = Problem(p.op, Dims(0, 0, d.H, d.HV, d.K, d.V, 0, d.scale, jnp.float32, d.varlen), p.output_final_state,
                  p.use_qk_l2norm_in_kernel, p.options)  # the static part only: one function serves every B and T
    # (its launches may still differ with B: see _make_op)
    cuda_graph = os.environ.get("GDN2_JAX_CUDA_GRAPH", "") == "1"
    outs = _make_op(key, names, tuple(sorted(cfg.items())), inplace, cuda_graph)(*arrays)
    o, ht = outs[0], (outs[1] if p.output_final_state else None)
    if poison is not None and not in_kernel_poison:
        o = o * poison.astype(o.dtype)
        ht = None if ht is None else ht * poison.astype(ht.dtype)
    return o, ht

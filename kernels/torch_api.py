"""Torch API of the GDN-2 TileLang kernels: ``chunk_gdn2`` and ``fused_recurrent_gdn2`` on torch CUDA tensors.

The same compiled ``tvm_ffi.Function`` objects as the JAX path (``kernels._compile.get_function``), called
with torch tensors: zero copy for contiguous inputs, on torch's current CUDA stream (tvm-ffi picks it up from
torch), outputs preallocated with ``torch.empty``. ``chunk_gdn2`` is differentiable (``torch.autograd``: the
training forward saves its states, the backward runs the backward kernels, the same launches as the JAX path's
``custom_vjp``); ``fused_recurrent_gdn2`` is forward only. Names and semantics follow FLA's
``fla.ops.gdn2`` (q,k ``[B,T,H,K]``; v,w ``[B,T,HV,V]``; g,b ``[B,T,HV,K]``; state ``[N,HV,K,V]`` fp32), with GVA
(HV a multiple of H) in both ops.
"""

from __future__ import annotations

import functools

from . import _compile, registry
from ._common import L2NORM_EPS
from ._pipeline import Pipeline, launch_io, resolve_shape

__all__ = ["chunk_gdn2", "fused_recurrent_gdn2", "run_pipeline"]


@functools.lru_cache(maxsize=None)
def _torch_dtype(name: str):
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
            "int32": torch.int32}[name]


class _Plan:
    def __init__(self, pipe: Pipeline):
        for i in range(len(pipe.launches)):
            launch_io(pipe, i)  # validates the parameter-order rule the JAX runner relies on
        self.alloc = tuple(pipe.scratch) + tuple(pipe.outputs)
        self.outputs = {b.name: b for b in pipe.outputs}


@functools.lru_cache(maxsize=256)
def _plan(pipe: Pipeline) -> _Plan:
    return _Plan(pipe)


def run_pipeline(pipe: Pipeline, inputs: dict, *, arch: str | None = None, out: dict | None = None,
                 return_scratch: bool = False) -> dict:
    """Run ``pipe`` on torch CUDA tensors ``inputs`` (name -> tensor); return ``{output name: tensor}``.

    ``out`` may supply preallocated output tensors (e.g. ``{"ht": h0}`` for an aliased in-place state update,
    only where ``pipe.aliases`` allows it). Everything else is allocated with ``torch.empty`` on the inputs'
    device; launches run in order on the current stream. ``return_scratch`` also returns the scratch buffers
    (the intermediate results of earlier launches: what the stage-by-stage tests compare with their xla twins).
    """
    import torch

    plan = _plan(pipe)
    first = inputs[pipe.inputs[0]]
    dev = first.device
    if arch is None:
        arch = _compile.device_arch(dev.index or 0)  # tensors on CUDA always carry their device index
    sizes = pipe.sizes({n: inputs[n].shape for n in pipe.inputs})
    bufs = dict(inputs)
    if out:
        for name, given in out.items():
            if name not in plan.outputs:
                raise ValueError(f"run_pipeline: `out` may only hold outputs {sorted(plan.outputs)}, got {name!r}")
            shape = resolve_shape(plan.outputs[name], sizes)
            if tuple(given.shape) != shape or given.dtype != _torch_dtype(plan.outputs[name].dtype):
                raise ValueError(f"run_pipeline: out[{name!r}] must be {plan.outputs[name].dtype} {shape}, "
                                 f"got {given.dtype} {tuple(given.shape)}")
            bufs[name] = given
    for b in plan.alloc:
        if b.name not in bufs:
            bufs[b.name] = torch.empty(resolve_shape(b, sizes), dtype=_torch_dtype(b.dtype), device=dev)
    for la in pipe.launches:
        _compile.get_function(la, arch)(*[bufs[a] for a in la.args])
    keep = tuple(pipe.outputs) + (tuple(pipe.scratch) if return_scratch else ())
    return {b.name: bufs[b.name] for b in keep}


@functools.lru_cache(maxsize=None)
def _dtype_names() -> dict:
    import torch

    return {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def _check(op: registry.KernelOp, q, k, v, g, b, w, initial_state, cu_seqlens, pool=False):
    """Shape / dtype / device checks (cheap: this runs on every decode step). Returns the pipeline dims."""
    import torch

    fn = op.name
    names = _dtype_names()
    try:
        B, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
    except (AttributeError, ValueError):
        raise ValueError(f"{fn}: `q` [B,T,H,K] and `v` [B,T,HV,V] must be 4-D torch tensors") from None
    for name, x, shape in (("q", q, (B, T, H, K)), ("k", k, (B, T, H, K)), ("v", v, (B, T, HV, V)),
                           ("g", g, (B, T, HV, K)), ("b", b, (B, T, HV, K)), ("w", w, (B, T, HV, V))):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{fn}: `{name}` must be a torch.Tensor, got {type(x).__name__}")
        if x.shape != shape:
            raise ValueError(f"{fn}: `{name}` must have shape {shape}, got {tuple(x.shape)}")
        if not x.is_cuda:
            raise ValueError(f"{fn}: `{name}` must be on a CUDA device, got {x.device}")
    if H < 1 or HV % H:
        raise ValueError(f"{fn}: HV={HV} (from `v`) must be a positive multiple of H={H} (from `q`)")
    dt, gdt = names.get(q.dtype, str(q.dtype)), names.get(g.dtype, str(g.dtype))
    err = op.support.problem(dtypes={n: names.get(x.dtype, str(x.dtype)) for n, x in
                                     (("q", q), ("k", k), ("v", v), ("b", b), ("w", w))},
                             g_dtype=gdt, K=K, V=V)
    if err is not None:
        raise type(err)(f"{fn}: {err}")
    N = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"{fn}: with `cu_seqlens` the batch size must be 1, got B={B}")
        N = cu_seqlens.numel() - 1
    if initial_state is not None:
        want = (initial_state.shape[0] if pool else N, HV, K, V)
        if initial_state.shape != want or initial_state.dtype != torch.float32:
            raise ValueError(f"{fn}: `initial_state` must be float32 {('P',) + want[1:] if pool else want}, got "
                             f"{initial_state.dtype} {tuple(initial_state.shape)}")
    return H, HV, K, V, dt, gdt


def _inputs(q, k, v, g, b, w, initial_state, cu_seqlens, state_indices=None, num_accepted_tokens=None):
    import torch

    ins = dict(q=q, k=k, v=v, g=g, b=b, w=w)
    if initial_state is not None:
        ins["h0"] = initial_state
    for name, x in (("cu_seqlens", cu_seqlens), ("state_indices", state_indices),
                    ("num_accepted_tokens", num_accepted_tokens)):
        if x is not None:
            ins[name] = x.to(device=q.device, dtype=torch.int32)
    return {n: (x if x.is_contiguous() else x.contiguous()) for n, x in ins.items()}


def _run(name, q, k, v, g, b, w, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
         ssm_state_indices=None, num_accepted_tokens=None, **options):
    op = registry.get(name)
    H, HV, K, V, dt, gdt = _check(op, q, k, v, g, b, w, initial_state, cu_seqlens, pool=ssm_state_indices is not None)
    if ssm_state_indices is not None:
        if initial_state is None:
            raise ValueError(f"{name}: `ssm_state_indices` needs the state pool as `initial_state`")
        options.update(inplace_state=True, state_pool="slot" if ssm_state_indices.dim() == 1 else "token",
                       num_accepted=num_accepted_tokens is not None)
    out = None
    if options.get("inplace_state"):
        if initial_state is None or not initial_state.is_contiguous():
            raise ValueError(f"{name}: inplace_final_state needs a contiguous `initial_state`")
        output_final_state = True
        out = {"ht": initial_state}
    cfg = registry.config(H=H, HV=HV, K=K, V=V, dtype=dt, g_dtype=gdt, scale=K ** -0.5 if scale is None else scale,
                          use_initial_state=initial_state is not None, output_final_state=output_final_state,
                          varlen=cu_seqlens is not None, use_qk_l2norm=use_qk_l2norm_in_kernel, **options)
    if op.backward is not None and _needs_grad(q, k, v, g, b, w, initial_state):
        out = _chunk_autograd().apply(q, k, v, g, b, w, initial_state, cu_seqlens, tuple(sorted(cfg.items())))
        return out[0], (out[1] if output_final_state else None)
    N = int(cu_seqlens.numel()) - 1 if cu_seqlens is not None else int(q.shape[0])
    res = run_pipeline(op.pipeline(**cfg, **op.options_for_call(N=N, HV=HV, V=V, varlen=cu_seqlens is not None)),
                       _inputs(q, k, v, g, b, w, initial_state, cu_seqlens, ssm_state_indices, num_accepted_tokens),
                       out=out)
    return res["o"], res.get("ht") if output_final_state else None


def _l2norm_fp32(x):
    """``x * rsqrt(sum(x**2, -1) + eps)`` in fp32: the arithmetic of ``gdn2_jax.xla.common.l2norm``."""
    import torch

    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _chunk_autograd():
    """The ``torch.autograd.Function`` of ``chunk_gdn2`` (built on first use: torch is imported lazily)."""
    global _CHUNK_FN
    if _CHUNK_FN is not None:
        return _CHUNK_FN
    import torch

    class ChunkGDN2Function(torch.autograd.Function):
        """Forward: the training pipeline (``save_states``: the chunk start states h, v_new and the scratch the
        backward reads are kept). Backward: ``chunk_bwd_pipeline`` on them, then what ``gdn2_jax._tilelang``'s
        ``_kernel_vjp`` does in jnp: the GVA group sum of dq, dk, the L2 norm's backward and the casts."""

        @staticmethod
        def forward(ctx, q, k, v, g, b, w, initial_state, cu_seqlens, cfg):
            from .chunk_bwd import training_forward_options

            op = registry.get("chunk_gdn2")
            cfg = dict(cfg)
            bwd = op.backward_pipeline(**cfg)
            train = op.pipeline(**dict(cfg, save_states=True, **training_forward_options(bwd)))
            ins = _inputs(q, k, v, g, b, w, initial_state, cu_seqlens)
            res = run_pipeline(train, ins, return_scratch=True)
            keep = tuple(n for n in bwd.inputs if n in res)
            ctx.cfg, ctx.keep, ctx.bwd = cfg, keep, bwd
            ctx.has_h0, ctx.varlen = initial_state is not None, cu_seqlens is not None
            extra = tuple(ins[n] for n in ("h0", "cu_seqlens") if n in ins)
            ctx.save_for_backward(*(ins[n] for n in ("q", "k", "v", "g", "b", "w")), *extra,
                                  *(res[n] for n in keep))
            o = res["o"]
            return (o, res["ht"]) if cfg["output_final_state"] else (o,)

        @staticmethod
        def backward(ctx, do, dht=None):
            cfg, bwd = ctx.cfg, ctx.bwd
            saved = ctx.saved_tensors
            a = dict(zip(("q", "k", "v", "g", "b", "w"), saved[:6]))
            i = 6
            for n, present in (("h0", ctx.has_h0), ("cu_seqlens", ctx.varlen)):
                if present:
                    a[n], i = saved[i], i + 1
            ins = dict(zip(ctx.keep, saved[i:]))
            ins.update({n: a[n] for n in ("v", "g", "b", "w")})
            if ctx.varlen:
                ins["cu_seqlens"] = a["cu_seqlens"]
            ins["do"] = do.to(a["v"].dtype).contiguous()
            if "dht" in bwd.inputs:  # (torch materialises an unused final state's gradient as zeros)
                ins["dht"] = dht.to(torch.float32).contiguous()
            l2 = cfg["use_qk_l2norm"]
            if l2:  # the kernels see the normalised q, k in the input dtype, as the forward's kernels made them
                with torch.enable_grad():
                    q32, k32 = (a[n].float().requires_grad_() for n in ("q", "k"))
                    qn, kn = _l2norm_fp32(q32), _l2norm_fp32(k32)
                ins["q"], ins["k"] = qn.detach().to(a["q"].dtype), kn.detach().to(a["k"].dtype)
            else:
                ins["q"], ins["k"] = a["q"], a["k"]
            r = run_pipeline(bwd, ins)
            dq, dk = r["dq"], r["dk"]
            H, HV = cfg["H"], cfg["HV"]
            if HV > H:  # value head j read q/k head j // group
                dq, dk = (x.float().reshape(x.shape[:2] + (H, HV // H, x.shape[-1])).sum(dim=3) for x in (dq, dk))
            if l2:
                dq, dk = torch.autograd.grad((qn, kn), (q32, k32), (dq.float(), dk.float()))
            grads = [x.to(a[n].dtype) for n, x in zip(("q", "k", "v", "g", "b", "w"),
                                                       (dq, dk, r["dv"], r["dg"], r["db"], r["dw"]))]
            dh0 = r["dh0"].to(a["h0"].dtype) if ctx.has_h0 else None
            return (*grads, dh0, None, None)

    _CHUNK_FN = ChunkGDN2Function
    return _CHUNK_FN


_CHUNK_FN = None


def _needs_grad(*tensors) -> bool:
    import torch

    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)


def chunk_gdn2(q, k, v, g, b, w, scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """Chunked GDN-2 forward (prefill and training) on torch CUDA tensors. Returns ``(o, final_state or None)``.

    q,k ``[B,T,H,K]`` bf16/fp16; v,w ``[B,T,HV,V]``; g ``[B,T,HV,K]`` fp32/bf16 natural-log decay; b ``[B,T,HV,K]``;
    initial_state ``[N,HV,K,V]`` fp32; cu_seqlens ``[N+1]`` int (B == 1). o has q's dtype; final state fp32.
    Differentiable when grad mode is on and any of q, k, v, g, b, w, initial_state requires grad: ``backward``
    gives their gradients in their dtypes (of ``<o, do> + <final_state, dht>``, dht zero when the final state is
    unused) through the backward kernels (``kernels/chunk_bwd.py``), the same launches and jnp-equivalent steps
    as ``gdn2_jax.chunk_gdn2(..., backend="tilelang")``'s VJP. Raises ``ValueError`` / ``TypeError`` for bad
    input (same checks as the forward).
    """
    return _run("chunk_gdn2", q, k, v, g, b, w, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                cu_seqlens)


def fused_recurrent_gdn2(q, k, v, g, b, w, scale=None, initial_state=None, output_final_state=False,
                         use_qk_l2norm_in_kernel=False, cu_seqlens=None, inplace_final_state=False,
                         ssm_state_indices=None, num_accepted_tokens=None):
    """Token-recurrent GDN-2 forward (decode) on torch CUDA tensors. Returns ``(o, final_state or None)``.

    Same arguments as :func:`chunk_gdn2` (``scale`` is the 7th positional argument here, unlike FLA, where it is
    ``A_log``). ``inplace_final_state=True`` writes the new state into ``initial_state`` (serving) and returns it.
    ``ssm_state_indices`` ``[N]`` / ``[N, L]`` (+ ``num_accepted_tokens`` ``[N]``) update the state pool
    ``initial_state`` ``[P, HV, K, V]`` in place, with the semantics of ``gdn2_jax.fused_recurrent_gdn2`` (indices
    are not validated here: slots must be < P and distinct).
    """
    return _run("fused_recurrent_gdn2", q, k, v, g, b, w, scale, initial_state, output_final_state,
                use_qk_l2norm_in_kernel, cu_seqlens, ssm_state_indices, num_accepted_tokens,
                **({"inplace_state": True} if inplace_final_state else {}))

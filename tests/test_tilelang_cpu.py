"""CPU-only checks of the TileLang path (no GPU needed).

* lowering: ``backend="tilelang"`` under ``jax.jit`` lowered for CUDA on this host shows the content-hashed
  ``custom_call`` targets, with the right operand/result types, vmap folded into the batch axis and the in-place
  state alias;
* the generic runner's launch -> ffi_call mapping on a synthetic two-launch pipeline;
* argument checks that fire in Python before any custom call;
* compile-only: every kernel builds for sm_90a here and its exported library loads;
* compile cache: keys and target names change with dtype / flag / arch and only then; two processes compiling
  the same kernel at once leave one valid library.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdn2_jax
from gdn2_jax import _tilelang
from kernels import _compile, registry
from kernels._pipeline import Buf, Launch, Pipeline, launch_io
from kernels.recurrent_fwd import fused_recurrent_fwd_pipeline

HAS_TILELANG = all(importlib.util.find_spec(m) is not None for m in ("tilelang", "tvm_ffi"))
needs_tilelang = pytest.mark.skipif(not HAS_TILELANG, reason="tilelang / tvm_ffi (the cuda extra) not installed")
ROOT = Path(__file__).resolve().parents[1]
S = jax.ShapeDtypeStruct
BF = jnp.bfloat16


def _cuda_source(launch: Launch) -> str:
    """The CUDA source TileLang generates for ``launch`` on sm_90a (its own pass configs; compiled, not run)."""
    import tilelang

    return tilelang.compile(launch.build(), target=_compile.target("sm_90a"), execution_backend="tvm_ffi",
                            pass_configs=dict(launch.pass_configs)).get_kernel_source()


@pytest.fixture(autouse=True)
def _pretend_hopper(monkeypatch):
    """Lowering for CUDA needs no GPU: let backend="tilelang" pass the device check on this CPU host (nothing is
    compiled or run; ``_tilelang`` registers targets only when JAX really has CUDA devices)."""
    from gdn2_jax import backends

    monkeypatch.setattr(backends, "tilelang_supported_device", lambda: True)
    monkeypatch.setattr(backends, "cuda_extra_installed", lambda: True)


def _specs(B, T, H, HV, K, V, dtype=BF, g_dtype=jnp.float32, N=None):
    N = B if N is None else N
    return [S((B, T, H, K), dtype), S((B, T, H, K), dtype), S((B, T, HV, V), dtype), S((B, T, HV, K), g_dtype),
            S((B, T, HV, K), dtype), S((B, T, HV, V), dtype), S((N, HV, K, V), jnp.float32)]


def _lower(f, specs, **kw):
    return jax.jit(f, **kw).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


def _custom_calls(txt):
    return [l for l in txt.splitlines() if "stablehlo.custom_call" in l]


def _rec(**kw):
    base = dict(H=2, HV=4, K=64, V=64, dtype="bfloat16", g_dtype="float32", scale=0.125, use_initial_state=True,
                output_final_state=True, varlen=False, use_qk_l2norm=False)
    base.update(kw)
    return fused_recurrent_fwd_pipeline(**base)


# ----------------------------------------------------------------------------------------------------- lowering
def test_lowering_fused_recurrent_custom_call_target_and_types():
    def f(q, k, v, g, b, w, h0):
        return gdn2_jax.fused_recurrent_gdn2(q, k, v, g, b, w, scale=0.125, initial_state=h0,
                                             output_final_state=True, backend="tilelang")

    calls = _custom_calls(_lower(f, _specs(3, 2, 2, 4, 64, 64)))
    assert len(calls) == 1
    expect = _compile.target_name(_rec().launches[0], "sm_90a")
    assert re.fullmatch(r"gdn2_recurrent_fwd_[0-9a-f]{12}", expect)
    assert f"@{expect}(" in calls[0]
    # operands q,k,v,g,b,w,h0 -> results o (bf16) and ht (f32), shapes exactly as given
    assert ("(tensor<3x2x2x64xbf16>, tensor<3x2x2x64xbf16>, tensor<3x2x4x64xbf16>, tensor<3x2x4x64xf32>, "
            "tensor<3x2x4x64xbf16>, tensor<3x2x4x64xbf16>, tensor<3x4x64x64xf32>) -> "
            "(tensor<3x2x4x64xbf16>, tensor<3x4x64x64xf32>)") in calls[0]
    assert "output_operand_alias" not in calls[0]  # the functional call never writes its input


def test_lowering_target_changes_with_flags_and_dtype():
    def f(l2, scale, q, k, v, g, b, w, h0):
        return gdn2_jax.fused_recurrent_gdn2(q, k, v, g, b, w, scale=scale, initial_state=h0,
                                             output_final_state=True, use_qk_l2norm_in_kernel=l2, backend="tilelang")

    names = set()
    for l2, scale, dt in [(False, 0.125, BF), (True, 0.125, BF), (False, 0.5, BF), (False, 0.125, jnp.float16)]:
        txt = _lower(lambda *a: f(l2, scale, *a), _specs(1, 1, 2, 4, 64, 64, dtype=dt))
        names |= set(re.findall(r"custom_call @(\w+)\(", txt))
    assert len(names) == 4


def test_lowering_vmap_folds_into_batch_and_varlen():
    def f(q, k, v, g, b, w, h0):
        return gdn2_jax.fused_recurrent_gdn2(q, k, v, g, b, w, initial_state=h0, output_final_state=True,
                                             backend="tilelang")

    specs = [S((5,) + s.shape, s.dtype) for s in _specs(2, 3, 2, 4, 64, 64)]
    calls = _custom_calls(_lower(jax.vmap(f), specs))
    assert len(calls) == 1  # one kernel call for the whole vmapped batch, not a loop
    assert "tensor<10x3x2x64xbf16>" in calls[0] and "tensor<10x4x64x64xf32>" in calls[0]

    def fv(q, k, v, g, b, w, h0, cu):
        return gdn2_jax.fused_recurrent_gdn2(q, k, v, g, b, w, initial_state=h0, output_final_state=True,
                                             cu_seqlens=cu, backend="tilelang")

    specs = [S((4,) + s.shape, s.dtype) for s in _specs(1, 7, 2, 4, 64, 64, N=3)] + [S((4, 4), jnp.int32)]
    calls = _custom_calls(_lower(jax.vmap(fv), specs))
    assert len(calls) == 1  # packed sequences of the 4 problems folded into one launch: T 4*7, N 4*3
    assert "tensor<1x28x2x64xbf16>" in calls[0] and "tensor<12x4x64x64xf32>" in calls[0]
    assert "tensor<13xi32>" in calls[0]


def test_lowering_inplace_state_alias_when_donated(monkeypatch):
    def f(q, k, v, g, b, w, h0):
        return gdn2_jax.fused_recurrent_gdn2(q, k, v, g, b, w, initial_state=h0, inplace_final_state=True,
                                             backend="tilelang")

    txt = _lower(f, _specs(2, 1, 2, 4, 64, 64), donate_argnums=6)
    calls = _custom_calls(txt)
    assert len(calls) == 1 and "output_operand_alias<output_tuple_indices = [1], operand_index = 6" in calls[0]
    assert "tf.aliasing_output = 1" in txt  # the donated jit argument is reused for the new state
    name = re.search(r"custom_call @(\w+)\(", calls[0]).group(1)
    monkeypatch.setenv("GDN2_JAX_CUDA_GRAPH", "1")  # read at trace time: a new function, not jit's cached trace
    txt_g = _lower(lambda *a: f(*a), _specs(2, 1, 2, 4, 64, 64), donate_argnums=6)
    # the CUDA-graph-capturable registration is a separate target of the same kernel
    assert re.findall(r"custom_call @(\w+)\(", txt_g) == [name + "_cg"]


def test_lowering_chunk_custom_calls():
    def f(q, k, v, g, b, w, h0):
        return gdn2_jax.chunk_gdn2(q, k, v, g, b, w, initial_state=h0, output_final_state=True, backend="tilelang")

    txt = _lower(f, _specs(2, 100, 2, 2, 128, 128))
    targets = re.findall(r"custom_call @(\w+)\(", txt)
    from kernels.chunk_fwd import chunk_fwd_pipeline

    pipe = chunk_fwd_pipeline(H=2, HV=2, K=128, V=128, dtype="bfloat16", g_dtype="float32", scale=128 ** -0.5,
                              use_initial_state=True, output_final_state=True, varlen=False, use_qk_l2norm=False)
    assert len(targets) == len(pipe.launches) >= 1
    assert all(re.fullmatch(r"gdn2_\w+_[0-9a-f]{12}(_d[\d_]+)?", t) for t in targets)
    assert "tensor<2x100x2x128xbf16>" in txt.split("return")[-1] or "2x100x2x128xbf16" in txt


def test_chunk_state_block_v_chosen_per_inference_call():
    """``chunk_gdn2``'s inference calls give the state pass two warpgroups and one V-block of 128 per head, or
    V-blocks of 64 or 32, where sequences x value heads reach ``STATE_WIDE_MIN_HEADS`` (V = 128 and equal-length
    sequences only), by the waves each option takes on 132 SMs; the factory default otherwise (packed sequences
    included); ops without a per-call rule add nothing. The JAX path lowers to that pipeline's launches (B = 8,
    H = 32: the wide state launch; B = 1: the default's; ``jax.vmap`` over 8 problems of B = 1: the folded batch's
    choice; 4 packed sequences: the default's), and a gradient keeps the training pipelines of the default."""
    from kernels.chunk_fwd import STATE_WIDE_MIN_HEADS, STATE_WIDE_OPTIONS, chunk_fwd_pipeline

    op = registry.get("chunk_gdn2")
    assert STATE_WIDE_MIN_HEADS == 128 and STATE_WIDE_OPTIONS == {"block_v": 128, "state_threads": 256}
    assert op.options_for_call(N=4, HV=32, V=128) == STATE_WIDE_OPTIONS
    assert op.options_for_call(N=8, HV=16, V=128) == STATE_WIDE_OPTIONS
    assert op.options_for_call(N=16, HV=32, V=128) == STATE_WIDE_OPTIONS  # (512 heads: 4 waves, V-blocks of 64 8)
    assert op.options_for_call(N=3, HV=32, V=128) == {} and op.options_for_call(N=1, HV=32, V=128) == {}
    # between whole waves the narrower blocks: 160 heads (wide 2 waves x 4.66 us, V-blocks of 64 3 x 2.61, of 32
    # 5 x 1.53 per block and chunk), 192 (2 x 4.66, 3 x 2.61, 6 x 1.53); V-blocks of 32 named (at HV < 32 the
    # factory's default is 16)
    assert op.options_for_call(N=5, HV=32, V=128) == {"block_v": 32}
    assert op.options_for_call(N=6, HV=32, V=128) == {"block_v": 64}
    assert op.options_for_call(N=10, HV=16, V=128) == {"block_v": 32}
    assert op.options_for_call(N=132, HV=1, V=128) == STATE_WIDE_OPTIONS
    assert op.options_for_call(N=133, HV=1, V=128) == {"block_v": 32}
    # packed sequences keep the default whatever their number (their lengths are unknown at trace time)
    assert op.options_for_call(N=16, HV=32, V=128, varlen=True) == {}
    assert op.options_for_call(N=64, HV=32, V=64) == {}
    assert registry.get("fused_recurrent_gdn2").options_for_call(N=128, HV=32, V=128) == {}
    # (each call gets its own dict: a caller that changes it cannot change the rule)
    op.options_for_call(N=4, HV=32, V=128).clear()
    assert op.options_for_call(N=4, HV=32, V=128) == STATE_WIDE_OPTIONS

    def f(q, k, v, g, b, w, h0):
        return gdn2_jax.chunk_gdn2(q, k, v, g, b, w, initial_state=h0, output_final_state=True, backend="tilelang")

    def target(pipe, i):
        return _compile.target_name(pipe.launches[i], "sm_90a")

    def names(txt):  # custom-call targets without the suffix of dropped operands
        return [re.sub(r"_d[\d_]+$", "", t) for t in re.findall(r"custom_call @(\w+)\(", txt)]

    kw = dict(H=32, HV=32, K=128, V=128, dtype="bfloat16", g_dtype="float32", scale=128 ** -0.5,
              use_initial_state=True, output_final_state=True, varlen=False, use_qk_l2norm=False)
    plain, wide = chunk_fwd_pipeline(**kw), chunk_fwd_pipeline(**kw, **STATE_WIDE_OPTIONS)
    assert target(plain, 0) == target(wide, 0) and target(plain, 1) != target(wide, 1)
    assert names(_lower(f, _specs(8, 64, 32, 32, 128, 128))) == [target(wide, 0), target(wide, 1)]
    assert names(_lower(f, _specs(1, 64, 32, 32, 128, 128))) == [target(plain, 0), target(plain, 1)]
    # under vmap the choice follows the folded batch: 8 problems of one sequence are one call of 8 sequences
    mapped = [S((8,) + x.shape, x.dtype) for x in _specs(1, 64, 32, 32, 128, 128)]
    assert names(_lower(jax.vmap(f), mapped)) == [target(wide, 0), target(wide, 1)]
    # packed sequences (4 x 32 heads, which as a batch would take the wide pass): the default's launches

    def fv(q, k, v, g, b, w, h0, cu):
        return gdn2_jax.chunk_gdn2(q, k, v, g, b, w, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                   backend="tilelang")

    kwv = dict(kw, varlen=True)
    vplain = chunk_fwd_pipeline(**kwv)
    specs = _specs(1, 256, 32, 32, 128, 128, N=4) + [S((5,), jnp.int32)]
    assert names(_lower(fv, specs)) == [target(vplain, 0), target(vplain, 1)]

    def loss(q, k, v, g, b, w, h0):
        o, ht = f(q, k, v, g, b, w, h0)
        return o.astype(jnp.float32).sum() + ht.sum()

    train = names(_lower(jax.grad(loss, argnums=(0, 1)), _specs(8, 64, 32, 32, 128, 128)))
    from kernels.chunk_bwd import training_forward_options

    cfg = registry.config(**kw)
    tr = op.pipeline(**cfg, save_states=True, **training_forward_options(op.backward_pipeline(**cfg)))
    trw = op.pipeline(**cfg, save_states=True, **STATE_WIDE_OPTIONS,
                      **training_forward_options(op.backward_pipeline(**cfg)))
    assert target(tr, 1) in train and target(trw, 1) not in train


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_lowering_chunk_grad_runs_the_backward_kernels(varlen):
    """``jax.grad`` through ``backend="tilelang"``: the training forward (its launches saving A, h and v_new: other
    targets than the inference ones), the three backward kernels (reverse state pass, WY, intra-chunk), no second
    forward and no sequential jnp state pass (no loop carrying a state) anywhere in the program; GVA, an initial
    state and the final state's cotangent included."""
    from kernels.chunk_fwd import chunk_fwd_pipeline

    cu = jnp.asarray([0, 30, 30, 100], jnp.int32) if varlen else None

    def loss(q, k, v, g, b, w, h0):
        o, ht = gdn2_jax.chunk_gdn2(q, k, v, g, b, w, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                    backend="tilelang")
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(ht)

    B, N = (1, 3) if varlen else (2, 2)
    txt = _lower(jax.grad(loss, argnums=tuple(range(7))), _specs(B, 100, 2, 4, 128, 128, N=N))
    targets = re.findall(r"custom_call @(\w+)\(", txt)
    kw = dict(H=2, HV=4, K=128, V=128, dtype="bfloat16", g_dtype="float32", scale=128 ** -0.5,
              use_initial_state=True, output_final_state=True, varlen=varlen, use_qk_l2norm=False)
    infer = {_tilelang.target_name(la, "sm_90a") for la in chunk_fwd_pipeline(**kw).launches}
    train = [_tilelang.target_name(la, "sm_90a") for la in chunk_fwd_pipeline(**kw, save_states=True).launches]
    bwd = [_tilelang.target_name(la, "sm_90a") for la in registry.get("chunk_gdn2").backward_pipeline(**kw).launches]
    assert sorted(re.sub(r"_d[0-9_]+$", "", t) for t in targets) == sorted(train + bwd), targets
    assert not set(train) & infer  # the training forward's launches write more (A; h, v_new)
    assert [la.name for la in registry.get("chunk_gdn2").backward_pipeline(**kw).launches] == [
        "gdn2_chunk_dstate", "gdn2_chunk_bwd_wy", "gdn2_chunk_bwd_intra"]
    loops = [l for l in txt.splitlines() if "stablehlo.while" in l]  # (varlen: searchsorted's binary search)
    assert not [l for l in loops if "128x128xf32" in l], loops  # no loop carries a [K, V] state
    assert varlen or not loops


def _default_option_launches(kw: dict, option: str) -> tuple:
    """The forward intra launch of ``chunk_fwd_pipeline(**kw)`` with pipeline option ``option`` at its default (on:
    ``kernels.defaults.FORWARD``) and off: its key names the option when on only, and a value that is not a bool is
    a ValueError naming it."""
    from kernels import defaults
    from kernels.chunk_fwd import chunk_fwd_pipeline

    assert defaults.FORWARD[option] is True
    on = chunk_fwd_pipeline(**kw).launches[0]
    off = chunk_fwd_pipeline(**kw, **{option: False}).launches[0]
    assert dict(on.key[2:])[option] is True and option not in dict(off.key[2:])
    with pytest.raises(ValueError, match=f"{option} must be a bool, got 1$"):
        chunk_fwd_pipeline(**kw, **{option: 1})
    return on, off


def _row_mask(cond: str) -> bool:
    """Whether the CUDA ``if`` condition bounds a row by ``valid`` (``... < valid`` or ``... == (valid - 1)``), as
    opposed to the chunk-level ``0 < valid``."""
    return bool(re.search(r"(<|==) \(?valid", cond)) and re.sub(r"[()\s]", "", cond) != "0<valid"


def _unmasked_global_accesses(src: str, exempt: tuple = ()) -> list[str]:
    """The global-buffer accesses of the CUDA ``src`` of a ``main_kernel`` that are not inside an ``if`` on a row
    bound (a condition comparing an expression of the thread index or a loop variable with ``valid``; the
    chunk-level ``0 < valid`` does not count) and are not a ``cp.async`` whose predicate is such a bound (its
    source is not read when the predicate is false); ``cu_seqlens`` (read by ``locate_chunk`` at indices its
    search keeps in range) and the buffers in ``exempt`` are not counted. Lexical: it does not follow pointers
    derived from a global buffer (TileLang's CUDA indexes the parameters directly) or check that the mask's row
    term is the address's."""
    head = re.search(r"__launch_bounds__[^(]*\([^)]*\) main_kernel\((.*?)\) \{", src, re.S)
    names = [n for n in re.findall(r"\*\s*__restrict__\s+(\w+)", head.group(1))
             if n != "cu_seqlens" and n not in exempt]
    body = src[head.end():]
    stack, bad = [], []
    for line in body.splitlines():
        s = line.strip()
        cp = re.match(r"tl::cp_async_gs_conditional<\d+>\(.*, (\(.*\))\);$", s)
        for n in names:
            if re.search(r"(?<![\w.])%s\s*(\[|\+)" % n, s):
                if not any(_row_mask(c) for c in stack) and not (cp and _row_mask(cp.group(1))):
                    bad.append(s[:120])
        if s.endswith("{"):
            m = re.match(r"(?:\} else )?if \((.*)\) \{$", s)
            if s.startswith("}") and stack:  # "} else {" / "} else if (...) {": the if branch ends here
                stack.pop()
            stack.append(m.group(1) if m else "")  # (an else branch adds no mask)
        elif s.startswith("}") and stack:
            stack.pop()
    return bad


@needs_tilelang
@pytest.mark.slow
@pytest.mark.parametrize("varlen,HV,KV,g_dtype,opts", [
    (False, 4, 128, "float32", {}), (True, 4, 128, "float32", dict(intra_tc=True, intra_fast_diag=True)),
    (True, 2, 64, "bfloat16", dict(intra_fast_diag=True)), (False, 2, 64, "bfloat16", dict(intra_tc=True))])
def test_backward_intra_masks_every_global_access_itself(varlen, HV, KV, g_dtype, opts):
    """The intra launch of version 2 is compiled with TileLang's bounds checks switched off
    (``tl.disable_safe_memory_legalize``): every load and store of a global buffer in its generated CUDA must sit
    under its own row mask (rows of the chunk's valid range), so none can reach past T or into another sequence."""
    pipe = registry.get("chunk_gdn2").backward_pipeline(
        H=2, HV=HV, K=KV, V=KV, dtype="bfloat16", g_dtype=g_dtype, scale=KV ** -0.5, use_initial_state=True,
        output_final_state=True, varlen=varlen, use_qk_l2norm=False, **opts)
    intra = pipe.launches[-1]
    assert intra.name == "gdn2_chunk_bwd_intra"
    assert dict(intra.pass_configs) == {"tl.disable_safe_memory_legalize": True}
    src = _cuda_source(intra)
    assert "dq[" in src or "(dq +" in src  # (the accesses are found at all)
    assert _unmasked_global_accesses(src) == []
    # the check itself: a kernel whose row mask is removed, or turned into a chunk-level one, is caught
    mask = "if ((((i * 4) + (((int)threadIdx.x) >> 5)) < valid)) {"
    assert mask in src
    for fake in (src.replace(mask, "if (1) {"), src.replace(mask, "if ((0 < valid)) {"),
                 src.replace(mask, "if (valid > 0) {")):
        assert _unmasked_global_accesses(fake)


def _copies_without_barrier(src: str) -> list[str]:
    """The ``cp.async`` copies of the CUDA ``src`` that may overwrite shared memory another thread still reads:
    scanning back from each copy, a line that accesses any shared buffer (other than another copy) comes before
    any ``__syncthreads()``. Any buffer, not only the copy's destination, because TileLang's planner places buffers
    over dead ones (``wS`` / ``Zs`` share memory with the slice loop's). Lexical, in source order: a loop-carried
    read (the previous iteration's) is behind the barrier that the scan meets first at the top of the loop body."""
    shared = re.findall(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem", src)
    lines = [line.strip() for line in src.splitlines()]
    bad = []
    for i, s in enumerate(lines):
        m = re.match(r"tl::cp_async_gs_conditional<\d+>\(\(&\(\(\(\w+\*\)(\w+)\)\[", s)
        if not m:
            continue
        for prev in reversed(lines[:i]):
            if prev.startswith("__syncthreads()") or "main_kernel(" in prev:
                break
            hit = [n for n in shared if re.search(r"(?<![\w.])%s\)?\s*(\[|\+)" % n, prev)]
            if "cp_async" not in prev and hit:
                bad.append(f"{m.group(1)}: {s[:80]} after {prev[:80]}")
                break
    return bad


@needs_tilelang
@pytest.mark.slow
@pytest.mark.parametrize("varlen,HV,KV,g_dtype,opts", [
    (False, 4, 128, "float32", {}), (True, 4, 128, "float32", dict(use_qk_l2norm=True)),
    (True, 2, 64, "bfloat16", dict(save_states=True)),
    (True, 2, 64, "float32", dict(save_states=True, z_split=True, qg_split=True))])
def test_forward_intra_prefetch_masks_every_global_access_itself(varlen, HV, KV, g_dtype, opts):
    """The forward intra launch with ``intra_prefetch`` is compiled without TileLang's bounds checks: its inputs
    arrive by predicated ``cp.async`` (predicate: the row is valid) and every other global access sits under a row
    mask; ``GAM`` (one row per chunk slot, in range for every block) is the only exception."""
    from kernels.chunk_fwd import chunk_fwd_pipeline

    kw = dict(H=2, HV=HV, K=KV, V=KV, dtype="bfloat16", g_dtype=g_dtype, scale=KV ** -0.5, use_initial_state=True,
              output_final_state=True, varlen=varlen, use_qk_l2norm=False)
    kw.update(opts)
    intra = chunk_fwd_pipeline(**kw, intra_prefetch=True).launches[0]
    assert intra.name == "gdn2_chunk_intra" and dict(intra.key[2:])["prefetch"] is True
    assert dict(intra.pass_configs)["tl.disable_safe_memory_legalize"] is True
    plain = chunk_fwd_pipeline(**kw, intra_prefetch=False, intra_ftz=False).launches[0]  # (the checks, v5's key)
    assert plain.pass_configs == () and "prefetch" not in dict(plain.key[2:])
    with pytest.raises(ValueError, match="intra_prefetch must be a bool"):
        chunk_fwd_pipeline(**kw, intra_prefetch=1)
    src = _cuda_source(intra)
    assert src.count("cp_async_gs_conditional") >= 6 and ("Y[" in src or "(Y +" in src)
    assert _unmasked_global_accesses(src, exempt=("GAM",)) == []
    # the check itself: a copy whose predicate is not a row bound, or a store without its row mask, is caught
    cp = next(l for l in src.splitlines() if "cp_async_gs_conditional" in l and "(&(q[" in l)
    pred = re.match(r".*, (\(.*\))\);$", cp.strip()).group(1)
    assert _unmasked_global_accesses(src.replace(cp, cp.replace(pred, "(0 < valid)")), exempt=("GAM",))
    assert _unmasked_global_accesses(src)  # (GAM counts unless exempt)
    # every copy into a staging buffer comes after a barrier behind the last read of that buffer (g / b of the next
    # slice after the conversion loop, w / v after the slice loop); the check catches a missing barrier
    assert _copies_without_barrier(src) == []
    lines = src.splitlines()
    reissue = [i for i, l in enumerate(lines) if "cp_async_gs_conditional" in l and re.search(r"\(\w+\*\)gS\)", l)][-1]
    bar = max(i for i in range(reissue) if lines[i].strip() == "__syncthreads();")
    assert any(x.startswith("gS:") for x in _copies_without_barrier("\n".join(lines[:bar] + lines[bar + 1:])))
    wv = next(i for i, l in enumerate(lines) if "cp_async_gs_conditional" in l and re.search(r"\(\w+\*\)wS\)", l))
    bar = max(i for i in range(wv) if lines[i].strip() == "__syncthreads();")
    assert any(x.startswith("wS:") for x in _copies_without_barrier("\n".join(lines[:bar] + lines[bar + 1:])))


@needs_tilelang
@pytest.mark.slow
def test_forward_intra_ftz_flag_key_and_slice_loop_barriers():
    """``intra_ftz`` (the default, ``kernels.defaults.FORWARD``) compiles the forward intra launch with
    ``nvcc -ftz=true`` and names itself in the launch's key (so its kernels never share a cache entry with the
    launch without it); off, neither. Whatever its value, the channel-slice loop of the generated CUDA keeps at most
    eight ``__syncthreads()``: the anchored operands' stores between the slice's decision and its products need
    none (session 21: with the anchor row read at an index ``n + 8 * fast``, TileLang's barrier planner put one
    between every two of them, sixteen in all)."""
    from kernels import defaults
    from kernels.chunk_fwd import chunk_fwd_pipeline

    kw = dict(H=2, HV=4, K=128, V=128, dtype="bfloat16", g_dtype="float32", scale=128 ** -0.5,
              use_initial_state=True, output_final_state=True, varlen=False, use_qk_l2norm=False)
    assert defaults.FORWARD["intra_ftz"] is True
    on = chunk_fwd_pipeline(**kw).launches[0]
    off = chunk_fwd_pipeline(**kw, intra_ftz=False).launches[0]
    assert dict(on.pass_configs)["tl.device_compile_flags"] == ("-ftz=true",) and dict(on.key[2:])["ftz"] is True
    assert "tl.device_compile_flags" not in dict(off.pass_configs) and "ftz" not in dict(off.key[2:])
    assert _compile.cache_key(on, "sm_90a") != _compile.cache_key(off, "sm_90a")
    assert chunk_fwd_pipeline(**kw, save_states=True).launches[0].pass_configs == on.pass_configs  # (training fwd)
    with pytest.raises(ValueError, match="intra_ftz must be a bool, got 1$"):
        chunk_fwd_pipeline(**kw, intra_ftz=1)
    src = _cuda_source(off)
    lines = src.splitlines()
    start = next(i for i, l in enumerate(lines) if l.strip().startswith("for (int dc = 0;"))
    depth, end = 0, None
    for i in range(start, len(lines)):  # the loop's closing brace
        depth += lines[i].count("{") - lines[i].count("}")
        if depth == 0:
            end = i
            break
    barriers = sum(l.count("__syncthreads()") for l in lines[start:end + 1])
    assert 4 <= barriers <= 8, barriers
    assert "__syncthreads_or(" in "\n".join(lines[start:end + 1])  # (the slice's path decision is in the loop)


@needs_tilelang
@pytest.mark.slow
def test_forward_intra_blocked_solve_key_and_products():
    """``blocked_solve`` (the default, ``kernels.defaults.FORWARD``) names itself in the forward intra launch's key
    (off: absent, the series' kernels keep their key); its generated CUDA has neither the Neumann series' N / N^2
    buffers nor as many TF32 ``mma_sync`` call sites (the four dense 64^3 products become two 32^3 ones), and keeps
    the level-1 partial products ``Mt``. The training forward (``Akk`` from the blocked inverse) compiles too.
    (Numbers: ``tests/test_stages.py::test_gpu_blocked_solve_vs_neumann_series`` on the GPU.)"""
    from kernels.chunk_fwd import chunk_fwd_pipeline

    kw = dict(H=2, HV=4, K=128, V=128, dtype="bfloat16", g_dtype="float32", scale=128 ** -0.5,
              use_initial_state=True, output_final_state=True, varlen=False, use_qk_l2norm=False)
    on, off = _default_option_launches(kw, "blocked_solve")
    assert _compile.cache_key(on, "sm_90a") != _compile.cache_key(off, "sm_90a")
    # (its thread mapping assumes 256 threads: the 128-thread launch keeps the series, and asking for both fails)
    assert "blocked_solve" not in dict(chunk_fwd_pipeline(**kw, intra_threads=128).launches[0].key[2:])
    with pytest.raises(ValueError, match="blocked_solve=True needs intra_threads=256, got 128$"):
        chunk_fwd_pipeline(**kw, intra_threads=128, blocked_solve=True)

    tf32 = "mma_sync<tl::DataType::kTensorFloat32"
    blocked, series = _cuda_source(on), _cuda_source(off)
    assert "N2s" in series and "Ns)" in series and "Mt" not in series
    assert "N2s" not in blocked and "Ns)" not in blocked and "Mt" in blocked
    assert 0 < blocked.count(tf32) < series.count(tf32), (blocked.count(tf32), series.count(tf32))
    train = _cuda_source(chunk_fwd_pipeline(**kw, save_states=True).launches[0])
    assert "Akk[" in train or "(Akk +" in train


@needs_tilelang
@pytest.mark.slow
def test_forward_intra_fused_slice_key_errors_and_loop():
    """``fused_slice`` (the default since session 23, ``kernels.defaults.FORWARD``) names itself in the forward
    intra launch's key, needs the prefetch launch of 256 threads (the launches without prefetch or with 128 threads
    keep the separate passes; asking for it there is a clear ValueError), and compiles: its channel-slice loop
    keeps at most ten ``__syncthreads()`` and the path decision, holds the per-row registers ``gl`` / ``bl``, and
    takes QGL's residual by an explicit fma (``_common.product_residual``).
    (Bit-identity with the launch without it:
    ``tests/test_stages.py::test_gpu_intra_fused_slice_bit_identical_to_default``.)"""
    from kernels import defaults
    from kernels.chunk_fwd import chunk_fwd_pipeline

    kw = dict(H=2, HV=4, K=128, V=128, dtype="bfloat16", g_dtype="float32", scale=128 ** -0.5,
              use_initial_state=True, output_final_state=True, varlen=True, use_qk_l2norm=True)
    assert defaults.FORWARD["fused_slice"] is True
    on = chunk_fwd_pipeline(**kw, save_states=True).launches[0]
    off = chunk_fwd_pipeline(**kw, fused_slice=False).launches[0]
    assert dict(on.key[2:])["fused_slice"] is True and "fused_slice" not in dict(off.key[2:])
    for other in (dict(intra_prefetch=False), dict(intra_threads=128)):
        assert "fused_slice" not in dict(chunk_fwd_pipeline(**kw, **other).launches[0].key[2:])
    with pytest.raises(ValueError, match="fused_slice must be a bool, got 1$"):
        chunk_fwd_pipeline(**kw, fused_slice=1)
    with pytest.raises(ValueError, match="fused_slice=True needs intra_prefetch=True and intra_threads=256"):
        chunk_fwd_pipeline(**kw, fused_slice=True, intra_prefetch=False)
    with pytest.raises(ValueError, match="fused_slice=True needs"):
        chunk_fwd_pipeline(**kw, fused_slice=True, intra_threads=128)
    src = _cuda_source(on)
    lines = src.splitlines()
    start = next(i for i, l in enumerate(lines) if l.strip().startswith("for (int dc = 0;"))
    depth, end = 0, None
    for i in range(start, len(lines)):
        depth += lines[i].count("{") - lines[i].count("}")
        if depth == 0:
            end = i
            break
    loop = "\n".join(lines[start:end + 1])
    assert 4 <= loop.count("__syncthreads()") <= 10, loop.count("__syncthreads()")
    assert "__syncthreads_or(" in loop and "gl[" in loop and "bl[" in loop
    assert "QGL[" in loop and "__fmaf_rn(" in loop


@needs_tilelang
@pytest.mark.slow
def test_forward_intra_warp_tiles_key_errors_and_tiles(tmp_path):
    """``warp_tiles`` (the default since session 23, ``kernels.defaults.FORWARD``) names itself in the forward
    intra launch's key, needs ``fused_slice`` (off without it; asking for it there is a clear ValueError), and
    compiles to hand-written tiles: no ``T.gemm`` of the anchored products
    is left (the only TF32 ``mma_sync`` call sites outside the per-warp tiles are the blocked solve's two), each
    warp role loads its operands with ``ldmatrix`` from the padded QE / Kc tiles, and the per-warp accumulators
    stay in registers (ptxas: no stack frame, no spills; checked where nvcc 13.0 is installed, the toolkit these
    counts were taken with). (Bit-identity with the ``T.gemm`` launch, ``warp_tiles=False``:
    ``tests/test_stages.py::test_gpu_intra_warp_tiles_bit_identical_to_default``.)"""
    import os
    import shutil
    import subprocess

    import tilelang

    from kernels.chunk_fwd import chunk_fwd_pipeline

    kw = dict(H=32, HV=32, K=128, V=128, dtype="bfloat16", g_dtype="float32", scale=128 ** -0.5,
              use_initial_state=False, output_final_state=True, varlen=False, use_qk_l2norm=False)
    on, off = _default_option_launches(kw, "warp_tiles")
    assert "warp_tiles" not in dict(chunk_fwd_pipeline(**kw, fused_slice=False).launches[0].key[2:])
    with pytest.raises(ValueError, match="warp_tiles=True needs fused_slice=True"):
        chunk_fwd_pipeline(**kw, warp_tiles=True, fused_slice=False)
    with pytest.raises(ValueError, match="warp_tiles=True needs fused_slice=True"):
        chunk_fwd_pipeline(**kw, warp_tiles=True, intra_prefetch=False)
    src = _cuda_source(on)
    assert "wacc[" in src and "Acc0" not in src and "Acc3" not in src
    assert src.count("tl::ptx_ldmatrix_x4((&(((float*)QEa)[") == 6  # (each warp role's A operands)
    assert src.count("tl::ptx_ldmatrix_x2((&(((float*)Kca)[") == 2  # (the third sub-chunk's 3-tile halves)
    assert "QE0" not in src and "Kc0" not in src
    mma = [line for line in src.splitlines() if "mma_sync<tl::DataType::kTensorFloat32" in line]
    assert sum("(&(wacc[" in line for line in mma) == 6  # (one call site per warp role)
    assert sum("(&(wacc[" not in line for line in mma) == 2  # (the blocked solve's two 32^3 products)
    # the Kc operands (kc_rows, session 25): one branch per sub-chunk around whole row loops, no per-row select.
    # Sub-chunks 1-3 have three row loops each (before the sub-chunk, inside it on a fast slice, zero), sub-chunk 0
    # two (fast, zero); every store is k 2^(...) or zero, none a selected value
    kc = [line.strip() for line in src.splitlines() if line.strip().startswith("((float*)Kca)[")]
    assert len(kc) == 3 * 3 + 2, kc
    assert all(re.fullmatch(r"\(\(float\*\)Kca\)\[.*\] = (\(kl\[i_\d+\] \* exp2f\(.*\)\)|0x0p\+0f/\*0\.000000e\+00\*/);",
                            line) for line in kc), kc
    assert sum("exp2f(min(" in line for line in kc) == 3 and not any("condval" in line for line in kc)
    nvcc = shutil.which("nvcc")
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout if nvcc else ""
    if "release 13.0" in version:
        root = os.path.dirname(tilelang.__file__)
        cu = tmp_path / "warp_tiles.cu"
        cu.write_text(src)
        out = subprocess.run([nvcc, "-arch=sm_90a", "-cubin", "-std=c++20", "-ftz=true", "-DENABLE_BF16",
                              f"-I{root}/src", f"-I{root}/3rdparty/cutlass/include", "--ptxas-options=-v",
                              "-o", str(tmp_path / "warp_tiles.cubin"), str(cu)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
        assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in out.stderr, out.stderr[-800:]


@needs_tilelang
@pytest.mark.slow
def test_forward_intra_smem_epilogue_key_errors_and_stores():
    """``smem_epilogue`` (the default since session 24) names itself in the forward intra launch's key and
    compiles to what it is for: Y and U rounded into shared memory by ``stmatrix`` behind a barrier after the
    products and stored as 16-byte pieces (``uint4``) under the row mask behind another, where the launch without it
    stores 4-byte pairs straight from the WGMMA accumulators. (Bit-identity:
    ``tests/test_stages.py::test_gpu_intra_smem_epilogue_bit_identical_to_default``.)"""
    import re

    kw = dict(H=32, HV=32, K=128, V=128, dtype="bfloat16", g_dtype="float32", scale=128 ** -0.5,
              use_initial_state=False, output_final_state=True, varlen=False, use_qk_l2norm=False)
    on, off = _default_option_launches(kw, "smem_epilogue")

    def stores(launch):
        src = _cuda_source(launch)
        return src, {n: re.findall(r"\*\((uint\d)\*\)\(" + n + r" \+", src) for n in ("Y", "U")}

    src, got = stores(on)
    assert got == {"Y": ["uint4"], "U": ["uint4"]}, got
    assert src.count("tl::ptx_stmatrix_m8n8_x4((&(((bfloat16_t*)Ebs)[") == 1
    assert src.count("tl::ptx_stmatrix_m8n8_x4((&(((bfloat16_t*)Zs)[") == 1
    assert _unmasked_global_accesses(src, exempt=("GAM",)) == []  # (the row stores under their row masks)
    # the barriers the epilogue relies on (placed by TileLang's planner): after the last product's wait (both
    # warpgroups' reads of Ebs / Zs / wS done) before the first stmatrix, and after the last stmatrix before the
    # first row store
    lines = src.splitlines()
    wait = max(i for i, line in enumerate(lines) if "tl::warpgroup_wait<0>();" in line)
    stm = [i for i, line in enumerate(lines) if "tl::ptx_stmatrix_m8n8_x4(" in line]
    row = min(i for i, line in enumerate(lines) if "*(uint4*)(Y +" in line)
    assert wait < stm[0] < stm[-1] < row
    assert any(line.strip() == "__syncthreads();" for line in lines[wait:stm[0]])
    assert any(line.strip() == "__syncthreads();" for line in lines[stm[-1]:row])
    src, got = stores(off)
    assert got == {"Y": ["uint1"], "U": ["uint1"]} and "stmatrix" not in src, got


@needs_tilelang
@pytest.mark.slow
def test_forward_intra_unroll_key_and_slice_copies():
    """``intra_unroll`` (experimental, off: for a per-SASS profile that tells the slices apart) names itself in the
    forward intra launch's key when on and marks the channel-slice loop ``#pragma unroll`` (nvcc then makes one copy
    per slice: four at K = 128, five ``DEPBAR`` waits in the bench configuration's SASS instead of two); off, the
    launch is the default's."""
    from kernels.chunk_fwd import chunk_fwd_pipeline

    kw = dict(H=2, HV=4, K=128, V=128, dtype="bfloat16", g_dtype="float32", scale=128 ** -0.5,
              use_initial_state=True, output_final_state=True, varlen=False, use_qk_l2norm=False)
    on = chunk_fwd_pipeline(**kw, intra_unroll=True).launches[0]
    off = chunk_fwd_pipeline(**kw).launches[0]
    assert dict(on.key[2:])["unroll_slices"] is True and "unroll_slices" not in dict(off.key[2:])
    assert chunk_fwd_pipeline(**kw, intra_unroll=False).launches[0].key == off.key
    with pytest.raises(ValueError, match="intra_unroll must be a bool, got 'False'"):
        chunk_fwd_pipeline(**kw, intra_unroll="False")
    with pytest.raises(ValueError, match="state_threads=256 needs block_v of 64 or 128, got 32"):
        chunk_fwd_pipeline(**kw, block_v=32, state_threads=256)
    with pytest.raises(ValueError, match="state_threads must be 128 or 256, got 64"):
        chunk_fwd_pipeline(**kw, state_threads=64)

    loop = "    for (int dc = 0; dc < 4; ++dc) {"
    on_lines, off_lines = _cuda_source(on).splitlines(), _cuda_source(off).splitlines()
    assert on_lines.count(loop) == 1 and off_lines.count(loop) == 1
    assert on_lines[on_lines.index(loop) - 1].strip() == "#pragma unroll"
    assert off_lines[off_lines.index(loop) - 1].strip() != "#pragma unroll"


@needs_tilelang
@pytest.mark.slow
def test_forward_intra_g_first_key_and_wait_order():
    """``g_first`` (the default since session 26) names itself in the forward intra launch's key, needs the fused
    slice pass, and compiles to the wait order it relies on (bench configuration, K = 128: four slices): the
    prologue commits g / b and q / k as two ``cp.async`` groups; a slice starts with ``cp_async_wait<1>`` and a
    barrier, then reads g and b; the next slice's g / b group is committed before its q / k group; q and k of the
    slice are waited for (``cp_async_wait<2>``, or ``<0>`` at the last slice) before the ``__syncthreads_or`` and
    read only after it. Off, the slice starts with ``cp_async_wait<0>`` as before. (Bit-identity:
    ``tests/test_stages.py::test_gpu_intra_g_first_bit_identical_to_default``.)"""
    import re

    from kernels.chunk_fwd import chunk_fwd_pipeline

    kw = dict(H=32, HV=32, K=128, V=128, dtype="bfloat16", g_dtype="float32", scale=128 ** -0.5,
              use_initial_state=False, output_final_state=True, varlen=False, use_qk_l2norm=False)
    on, off = _default_option_launches(kw, "g_first")
    with pytest.raises(ValueError, match="g_first=True needs fused_slice=True"):
        chunk_fwd_pipeline(**kw, fused_slice=False, warp_tiles=False, g_first=True)
    assert "g_first" not in dict(chunk_fwd_pipeline(**kw, fused_slice=False, warp_tiles=False).launches[0].key[2:])

    src = _cuda_source(on).splitlines()
    loop = src.index("    for (int dc = 0; dc < 4; ++dc) {")
    first = [i for i, x in enumerate(src) if "tl::cp_async_gs_conditional" in x or "tl::cp_async_commit" in x]
    pro = [("qk" if re.search(r"\(\(bfloat16_t\*\)[qk]c\)", src[i]) else "gb" if "cp_async_gs" in src[i] else "commit")
           for i in first if i < loop]
    assert pro == ["gb", "gb", "commit", "qk", "qk", "commit"], pro  # (g: one copy in a loop line, b: one)
    assert src[loop + 1].strip() == "tl::cp_async_wait<1>();" and src[loop + 2].strip() == "__syncthreads();"
    sor = next(i for i in range(loop, len(src)) if "__syncthreads_or(" in src[i])
    body = src[loop:sor]
    waits = [x.strip() for x in body if "cp_async_wait" in x]
    assert waits == ["tl::cp_async_wait<1>();", "tl::cp_async_wait<2>();", "tl::cp_async_wait<0>();"], waits
    w2 = next(i for i, x in enumerate(body) if "cp_async_wait<2>" in x)
    assert body[w2 - 1].strip() == "if (dc < 3) {" and "cp_async_wait<0>" in body[w2 + 2]
    copies = [("qk" if re.search(r"\(\(bfloat16_t\*\)[qk]c\)", x) else "commit" if "commit" in x else "gb")
              for x in body if "tl::cp_async_gs_conditional" in x or "tl::cp_async_commit" in x]
    assert copies == ["gb", "gb", "commit", "qk", "qk", "commit"], copies
    # (the next slice's q / k land in the other buffer, 64 rows x 40 = 2560 elements away, not the one being read)
    qk_next = [x for x in body if "tl::cp_async_gs_conditional" in x and re.search(r"\(\(bfloat16_t\*\)[qk]c\)", x)]
    assert len(qk_next) == 2 and all("+ 2560) - ((dc & 1) * 2560))" in x for x in qk_next), qk_next
    # (q and k are not read between the slice's start and the barrier after their wait)
    assert not [x for x in body if re.search(r"\(\(bfloat16_t\*\)[qk]c\)\[", x) and "cp_async" not in x]
    assert any(re.search(r"\(\(bfloat16_t\*\)qc\)\[", x) for x in src[sor:])
    off_src = _cuda_source(off).splitlines()
    off_loop = off_src.index("    for (int dc = 0; dc < 4; ++dc) {")
    assert off_src[off_loop + 1].strip() == "tl::cp_async_wait<0>();"
    assert not any("cp_async_wait<1>" in x or "cp_async_wait<2>" in x for x in off_src)


def test_forward_default_option_errors_name_kernels_defaults(monkeypatch):
    """A bad value in ``kernels.defaults.FORWARD`` is reported as coming from there, an explicit bad value as is."""
    from kernels import defaults
    from kernels.chunk_fwd import chunk_fwd_pipeline

    kw = dict(H=2, HV=2, K=64, V=64, dtype="bfloat16", g_dtype="float32", scale=0.125, use_initial_state=False,
              output_final_state=False, varlen=False, use_qk_l2norm=False)
    monkeypatch.setitem(defaults.FORWARD, "intra_prefetch", 1)
    with pytest.raises(ValueError, match=r"intra_prefetch must be a bool, got 1 \(from kernels.defaults.FORWARD\)"):
        chunk_fwd_pipeline(**kw)
    with pytest.raises(ValueError, match=r"got 'yes'$"):
        chunk_fwd_pipeline(**kw, intra_prefetch="yes")
    monkeypatch.setitem(defaults.FORWARD, "intra_prefetch", False)
    assert "prefetch" not in dict(chunk_fwd_pipeline(**kw).launches[0].key[2:])


@pytest.mark.parametrize("H,HV,g_dtype,l2,qk", [(2, 2, "float32", False, True), (2, 4, "float32", False, False),
                                                 (2, 2, "bfloat16", True, False), (1, 1, "bfloat16", False, True)])
def test_backward_cast_grads_output_dtypes_and_buffers(H, HV, g_dtype, l2, qk):
    """``cast_grads`` (default on): dv, dw, db leave the kernels in the input dtype, dg in g's dtype, dq and dk in
    the input dtype unless a jnp step follows (GVA, l2 norm); the WY launch's partials of the cast ones become fp32
    scratch read by the intra launch, which writes the outputs; ``cast_grads=False`` keeps every gradient fp32 and
    the session-12 launches (the WY launch's key without ``cast_dvw``, the intra launch's without ``cast``)."""
    op = registry.get("chunk_gdn2")
    kw = dict(H=H, HV=HV, K=128, V=128, dtype="float16", g_dtype=g_dtype, scale=128 ** -0.5,
              use_initial_state=True, output_final_state=True, varlen=False, use_qk_l2norm=l2)
    on, off = op.backward_pipeline(**kw), op.backward_pipeline(**kw, cast_grads=False)
    out = {b.name: b.dtype for b in on.outputs}
    cast = {"dv", "dw", "db"} | ({"dg"} if g_dtype != "float32" else set()) | ({"dq", "dk"} if qk else set())
    assert out == {n: ("float16" if n in cast - {"dg"} else g_dtype if n in cast else "float32")
                   for n in ("dh0", "dq", "dk", "db", "dg", "dv", "dw")}
    assert all(b.dtype == "float32" for b in off.outputs)
    wy, intra = on.launches[1:]
    part = [n + "_wy" if n in cast else n for n in ("dq", "dk", "db", "dg")]
    assert wy.args[-9:-5] == tuple(part) and {n + "_wy" for n in cast - {"dv", "dw"}} == {
        b.name for b in on.scratch if b.name.endswith("_wy")}
    grads = ("dq", "dk", "db", "dg")  # intra launch: partials of the cast ones, their outputs, the in-place rest
    ordered = (tuple(n + "_wy" for n in grads if n in cast) + tuple(n for n in grads if n in cast)
               + tuple(n for n in grads if n not in cast))
    assert intra.args[-(4 + len(cast) - 2):] == ordered
    assert launch_io(on, 2)[1] == ordered[len(cast) - 2:]  # (every gradient it writes is a result)
    assert dict(wy.key[3:])["cast_dvw"] is True and "cast_dvw" not in dict(off.launches[1].key[3:])
    assert dict(intra.key[3:])["cast"] == tuple(n for n in ("dq", "dk", "db", "dg") if n in cast)
    assert "cast" not in dict(off.launches[2].key[3:])
    with pytest.raises(ValueError, match="cast_grads=1 must be True or False"):
        op.backward_pipeline(**kw, cast_grads=1)


def test_backward_pipeline_options_are_checked_and_keyed(monkeypatch):
    """``chunk_bwd_pipeline`` refuses option combinations that do not exist (naming them) and gives every option
    its own kernels: distinct cache keys for the WY launch per ``wy_load`` / ``wy_tf32_round`` and for the intra
    launch per version; ``kernels.defaults.BACKWARD`` supplies the options left unset."""
    from kernels import _compile, defaults
    from kernels.build import BACKWARD_OPTIONS

    op = registry.get("chunk_gdn2")
    kw = dict(H=2, HV=4, K=128, V=128, dtype="bfloat16", g_dtype="float32", scale=128 ** -0.5,
              use_initial_state=True, output_final_state=True, varlen=False, use_qk_l2norm=False)
    with pytest.raises(ValueError, match="reg_diag=True needs intra_v2=False"):
        op.backward_pipeline(**kw, reg_diag=True)
    with pytest.raises(ValueError, match="intra_tc=True needs intra_v2=True"):
        op.backward_pipeline(**kw, intra_v2=False, intra_tc=True)
    with pytest.raises(ValueError, match="intra_fast_diag=True needs intra_v2=True"):
        op.backward_pipeline(**kw, intra_v2=False, intra_fast_diag=True)
    with pytest.raises(ValueError, match="wy_load='cp' must be"):
        op.backward_pipeline(**kw, wy_load="cp")
    with pytest.raises(ValueError, match="wy_threads=128 must be"):
        op.backward_pipeline(**kw, wy_threads=128)
    with pytest.raises(ValueError, match="wy_tf32_round=True needs"):
        op.backward_pipeline(**kw, wy_load="async", wy_tf32_round=True)
    with pytest.raises(ValueError, match="wy_threads=512 needs"):
        op.backward_pipeline(**kw, wy_load="tma", wy_threads=512)
    assert {"intra_v2", "intra_tc", "reg_diag", "split_ds", "wy_load", "wy_threads", "wy_tf32_round"} <= BACKWARD_OPTIONS
    assert not BACKWARD_OPTIONS & {"block_v", "stages", "aqk_split", "tf32_round", "H", "varlen"}

    def keys(**o):
        wy, intra = op.backward_pipeline(**kw, **o).launches[1:]
        return _compile.cache_key(wy, "sm_90a"), _compile.cache_key(intra, "sm_90a")

    default = keys()
    assert default == keys(**{n: v for n, v in defaults.BACKWARD.items() if n != "split_ds"})
    wys = {keys(wy_load=m, wy_threads=t, wy_tf32_round=r)[0] for m in ("sync", "async", "tma") for t in (256, 512)
           for r in (False, True, "dy", "dy_min") if (m != "tma" or t == 256) and (m == "sync" or r is not True)
           and (m != "tma" or r is False)}
    assert len(wys) == 15
    with pytest.raises(ValueError, match="wy_tf32_round='dy' needs wy_load='sync' or 'async'"):
        op.backward_pipeline(**kw, wy_load="tma", wy_tf32_round="dy")
    op.backward_pipeline(**kw, wy_load="sync", wy_tf32_round=True)  # (memoised: 1 == True must not answer for it)
    for bad in (0, 1, 2, "yes", "all"):
        with pytest.raises(ValueError, match="must be False, True, 'dy' or 'dy_min'"):
            op.backward_pipeline(**kw, wy_tf32_round=bad)
    with pytest.raises(ValueError, match="intra_tc=1 must be True or False"):
        op.backward_pipeline(**kw, intra_tc=1)
    assert keys(intra_v2=False)[1] != default[1] and keys(intra_v2=False)[0] == default[0]
    intras = {keys(intra_v2=True, intra_tc=t, intra_fast_diag=f)[1] for t in (False, True) for f in (False, True)}
    assert len(intras | {keys(intra_v2=False)[1]}) == 5 and keys(intra_tc=True)[0] == default[0]
    wy_async = op.backward_pipeline(**kw, wy_load="async").launches[1]
    assert dict(wy_async.pass_configs) == {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True}
    wy_tma = op.backward_pipeline(**kw, wy_load="tma").launches[1]  # (256 threads when tma is asked for)
    assert wy_tma.key != wy_async.key and not wy_tma.pass_configs and ("threads", 256) in wy_tma.key
    # the state pass follows split_ds (default on, explicit False off)
    dstate = {n: op.backward_pipeline(**kw, split_ds=v).launches[0].key for n, v in (("on", True), ("off", False))}
    assert op.backward_pipeline(**kw).launches[0].key == dstate["on" if defaults.BACKWARD["split_ds"] else "off"]
    assert dstate["on"] != dstate["off"]
    with pytest.raises(ValueError, match="intra_v2=2 must be True or False"):
        op.backward_pipeline(**kw, intra_v2=2)
    with pytest.raises(ValueError, match="unknown option.*wy_laod"):
        op.backward_pipeline(**kw, wy_laod="sync")
    monkeypatch.setitem(defaults.BACKWARD, "wy_load", "async")  # (a failed call is not memoised)
    with pytest.raises(ValueError, match=r"wy_tf32_round=True needs wy_load='sync', got 'async' \(from kernels"):
        op.backward_pipeline(**kw, wy_tf32_round=True)


def test_precision_options_of_session_16_are_checked_keyed_and_wired(monkeypatch):
    """``z_split`` (forward), ``qg_split`` (training forward and reverse state pass) and ``split_dr`` (state pass):
    off, the launches keep the keys of the kernels measured up to session 15 (the options enter a key only when
    on); on, the forward's intra launch writes ``QGL`` after ``GAM`` and the state pass reads it after ``GAM``;
    bad values raise naming the option (and ``kernels.defaults`` when it came from there); the JAX and torch
    training forward stores QGL by default exactly when the backward's default reads it."""
    from kernels import defaults
    from kernels.chunk_bwd import chunk_dstate_pipeline
    from kernels.chunk_fwd import chunk_fwd_pipeline

    op = registry.get("chunk_gdn2")
    kw = dict(H=2, HV=4, K=128, V=128, dtype="bfloat16", g_dtype="float32", scale=128 ** -0.5,
              use_initial_state=True, output_final_state=True, varlen=False, use_qk_l2norm=False)
    plain = chunk_fwd_pipeline(**kw, z_split=False)
    assert not {"z_split", "qg_split"} & set(dict(plain.launches[0].key[2:]))
    zs = chunk_fwd_pipeline(**kw, z_split=True)
    assert dict(zs.launches[0].key[2:])["z_split"] is True and zs.launches[1].key == plain.launches[1].key
    tr = chunk_fwd_pipeline(**kw, save_states=True, qg_split=True)
    intra = tr.launches[0]
    assert intra.args[-3:] == ("GAM", "QGL", "Akk") and "QGL" in {b.name for b in tr.scratch}
    assert "QGL" not in chunk_fwd_pipeline(**kw, save_states=True, qg_split=False).launches[0].args
    with pytest.raises(ValueError, match="qg_split=True needs save_states=True"):
        chunk_fwd_pipeline(**kw, qg_split=True)
    with pytest.raises(ValueError, match="z_split must be a bool, got 1$"):
        chunk_fwd_pipeline(**kw, z_split=1)
    monkeypatch.setitem(defaults.FORWARD, "z_split", "on")
    with pytest.raises(ValueError, match=r"z_split must be a bool, got 'on' \(from kernels.defaults.FORWARD\)"):
        chunk_fwd_pipeline(**kw)
    monkeypatch.undo()
    d = dict(HV=4, K=128, V=128, dtype="bfloat16", use_dht=True, varlen=False)
    off = chunk_dstate_pipeline(**d, split_ds=True)
    on = chunk_dstate_pipeline(**d, split_ds=True, qg_split=True)
    assert "QGL" not in off.inputs and on.inputs[on.inputs.index("GAM") + 1] == "QGL"
    assert not {"split_dr", "qg_split"} & set(dict(off.launches[0].key[2:]))
    assert len({chunk_dstate_pipeline(**d, split_ds=a, split_dr=b, qg_split=c).launches[0].key
                for a in (False, True) for b in (False, True) for c in (False, True)}) == 8
    for name in ("split_dr", "qg_split"):
        with pytest.raises(ValueError, match=f"{name}=1 must be True or False"):
            op.backward_pipeline(**kw, **{name: 1})
    bwd = op.backward_pipeline(**kw, qg_split=True, split_dr=False)
    assert "QGL" in bwd.inputs and "QGL" not in op.backward_pipeline(**kw, qg_split=False).inputs
    # the training forward's default follows the backward's default
    for v in (False, True):
        monkeypatch.setitem(defaults.BACKWARD, "qg_split", v)
        assert ("QGL" in chunk_fwd_pipeline(**kw, save_states=True).launches[0].args) == v
    monkeypatch.undo()


def test_tf32_rounded_operands_are_keyed_wired_and_emitted(monkeypatch):
    """``wy_tf32_round="dy"`` / ``"dy_min"`` (sessions 18-19, options): the WY launch reads S0, dR and A as
    TF32 values that their producers store rounded to nearest: the training forward's ``h`` and ``Akk``
    (``tf32_states``: its state launch keyed ``tf32_h``, its intra launch ``tf32_a``) and the state pass's dR
    (``tf32_dr``); the WY launch rounds dY (both) and the operands behind dT (Z, Ebar, dA, A^T dA: ``"dy"`` only)
    itself. With ``wy_tf32_round=False`` nothing is rounded and the launches keep their keys;
    ``training_forward_options`` gives the training forward each backward expects (JAX, torch and
    ``kernels.build`` use it); the rounding (``_common.tf32_nearest``: ``t = fma(x, 2^13, x)``, ``t - (t - x)``)
    is in the TIR exactly where on; bad values raise naming the option. (On the GPU:
    ``tests/test_stages.py::test_gpu_tf32_rounded_states_and_dr``.)"""
    from kernels import build, defaults
    from kernels.chunk_bwd import _dstate_prim, _wy_bwd_prim, training_forward_options
    from kernels.chunk_fwd import _intra_prim, _state_prim, chunk_fwd_pipeline

    op = registry.get("chunk_gdn2")
    kw = dict(H=2, HV=4, K=128, V=128, dtype="bfloat16", g_dtype="float32", scale=128 ** -0.5,
              use_initial_state=True, output_final_state=True, varlen=False, use_qk_l2norm=False)
    off = op.backward_pipeline(**kw, wy_tf32_round=False)
    default = op.backward_pipeline(**kw, wy_tf32_round=defaults.BACKWARD["wy_tf32_round"])
    assert [la.key for la in op.backward_pipeline(**kw).launches] == [la.key for la in default.launches]
    for mode in ("dy", "dy_min"):
        on = op.backward_pipeline(**kw, wy_tf32_round=mode)
        assert dict(on.launches[0].key[2:])["tf32_dr"] is True and "tf32_dr" not in dict(off.launches[0].key[2:])
        assert dict(on.launches[1].key[3:])["tf32_round"] == mode
        assert training_forward_options(on) == dict(qg_split=True, tf32_states=True)
    assert dict(off.launches[1].key[3:])["tf32_round"] is False
    assert training_forward_options(off) == dict(qg_split=True, tf32_states=False)
    sync_all = op.backward_pipeline(**kw, wy_load="sync", wy_tf32_round=True)  # (rounds S0, dR and A itself)
    assert training_forward_options(sync_all)["tf32_states"] is False and "tf32_dr" not in dict(
        sync_all.launches[0].key[2:])
    assert training_forward_options(op.backward_pipeline(**kw, local_bwd=False))["tf32_states"] is False
    assert "tf32_dr" not in dict(op.backward_pipeline(**kw, local_bwd=False).launches[0].key[2:])
    fwd = {v: chunk_fwd_pipeline(**kw, save_states=True, tf32_states=v).launches for v in (False, True)}
    assert dict(fwd[True][1].key[2:])["tf32_h"] is True and "tf32_h" not in dict(fwd[False][1].key[2:])
    assert dict(fwd[True][0].key[2:])["tf32_a"] is True and "tf32_a" not in dict(fwd[False][0].key[2:])
    for mode in ("dy", "dy_min"):
        monkeypatch.setitem(defaults.BACKWARD, "wy_tf32_round", mode)
        assert [la.key for la in chunk_fwd_pipeline(**kw, save_states=True).launches] == [
            la.key for la in fwd[True]]  # (follows the backward's)
        monkeypatch.undo()
    inference = chunk_fwd_pipeline(**kw).launches  # (no h or Akk stored)
    assert "tf32_h" not in dict(inference[1].key[2:]) and "tf32_a" not in dict(inference[0].key[2:])
    with pytest.raises(ValueError, match="tf32_states=True needs save_states=True"):
        chunk_fwd_pipeline(**kw, tf32_states=True)
    with pytest.raises(ValueError, match="tf32_states must be a bool, got 'yes'"):
        chunk_fwd_pipeline(**kw, save_states=True, tf32_states="yes")
    monkeypatch.setitem(defaults.BACKWARD, "wy_tf32_round", False)
    assert [la.key for la in chunk_fwd_pipeline(**kw, save_states=True).launches] == [la.key for la in fwd[False]]
    monkeypatch.undo()
    # kernels.build: a backward variant builds the training forward it expects
    for v in (False, "dy", "dy_min"):
        train = [build._pipe("chunk_gdn2", c, p).launches[i].key for n, c, p, i, _ in
                 build.plan([dict(build.cfg(2, 4, 128), wy_tf32_round=v)], ("chunk_gdn2",), "sm_90a") if p == "train"]
        assert [dict(k[2:]).get("tf32_h", False) for k in train if k[0] == "gdn2_chunk_state_o"] == [bool(v)]
        assert [dict(k[2:]).get("tf32_a", False) for k in train if k[0] == "gdn2_chunk_intra"] == [bool(v)]
    # the rounding in the TIR: the producers' stores, and the WY launch's own sites (one fma each)
    ds = dict(HV=4, K=128, V=128, BV=32, dtype="bfloat16", use_dht=True, varlen=False, stages=2, aqk_split=True)
    st = dict(HV=4, K=128, V=128, BV=32, dtype="bfloat16", use_h0=True, store_ht=True, varlen=False, stages=2,
              save_states=True)
    it = dict(H=2, HV=4, K=128, V=128, dtype="bfloat16", g_dtype="float32", scale=0.1, varlen=False, l2norm=False,
              threads=256, min_blocks=2, exact_diag=False, aqk_split=True, save_a=True, prefetch=True)
    fma = "T.fma("
    for make, name, args in ((_dstate_prim, "tf32_dr", ds), (_state_prim, "tf32_h", st), (_intra_prim, "tf32_a", it)):
        assert str(make(**args, **{name: True})).count(fma) == 1, name
        assert fma not in str(make(**args)), name
    wy = dict(H=2, HV=4, K=128, V=128, BV=32, dtype="bfloat16", g_dtype="float32", scale=0.1, varlen=False,
              stages=2, threads=512)
    assert [str(_wy_bwd_prim(**wy, tf32_round=r)).count(fma) for r in (False, "dy_min", "dy")] == [0, 1, 5]
    # (with the stages = 1 loads too: S0, dR and A read as stored, no integer rounding)
    mask = "4294959104"  # (0xFFFFE000: tf32_operand's mantissa mask, True's rounding)
    assert [mask in str(_wy_bwd_prim(**dict(wy, stages=1), tf32_round=r)) for r in (False, "dy_min", "dy", True)] == [
        False, False, False, True]


def _written_params(func) -> set:
    """Names of the parameters of the TileLang prim_func ``func`` that its body writes (element stores, and the
    destinations of ``T.copy`` / ``T.fill``), from the TIR before lowering."""
    import importlib

    tir = importlib.import_module("tvm.tirx" if importlib.util.find_spec("tvm.tirx") else "tvm.tir")
    params = {func.buffer_map[p] for p in func.params}
    out = set()

    def dest(region):  # tl.region(BufferLoad, access, extents...) or a BufferRegion / BufferLoad
        for x in (region, getattr(region, "args", [None])[0]):
            buf = getattr(x, "buffer", None)
            if buf is not None:
                return buf

    def visit(node):
        buf = None
        if isinstance(node, tir.BufferStore):
            buf = node.buffer
        elif isinstance(node, tir.Call) and getattr(node.op, "name", "") in ("tl.tileop.copy", "tl.copy"):
            buf = dest(node.args[1])
        elif isinstance(node, tir.Call) and getattr(node.op, "name", "") in ("tl.tileop.fill", "tl.fill"):
            buf = dest(node.args[0])
        if buf is not None and buf in params:
            out.add(buf.name)

    tir.stmt_functor.post_order_visit(func.body, visit)
    return out


def test_written_params_sees_stores_copies_and_fills():
    """The helper of the next test finds element stores, T.copy and T.fill destinations, and not what is read."""
    import tilelang.language as T

    @T.prim_func
    def main(a: T.Tensor((64,), "float32"), b: T.Tensor((64,), "float32"), c: T.Tensor((64,), "float32"),
             d: T.Tensor((64,), "float32"), e: T.Tensor((64,), "float32")):
        with T.Kernel(1, threads=64) as bx:
            s = T.alloc_shared((64,), "float32")
            T.copy(a, s)
            T.copy(s, b)
            T.fill(c, 0)
            for i in T.Parallel(64):
                d[i] = s[i] + e[i]

    assert _written_params(main) == {"b", "c", "d"}


def test_every_launch_lists_what_it_writes_among_its_results():
    """Every launch of every pipeline of the ``all`` preset (forward, training forward, backward, with every
    backward variant) lists each buffer its kernel writes among the results of ``launch_io``: a buffer updated in
    place but listed before the launch's first new output would be passed to XLA as a read-only operand, and XLA
    may then schedule the buffer's readers before the update (the GVA dq of ``cast_grads`` was, before its
    parameter order was fixed: the gradient audit failed on the GPU with dq off by 52%)."""
    from kernels import build

    written, checked = {}, 0
    for name, kw, part, _, _ in build.plan(build.preset("all"), tuple(registry.OPS), "sm_90a"):
        pipe = build._pipe(name, kw, part)
        for i, la in enumerate(pipe.launches):
            ck = (la.key, la.pass_configs)
            if ck not in written:
                func = la.build()
                names = [func.buffer_map[p].name for p in func.params]
                assert len(names) == len(la.args), (la.name, names, la.args)
                w = _written_params(func)
                written[ck] = {j for j, n in enumerate(names) if n in w}  # (one kernel serves several pipelines)
            _, results, _ = launch_io(pipe, i)
            missing = sorted({la.args[j] for j in written[ck]} - set(results))
            assert not missing, (name, kw, part, la.name, missing)
            checked += 1
    assert checked > 200 and all(written.values())


def test_every_preset_describes_valid_pipelines():
    """Every configuration of every ``kernels.build`` preset gives its pipelines (forward, training forward and
    backward as ``build`` would compile them) without an error: the variants stay valid under the current
    ``kernels.defaults`` (no kernel is compiled)."""
    from kernels import build

    for name in ("serving", "bench", "tests", "layers", "profile", "bwdexp", "sweep"):
        work = build.plan(build.preset(name), tuple(registry.OPS), "sm_90a")
        assert work, name
        assert {part for _, _, part, _, _ in work} >= ({"fwd"} if name in ("sweep", "serving") else {"fwd", "bwd"})


@pytest.mark.parametrize("T", [0, 10])
def test_lowering_chunk_grad_short_inputs(T):
    """``jax.grad`` through the backward kernels traces and lowers for T = 0 (no chunk slot at all) and T < 64:
    the gradients have the inputs' shapes and dtypes (fp16 inputs, bf16 g, no states) and the program runs the
    training forward's launches and the backward kernels (not the xla VJP)."""
    def loss(q, k, v, g, b, w):
        o, _ = gdn2_jax.chunk_gdn2(q, k, v, g, b, w, backend="tilelang")
        return jnp.sum(o.astype(jnp.float32))

    specs = _specs(2, T, 1, 2, 64, 64, dtype=jnp.float16, g_dtype=BF)[:6]
    grads = jax.eval_shape(jax.grad(loss, argnums=tuple(range(6))), *specs)
    assert [(a.shape, a.dtype) for a in grads] == [(s.shape, s.dtype) for s in specs]
    targets = {re.sub(r"_d[0-9_]+$", "", t)  # (the in-place variants' names end in the aliased results)
               for t in re.findall(r"custom_call @(\w+)\(", _lower(jax.grad(loss, argnums=tuple(range(6))), specs))}
    kw = dict(H=1, HV=2, K=64, V=64, dtype="float16", g_dtype="bfloat16", scale=64 ** -0.5, use_initial_state=False,
              output_final_state=False, varlen=False, use_qk_l2norm=False)
    op = registry.get("chunk_gdn2")
    want = {_tilelang.target_name(la, "sm_90a") for la in op.pipeline(**kw, save_states=True).launches}
    want |= {_tilelang.target_name(la, "sm_90a") for la in op.backward_pipeline(**kw).launches}
    assert targets == want, (targets, want)


def test_generic_runner_maps_launches_to_ffi_calls():
    """Launch 1 writes scratch `A` and output `o`; launch 2 updates both in place; launch 3 reads `A` (listed
    first) and writes the new output `p`."""
    never = lambda: None  # noqa: E731  (no kernel is built when lowering on a CPU host)
    pipe = Pipeline(
        inputs=("x",),
        scratch=(Buf("A", ("B", 4), "float32"),),
        outputs=(Buf("o", ("B", 8), "bfloat16"), Buf("p", (2, "B"), "float16")),
        launches=(Launch("gdn2_t1", ("t1",), never, ("x", "A", "o")),
                  Launch("gdn2_t2", ("t2",), never, ("x", "A", "o")),
                  Launch("gdn2_t3", ("t3",), never, ("A", "x", "p"))),
        sizes=lambda shapes: {"B": shapes["x"][0]},
    )
    assert launch_io(pipe, 0) == (("x",), ("A", "o"), ("A", "o"))
    assert launch_io(pipe, 1) == (("x",), ("A", "o"), ())
    assert launch_io(pipe, 2) == (("A", "x"), ("p",), ("p",))
    txt = _lower(lambda x: _tilelang.run_pipeline(pipe, {"x": x}, register_targets=False),
                 [S((3, 5), jnp.float32)])
    calls = _custom_calls(txt)
    assert len(calls) == 3
    assert "(tensor<3x4xf32>, tensor<3x5xf32>) -> tensor<2x3xf16>" in calls[2] and "alias" not in calls[2]
    assert "-> (tensor<3x4xf32>, tensor<3x8xbf16>)" in calls[0] and "output_operand_alias" not in calls[0]
    # second call: x plus the two buffers it updates in place, aliased to its results
    assert "(tensor<3x5xf32>, tensor<3x4xf32>, tensor<3x8xbf16>) -> (tensor<3x4xf32>, tensor<3x8xbf16>)" in calls[1]
    assert "output_tuple_indices = [0], operand_index = 1" in calls[1]
    assert "output_tuple_indices = [1], operand_index = 2" in calls[1]
    assert re.search(r"@gdn2_t2_[0-9a-f]{12}_d1_2\(", calls[1])


def test_pipeline_rejects_unknown_buffers_and_bad_alias():
    never = lambda: None  # noqa: E731
    with pytest.raises(ValueError, match="unknown buffers"):
        Pipeline(inputs=("x",), scratch=(), outputs=(Buf("o", (1,), "float32"),),
                 launches=(Launch("l", (1,), never, ("x", "y", "o")),), sizes=lambda s: {})
    with pytest.raises(ValueError, match="alias"):
        Pipeline(inputs=("x",), scratch=(), outputs=(Buf("o", (1,), "float32"),),
                 launches=(Launch("l", (1,), never, ("x", "o")),), sizes=lambda s: {}, aliases={"o": "z"})
    with pytest.raises(ValueError, match="dtype"):
        Buf("o", (1,), "float64")
    bad = Pipeline(inputs=("x", "y"), scratch=(), outputs=(Buf("o", (1,), "float32"),),
                   launches=(Launch("l", (1,), never, ("x", "o", "y")),), sizes=lambda s: {})
    with pytest.raises(ValueError, match="lists inputs"):
        launch_io(bad, 0)


# ------------------------------------------------------------------------------------------ argument checks
def _arrays(dtype=BF, K=64, V=64, g_dtype=jnp.float32):
    rng = np.random.default_rng(0)
    B, T, H, HV = 1, 2, 2, 4
    mk = lambda shape, dt: jnp.asarray(rng.standard_normal(shape), dt)  # noqa: E731
    return [mk((B, T, H, K), dtype), mk((B, T, H, K), dtype), mk((B, T, HV, V), dtype),
            -jnp.abs(mk((B, T, HV, K), g_dtype)), jnp.abs(mk((B, T, HV, K), dtype)), jnp.abs(mk((B, T, HV, V), dtype))]


@pytest.mark.parametrize("op", ["fused_recurrent_gdn2", "chunk_gdn2"])
def test_tilelang_rejects_unsupported_inputs_before_any_call(op):
    fn = getattr(gdn2_jax, op)
    with pytest.raises(TypeError, match=r"`q` in bfloat16 or float16"):
        fn(*_arrays(jnp.float32), backend="tilelang")
    a = _arrays()
    a[2] = a[2].astype(jnp.float16)
    with pytest.raises(TypeError, match=r"`v` in q's dtype"):
        fn(*a, backend="tilelang")
    a = _arrays(g_dtype=jnp.float16)
    with pytest.raises(TypeError, match=r"`g` in float32 or bfloat16"):
        fn(*a, backend="tilelang")
    with pytest.raises(ValueError, match=r"key head dim K in .* got K=48"):
        fn(*_arrays(K=48), backend="tilelang")
    with pytest.raises(ValueError, match=r"value head dim V in .* got V=24"):
        fn(*_arrays(V=24), backend="tilelang")


def test_unsupported_gpu_arch_is_a_clear_error():
    assert _compile.arch_for_capability(9, 0) == "sm_90a"
    with pytest.raises(_compile.UnsupportedGPUError, match=r"compute capability 8\.0.*backend='xla'"):
        _compile.arch_for_capability(8, 0)
    with pytest.raises(_compile.UnsupportedGPUError, match="sm_80"):
        _compile.target("sm_80")


def test_import_gdn2_jax_does_not_import_tilelang_or_torch():
    code = "import sys, gdn2_jax; print('tilelang' in sys.modules, 'torch' in sys.modules, 'tvm_ffi' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert out.stdout.split() == ["False", "False", "False"], out.stderr


# -------------------------------------------------------------------------------------------------- cache keys
def test_cache_key_and_target_name_depend_on_exactly_the_code():
    la = lambda **kw: _rec(**kw).launches[0]  # noqa: E731
    base = la()
    assert _compile.cache_key(base, "sm_90a") == _compile.cache_key(la(), "sm_90a")  # rebuilt: same key
    assert _compile.target_name(base, "sm_90a") == _compile.target_name(la(), "sm_90a")
    # in-place aliasing changes no kernel code: same compiled kernel and target
    assert _compile.cache_key(la(), "sm_90a") == _compile.cache_key(_rec().launches[0], "sm_90a")
    variants = [la(dtype="float16"), la(g_dtype="bfloat16"), la(use_qk_l2norm=True), la(varlen=True),
                la(output_final_state=False), la(use_initial_state=False), la(scale=0.5), la(K=128), la(HV=8)]
    keys = {_compile.cache_key(v, "sm_90a") for v in variants} | {_compile.cache_key(base, "sm_90a")}
    names = {_compile.target_name(v, "sm_90a") for v in variants} | {_compile.target_name(base, "sm_90a")}
    assert len(keys) == len(variants) + 1 and len(names) == len(variants) + 1
    assert _compile.cache_key(base, "sm_100a") != _compile.cache_key(base, "sm_90a")
    assert _compile.target_name(base, "sm_100a") != _compile.target_name(base, "sm_90a")
    assert _rec(inplace_state=True).aliases == {"ht": "h0"} and _rec().aliases == {}


def test_cache_dir_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("GDN2_JAX_CACHE_DIR", str(tmp_path / "kc"))
    p = _compile.library_path(_rec().launches[0], "sm_90a")
    assert p.parent == tmp_path / "kc" / "sm_90a" and p.suffix == ".so"
    monkeypatch.delenv("GDN2_JAX_CACHE_DIR")
    assert _compile.cache_dir() == Path.home() / ".cache" / "gdn2-jax" / "kernels"


# ------------------------------------------------------------------------------------------------ compile-only
@needs_tilelang
@pytest.mark.slow
def test_two_processes_compile_the_same_kernel_into_one_valid_library(tmp_path):
    """Both processes succeed, exactly one library and no temp files remain, and it loads (one kernel compile:
    the second process waits on the lock and reuses the first one's file)."""
    script = textwrap.dedent("""
        import sys, time
        from kernels import _compile, registry
        from kernels.recurrent_fwd import fused_recurrent_fwd_pipeline
        la = fused_recurrent_fwd_pipeline(H=1, HV=2, K=32, V=32, dtype="float16", g_dtype="float32", scale=0.2,
                                          use_initial_state=False, output_final_state=True, varlen=True,
                                          use_qk_l2norm=True).launches[0]
        print(_compile.compile_launch(la, "sm_90a"))
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GDN2_JAX_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    paths = {o[0].strip().splitlines()[-1] for o in outs}
    assert len(paths) == 1
    files = sorted(f.name for f in (tmp_path / "sm_90a").iterdir())
    assert [f for f in files if f.endswith(".so")] == [Path(next(iter(paths))).name]
    assert not [f for f in files if f.startswith(".tmp")]
    import tilelang  # noqa: F401
    import tvm_ffi

    mod = tvm_ffi.load_module(next(iter(paths)))
    assert mod["main"] is not None


def _kernels_to_build():
    out = [("recurrent-dense", _rec(K=128, V=128)),
           ("recurrent-varlen-l2-fp16-nostate", _rec(dtype="float16", g_dtype="bfloat16", use_initial_state=False,
                                                     output_final_state=False, varlen=True, use_qk_l2norm=True))]
    for varlen in (False, True):
        out.append((f"chunk-varlen{varlen}", registry.get("chunk_gdn2").pipeline(
            H=2, HV=4, K=128, V=128, dtype="bfloat16", g_dtype="float32", scale=128 ** -0.5,
            use_initial_state=True, output_final_state=True, varlen=varlen, use_qk_l2norm=varlen)))
    out.append(("chunk-precision-options", registry.get("chunk_gdn2").pipeline(  # (precision options, off by default)
        H=2, HV=4, K=128, V=128, dtype="bfloat16", g_dtype="float32", scale=128 ** -0.5, use_initial_state=True,
        output_final_state=True, varlen=True, use_qk_l2norm=False, tf32_round=True, exact_self=True,
        aqk_split=True)))
    out.append(("chunk-state-two-warpgroups", registry.get("chunk_gdn2").pipeline(  # experimental, off by default
        H=2, HV=4, K=128, V=128, dtype="bfloat16", g_dtype="float32", scale=128 ** -0.5, use_initial_state=True,
        output_final_state=True, varlen=False, use_qk_l2norm=False, block_v=128, state_threads=256)))
    out.append(("chunk-train-forward-varlen", registry.get("chunk_gdn2").pipeline(  # save_states: h, v_new
        H=2, HV=4, K=128, V=128, dtype="bfloat16", g_dtype="float32", scale=128 ** -0.5, use_initial_state=True,
        output_final_state=True, varlen=True, use_qk_l2norm=False, save_states=True)))
    from kernels.chunk_bwd import chunk_dstate_pipeline  # the reverse state-gradient pass

    out.append(("chunk-dstate-dense", chunk_dstate_pipeline(HV=4, K=128, V=128, dtype="bfloat16", use_dht=True,
                                                            varlen=False)))
    out.append(("chunk-dstate-varlen-fp16-k64", chunk_dstate_pipeline(HV=4, K=64, V=64, dtype="float16",
                                                                      use_dht=False, varlen=True, aqk_split=False)))
    out.append(("chunk-dstate-split-ds", chunk_dstate_pipeline(HV=4, K=128, V=128, dtype="bfloat16", use_dht=True,
                                                               varlen=False, split_ds=True)))  # experimental
    for varlen, kv, dt in ((False, 128, "bfloat16"), (True, 64, "float16")):  # the backward: dstate, WY, intra
        out.append((f"chunk-backward-varlen{varlen}-k{kv}", registry.get("chunk_gdn2").backward_pipeline(
            H=2, HV=4, K=kv, V=kv, dtype=dt, g_dtype="float32" if varlen else "bfloat16", scale=kv ** -0.5,
            use_initial_state=True, output_final_state=True, varlen=varlen, use_qk_l2norm=False)))
    for varlen, kv, opts in ((False, 128, dict(intra_v2=False)), (True, 64, dict(wy_load="async", wy_threads=256)),
                             (True, 64, dict(intra_tc=True)), (False, 128, dict(intra_tc=True, intra_fast_diag=True)),
                             (True, 128, dict(intra_fast_diag=True)),
                             (True, 128, dict(wy_load="tma", wy_threads=256)),
                             (False, 128, dict(wy_load="sync", wy_threads=512, wy_tf32_round=True)),
                             (True, 64, dict(wy_load="sync", wy_threads=256, wy_tf32_round="dy")),
                             (False, 128, dict(wy_tf32_round=False))):  # options
        tag = "-".join(f"{n}{v}" for n, v in opts.items())
        out.append((f"chunk-backward-{tag}-varlen{varlen}-k{kv}", registry.get("chunk_gdn2").backward_pipeline(
            H=2, HV=4, K=kv, V=kv, dtype="bfloat16", g_dtype="float32", scale=kv ** -0.5, use_initial_state=True,
            output_final_state=True, varlen=varlen, use_qk_l2norm=False, **opts)))
    return out


@needs_tilelang
@pytest.mark.slow
@pytest.mark.parametrize("name,pipe", _kernels_to_build(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_kernel_compiles_for_sm90a_on_cpu(name, pipe, monkeypatch, tmp_path_factory):
    monkeypatch.setenv("GDN2_JAX_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "kcache"))
    import tilelang  # noqa: F401
    import tvm_ffi

    for la in pipe.launches:
        path = _compile.compile_launch(la, "sm_90a")
        assert path.stat().st_size > 10_000
        blob = path.read_bytes()
        assert b"sm_90a" in blob or b"sm_90" in blob  # device code for Hopper embedded in the library
        assert tvm_ffi.load_module(str(path))["main"] is not None


@needs_tilelang
@pytest.mark.slow
def test_heads_first_keys_and_block_index():
    """The launches' grids with the value head fastest (session 32): ``intra_heads_first`` (on in
    ``kernels.defaults.FORWARD``) in launch 1's key, and ``state_heads_first`` (on by default exactly when
    ``state_threads=256``) in launch 2's, each when on only; not a bool: ValueError. The CUDA of each launch then
    indexes one grid axis, ``blockIdx.x``, as head ``i % HV`` (``& 31`` at HV = 32) of slot / sequence ``i // HV``
    (``>> 5``), and never ``blockIdx.y``; off, the head is ``blockIdx.y``. Bench configuration, H = 32.
    (Bit-identity on the GPU: ``tests/test_stages.py::test_gpu_heads_first_bit_identical``.)"""
    from kernels import defaults
    from kernels.chunk_fwd import STATE_WIDE_OPTIONS, chunk_fwd_pipeline

    kw = dict(H=32, HV=32, K=128, V=128, dtype="bfloat16", g_dtype="float32", scale=128 ** -0.5,
              use_initial_state=True, output_final_state=True, varlen=False, use_qk_l2norm=False)
    assert defaults.FORWARD["intra_heads_first"] is True
    narrow, wide = chunk_fwd_pipeline(**kw).launches, chunk_fwd_pipeline(**kw, **STATE_WIDE_OPTIONS).launches
    rows = chunk_fwd_pipeline(**kw, **STATE_WIDE_OPTIONS, intra_heads_first=False, state_heads_first=False).launches
    assert dict(narrow[0].key[2:])["heads_first"] is True and narrow[0].key == wide[0].key
    assert "heads_first" not in dict(narrow[1].key[2:]) and dict(wide[1].key[2:])["heads_first"] is True
    assert not [la for la in rows if "heads_first" in dict(la.key[2:])]
    for name in ("intra_heads_first", "state_heads_first"):
        with pytest.raises(ValueError, match=f"{name} must be a bool, got 1$"):
            chunk_fwd_pipeline(**kw, **{name: 1})
    for la, first in ((wide[0], True), (wide[1], True), (narrow[1], False), (rows[0], False), (rows[1], False)):
        src = _cuda_source(la)
        assert ("blockIdx.y" in src) != first, la.name
    # which part is the head: launch 1's chunk slot and batch row come from i >> 5 (locate_chunk's division by
    # NT), its head from i & 31; launch 2's TMA loads take (..., head i & 31, [chunk j of GAM,] sequence i >> 5)
    intra = _cuda_source(wide[0])
    assert re.search(r"rdiv = \(\(\(\(int\)blockIdx\.x\) >> 5\) / NT\)", intra)
    assert re.search(r"blockIdx\.x\)+ & \(int64_t\)31\)", intra)
    loads = [x for x in _cuda_source(wide[1]).splitlines() if "tl::tma_load(" in x]
    assert len(loads) >= 7 and all(
        re.search(r"\(\(\(int\)blockIdx\.x\) & 31\), (j, )?\(\(\(int\)blockIdx\.x\) >> 5\)\);$", x) for x in loads)


@needs_tilelang
@pytest.mark.slow
@pytest.mark.parametrize("opts", [{}, {"block_v": 128, "state_threads": 256}, {"save_states": True}])
def test_state_async_key_and_release_order(opts):
    """``state_async`` (the default since session 30, ``kernels.defaults.FORWARD``) names itself in the state
    launch's key when on only (a value that is not a bool: ValueError), and compiles to the order it relies on: in
    the consumer's chunk loop, the products are issued by ``wgmma`` without a wait after each (two waits per chunk,
    ``wait_wgmma<1>`` then ``wait_wgmma<0>``), and the pipeline slot of every tile a product reads (Y, QG, Aqk, KG,
    mapped from the producer's ``mbarrier`` wait before its TMA load) is released (``mbarrier[...].arrive()``) only
    after a wait that follows that product's issue. Off: one ``warpgroup_wait<0>`` after each product. Bench
    configuration, H = 32; with two warpgroups; with ``save_states``. (Bit-identity and three reruns on a long
    sequence: ``tests/test_stages.py::test_gpu_state_async_bit_identical``.)"""
    from kernels import defaults
    from kernels.chunk_fwd import chunk_fwd_pipeline

    kw = dict(H=32, HV=32, K=128, V=128, dtype="bfloat16", g_dtype="float32", scale=128 ** -0.5,
              use_initial_state=True, output_final_state=True, varlen=False, use_qk_l2norm=False, **opts)
    assert defaults.FORWARD["state_async"] is True
    on = chunk_fwd_pipeline(**kw).launches[1]
    off = chunk_fwd_pipeline(**kw, state_async=False).launches[1]
    assert dict(on.key[2:])["async_mma"] is True and "async_mma" not in dict(off.key[2:])
    with pytest.raises(ValueError, match="state_async must be a bool, got 1$"):
        chunk_fwd_pipeline(**kw, state_async=1)

    src = _cuda_source(on).splitlines()
    loops = [i for i, x in enumerate(src) if re.match(r"\s*for \(int j(_1)? = 0; j(_1)? < ", x)]
    assert len(loops) == 2, loops  # (the producer's loop over chunks, then the consumer's)
    producer, consumer = src[loops[0]:loops[1]], src[loops[1]:]
    slot = {}  # release barrier offset -> the shared tile its TMA load refills
    for i, x in enumerate(producer):
        m = re.match(r"\s*mbarrier\[\(\(j & 1\) \+ (\d+)\)\]\.wait\(", x)
        if m:
            load = next(y for y in producer[i + 1:] if "tl::tma_load(" in y)
            slot[m.group(1)] = re.search(r"\(\(\w+\*\)(\w+)\)\[", load).group(1)
    assert {"Ys", "Qs", "As", "Ks"} <= set(slot.values()), slot
    assert not [x for x in consumer if "warpgroup_wait" in x]
    waits = [i for i, x in enumerate(consumer) if "tl::wait_wgmma<" in x]
    assert [consumer[i].strip() for i in waits] == ["tl::wait_wgmma<1>();", "tl::wait_wgmma<0>();"]
    for buf in ("Ys", "Qs", "As", "Ks"):
        reads = [i for i, x in enumerate(consumer) if "initialize_wgmma_descriptor" in x
                 and "(bfloat16_t*)%s)" % buf in x]
        (off_,) = [k for k, v in slot.items() if v == buf]
        release = r"\s*mbarrier\[\(\(j_1 & 1\) \+ %s\)\]\.arrive\(\);" % off_
        rel = [i for i, x in enumerate(consumer) if re.match(release, x)]
        assert len(reads) == 1 and len(rel) == 1, (buf, reads, rel)
        assert any(reads[0] < w < rel[0] for w in waits), (buf, reads, rel, waits)
    off_src = _cuda_source(off).splitlines()
    assert not [x for x in off_src if "wait_wgmma" in x]
    assert sum("warpgroup_wait<0>" in x for x in off_src) == sum("warpgroup_commit_batch" in x for x in off_src) > 0

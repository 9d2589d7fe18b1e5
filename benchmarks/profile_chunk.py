"""Run the chunk prefill pipeline (torch path) on one grid shape, for ``ncu`` (Nsight Compute) to profile; or time
its launches over the benchmark grid; or compare kernel variants' accuracy; or time the training step.

    ncu --clock-control none --kernel-name main_kernel --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight --section Occupancy ... python -m benchmarks.profile_chunk --B 4 --T 4096 --H 32
    python -m benchmarks.profile_chunk --time [--variants default,exact_diag,bv64]
    python -m benchmarks.profile_chunk --accuracy [--variants default,exact_diag,exact_self]
    python -m benchmarks.profile_chunk --train

Profiling: two warm-up calls, then two profiled launches: the intra-chunk kernel and the state/output kernel
(TileLang names every kernel ``main_kernel``). ``--time``: do_bench medians (ms) of each launch of each kernel
variant on the prefill grid, and FLA 0.6.0's ``chunk_gdn2`` in the same process; one JSON line per shape
(``PROFILE {...}``). Variants (:data:`VARIANTS`; all but ``v5`` and ``v5w`` keep Aqk's bf16 residual, the default since
session 5): ``default``; ``exact_diag`` (every diagonal block of the intra kernel summed exactly in fp32, the pre-v5
arithmetic); ``bv64`` (state kernel with V-blocks of 64); ``exact_self`` (the diagonal of Aqk in fp32);
``tf32_round`` (TF32 operands rounded to nearest); ``precise`` (those two together); ``v5`` (Aqk as plain bf16);
``no_prefetch``, ``noftz``, ``neumann``, ``unfused``, ``gemm_tiles``, ``frag_stores``, ``whole_wait`` (the intra
launch without its cp.async prefetch, without ``-ftz``, with the Neumann-series solve, without the fused slice pass,
with the anchored products by ``T.gemm``, with Y / U stored from the accumulators, with a slice's four tiles waited
for at once: each a former default); ``unrolled`` (the slice loop unrolled, experimental); ``bv16`` (state kernel
with V-blocks of 16); ``bv128w`` (two warpgroups, V-blocks of 128); ``v5w`` (``v5`` with ``bv128w``'s state pass);
``bv32`` (V-blocks of 32), ``s3`` (the state pass's software pipeline three stages deep), ``bv16s3``, ``bv32s3``;
``sync``, ``sync128w`` (the state pass's products issued one at a time, each waited for: before ``state_async``);
``rows``, ``bv128w_rows`` (``default`` and ``bv128w`` with the launches' grids of chunk slots x heads, before
``intra_heads_first`` / ``state_heads_first``). ``--time`` also times each variant's launches back to back
(``VARIANT:total``).
``--accuracy``: o and final-state RMS ratios vs fp64 per variant and FLA (``ACCURACY {...}``); ``--train``: see
:func:`train_grid` (``TRAIN {...}``). Inputs follow spec §15 (bf16, fp32 g, D = 128). Needs a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

VARIANTS = {"default": {}, "exact_diag": {"exact_diag": True}, "bv64": {"block_v": 64},
            "exact_self": {"exact_self": True}, "tf32_round": {"tf32_round": True}, "v5": {"aqk_split": False},
            "precise": {"tf32_round": True, "exact_self": True},
            "no_prefetch": {"intra_prefetch": False},  # (prefetch: the default, kernels.defaults.FORWARD)
            "noftz": {"intra_ftz": False},  # (-ftz=true: the default since session 21)
            "neumann": {"blocked_solve": False},  # (the blocked solve: the default since session 22)
            "bv16": {"block_v": 16},  # (the state pass with twice the blocks of the default's at HV = 32)
            "unfused": {"fused_slice": False},  # (the slice loop in one pass per row: the default since session 23)
            "gemm_tiles": {"warp_tiles": False},  # (the anchored products as per-warp tiles: the default, session 23)
            "frag_stores": {"smem_epilogue": False},  # (Y / U through shared memory: the default, session 24)
            "unrolled": {"intra_unroll": True},  # (experimental: the slice loop unrolled, session 24)
            "whole_wait": {"g_first": False},  # (g / b waited for before q / k: the default, session 26)
            "bv128w": {"block_v": 128, "state_threads": 256},  # (the state pass, 2 warpgroups: inference calls, session 25)
            "v5w": {"aqk_split": False, "block_v": 128, "state_threads": 256},  # (v5 on bv128w's state pass)
            # the state pass's V-block and pipeline depth on its own (session 30: the H200's choice per shape)
            "bv32": {"block_v": 32}, "s3": {"stages": 3}, "bv16s3": {"block_v": 16, "stages": 3},
            "bv32s3": {"block_v": 32, "stages": 3},
            # the state pass's products issued synchronously (before session 30's state_async)
            "sync": {"state_async": False}, "sync128w": {"block_v": 128, "state_threads": 256, "state_async": False},
            # the grids of chunk slots x heads (before session 32's intra_heads_first / state_heads_first)
            "rows": {"intra_heads_first": False},
            "bv128w_rows": {"block_v": 128, "state_threads": 256, "intra_heads_first": False,
                            "state_heads_first": False}}


def accuracy(variants, seeds=(123, 1, 2, 3, 4, 5), shape=(1, 512, 4)):
    """RMS ratio vs the fp64 token loop of o and the final state for each kernel variant and FLA, on the
    benchmark's accuracy inputs (spec §15 accuracy distribution, g ~ U(-5, -0.1); seed 123 is bench.py's)."""
    from benchmarks import bench_lib as L
    from kernels import torch_api

    B, T, H = shape
    for seed in seeds:
        x = L.torch_inputs(B, T, H, H, seed=seed, g_scale=1.0)
        a = [x[n] for n in L.ARGS]
        ref_o, ref_s = L.oracle_np(*(L.tnp(t) for t in a), L.tnp(x["h0"]), L.D ** -0.5)
        row = {"seed": seed, "B": B, "T": T, "H": H}
        for name in variants:
            r = torch_api.run_pipeline(L.chunk_pipeline(H, H, **VARIANTS[name]), x)
            row[f"{name}:o"], row[f"{name}:ht"] = L.rms(L.tnp(r["o"]), ref_o), L.rms(L.tnp(r["ht"]), ref_s)
        try:
            from fla.ops.gdn2 import chunk_gdn2 as fla_chunk

            o, s = fla_chunk(*a, initial_state=x["h0"], output_final_state=True)
            row["fla:o"], row["fla:ht"] = L.rms(L.tnp(o), ref_o), L.rms(L.tnp(s), ref_s)
        except Exception as e:  # pragma: no cover
            row["fla_error"] = repr(e)[:200]
        print("ACCURACY " + json.dumps(row), flush=True)


@contextlib.contextmanager
def _switches(kernel_backward=None, factored=None, levels=None, options=None, forward=None, precision=None):
    """Set the training path's module switches for the block (None keeps one), then restore them; the memoised
    op functions are dropped on entry and exit so that the next trace sees the switches as set:
    ``gdn2_jax._tilelang.KERNEL_BACKWARD`` / ``KERNEL_BACKWARD_OPTIONS``,
    ``gdn2_jax.xla.chunk._FACTORED_INTRA`` / ``_FACTORED_LEVELS`` and ``forward``, entries of
    ``kernels.defaults.FORWARD`` (the forward pipelines of the inference and training paths; the memoised
    pipelines of ``kernels.registry`` are dropped too). ``precision``: ``jax.default_matmul_precision`` for the
    block (``"highest"``: the jnp stages' fp32 products in full fp32 instead of the GPU's TF32 default)."""
    import jax

    from gdn2_jax import _tilelang
    from gdn2_jax.xla import chunk as xla_chunk
    from kernels import defaults, registry

    targets = [(_tilelang, "KERNEL_BACKWARD", kernel_backward), (_tilelang, "KERNEL_BACKWARD_OPTIONS", options),
               (xla_chunk, "_FACTORED_INTRA", factored), (xla_chunk, "_FACTORED_LEVELS", levels)]
    saved = [(m, n, getattr(m, n)) for m, n, _ in targets]
    fwd_saved = dict(defaults.FORWARD)
    try:
        for m, n, val in targets:
            if val is not None:
                setattr(m, n, val)
        defaults.FORWARD.update(forward or {})
        _tilelang._make_op.cache_clear()
        registry._pipeline.cache_clear()
        with jax.default_matmul_precision(precision) if precision else contextlib.nullcontext():
            yield
    finally:
        for m, n, val in saved:
            setattr(m, n, val)
        defaults.FORWARD.clear()
        defaults.FORWARD.update(fwd_saved)
        _tilelang._make_op.cache_clear()
        registry._pipeline.cache_clear()


#: the defaults of sessions 10-15 (the benchmark of record up to session 15), for when session 16's options become
#: the defaults
_S15 = dict(forward=dict(z_split=False), backward=dict(qg_split=False, split_dr=True))

GRAD_VARIANTS = {  # name -> _switches of the backward
    "xla": dict(kernel_backward=False), "kernel": dict(kernel_backward=True, options={}),
    "kernel_jnp": dict(kernel_backward=True, options={"local_bwd": False}),
    "kernel_v1": dict(kernel_backward=True, options={"intra_v2": False}),
    "intra_tc": dict(kernel_backward=True, options={"intra_tc": True}),
    "fast_diag": dict(kernel_backward=True, options={"intra_fast_diag": True}),
    "split_ds": dict(kernel_backward=True, options={"split_ds": True}),
    "no_split_ds": dict(kernel_backward=True, options={"split_ds": False, "split_dr": False}),
    "wy_round": dict(kernel_backward=True, options={"wy_load": "sync", "wy_tf32_round": True}),
    # (session 18) the operands behind db rounded to nearest (the WY launch, the training forward's h, dR)
    "wy_dy": dict(kernel_backward=True, options={"wy_tf32_round": "dy"}),
    # (session 19) only db's own chain rounded: S0, dR, A (by their producers) and dY
    "wy_dymin": dict(kernel_backward=True, options={"wy_tf32_round": "dy_min"}),
    "wy_trunc": dict(kernel_backward=True, options={"wy_tf32_round": False}),  # (sessions 10-18: truncation)
    "no_cast": dict(kernel_backward=True, options={"cast_grads": False}),
    "no_split_dr": dict(kernel_backward=True, options={"split_dr": False}),
    "qg_split": dict(kernel_backward=True, options={"qg_split": True, "split_dr": False}),
    "z_split": dict(kernel_backward=True, forward={"z_split": True}),
    "candidate": dict(kernel_backward=True, options={"qg_split": True, "split_dr": False},
                      forward={"z_split": True}),  # (session 16's options, tests/test_gradient_audit_gpu.py)
    "s15": dict(kernel_backward=True, options=dict(_S15["backward"]), forward=dict(_S15["forward"])),
    # where db's error comes from (session 17): the WY and intra partials in jnp with fp32 products, and the
    # whole xla VJP with fp32 products (the forward kernels' saved states as in ``kernel``)
    "kernel_jnp_hi": dict(kernel_backward=True, options={"local_bwd": False}, precision="highest"),
    "xla_hi": dict(kernel_backward=False, precision="highest")}

# training-forward variants timed by --train-launches beside the default (kernels.defaults.FORWARD: prefetch on)
FWD_LAUNCH_VARIANTS = {"nopre:": dict(intra_prefetch=False), "z:": dict(z_split=True), "qg:": dict(qg_split=True),
                       "zqg:": dict(z_split=True, qg_split=True), "s15:": dict(z_split=False, qg_split=False),
                       "tf32:": dict(tf32_states=True),  # (h and Akk stored rounded: wy_tf32_round "dy" / "dy_min")
                       "neumann:": dict(blocked_solve=False)}  # (the solve before session 22)
# the backward variants that ``--train-launches`` times beside the default (tag -> chunk_bwd_pipeline options)
BWD_LAUNCH_VARIANTS = {"v1": dict(intra_v2=False), "tc": dict(intra_tc=True), "fd": dict(intra_fast_diag=True),
                       "tcfd": dict(intra_tc=True, intra_fast_diag=True),
                       "sync256": dict(wy_load="sync", wy_threads=256), "async": dict(wy_load="async", wy_threads=256),
                       "tma": dict(wy_load="tma", wy_threads=256),
                       "sync512": dict(wy_load="sync", wy_threads=512),
                       "async512": dict(wy_load="async", wy_threads=512),
                       "nosplit": dict(split_ds=False, split_dr=False),
                       "nocast": dict(cast_grads=False), "nosplitdr": dict(split_dr=False),
                       "qg": dict(qg_split=True, split_dr=False), "s15": dict(qg_split=False, split_dr=True),
                       "wydy": dict(wy_tf32_round="dy"), "wydymin": dict(wy_tf32_round="dy_min"),
                       "wytrunc": dict(wy_tf32_round=False)}


def grad_accuracy(variants, seeds=(77, 1, 2), shape=(1, 256, 2)):
    """RMS ratio vs the fp64 reverse pass of the seven gradients per :data:`GRAD_VARIANTS` entry and FLA, on the
    benchmark's gradient case (seed 77 is bench.py's ``_acc_train``); one ``GRADACC {...}`` line per seed."""
    from benchmarks import bench_lib as L

    B, T, H = shape
    D = L.D
    names = L.ARGS + ("h0",)
    for seed in seeds:
        x = L.torch_inputs(B, T, H, H, seed=seed, g_scale=1.0)
        do = L.randn((B, T, H, D), seed + 1)
        dht = L.randn((B, H, D, D), seed + 2)
        ref = L.oracle_grads_fp64({n: L.tnp(x[n]) for n in names}, L.tnp(do), L.tnp(dht), D ** -0.5)
        row = {"seed": seed}
        for name in variants:
            try:
                with _switches(**GRAD_VARIANTS[name]):
                    grads = L.jax_grad_with_state_fn()(*[L.to_jax(x[n]) for n in names], L.to_jax(do),
                                                       L.to_jax(dht))
                for n, gr in zip(names, grads):
                    row[f"{name}:d{n}"] = L.rms(L.tnp(gr), ref[f"d{n}"])
            except Exception as e:  # pragma: no cover
                row[f"{name}:error"] = repr(e)[:300]
        try:
            for n, gr in L.fla_grads(x, do, dht).items():
                row[f"fla:{n}"] = L.rms(L.tnp(gr), ref[n])
        except Exception as e:  # pragma: no cover
            row["fla_error"] = repr(e)[:200]
        print("GRADACC " + json.dumps(row), flush=True)


def time_grid(variants, shapes=None):
    import torch
    from triton.testing import do_bench

    from benchmarks import bench_lib
    from benchmarks.bench import PREFILL_GRID

    rows = []
    for B, T, H in shapes or PREFILL_GRID:
        x = bench_lib.torch_inputs(B, T, H, H, seed=0)
        row = {"B": B, "T": T, "H": H}
        for name in variants:
            try:  # (a variant that fails to build or launch on this shape is reported, and the others still run)
                calls = bench_lib.stage_callables(bench_lib.chunk_pipeline(H, H, **VARIANTS[name]), x)
                for la, fn in calls:
                    row[f"{name}:{la}"] = do_bench(fn, warmup=10, rep=60, return_mode="median")
                row[f"{name}:total"] = do_bench(lambda: [fn() for _, fn in calls], warmup=10, rep=60,
                                                return_mode="median")
                del calls
            except Exception as e:
                row[f"{name}:error"] = repr(e)[:200]
            torch.cuda.empty_cache()
        try:
            from fla.ops.gdn2 import chunk_gdn2 as fla_chunk

            a = [x[n] for n in bench_lib.ARGS]
            with torch.inference_mode():
                row["fla_total"] = do_bench(lambda: fla_chunk(*a, initial_state=x["h0"], output_final_state=True),
                                            warmup=10, rep=60, return_mode="median")
        except Exception as e:  # pragma: no cover
            row["fla_error"] = repr(e)[:200]
        print("PROFILE " + json.dumps(row), flush=True)
        rows.append(row)
    return rows


TRAIN_VARIANTS = {  # name -> _switches of the training step
    "dense": dict(kernel_backward=False, factored=False, levels=1),
    "factored": dict(kernel_backward=False, factored=True, levels=1),
    "kernel": dict(kernel_backward=True, factored=True, levels=1),
    "kernel_jnp": dict(kernel_backward=True, factored=True, levels=1, options={"local_bwd": False}),
    "kernel_l2": dict(kernel_backward=True, factored=True, levels=2, options={"local_bwd": False}),
    "kernel_nocast": dict(kernel_backward=True, factored=True, levels=1, options={"cast_grads": False}),
    # session 15's kernels named explicitly, qg_split alone and session 16's candidate (GRAD_VARIANTS')
    "s15": dict(kernel_backward=True, factored=True, levels=1, options=dict(_S15["backward"]),
                forward=dict(_S15["forward"])),
    "qg": dict(kernel_backward=True, factored=True, levels=1, options={"qg_split": True, "split_dr": False},
               forward={"z_split": False}),
    "candidate": dict(kernel_backward=True, factored=True, levels=1, options={"qg_split": True, "split_dr": False},
                      forward={"z_split": True}),
    "wy_dy": dict(kernel_backward=True, factored=True, levels=1, options={"wy_tf32_round": "dy"}),
    "wy_dymin": dict(kernel_backward=True, factored=True, levels=1, options={"wy_tf32_round": "dy_min"}),
    "wy_trunc": dict(kernel_backward=True, factored=True, levels=1, options={"wy_tf32_round": False})}


def _kernel_totals(fn, top=16):
    """Device time of one call of ``fn`` per kernel name (CUPTI via torch.profiler, JAX's kernels included):
    ``{"total_us", "kernels", "top": [[name, us, count], ...]}`` (the ``top`` largest)."""
    import collections
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:  # (the chrome trace, as decode_paths.trace reads it)
        prof.export_chrome_trace(f.name)
        ev = json.load(open(f.name))["traceEvents"]
    tot, cnt = collections.Counter(), collections.Counter()
    for e in ev:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            tot[e["name"]] += e["dur"]
            cnt[e["name"]] += 1
    return {"total_us": round(sum(tot.values()), 1), "kernels": sum(cnt.values()),
            "top": [[n[:80], round(t, 1), cnt[n]] for n, t in tot.most_common(top)]}


def train_grid(variants=("dense", "factored", "kernel"), shapes=None, trace=False):
    """The benchmark's training step (``bench_lib.jax_train_fn``, the tilelang forward) per variant of
    :data:`TRAIN_VARIANTS`: the xla VJP recomputing the forward with the intra stage's pairwise decays dense or
    sub-chunk factored (``gdn2_jax.xla.chunk._FACTORED_INTRA``, ``_FACTORED_LEVELS``), or the backward kernels
    (``gdn2_jax._tilelang.KERNEL_BACKWARD``), on the grid: host-loop ms and XLA's compiled memory per variant,
    FLA's forward + backward (do_bench) in the same process; one ``TRAIN {...}`` JSON line per shape. ``trace``:
    also each variant's device time per kernel name (:func:`_kernel_totals`)."""
    import torch

    from benchmarks import bench_lib as L
    from benchmarks.bench import PREFILL_GRID

    for B, T, H in shapes or PREFILL_GRID:
        x = L.torch_inputs(B, T, H, H, seed=0, h0=False)
        do = L.randn((B, T, H, L.D), 1)
        jx = [L.to_jax(x[n]) for n in L.ARGS] + [L.to_jax(do)]
        row = {"B": B, "T": T, "H": H}
        for name in variants:
            try:
                with _switches(**TRAIN_VARIANTS[name]):
                    f = L.jax_train_fn()  # a fresh jit: traced (on first call, inside the block) with the switches
                    row[f"{name}:peak_MiB"] = L.jax_compiled_memory(f, *jx)["total_MiB"]
                    row[f"{name}:ms"] = L.host_ms(lambda: f(*jx), L.jax_sync, target_s=0.1)[0]
                    if trace:
                        row[f"{name}:top"] = _kernel_totals(lambda: L.jax_sync(f(*jx)))
            except Exception as e:  # pragma: no cover
                row[f"{name}:error"] = repr(e)[:200]
        try:
            from fla.ops.gdn2 import chunk_gdn2 as fla_chunk
            from triton.testing import do_bench

            leaves = [x[n].detach().clone().requires_grad_(True) for n in L.ARGS]

            def step():
                o, _ = fla_chunk(*leaves)
                (o.float() * do).sum().backward()

            row["fla_ms"] = do_bench(step, warmup=10, rep=60, grad_to_none=leaves, return_mode="median")
        except Exception as e:  # pragma: no cover
            row["fla_error"] = repr(e)[:200]
        print("TRAIN " + json.dumps(row), flush=True)
        del jx, x
        torch.cuda.empty_cache()


def time_train_launches(shapes, once=0):
    """do_bench medians (ms) of each launch of the training forward (``save_states``) and of the backward kernels
    (``kernels/chunk_bwd.py``) on torch tensors, h0 and ht on (the benchmark's training case); one
    ``TLAUNCH {...}`` JSON line per shape. ``once`` > 0: no timing, both pipelines run that many times (ncu)."""
    import torch
    from triton.testing import do_bench

    from benchmarks import bench_lib
    from kernels import registry, torch_api
    from kernels.chunk_bwd import training_forward_options

    op = registry.get("chunk_gdn2")
    for B, T, H in shapes:
        x = bench_lib.torch_inputs(B, T, H, H, seed=0)
        cfg = registry.config(H=H, HV=H, K=bench_lib.D, V=bench_lib.D, dtype="bfloat16", g_dtype="float32",
                              scale=bench_lib.D ** -0.5, use_initial_state=True, output_final_state=True,
                              varlen=False, use_qk_l2norm=False)
        row = {"B": B, "T": T, "H": H}
        fwd = op.pipeline(**cfg, save_states=True)
        pick = os.environ.get("TLAUNCH_VARIANTS")  # (a comma list of tags: only those variants, both tables)
        pick = None if pick is None else {t.strip().rstrip(":") for t in pick.split(",")}
        fwd_variants = {t: o for t, o in FWD_LAUNCH_VARIANTS.items() if pick is None or t.rstrip(":") in pick}
        bwds = {"": op.backward_pipeline(**cfg), **{f"{tag}:": op.backward_pipeline(**cfg, **o)
                                                     for tag, o in BWD_LAUNCH_VARIANTS.items()
                                                     if pick is None or tag in pick}}
        tag = os.environ.get("BWD_VARIANT", "").rstrip(":") if once else ""  # (ncu: BWD_VARIANT=tma: etc.)
        bwd = op.backward_pipeline(**cfg, **BWD_LAUNCH_VARIANTS[tag]) if tag else bwds[""]  # (whatever the filter)
        if once:
            fwd = op.pipeline(**cfg, save_states=True, **training_forward_options(bwd))
            for _ in range(once):
                res = torch_api.run_pipeline(fwd, x, return_scratch=True)
                ins = {n: (res[n] if n in res else x[n]) for n in bwd.inputs if n not in ("do", "dht")}
                ins.update(do=torch.ones_like(res["o"]), dht=torch.ones_like(res["ht"]))
                torch_api.run_pipeline(bwd, ins)
            torch.cuda.synchronize()
            return
        for la, fn in bench_lib.stage_callables(fwd, x):
            row[f"fwd:{la}"] = do_bench(fn, warmup=10, rep=60, return_mode="median")
        for tag, o in fwd_variants.items():  # (not in the total)
            for la, fn in bench_lib.stage_callables(op.pipeline(**cfg, save_states=True, **o), x):
                row[f"{tag}fwd:{la}"] = do_bench(fn, warmup=10, rep=60, return_mode="median")
        # (the backward inputs from a forward that also stores QGL, for the variants that read it; its other
        # buffers are bit-identical to the default's, tests/test_stages.py)
        res = torch_api.run_pipeline(op.pipeline(**cfg, save_states=True, qg_split=True), x, return_scratch=True)
        ins = {n: (res[n] if n in res else x[n]) for n in set().union(*(p.inputs for p in bwds.values()))
               if n not in ("do", "dht")}
        ins["do"] = torch.randn_like(res["o"])
        ins["dht"] = torch.randn_like(res["ht"])
        for tag, pipe in bwds.items():  # the default backward, then experimental variants (``tag`` prefixed)
            for la, fn in bench_lib.stage_callables(pipe, ins):
                row[f"{tag}bwd:{la}"] = do_bench(fn, warmup=10, rep=60, return_mode="median")
        row["total"] = sum(v for n, v in row.items() if n.startswith(("fwd:", "bwd:")))
        print("TLAUNCH " + json.dumps(row), flush=True)
        del res, ins
        torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--variants", default=None,
                    help="comma-separated VARIANTS keys (default: --time default,exact_diag,bv64; "
                         "--accuracy default,exact_diag,exact_self; --train dense,factored,kernel)")
    ap.add_argument("--accuracy", action="store_true")
    ap.add_argument("--grad-accuracy", action="store_true", help="gradient RMS vs fp64 per backward variant")
    ap.add_argument("--seeds", default=None, help="--grad-accuracy: comma-separated seeds (default 77,1,2)")
    ap.add_argument("--shapes", default=None,
                    help="--train, --time: B,T,H[;B,T,H...] instead of the benchmark grid")
    ap.add_argument("--trace", action="store_true", help="--train: device time per kernel name too")
    ap.add_argument("--train", action="store_true", help="training step: xla VJP (dense / factored intra decays) vs backward kernels")
    ap.add_argument("--train-launches", action="store_true", help="each training-forward and backward launch, timed")
    ap.add_argument("--bwd-once", action="store_true", help="run the training launches twice, untimed (for ncu)")
    a = ap.parse_args(argv)
    if a.train_launches:
        time_train_launches([tuple(int(n) for n in t.split(",")) for t in (a.shapes or "4,4096,32").split(";")])
        return
    if a.bwd_once:  # for ncu: twice the training forward's 2 launches and the backward's 3 (launches 5-9: warm)
        time_train_launches([(a.B, a.T, a.H)], once=2)
        return
    if a.grad_accuracy:
        seeds = tuple(int(n) for n in a.seeds.split(",")) if a.seeds else (77, 1, 2)
        grad_accuracy(tuple((a.variants or "xla,kernel,no_split_ds").split(",")), seeds=seeds)
        return
    if a.train:
        shapes = None if not a.shapes else [tuple(int(n) for n in t.split(",")) for t in a.shapes.split(";")]
        train_grid(tuple((a.variants or "dense,factored,kernel").split(",")), shapes, a.trace)
        return
    if a.accuracy:
        accuracy((a.variants or "default,exact_diag,exact_self").split(","))
        return
    if a.time:
        shapes = None if not a.shapes else [tuple(int(n) for n in t.split(",")) for t in a.shapes.split(";")]
        time_grid((a.variants or "default,exact_diag,bv64").split(","), shapes)
        return
    import torch

    from benchmarks import bench_lib
    from kernels import torch_api

    x = bench_lib.torch_inputs(a.B, a.T, a.H, a.H, seed=0)
    q, k, v, gg, b, w, h0 = (x[n] for n in ("q", "k", "v", "g", "b", "w", "h0"))
    variant = os.environ.get("PROFILE_VARIANT")  # (ncu of a VARIANTS entry instead of the public op's kernels)
    pipe = bench_lib.chunk_pipeline(a.H, a.H, **VARIANTS[variant]) if variant else None
    for _ in range(a.calls):
        if pipe is None:
            o, ht = torch_api.chunk_gdn2(q, k, v, gg, b, w, initial_state=h0, output_final_state=True)
        else:
            o = torch_api.run_pipeline(pipe, x)["o"]
    torch.cuda.synchronize()
    print("ok", tuple(o.shape), float(o.float().abs().mean()))


if __name__ == "__main__":
    main()

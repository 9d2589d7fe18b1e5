"""Ahead-of-time compile of the GDN-2 TileLang kernels into the on-disk cache (no GPU needed).

    python -m kernels.build [--arch sm_90a] [--preset serving|tests|bench|layers|sweep|profile|bwdexp|all] [--op NAME[,NAME]] [-j N]
    python -m kernels.build --H 16 --HV 16 --K 128 --V 128 --dtype bfloat16 [--g-dtype float32] \
        [--initial-state] [--final-state] [--varlen] [--l2norm] [--scale S]

Kernels land in ``$GDN2_JAX_CACHE_DIR`` (default ``~/.cache/gdn2-jax/kernels``) keyed by everything that
changes their code (see ``kernels/_compile.py``); a later run with the same configuration loads them instead of
compiling. ``--arch`` defaults to the local GPU's (sm_90a on a GPU-less host). Several processes may build into
the same cache at once (file lock + atomic rename). Dynamic sizes (B, T, N) are not part of a kernel's key: one
build serves every batch size and sequence length.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import inspect
import itertools
import os
import sys
import time

from . import registry
from .chunk_fwd import STATE_CHOICE_OPTIONS, STATE_WIDE_OPTIONS


def cfg(H, HV, K, V=None, dtype="bfloat16", g_dtype="float32", scale=None, h0=True, ht=True, varlen=False,
        l2=False):
    V = K if V is None else V
    return registry.config(H=H, HV=HV, K=K, V=V, dtype=dtype, g_dtype=g_dtype,
                           scale=K ** -0.5 if scale is None else scale, use_initial_state=h0, output_final_state=ht,
                           varlen=varlen, use_qk_l2norm=l2)


def _backward_options() -> frozenset:
    """Options of the backward pipeline alone: ``chunk_bwd_pipeline``'s keyword arguments that neither
    ``registry.config`` nor the forward's ``chunk_fwd_pipeline`` takes (a configuration carrying only such extras
    builds that backward's launches only)."""
    from .chunk_bwd import chunk_bwd_pipeline
    from .chunk_fwd import chunk_fwd_pipeline

    def names(f):
        return {n for n, p in inspect.signature(f).parameters.items() if p.kind is p.KEYWORD_ONLY}

    return frozenset(names(chunk_bwd_pipeline) - names(chunk_fwd_pipeline) - set(cfg(1, 1, 64)) - {"local_bwd"})


BACKWARD_OPTIONS = _backward_options()
#: forward options that also select training kernels: a configuration carrying only these (and backward options)
#: builds its forward, its training forward and its backward (``chunk_fwd_pipeline``'s ``z_split``, ``qg_split``)
TRAINING_OPTIONS = frozenset({"z_split", "qg_split"})


#: the configurations of ``tests/test_stages.py``'s ``_PREFETCH_CASES`` (varlen, H, HV, K, V, l2, dtype, g dtype,
#: save_states): its prefetch and ``intra_ftz`` tests
_PREFETCH_CFGS = ((False, 2, 4, 128, 128, False, "bfloat16", "float32", False),
                  (True, 2, 4, 64, 128, True, "bfloat16", "float32", True),
                  (False, 1, 1, 128, 64, False, "float16", "bfloat16", False),
                  (False, 2, 2, 64, 64, True, "bfloat16", "bfloat16", True),
                  (True, 1, 2, 128, 128, False, "float16", "float32", False))
#: forward options whose launch-1 code differs with ``warp_tiles`` (TF32 operand rounding with the fp32 self terms,
#: every diagonal block exact, the Neumann-series solve and its unpadded Aqk tile): ``tests/test_stages.py``'s
#: ``test_gpu_intra_warp_tiles_bit_identical_with_precision_options`` on its first prefetch case (H 2, HV 4, K 128)
WARP_TILE_OPTIONS = (dict(tf32_round=True, exact_self=True), dict(exact_diag=True), dict(blocked_solve=False))
#: launch-1 variants whose Y / U epilogue code differs from the default's (no prefetch: U's residual from ZsL; the
#: Neumann-series solve; 128 threads, one warpgroup): ``tests/test_stages.py``'s
#: ``test_gpu_intra_smem_epilogue_bit_identical_other_launches`` on its first prefetch case (H 2, HV 4, K 128)
SMEM_EPILOGUE_OPTIONS = (dict(intra_prefetch=False), dict(blocked_solve=False), dict(intra_threads=128))
#: cases of ``tests/test_stages.py``'s ``test_gpu_state_block_v64_bit_identical`` and
#: ``test_gpu_state_two_warpgroups_bit_identical`` (``_bv_case``): (varlen, H, HV, K, V, l2, dtype, g dtype)
_BV_CASES = ((False, 2, 4, 128, 128, False, "bfloat16", "float32"), (True, 2, 4, 64, 128, True, "bfloat16", "float32"),
             (False, 2, 2, 128, 128, False, "float16", "bfloat16"), (False, 1, 2, 64, 64, False, "bfloat16", "float32"))
#: ``tests/test_stages.py::test_gpu_heads_first_bit_identical``'s cases: ``_BV_CASES`` and HV = 3 (no power of two)
_HEADS_FIRST_CASES = _BV_CASES + ((False, 1, 3, 64, 64, False, "bfloat16", "float32"),)


def preset(name: str) -> list[dict]:
    """Configurations of a preset (``tests`` mirrors the GPU tests, ``bench`` benchmarks/bench.py)."""
    serving = [cfg(h, h, 128, dtype=dt, l2=l2) for h in (16, 32) for dt in ("bfloat16", "float16")
               for l2 in (False, True)]
    bench = [cfg(32, 32, 128), cfg(16, 16, 128), cfg(4, 4, 128)]
    tests = [cfg(2, 2, 128), cfg(2, 4, 128), cfg(1, 3, 64), cfg(2, 4, 128, dtype="float16"),
             cfg(2, 2, 64, dtype="float16", h0=False), cfg(4, 8, 128),
             cfg(2, 4, 128, g_dtype="bfloat16", scale=0.3), cfg(2, 4, 128, scale=0.3, l2=True),
             cfg(2, 4, 64, scale=0.125, varlen=True), cfg(2, 4, 64), cfg(1, 2, 64), cfg(4, 4, 128)]
    # flax_layers.GatedDeltaNet2 (l2 norm in kernel, fp32 g) as tests/test_flax_fla_parity.py and
    # examples/train_lm.py build it: 2 qk heads, 2 or 4 value heads, head dim 64, with and without a cache
    layers = [cfg(2, hv, 64, l2=True, h0=h0) for hv in (2, 4) for h0 in (False, True)]
    # state pools (continuous batching / speculative decoding): slot, per-token and per-token with accepted counts
    pool_modes = (dict(state_pool="slot"), dict(state_pool="token"), dict(state_pool="token", num_accepted=True))
    pools = [dict(c, inplace_state=True, **m) for c in (cfg(32, 32, 128), cfg(2, 4, 128), cfg(2, 4, 128, l2=True),
                                                        cfg(2, 4, 64, varlen=True), cfg(1, 2, 64))
             for m in pool_modes]
    # benchmarks/profile_chunk.py --time: the chunk kernel variants it compares with the default on the grid
    profile = [dict(cfg(h, h, 128), **opt) for h in (16, 32) for opt in (dict(exact_diag=True), dict(block_v=64))]
    # precision options of the chunk kernels (tests/test_tilelang_gpu.py, test_stages.py; profile_chunk.py)
    precision = (dict(tf32_round=True), dict(tf32_round=True, aqk_split=False), dict(exact_self=True),
                 dict(aqk_split=False), dict(aqk_split=False, exact_self=True),
                 dict(tf32_round=True, exact_self=True, aqk_split=True))
    profile += [dict(cfg(h, h, 128), **opt) for h in (4, 16, 32) for opt in ({},) + precision]
    profile += [dict(cfg(4, 4, 128), exact_diag=True)]
    # the forward intra launch without its cp.async prefetch (the default, kernels.defaults.FORWARD): the
    # "before" of profile_chunk --time / --train-launches
    profile += [dict(cfg(h, h, 128), intra_prefetch=False, save_states=s) for h in (16, 32) for s in (False, True)]
    # the forward intra launch with the Neumann-series solve (the blocked solve is the default since session 22):
    # profile_chunk --time / --accuracy's "neumann", --train-launches' "neumann:" (the training forward)
    profile += [dict(cfg(h, h, 128), blocked_solve=False, save_states=s) for h in (4, 16, 32) for s in (False, True)]
    profile += [dict(cfg(h, h, 128), fused_slice=False) for h in (4, 16, 32)]  # profile_chunk's "unfused"
    profile += [dict(cfg(h, h, 128), warp_tiles=False) for h in (4, 16, 32)]  # profile_chunk's "gemm_tiles"
    profile += [dict(cfg(h, h, 128), smem_epilogue=False) for h in (4, 16, 32)]  # profile_chunk's "frag_stores"
    profile += [dict(cfg(h, h, 128), intra_unroll=True) for h in (4, 16, 32)]  # profile_chunk's "unrolled"
    profile += [dict(cfg(h, h, 128), g_first=False) for h in (4, 16, 32)]  # profile_chunk's "whole_wait"
    profile += [dict(cfg(h, h, 128), block_v=128, state_threads=256) for h in (16, 32)]  # profile_chunk's "bv128w"
    # profile_chunk's "sync" and "sync128w": the state pass's products issued synchronously (before session 30)
    sync = [dict(cfg(h, h, 128), state_async=False, **o) for h in (16, 32) for o in ({}, STATE_WIDE_OPTIONS)]
    profile += sync
    bench += sync
    # profile_chunk's "rows" and "bv128w_rows": the grids of chunk slots x heads (before session 32)
    profile += [dict(cfg(h, h, 128), intra_heads_first=False, **o) for h in (16, 32)
                for o in ({}, dict(STATE_WIDE_OPTIONS, state_heads_first=False))]
    # profile_chunk's "bv16", "bv32", "s3", "bv16s3", "bv32s3": the state pass's V-block and pipeline depth
    profile += [dict(cfg(h, h, 128), **opt) for h in (16, 32) for opt in (
        dict(block_v=16), dict(block_v=32), dict(stages=3), dict(block_v=16, stages=3), dict(block_v=32, stages=3))]
    # experimental backward variants (tests/test_stages.py, profile_chunk.py --train-launches)
    bwd_variants = (dict(intra_v2=False), dict(intra_v2=False, reg_diag=True), dict(intra_tc=True),
                    dict(intra_fast_diag=True), dict(intra_tc=True, intra_fast_diag=True),
                    dict(wy_load="async", wy_threads=256),
                    dict(wy_load="async", wy_threads=512), dict(wy_load="tma", wy_threads=256),
                    dict(wy_load="sync", wy_threads=256), dict(wy_load="sync", wy_threads=512),
                    dict(wy_load="sync", wy_threads=256, wy_tf32_round=True), dict(wy_tf32_round="dy"),
                    dict(wy_tf32_round="dy_min"), dict(wy_tf32_round=False),
                    dict(split_ds=False, split_dr=False), dict(cast_grads=False), dict(split_dr=False),
                    dict(qg_split=True),
                    dict(qg_split=True, split_dr=False), dict(z_split=True),
                    dict(z_split=True, qg_split=True, split_dr=False),
                    dict(z_split=False, qg_split=False, split_dr=True), dict(qg_split=False, split_dr=True))
    bench += [dict(cfg(32, 32, 128), **o) for o in bwd_variants]
    # the training step of profile_chunk --train (no h0 / ht): session 15's kernels, qg_split alone, the candidate
    bench += [dict(cfg(h, h, 128, h0=False, ht=False), **o) for h in (16, 32)
              for o in (dict(z_split=False, qg_split=False, split_dr=True),
                        dict(z_split=False, qg_split=True, split_dr=False),
                        dict(z_split=True, qg_split=True, split_dr=False), dict(wy_tf32_round="dy"),
                        dict(wy_tf32_round="dy_min"), dict(wy_tf32_round=False))]
    # profile_chunk --grad-accuracy's case (B1 T256 H2) with the TF32-rounding variants of the WY launch
    bench += [dict(cfg(2, 2, 128), wy_tf32_round=r) for r in ("dy", "dy_min", False)]
    tests += [dict(cfg(2, 4, 128, varlen=v), **o) for v in (False, True) for o in bwd_variants]
    # the backward variants (with the training kernels of their configurations): stage tests, launch times at the
    # bench's largest head count, gradient accuracy (profile_chunk --grad-accuracy: B1 T256 H2)
    bwdexp = [dict(c, **o) for c in (cfg(32, 32, 128), cfg(2, 2, 128), cfg(2, 4, 128), cfg(2, 4, 128, varlen=True))
              for o in ({},) + bwd_variants]
    # the prefetch tests' configurations (tests/test_stages.py's _PREFETCH_CASES), with and without the prefetch
    prefetch_cases = [dict(cfg(h, hv, k, v, dtype=dt, g_dtype=gd, l2=l2, varlen=vl), save_states=s)
                      for (vl, h, hv, k, v, l2, dt, gd, s) in _PREFETCH_CFGS]
    tests += [dict(c, intra_prefetch=p) for c in prefetch_cases for p in (False, True)]
    # fp32 against input-dtype gradients (tests/test_stages.py: cast_grads bit-identical to casting afterwards)
    casts = [cfg(2, 2, 128), cfg(2, 4, 128, varlen=True), cfg(2, 2, 64, 128, l2=True, g_dtype="bfloat16"),
             cfg(1, 1, 128, 64, dtype="float16")]
    tests += casts + [dict(c, cast_grads=False) for c in casts]
    # the session-16 precision candidate (tests/test_gradient_audit_gpu.py, test_stages.py's z_split test)
    tests += [dict(cfg(2, 2, 128), z_split=True, qg_split=True, split_dr=False), dict(cfg(4, 4, 128), z_split=True),
              dict(cfg(4, 4, 128), z_split=True, intra_prefetch=False), dict(cfg(4, 4, 128), qg_split=True)]
    tests = tests + [dict(cfg(4, 4, 128), **opt) for opt in precision] + [
        dict(cfg(2, 4, 128), aqk_split=False), dict(cfg(2, 4, 128), exact_diag=True)]
    # the state passes that inference calls with many sequences x heads choose (kernels.chunk_fwd.inference_options:
    # two warpgroups and one V-block of 128, or V-blocks of 64 or 32): serving and benchmark head counts, and the
    # public calls of tests/test_stages.py's state-pass tests
    serving += [dict(c, **opt) for c in serving for opt in STATE_CHOICE_OPTIONS]
    bench += [dict(cfg(32, 32, 128), **STATE_WIDE_OPTIONS)]
    tests += [dict(cfg(32, 32, 128), **opt) for opt in ({}, STATE_WIDE_OPTIONS, {"block_v": 64})]
    # the tests' bit-identity cases (tests/test_stages.py): V-blocks of 64, and two warpgroups with V-blocks of V
    tests += [dict(cfg(h, hv, k, v, dtype=dt, g_dtype=gd, l2=l2, varlen=vl), **({"block_v": 64} if bv else {}))
              for (vl, h, hv, k, v, l2, dt, gd) in _BV_CASES for bv in (False, True)]
    tests += [dict(cfg(h, hv, k, v, dtype=dt, g_dtype=gd, l2=l2, varlen=vl), block_v=v, state_threads=256)
              for (vl, h, hv, k, v, l2, dt, gd) in _BV_CASES]
    # the state pass with its products issued synchronously (tests/test_stages.py: the default, asynchronous one is
    # bit-identical to it), and the training forward's launches of those cases
    tests += [dict(cfg(h, hv, k, v, dtype=dt, g_dtype=gd, l2=l2, varlen=vl), state_async=False, **o)
              for (vl, h, hv, k, v, l2, dt, gd) in _BV_CASES
              for o in ({}, dict(block_v=v, state_threads=256), dict(save_states=True))]
    tests += [dict(cfg(h, hv, k, v, dtype=dt, g_dtype=gd, l2=l2, varlen=vl), save_states=True)
              for (vl, h, hv, k, v, l2, dt, gd) in _BV_CASES]
    # (its three reruns of a 128-chunk sequence: the default V-blocks, two warpgroups, the training forward)
    tests += [dict(cfg(4, 4, 128), **o, **a) for o in ({}, STATE_WIDE_OPTIONS, dict(save_states=True))
              for a in ({}, dict(state_async=False))]
    # the launches' grids with the head fastest or not (tests/test_stages.py::test_gpu_heads_first_bit_identical)
    tests += [dict(cfg(h, hv, k, v, dtype=dt, g_dtype=gd, l2=l2, varlen=vl), intra_heads_first=f,
                   state_heads_first=f, **o)
              for (vl, h, hv, k, v, l2, dt, gd) in _HEADS_FIRST_CASES for f in (False, True)
              for o in ({}, dict(block_v=v, state_threads=256), dict(save_states=True))]
    tests += [cfg(h, hv, k, v, dtype=dt, g_dtype=gd, l2=l2, varlen=vl)
              for (vl, h, hv, k, v, l2, dt, gd) in _HEADS_FIRST_CASES]
    # the forward intra launch on the prefetch cases with one default option off, what tests/test_stages.py
    # compares the default with: without the fused slice pass (fused_slice bit-identical to it), the anchored
    # products by T.gemm (warp_tiles), Y / U stored from the accumulators (smem_epilogue), each slice waiting for all
    # of its tiles at once (g_first), the Neumann-series solve (the blocked solve against it), without -ftz
    # (intra_ftz changes only subnormal terms)
    tests += [dict(c, **{opt: False}) for opt in ("fused_slice", "warp_tiles", "smem_epilogue", "g_first",
                                                  "blocked_solve", "intra_ftz") for c in prefetch_cases]
    tests += [dict(cfg(2, 4, 128), smem_epilogue=e, **o) for o in SMEM_EPILOGUE_OPTIONS for e in (False, True)]
    # the slice loop unrolled (experimental; tests/test_stages.py: bit-identical), the first two prefetch cases
    tests += [dict(c, intra_unroll=True) for c in prefetch_cases[:2]]
    # warp_tiles with the options that change its code (tests/test_stages.py), on and off
    tests += [dict(cfg(2, 4, 128), warp_tiles=w, **o) for o in WARP_TILE_OPTIONS for w in (False, True)]
    table = {"serving": serving + pools, "bench": bench, "tests": tests + pools, "layers": layers,
             "all": serving + pools + bench + tests + layers, "sweep": _sweep(), "profile": profile, "bwdexp": bwdexp}
    if name not in table:
        raise SystemExit(f"unknown preset {name!r}; choose from {sorted(table)}")
    seen, out = set(), []
    for c in table[name]:
        key = tuple(sorted(c.items()))
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def _sweep() -> list[dict]:
    """Decode tile-sweep variants (benchmarks/bench.py --decode-sweep): recurrent only."""
    from .recurrent_fwd import TUNING_TILES

    return [dict(cfg(32, 32, 128), inplace_state=True, block_v=bv, threads=th) for bv, th in TUNING_TILES]


def _pipe(name, kw, part):
    """``part``: "fwd" (the op's pipeline), "train" (its forward with ``save_states``) or "bwd" (its backward)."""
    op = registry.get(name)
    if part == "bwd":
        return op.backward_pipeline(**kw)
    accepted = inspect.signature(registry.resolve(op.factory)).parameters
    fwd_kw = {k: v for k, v in kw.items() if k in accepted}  # (the forward's options only: a backward variant's others)
    if part == "fwd":  # (QG's residual is for the backward: the inference forward never stores it)
        fwd_kw.pop("qg_split", None)
        return op.pipeline(**fwd_kw)
    from .chunk_bwd import training_forward_options  # (the training forward that this backward expects)

    return op.pipeline(**dict(fwd_kw, save_states=True, **training_forward_options(op.backward_pipeline(**kw))))


def _job(name, kw, part, index, arch):
    from . import _compile

    launch = _pipe(name, kw, part).launches[index]
    t0 = time.time()
    existed = _compile.library_path(launch, arch).exists()
    path = _compile.compile_launch(launch, arch)
    return launch.name, str(path), existed, time.time() - t0


def build(configs, ops, arch, jobs=1, log=print):
    """Compile every launch of every (op, config) (op names from ``kernels.registry``); returns the library paths."""
    work = plan(configs, ops, arch)
    paths = []
    if jobs <= 1:
        results = (_job(*w) for w in work)
    else:
        ex = cf.ProcessPoolExecutor(jobs)
        results = ex.map(_job, *zip(*work))
    for (op, kw, _, i, _), (name, path, existed, dt) in zip(work, results):
        log(f"{'cached ' if existed else 'built  '} {dt:6.1f}s {op:21s} {name:28s} {os.path.basename(path)[:60]}")
        paths.append(path)
    return paths


def plan_launches(configs, ops, arch) -> list:
    """The ``Launch`` of each entry of :func:`plan` (no compile), e.g. to check that a preset holds a launch."""
    return [_pipe(name, kw, part).launches[i] for name, kw, part, i, _ in plan(configs, ops, arch)]


def plan(configs, ops, arch) -> list[tuple]:
    """The launches :func:`build` compiles, as ``(op name, config, part, launch index, arch)`` (no compile: raises
    what a pipeline factory raises for an invalid configuration)."""
    work, seen = [], set()
    for name, kw in itertools.product(ops, configs):
        op = registry.get(name)
        accepted = inspect.signature(registry.resolve(op.factory)).parameters
        extra = set(kw) - set(cfg(1, 1, 64))
        if op.backward and extra and extra <= BACKWARD_OPTIONS:  # a backward variant: its launches and the
            parts = ("train", "bwd")  # training forward it expects (mostly the default's: built once)
        elif op.backward and extra and extra & TRAINING_OPTIONS and extra <= BACKWARD_OPTIONS | TRAINING_OPTIONS:
            parts = ("fwd", "train", "bwd")  # forward options the training path shares (with backward ones)
        elif any(k not in accepted for k in kw):  # an option of another op's factory (e.g. block_v)
            continue
        else:  # training kernels (the forward saving its states, the backward) for the plain configurations
            parts = ("fwd",) + (("train", "bwd") if op.backward and not extra else ())
        for part in parts:
            pipe = _pipe(name, kw, part)
            for i, la in enumerate(pipe.launches):
                if (la.key, la.pass_configs) not in seen:  # (the training forward shares its first launch)
                    seen.add((la.key, la.pass_configs))
                    work.append((name, kw, part, i, arch))
    return work


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default=None, help="e.g. sm_90a (default: the local GPU's, else sm_90a)")
    ap.add_argument("--preset", default=None,
                    help="serving | tests | bench | layers | sweep | profile | bwdexp | all (or a,b,...)")
    ap.add_argument("--op", default="all",
                    help=f"comma-separated op names from kernels.registry ({', '.join(registry.OPS)}), or all")
    ap.add_argument("-j", "--jobs", type=int, default=1)
    for n in ("H", "HV", "K", "V"):
        ap.add_argument(f"--{n}", type=int)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--g-dtype", default="float32")
    ap.add_argument("--scale", type=float)
    ap.add_argument("--initial-state", action="store_true")
    ap.add_argument("--final-state", action="store_true")
    ap.add_argument("--varlen", action="store_true")
    ap.add_argument("--l2norm", action="store_true")
    a = ap.parse_args(argv)
    from . import _compile

    arch = a.arch
    if arch is None:
        try:
            arch = _compile.device_arch()
        except Exception:
            arch = "sm_90a"
    ops = tuple(registry.OPS) if a.op == "all" else tuple(a.op.split(","))
    for name in ops:
        if name not in registry.OPS:
            ap.error(f"--op: unknown op {name!r}; choose from {', '.join(registry.OPS)}")
    if a.preset == "sweep":
        ops = ("fused_recurrent_gdn2",)
    if a.preset:  # comma-separated presets build in one process
        configs = [c for name in a.preset.split(",") for c in preset(name)]
    elif a.H:
        configs = [cfg(a.H, a.HV or a.H, a.K or 128, a.V, a.dtype, a.g_dtype, a.scale, a.initial_state,
                       a.final_state, a.varlen, a.l2norm)]
    else:
        ap.error("give --preset or --H (and friends)")
    t0 = time.time()
    paths = build(configs, ops, arch, a.jobs)
    print(f"{len(paths)} kernels for {arch} in {_compile.cache_dir()} ({time.time() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

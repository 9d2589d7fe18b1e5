"""Run the chunk prefill pipeline (torch path) on one grid shape, for ``ncu`` (Nsight Compute) to profile; or time
its launches over the benchmark grid.

    ncu --clock-control none --kernel-name main_kernel --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight --section Occupancy ... python -m benchmarks.profile_chunk --B 4 --T 4096 --H 32
    python -m benchmarks.profile_chunk --time [--variants default,exact_diag,bv64]
    python -m benchmarks.profile_chunk --accuracy [--variants default,exact_diag,exact_self]

Profiling: two warm-up calls, then two profiled launches: the intra-chunk kernel and the state/output kernel
(TileLang names every kernel ``main_kernel``). ``--time``: do_bench medians (ms) of each launch of each kernel
variant (``default``; ``exact_diag``: every diagonal block of the intra kernel summed exactly in fp32, the
pre-v5 arithmetic; ``bv64``: state kernel with V-blocks of 64; ``exact_self``: the diagonal of Aqk in fp32;
``tf32_round``: TF32 operands rounded to nearest; ``aqk_split``: Aqk as bf16 + residual; ``precise``: the last
three together; ``aqk_self``: ``aqk_split`` + ``exact_self``) on the prefill grid, and FLA 0.6.0's
``chunk_gdn2`` in the same process; one JSON line per shape (``PROFILE {...}``). Inputs follow spec §15 (bf16,
fp32 g, D = 128). Needs a GPU.
"""

from __future__ import annotations

import argparse
import json

VARIANTS = {"default": {}, "exact_diag": {"exact_diag": True}, "bv64": {"block_v": 64},
            "exact_self": {"exact_self": True}, "tf32_round": {"tf32_round": True}, "v5": {"aqk_split": False},
            "precise": {"tf32_round": True, "exact_self": True}}


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
            calls = bench_lib.stage_callables(bench_lib.chunk_pipeline(H, H, **VARIANTS[name]), x)
            for la, fn in calls:
                row[f"{name}:{la}"] = do_bench(fn, warmup=10, rep=60, return_mode="median")
            del calls
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--variants", default=None,
                    help="comma-separated VARIANTS keys (default: --time default,exact_diag,bv64; "
                         "--accuracy default,exact_diag,exact_self)")
    ap.add_argument("--accuracy", action="store_true")
    a = ap.parse_args(argv)
    if a.accuracy:
        accuracy((a.variants or "default,exact_diag,exact_self").split(","))
        return
    if a.time:
        time_grid((a.variants or "default,exact_diag,bv64").split(","))
        return
    import torch

    from benchmarks import bench_lib
    from kernels import torch_api

    x = bench_lib.torch_inputs(a.B, a.T, a.H, a.H, seed=0)
    q, k, v, gg, b, w, h0 = (x[n] for n in ("q", "k", "v", "g", "b", "w", "h0"))
    for _ in range(a.calls):
        o, ht = torch_api.chunk_gdn2(q, k, v, gg, b, w, initial_state=h0, output_final_state=True)
    torch.cuda.synchronize()
    print("ok", tuple(o.shape), float(o.float().abs().mean()))


if __name__ == "__main__":
    main()

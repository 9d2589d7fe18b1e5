"""Run the chunk prefill pipeline (torch path) on one grid shape, for ``ncu`` (Nsight Compute) to profile.

    ncu --clock-control none --kernel-name main_kernel --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight --section Occupancy ... python -m benchmarks.profile_chunk --B 4 --T 4096 --H 32

Two warm-up calls, then two profiled launches: the intra-chunk kernel and the state/output kernel (TileLang names
every kernel ``main_kernel``). Inputs follow spec §15 (bf16, fp32 g, D = 128). Needs a GPU.
"""

from __future__ import annotations

import argparse


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--calls", type=int, default=3)
    a = ap.parse_args(argv)
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

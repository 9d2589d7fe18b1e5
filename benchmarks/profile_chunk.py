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

    from kernels import torch_api

    g = torch.Generator(device="cuda").manual_seed(0)
    B, T, H, D = a.B, a.T, a.H, 128
    kw = dict(device="cuda", generator=g)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, D, **kw), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, **kw), dim=-1).bfloat16()
    v = (0.5 * torch.randn(B, T, H, D, **kw)).bfloat16()
    gg = 0.02 * (-5.0 + 4.9 * torch.rand(B, T, H, D, **kw))
    b = torch.rand(B, T, H, D, **kw).bfloat16()
    w = torch.rand(B, T, H, D, **kw).bfloat16()
    h0 = torch.randn(B, H, D, D, **kw)
    for _ in range(a.calls):
        o, ht = torch_api.chunk_gdn2(q, k, v, gg, b, w, initial_state=h0, output_final_state=True)
    torch.cuda.synchronize()
    print("ok", tuple(o.shape), float(o.float().abs().mean()))


if __name__ == "__main__":
    main()

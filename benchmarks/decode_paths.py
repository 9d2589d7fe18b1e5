"""Quick look at the decode paths a JAX user writes (GPU): per-token time of a jitted ``lax.scan`` carrying the
state, a donated jitted step and a plain jitted step, against FLA 0.6.0's in-place serving call, plus whether the
compiled HLO copies the state. A development probe; the benchmark of record is ``benchmarks/bench.py``.

    python -m benchmarks.decode_paths [--B 1,16,128] [--graph]     (--graph: CUDA-graph capturable targets)
"""

from __future__ import annotations

import argparse
import json
import re


def host_us(fn, sync, n=50):
    """Host-clock loop (``bench_lib.host_ms``) in microseconds per call."""
    from benchmarks import bench_lib

    return bench_lib.host_ms(fn, sync, n=n)[0] * 1e3


def copies(txt):
    """``copy`` instructions in compiled HLO text, with their shapes (a state copy shows as f32[B,32,128,128])."""
    return re.findall(r"= (f32\[[\d,]+\][^ ]*) copy\(", txt)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", default="1,16,64,128")
    ap.add_argument("--graph", action="store_true")
    a = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp
    import torch
    from triton.testing import do_bench

    import gdn2_jax
    from benchmarks import bench_lib

    H, D = 32, 128
    rows = []
    for B in (int(x) for x in a.B.split(",")):
        T = 16
        x = bench_lib.torch_inputs(B, T, H, H, seed=B)
        q, k, v, gg, b, w, h0 = (x[n] for n in ("q", "k", "v", "g", "b", "w", "h0"))
        torch.cuda.synchronize()
        xs = [jnp.array(jax.dlpack.from_dlpack(t)) for t in (q, k, v, gg, b, w)]
        S0 = jnp.array(jax.dlpack.from_dlpack(h0))
        row = {"B": B, "graph": a.graph}

        def step(S, q, k, v, g, b, w, inplace):
            return gdn2_jax.fused_recurrent_gdn2(q, k, v, g, b, w, initial_state=S, output_final_state=True,
                                                 inplace_final_state=inplace, backend="tilelang")

        one = [x[:, :1] for x in xs]
        f_call = jax.jit(lambda S, *x: step(S, *x, False))
        f_don = jax.jit(lambda S, *x: step(S, *x, True), donate_argnums=0)

        def scan(S, q, k, v, g, b, w):
            def body(S, x):
                o, S = step(S, *(y[:, None] for y in x), True)
                return S, o[:, 0]
            S, os_ = jax.lax.scan(body, S, tuple(jnp.moveaxis(y, 1, 0) for y in (q, k, v, g, b, w)))
            return os_, S
        f_scan = jax.jit(scan, donate_argnums=0)

        def scan_unrolled(S, q, k, v, g, b, w):  # the same loop unrolled: no XLA while loop
            def body(S, x):
                o, S = step(S, *(y[:, None] for y in x), True)
                return S, o[:, 0]
            S, os_ = jax.lax.scan(body, S, tuple(jnp.moveaxis(y, 1, 0) for y in (q, k, v, g, b, w)), unroll=True)
            return os_, S
        f_unr = jax.jit(scan_unrolled, donate_argnums=0)

        def trivial(S, q, k, v, g, b, w):  # the loop with a trivial XLA op instead of the kernel: loop overhead
            def body(S, x):
                return S * 0.999 + 1.0, x[0][:, 0, :1]
            return jax.lax.scan(body, S[:1, :1, :1, :1], tuple(jnp.moveaxis(y, 1, 0) for y in (q,)))
        f_triv = jax.jit(trivial)
        st = {"S": jnp.array(S0)}

        def run_call():
            return f_call(S0, *one)

        def run_don():
            o, st["S"] = f_don(st["S"], *one)
            return st["S"]

        def run_scan():
            o, st["S"] = f_scan(st["S"], *xs)
            return st["S"]
        sync = jax.block_until_ready
        row["call_us"] = host_us(run_call, sync)
        row["donated_us"] = host_us(run_don, sync)
        row["scan_us_per_token"] = host_us(run_scan, sync, n=10) / T

        def run_unr():
            o, st["S"] = f_unr(st["S"], *xs)
            return st["S"]
        row["scan_unrolled_us_per_token"] = host_us(run_unr, sync, n=10) / T
        row["scan_trivial_op_us_per_token"] = host_us(lambda: f_triv(S0, *xs), sync, n=10) / T
        txt = f_scan.lower(jnp.array(S0), *xs).compile().as_text()
        row["scan_hlo_command_buffers"] = txt.count("command_buffer")
        # state copies in the compiled programs
        row["copies_call"] = copies(f_call.lower(S0, *one).compile().as_text())
        row["copies_donated"] = copies(f_don.lower(S0, *one).compile().as_text())
        row["copies_scan"] = copies(f_scan.lower(S0, *xs).compile().as_text())
        # correctness: scan over 16 tokens == 16 functional calls
        Sa = jnp.array(S0)
        for t in range(T):
            _, Sa = f_call(Sa, *(x[:, t:t + 1] for x in xs))
        _, Sb = f_scan(jnp.array(S0), *xs)
        row["scan_equals_calls"] = bool(jnp.array_equal(Sa, Sb))
        try:
            from fla.ops.gdn2.fused_recurrent import fused_recurrent_gdn2_fwd
            a1 = [t[:, :1].contiguous() for t in (q, k, v, gg, b, w)]
            hf = h0.clone()
            row["fla_inplace_us"] = do_bench(lambda: fused_recurrent_gdn2_fwd(
                *a1, initial_state=hf, output_final_state=True, inplace_final_state=True),
                warmup=25, rep=200, return_mode="median") * 1e3
        except Exception as e:  # pragma: no cover
            row["fla_error"] = repr(e)[:200]
        from kernels import torch_api
        hh = h0.clone()
        a1 = [t[:, :1].contiguous() for t in (q, k, v, gg, b, w)]
        row["torch_inplace_us"] = do_bench(lambda: torch_api.fused_recurrent_gdn2(
            *a1, initial_state=hh, inplace_final_state=True), warmup=25, rep=200, return_mode="median") * 1e3
        row["state_MB_rw"] = 2 * B * H * D * D * 4 / 1e6
        print("DECODE " + json.dumps(row), flush=True)
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()

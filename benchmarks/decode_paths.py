"""Quick look at the decode paths a JAX user writes (GPU): per-token time of a jitted ``lax.scan`` carrying the
state, a donated jitted step and a plain jitted step, against FLA 0.6.0's in-place serving call, plus whether the
compiled HLO copies the state. A development probe; the benchmark of record is ``benchmarks/bench.py``.

    python -m benchmarks.decode_paths [--B 1,16,128] [--graph] [--torch-first] [--trace DIR]

``--graph``: CUDA-graph capturable targets. ``--torch-first``: before JAX is imported, time FLA's in-place call and
our kernel through torch (do_bench, and per step from a replayed CUDA graph of 16 steps: device time without host
launch cost); FLA's do_bench is repeated after the JAX rows (does a live JAX runtime slow torch's launches?).
``--trace DIR``: a CUPTI (torch.profiler) trace of one scan call and of 8 donated steps at the first B, and a
summary of its kernels (name, duration, gap to the previous kernel) in ``DIR/trace_summary.txt``.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def host_us(fn, sync, n=50):
    """Host-clock loop (``bench_lib.host_ms``) in microseconds per call."""
    from benchmarks import bench_lib

    return bench_lib.host_ms(fn, sync, n=n)[0] * 1e3


def copies(txt):
    """``copy`` instructions in compiled HLO text, with their shapes (a state copy shows as f32[B,32,128,128])."""
    return re.findall(r"= (f32\[[\d,]+\][^ ]*) copy\(", txt)


def graph_us(fn, steps=16, reps=20):
    """Device time per call of ``fn`` from replays of a CUDA graph holding ``steps`` calls (median of ``reps``)."""
    import statistics

    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(steps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / steps)
    return statistics.median(ts)


def torch_rows(Bs, H=32):
    """FLA's in-place serving call and our kernel through torch: do_bench and CUDA-graph device time per step."""
    import torch
    from triton.testing import do_bench

    from benchmarks import bench_lib
    from kernels import torch_api

    out = {}
    for B in Bs:
        x = bench_lib.torch_inputs(B, 1, H, H, seed=B)
        a1 = [x[n].contiguous() for n in ("q", "k", "v", "g", "b", "w")]
        hf, hh = x["h0"].clone(), x["h0"].clone()
        row = {}
        try:
            from fla.ops.gdn2.fused_recurrent import fused_recurrent_gdn2_fwd
            f = lambda: fused_recurrent_gdn2_fwd(*a1, initial_state=hf, output_final_state=True,  # noqa: E731
                                                 inplace_final_state=True)
            row["fla_inplace_us_torch_only"] = do_bench(f, warmup=25, rep=200, return_mode="median") * 1e3
            row["fla_inplace_us_graph"] = graph_us(f)
        except Exception as e:  # pragma: no cover
            row["fla_error"] = repr(e)[:200]
        f = lambda: torch_api.fused_recurrent_gdn2(*a1, initial_state=hh, inplace_final_state=True)  # noqa: E731
        row["torch_inplace_us_torch_only"] = do_bench(f, warmup=25, rep=200, return_mode="median") * 1e3
        try:
            row["torch_inplace_us_graph"] = graph_us(f)
        except Exception as e:  # pragma: no cover
            row["torch_graph_error"] = repr(e)[:200]
        print("TORCH " + json.dumps({"B": B, **row}), flush=True)
        out[B] = row
    return out


def trace(fns, path):
    """CUPTI trace (torch.profiler: every kernel of the process, JAX's included) of ``fns`` (name -> callable)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    lines = []
    for name, fn in fns.items():
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        f = f"{path}/trace_{name}.json"
        prof.export_chrome_trace(f)
        ev = json.load(open(f))["traceEvents"]
        ks = sorted((e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
        api = [e for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver")]
        lines.append(f"== {name}: {len(ks)} device activities, {len(api)} CUDA API calls "
                     f"({sorted(set(e['name'] for e in api))[:12]})")
        prev = None
        for e in ks[:80]:
            gap = "" if prev is None else f"gap {e['ts'] - prev:8.2f} us"
            lines.append(f"  {e['dur']:8.2f} us  {gap:18s} {e['name'][:90]}")
            prev = e["ts"] + e["dur"]
        if len(ks) > 1:
            span = ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"]
            busy = sum(e["dur"] for e in ks)
            lines.append(f"  span {span:.1f} us, busy {busy:.1f} us")
    open(f"{path}/trace_summary.txt", "w").write("\n".join(lines) + "\n")
    print("\n".join(lines[:60]), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", default="1,16,64,128")
    ap.add_argument("--graph", action="store_true")
    ap.add_argument("--torch-first", action="store_true")
    ap.add_argument("--trace", default=None)
    a = ap.parse_args(argv)
    Bs = [int(x) for x in a.B.split(",")]
    pre = torch_rows(Bs) if a.torch_first else {}
    import jax
    import jax.numpy as jnp
    import torch
    from triton.testing import do_bench

    import gdn2_jax
    from benchmarks import bench_lib

    H, D = 32, 128
    rows = []
    for B in Bs:
        T = 16
        x = bench_lib.torch_inputs(B, T, H, H, seed=B)
        q, k, v, gg, b, w, h0 = (x[n] for n in ("q", "k", "v", "g", "b", "w", "h0"))
        torch.cuda.synchronize()
        xs = [jnp.array(jax.dlpack.from_dlpack(t)) for t in (q, k, v, gg, b, w)]
        S0 = jnp.array(jax.dlpack.from_dlpack(h0))
        row = {"B": B, "graph": a.graph, **pre.get(B, {})}
        triv1 = jax.jit(lambda x: x + 1)
        xt = jnp.zeros((8,), jnp.float32)
        row["jit_trivial_dispatch_us"] = host_us(lambda: triv1(xt), jax.block_until_ready)

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
        if a.trace and B == Bs[0]:
            Path(a.trace, f"scan_hlo{'_graph' if a.graph else ''}.txt").write_text(txt)
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
        if a.trace and B == Bs[0]:
            def don8():
                for _ in range(8):
                    run_don()
                jax.block_until_ready(st["S"])
            trace({"scan": lambda: jax.block_until_ready(run_scan()), "donated8": don8,
                   "unrolled": lambda: jax.block_until_ready(run_unr())}, a.trace)
        print("DECODE " + json.dumps(row), flush=True)
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()

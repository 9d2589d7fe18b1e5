"""One-command benchmark of GDN-2 forward kernels (issue 3 item 6).

    python -m benchmarks.bench [--out benchmarks/results] [--skip-prefill] [--skip-decode] [--skip-xla] [--quick]

Times, in one process and run, on the spec §15 grid (bf16, D = 128):
  * this library through JAX (``backend="tilelang"``: jitted single call; decode also per step inside a jitted
    ``fori_loop`` and as a donated in-place step), the same kernels through torch (``kernels.torch_api``),
  * FLA 0.6.0 ``chunk_gdn2``, ``fused_recurrent_gdn2`` and its in-place serving path
    ``fused_recurrent_gdn2_fwd(inplace_final_state=True)``, and ``backend="xla"``;
plus the extra peak device memory of each call, the copy bandwidth of the card, ratios vs FLA measured in the
same run, and accuracy against an fp64 oracle (RMS ratio) for prefill o/state and decode o/state.
Writes ``bench-<gpu>-<date>.json`` + ``.md`` (+ ``.png`` when matplotlib is importable) to ``--out``.

Timing: torch/FLA with ``triton.testing.do_bench`` (CUDA events, median; the §15 method) AND every path with
the same host-clock loop (``n`` back-to-back calls, then a device sync; median over repeats), so JAX — whose
work runs on XLA's stream — is compared like for like. Compile / autotune time is excluded (warm-up first).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

PREFILL_GRID = [(1, 4096, 16), (1, 16384, 16), (4, 4096, 32), (8, 2048, 32), (1, 32768, 32), (16, 1024, 32)]
DECODE_B = [1, 4, 16, 64, 128]
DECODE_H = 32
D = 128


# ------------------------------------------------------------------------------------------------------ helpers
def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for p in ("jax", "jaxlib", "torch", "triton", "tilelang", "apache-tvm-ffi", "jax-tvm-ffi", "fla-core",
              "numpy"):
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            out[p] = None
    return out


def gpu_info() -> dict:
    import torch

    info = {"name": torch.cuda.get_device_name(0), "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
            "torch_cuda": torch.version.cuda}
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,memory.total,clocks.max.sm",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
        info["nvidia_smi"] = q
        info["driver"] = q.split(",")[0].strip()
    except Exception as e:  # pragma: no cover
        info["nvidia_smi"] = f"unavailable: {e}"
    return info


def host_time_us(fn, sync, n=50, reps=5, warm=3):
    """Median over ``reps`` of (wall time of ``n`` back-to-back calls + one sync) / n, in µs."""
    for _ in range(warm):
        fn()
    sync()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            r = fn()
        sync(r)
        ts.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(ts)


def event_time_us(fn):
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def torch_sync(*_):
    import torch

    torch.cuda.synchronize()


def jax_sync(r=None):
    import jax

    if r is not None:
        jax.block_until_ready(r)
    else:
        (jax.device_put(0.0) + 0).block_until_ready()


def torch_extra_peak_mib(fn):
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    r = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del r
    return (peak - base) / 2**20


def jax_extra_peak_mib(jitted, *args):
    """Outputs + temporaries of the compiled computation (XLA's memory analysis), MiB."""
    try:
        ma = jitted.lower(*args).compile().memory_analysis()
        return (ma.output_size_in_bytes + ma.temp_size_in_bytes - ma.alias_size_in_bytes) / 2**20
    except Exception:
        return None


def rms(x, ref):
    x = np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    if not np.all(np.isfinite(x)):
        return float("nan")
    return float(np.sqrt(np.mean((x - ref) ** 2)) / np.sqrt(np.mean(ref * ref)))


def make_torch_inputs(B, T, H, HV, seed=0, g_scale=0.02, g_range=(-5.0, -0.1), h0=True):
    """Spec §15 inputs: q,k L2-normalised; v = 0.5 N(0,1); b,w ~ U(0,1); g = g_scale*U(g_range) fp32."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    kw = dict(device="cuda", generator=gen)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, D, **kw), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, **kw), dim=-1).bfloat16()
    v = (0.5 * torch.randn(B, T, HV, D, **kw)).bfloat16()
    g = g_scale * (g_range[0] + (g_range[1] - g_range[0]) * torch.rand(B, T, HV, D, **kw))
    b = torch.rand(B, T, HV, D, **kw).bfloat16()
    w = torch.rand(B, T, HV, D, **kw).bfloat16()
    out = dict(q=q, k=k, v=v, g=g.float(), b=b, w=w)
    if h0:
        out["h0"] = torch.randn(B, HV, D, D, **kw)
    torch.cuda.synchronize()  # JAX reads these through DLPack on its own stream
    return out


def to_jax(t):
    import jax.dlpack

    return jax.dlpack.from_dlpack(t)  # zero-copy view of the torch buffer


def oracle_np(q, k, v, g, b, w, h0, scale):
    """fp64 token loop (dense, H == HV) on numpy arrays."""
    q, k, v, g, b, w = (np.asarray(x, np.float64) for x in (q, k, v, g, b, w))
    B, T, H, K = q.shape
    S = np.array(h0, np.float64, copy=True)
    o = np.zeros(v.shape)
    for t in range(T):
        S = np.exp(g[:, t])[..., None] * S
        u = w[:, t] * v[:, t] - np.einsum("bhk,bhkv->bhv", b[:, t] * k[:, t], S)
        S = S + k[:, t][..., None] * u[..., None, :]
        o[:, t] = scale * np.einsum("bhk,bhkv->bhv", q[:, t], S)
    return o, S


def tnp(x):
    return x.float().cpu().numpy()


# --------------------------------------------------------------------------------------------------- sections
def copy_bandwidth():
    import torch

    n = 2 * 2**30 // 4
    a = torch.randn(n, device="cuda")
    bb = torch.empty_like(a)
    us = event_time_us(lambda: bb.copy_(a))
    del a, bb
    torch.cuda.empty_cache()
    return {"bytes_rw": 2 * n * 4, "us": us, "TBps": 2 * n * 4 / us / 1e6}


def bench_prefill(args, rows, fla_ok, have_chunk, save=lambda: None):
    import jax
    import torch

    import gdn2_jax
    from kernels import torch_api

    for B, T, H in (PREFILL_GRID[:2] if args.quick else PREFILL_GRID):
        x = make_torch_inputs(B, T, H, H, seed=B * T + H)
        names = ("q", "k", "v", "g", "b", "w")
        args_t = [x[n] for n in names]
        row = {"B": B, "T": T, "H": H, "D": D}
        if have_chunk:
            def ours_t():
                return torch_api.chunk_gdn2(*args_t, initial_state=x["h0"], output_final_state=True)
            row["torch_ms"] = event_time_us(ours_t) / 1e3
            row["torch_host_ms"] = host_time_us(ours_t, torch_sync, n=10) / 1e3
            row["torch_extra_MiB"] = torch_extra_peak_mib(ours_t)
            jx = [to_jax(x[n]) for n in names] + [to_jax(x["h0"])]
            fj = jax.jit(lambda q, k, v, g, b, w, h0: gdn2_jax.chunk_gdn2(
                q, k, v, g, b, w, initial_state=h0, output_final_state=True, backend="tilelang"))
            row["jax_ms"] = host_time_us(lambda: fj(*jx), jax_sync, n=10) / 1e3
            row["jax_extra_MiB"] = jax_extra_peak_mib(fj, *jx)
            row["jax_over_torch"] = row["jax_ms"] / row["torch_host_ms"]
        if fla_ok:
            from fla.ops.gdn2 import chunk_gdn2 as fla_chunk

            def fla_f():
                with torch.inference_mode():
                    return fla_chunk(*args_t, initial_state=x["h0"], output_final_state=True)
            row["fla_ms"] = event_time_us(fla_f) / 1e3
            row["fla_host_ms"] = host_time_us(fla_f, torch_sync, n=10) / 1e3
            row["fla_extra_MiB"] = torch_extra_peak_mib(fla_f)
            if have_chunk:
                row["speedup_vs_fla_torch"] = row["fla_ms"] / row["torch_ms"]
                row["speedup_vs_fla_jax"] = row["fla_host_ms"] / row["jax_ms"]
        print("prefill", json.dumps(row), flush=True)
        rows.append(row)
        save()
        del x
        torch.cuda.empty_cache()


def bench_prefill_xla(args, rows, save=lambda: None):
    import jax
    import torch

    import gdn2_jax

    for row in rows:  # backend="xla" last: the slowest path (and the least important number)
        B, T, H = row["B"], row["T"], row["H"]
        if B * T * H > args.xla_max_tokens:
            continue
        x = make_torch_inputs(B, T, H, H, seed=B * T + H)
        jx = [to_jax(x[n]) for n in ("q", "k", "v", "g", "b", "w", "h0")]
        fx = jax.jit(lambda q, k, v, g, b, w, h0: gdn2_jax.chunk_gdn2(
            q, k, v, g, b, w, initial_state=h0, output_final_state=True, backend="xla"))
        row["xla_ms"] = host_time_us(lambda: fx(*jx), jax_sync, n=2, reps=3, warm=1) / 1e3
        row["xla_extra_MiB"] = jax_extra_peak_mib(fx, *jx)
        print("prefill-xla", json.dumps(row), flush=True)
        save()
        del x, jx
        torch.cuda.empty_cache()


def bench_decode(args, rows, fla_ok):
    import jax
    import jax.numpy as jnp
    import torch

    import gdn2_jax
    from gdn2_jax._tilelang_ops import fused_recurrent_gdn2_inplace
    from kernels import torch_api

    names = ("q", "k", "v", "g", "b", "w")
    for B in ([1, 128] if args.quick else DECODE_B):
        H = DECODE_H
        x = make_torch_inputs(B, 1, H, H, seed=B)
        a = [x[n] for n in names]
        state_bytes = 2 * B * H * D * D * 4
        row = {"B": B, "H": H, "T": 1, "D": D, "state_MB_rw": state_bytes / 1e6}
        h_ours = x["h0"].clone()

        def ours_new():
            return torch_api.fused_recurrent_gdn2(*a, initial_state=x["h0"], output_final_state=True)

        def ours_inplace():
            return torch_api.fused_recurrent_gdn2(*a, initial_state=h_ours, inplace_final_state=True)
        row["torch_new_us"] = event_time_us(ours_new)
        row["torch_inplace_us"] = event_time_us(ours_inplace)
        row["torch_inplace_host_us"] = host_time_us(ours_inplace, torch_sync, n=100)
        row["torch_new_extra_MiB"] = torch_extra_peak_mib(ours_new)
        row["torch_inplace_extra_MiB"] = torch_extra_peak_mib(ours_inplace)
        row["torch_inplace_TBps"] = state_bytes / row["torch_inplace_us"] / 1e6
        # JAX: one jitted call per token (functional), donated in-place step, and per step in a jitted loop
        jx = [to_jax(t) for t in a]
        f_new = jax.jit(lambda q, k, v, g, b, w, h0: gdn2_jax.fused_recurrent_gdn2(
            q, k, v, g, b, w, initial_state=h0, output_final_state=True, backend="tilelang"))
        h0j = jnp.array(to_jax(x["h0"]))
        row["jax_call_us"] = host_time_us(lambda: f_new(*jx, h0j), jax_sync, n=100)
        row["jax_call_extra_MiB"] = jax_extra_peak_mib(f_new, *jx, h0j)
        f_inp = jax.jit(fused_recurrent_gdn2_inplace, donate_argnums=6)
        state = {"h": jnp.array(h0j)}

        def step_inplace():
            o, state["h"] = f_inp(*jx, state["h"])
            return o
        row["jax_inplace_call_us"] = host_time_us(step_inplace, lambda r=None: jax_sync(state["h"]), n=100)
        steps = 64

        def make_loop(step_fn):
            @jax.jit
            def loop(h, q, k, v, g, b, w):
                def body(i, carry):
                    h, acc = carry
                    o, h = step_fn(q, k, v, g, b, w, h)
                    return h, acc + o[0, 0, 0, 0].astype(jnp.float32)
                return jax.lax.fori_loop(0, steps, body, (h, jnp.float32(0)))
            return loop

        loop_inplace = make_loop(lambda q, k, v, g, b, w, h: fused_recurrent_gdn2_inplace(q, k, v, g, b, w, h))
        loop_func = make_loop(lambda q, k, v, g, b, w, h: gdn2_jax.fused_recurrent_gdn2(
            q, k, v, g, b, w, initial_state=h, output_final_state=True, backend="tilelang"))
        row["jax_loop_step_us"] = host_time_us(lambda: loop_inplace(h0j, *jx), jax_sync, n=2, reps=3) / steps
        row["jax_loop_functional_step_us"] = host_time_us(lambda: loop_func(h0j, *jx), jax_sync, n=2,
                                                          reps=3) / steps

        @jax.jit
        def loop_xla_add(h):  # the same loop with a trivial XLA op: the loop's own overhead per step
            return jax.lax.fori_loop(0, steps, lambda i, c: c * 0.999 + 1.0, h[:1, :1])

        row["xla_loop_trivial_step_us"] = host_time_us(lambda: loop_xla_add(h0j), jax_sync, n=3, reps=3) / steps
        f_x = jax.jit(lambda q, k, v, g, b, w, h0: gdn2_jax.fused_recurrent_gdn2(
            q, k, v, g, b, w, initial_state=h0, output_final_state=True, backend="xla"))
        row["xla_call_us"] = host_time_us(lambda: f_x(*jx, h0j), jax_sync, n=20, reps=3)
        if fla_ok:
            from fla.ops.gdn2 import fused_recurrent_gdn2 as fla_rec
            from fla.ops.gdn2.fused_recurrent import fused_recurrent_gdn2_fwd as fla_fwd

            h_fla = x["h0"].clone()

            def fla_new():
                return fla_rec(*a, initial_state=x["h0"], output_final_state=True)

            def fla_inplace():
                return fla_fwd(*a, initial_state=h_fla, output_final_state=True, inplace_final_state=True)
            row["fla_new_us"] = event_time_us(fla_new)
            row["fla_inplace_us"] = event_time_us(fla_inplace)
            row["fla_inplace_host_us"] = host_time_us(fla_inplace, torch_sync, n=100)
            row["fla_new_extra_MiB"] = torch_extra_peak_mib(fla_new)
            row["fla_inplace_extra_MiB"] = torch_extra_peak_mib(fla_inplace)
            row["speedup_torch_inplace_vs_fla_inplace"] = row["fla_inplace_us"] / row["torch_inplace_us"]
            row["speedup_torch_new_vs_fla_new"] = row["fla_new_us"] / row["torch_new_us"]
            row["speedup_jax_loop_vs_fla_inplace"] = row["fla_inplace_us"] / row["jax_loop_step_us"]
            row["speedup_jax_call_vs_fla_inplace_host"] = row["fla_inplace_host_us"] / row["jax_inplace_call_us"]
        print("decode", json.dumps(row), flush=True)
        rows.append(row)
        del x
        torch.cuda.empty_cache()


def decode_sweep(fla_ok):
    """Decode tile sweep (V columns per block, threads) through torch, in-place state, H=32, D=128."""
    from kernels import _compile, torch_api
    import torch

    from kernels.recurrent_fwd import TUNING_TILES, fused_recurrent_fwd_pipeline

    out = []
    for B in (1, 16, 128):
        x = make_torch_inputs(B, 1, DECODE_H, DECODE_H, seed=7 + B)
        h0_orig = x["h0"].clone()  # pristine: the timing loops below update their own state buffer in place
        ins = {n: x[n] for n in ("q", "k", "v", "g", "b", "w", "h0")}
        row = {"B": B}
        ref = None
        for bv, th, sc in TUNING_TILES:
            tag = f"bv{bv}_t{th}" + ("" if sc == "block" else f"_{sc}")
            pipe = fused_recurrent_fwd_pipeline(H=DECODE_H, HV=DECODE_H, K=D, V=D, dtype="bfloat16",
                                                g_dtype="float32", scale=D ** -0.5, use_initial_state=True,
                                                output_final_state=True, varlen=False, use_qk_l2norm=False,
                                                inplace_state=True, block_v=bv, threads=th, schedule=sc)
            try:
                _compile.get_function(pipe.launches[0], _compile.device_arch())
                # correctness vs the default tile (first entry) on a fresh copy of the state
                h = h0_orig.clone()
                res = torch_api.run_pipeline(pipe, dict(ins, h0=h), out={"ht": h})
                cur = torch.cat([res["o"].float().flatten(), h.flatten()])
                ref = cur if ref is None else ref
                row[f"{tag}_maxdiff"] = float((cur - ref).abs().max())
                row[f"{tag}_us"] = event_time_us(lambda: torch_api.run_pipeline(pipe, ins, out={"ht": ins["h0"]}))
            except Exception as e:  # a tile the compiler rejects
                row[f"{tag}_us"] = None
                print("sweep", tag, "failed:", repr(e)[:300])
        if fla_ok:
            from fla.ops.gdn2.fused_recurrent import fused_recurrent_gdn2_fwd as fla_fwd

            a = [x[n] for n in ("q", "k", "v", "g", "b", "w")]
            h = x["h0"].clone()
            row["fla_inplace_us"] = event_time_us(lambda: fla_fwd(*a, initial_state=h, output_final_state=True,
                                                                  inplace_final_state=True))
        print("sweep", json.dumps(row), flush=True)
        out.append(row)
    return out


GRAPH_XLA_FLAGS = ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL "
                   "--xla_gpu_graph_min_graph_size=1")


def decode_graph_child():
    """(Child process) JAX decode loop with the CUDA-graph-capturable target; checks it against the plain one."""
    import jax
    import jax.numpy as jnp

    from gdn2_jax._tilelang_ops import fused_recurrent_gdn2_inplace

    steps = 64
    for B in (1, 16, 128):
        x = make_torch_inputs(B, 1, DECODE_H, DECODE_H, seed=B)
        jx = [to_jax(x[n]) for n in ("q", "k", "v", "g", "b", "w")]
        h0 = jnp.array(to_jax(x["h0"]))

        def make_loop(graph):
            @jax.jit
            def loop(h, q, k, v, g, b, w):
                def body(i, h):
                    o, h = fused_recurrent_gdn2_inplace(q, k, v, g, b, w, h, cuda_graph=graph)
                    return h
                return jax.lax.fori_loop(0, steps, body, h)
            return loop

        plain, graph = make_loop(False), make_loop(True)
        ref = plain(h0, *jx).block_until_ready()  # loads the kernel module outside any capture
        got = graph(h0, *jx).block_until_ready()
        row = {"B": B, "graph_equal": bool(jnp.array_equal(ref, got)),
               "jax_loop_graph_step_us": host_time_us(lambda: graph(h0, *jx), jax_sync, n=5, reps=5) / steps,
               "jax_loop_plain_step_us": host_time_us(lambda: plain(h0, *jx), jax_sync, n=5, reps=5) / steps}
        print("GRAPH " + json.dumps(row), flush=True)


def decode_graph(rows, timeout=120):
    """Run :func:`decode_graph_child` in a subprocess (an XLA/graph failure cannot take the benchmark down)."""
    env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " " + GRAPH_XLA_FLAGS).strip()}
    try:
        p = subprocess.run([sys.executable, "-m", "benchmarks.bench", "--graph-child"], env=env,
                           capture_output=True, text=True, timeout=timeout)
        out, err, rc = p.stdout, p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out, err, rc = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout", -1
    got = [json.loads(line[6:]) for line in out.splitlines() if line.startswith("GRAPH ")]
    for g in got:
        for r in rows:
            if r["B"] == g["B"]:
                r.update({k: v for k, v in g.items() if k != "B"})
    if rc != 0:
        print("graph child failed:", rc, err[-1500:], flush=True)
    return {"rc": rc, "rows": got, "stderr_tail": err[-1500:] if rc else ""}


def accuracy(fla_ok, have_chunk):
    """RMS ratios vs an fp64 oracle on the same quantised inputs (spec §15 accuracy setting)."""
    import torch

    from kernels import torch_api

    out = {}
    B, T, H = 1, 512, 4
    x = make_torch_inputs(B, T, H, H, seed=123, g_scale=1.0)
    a = [x[n] for n in ("q", "k", "v", "g", "b", "w")]
    ref_o, ref_s = oracle_np(*(tnp(t) for t in a), tnp(x["h0"]), D ** -0.5)
    out["bf16_floor_o"] = rms(torch.from_numpy(ref_o).bfloat16().float().numpy(), ref_o)
    if have_chunk:
        o, s = torch_api.chunk_gdn2(*a, initial_state=x["h0"], output_final_state=True)
        out["prefill_o"], out["prefill_state"] = rms(tnp(o), ref_o), rms(tnp(s), ref_s)
    # decode: step the state through all T tokens one call at a time (what serving does)
    h = x["h0"].clone()
    os_ = []
    for t in range(T):
        o, _ = torch_api.fused_recurrent_gdn2(*(z[:, t:t + 1] for z in a), initial_state=h,
                                              inplace_final_state=True)
        os_.append(tnp(o))
    out["decode_o"], out["decode_state"] = rms(np.concatenate(os_, 1), ref_o), rms(tnp(h), ref_s)
    o, s = torch_api.fused_recurrent_gdn2(*a, initial_state=x["h0"], output_final_state=True)
    out["recurrent_T512_o"], out["recurrent_T512_state"] = rms(tnp(o), ref_o), rms(tnp(s), ref_s)
    if fla_ok:
        from fla.ops.gdn2 import chunk_gdn2 as fla_chunk
        from fla.ops.gdn2 import fused_recurrent_gdn2 as fla_rec

        with torch.inference_mode():
            o, s = fla_chunk(*a, initial_state=x["h0"], output_final_state=True)
            out["fla_chunk_o"], out["fla_chunk_state"] = rms(tnp(o), ref_o), rms(tnp(s), ref_s)
            o, s = fla_rec(*a, initial_state=x["h0"], output_final_state=True)
            out["fla_recurrent_o"], out["fla_recurrent_state"] = rms(tnp(o), ref_o), rms(tnp(s), ref_s)
    print("accuracy", json.dumps(out), flush=True)
    return out


# ------------------------------------------------------------------------------------------------------ report
def _f(x, nd=3):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    if isinstance(x, float):
        return f"{x:.{nd}f}" if abs(x) >= 1e-2 else f"{x:.2e}"
    return str(x)


def markdown(res) -> str:
    L = [f"# GDN-2 forward benchmark — {res['gpu']['name']} ({res['date']})", "",
         f"GPU: {res['gpu']['name']} (cc {res['gpu']['capability']}), driver {res['gpu'].get('driver')}, "
         f"torch CUDA {res['gpu']['torch_cuda']}. Copy bandwidth (read+write): {res['copy']['TBps']:.2f} TB/s.", "",
         "Versions: " + ", ".join(f"{k} {v}" for k, v in res["versions"].items()), "",
         "Timing: `do_bench` medians (CUDA events) for torch/FLA; host-clock loops (n back-to-back calls + sync) "
         "for every path incl. JAX (`*_host`, `jax_*`). Extra peak memory: torch peak − allocated before the call "
         "(outputs included); JAX: XLA memory analysis (outputs + temporaries − aliased).", ""]
    if res.get("notes"):
        L += ["## Notes on this run", ""] + [f"* {n}" for n in res["notes"]] + [""]
    if res["prefill"]:
        L += ["## Prefill forward (inference), bf16, D=128, with initial and final state", "",
              "| B | T | H | ours torch ms | ours JAX ms | JAX/torch(host) | FLA ms | speedup vs FLA (torch) | "
              "speedup vs FLA (JAX, host) | xla ms | extra MiB ours torch / JAX / FLA |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in res["prefill"]:
            L.append(f"| {r['B']} | {r['T']} | {r['H']} | {_f(r.get('torch_ms'))} | {_f(r.get('jax_ms'))} | "
                     f"{_f(r.get('jax_over_torch'))} | {_f(r.get('fla_ms'))} | {_f(r.get('speedup_vs_fla_torch'))} | "
                     f"{_f(r.get('speedup_vs_fla_jax'))} | {_f(r.get('xla_ms'))} | {_f(r.get('torch_extra_MiB'), 1)} / "
                     f"{_f(r.get('jax_extra_MiB'), 1)} / {_f(r.get('fla_extra_MiB'), 1)} |")
        L.append("")
    if res["decode"]:
        L += ["## Decode, one token, H=32, D=128, fp32 state [B,32,128,128]", "",
              "| B | ours torch in-place µs | ours torch new-state µs | FLA in-place µs | FLA new-state µs | "
              "speedup in-place vs FLA | state TB/s (ours in-place) | JAX loop µs/step (in-place / functional) | "
              "JAX loop µs/step, CUDA-graph target (bit-equal) | "
              "JAX call µs | JAX donated call µs | FLA in-place host µs | ours torch in-place host µs | xla call µs |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in res["decode"]:
            L.append(f"| {r['B']} | {_f(r.get('torch_inplace_us'), 1)} | {_f(r.get('torch_new_us'), 1)} | "
                     f"{_f(r.get('fla_inplace_us'), 1)} | {_f(r.get('fla_new_us'), 1)} | "
                     f"{_f(r.get('speedup_torch_inplace_vs_fla_inplace'), 2)} | {_f(r.get('torch_inplace_TBps'), 2)} | "
                     f"{_f(r.get('jax_loop_step_us'), 1)} / {_f(r.get('jax_loop_functional_step_us'), 1)} | "
                     f"{_f(r.get('jax_loop_graph_step_us'), 1)} ({r.get('graph_equal', '—')}) | "
                     f"{_f(r.get('jax_call_us'), 1)} | {_f(r.get('jax_inplace_call_us'), 1)} | "
                     f"{_f(r.get('fla_inplace_host_us'), 1)} | {_f(r.get('torch_inplace_host_us'), 1)} | "
                     f"{_f(r.get('xla_call_us'), 1)} |")
        L.append("")
    if res.get("decode_sweep"):
        keys = [k for k in res["decode_sweep"][0] if k.endswith("_us") or k.endswith("_maxdiff")]
        L += ["## Decode tile sweep (torch path, in-place state, do_bench µs; bvX_tY = V columns per block, threads)",
              "", "| B | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
        for r in res["decode_sweep"]:
            L.append(f"| {r['B']} | " + " | ".join(_f(r.get(k), 1) for k in keys) + " |")
        L.append("")
    if res.get("accuracy"):
        L += ["## Accuracy vs fp64 oracle (RMS ratio), B=1 T=512 H=4 D=128, g~U(-5,-0.1), random h0", "",
              "| quantity | value |", "|---|---|"]
        L += [f"| {k} | {_f(v)} |" for k, v in res["accuracy"].items()]
        L.append("")
    return "\n".join(L)


def plot(res, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, key in zip(axes, ("prefill", "decode")):
        if not res.get(key):
            ax.text(0.5, 0.5, f"{key}: not measured in this run", ha="center", va="center")
            ax.axis("off")
    if res["prefill"]:
        ax = axes[0]
        labels = [f"{r['B']},{r['T']},{r['H']}" for r in res["prefill"]]
        xs = np.arange(len(labels))
        for i, (key, lab) in enumerate([("torch_ms", "ours (torch)"), ("jax_ms", "ours (JAX)"),
                                        ("fla_ms", "FLA 0.6.0")]):
            ys = [r.get(key) or 0 for r in res["prefill"]]
            ax.bar(xs + (i - 1) * 0.27, ys, 0.27, label=lab)
        ax.set_xticks(xs, labels, rotation=20)
        ax.set_ylabel("ms")
        ax.set_title("prefill forward (B,T,H), bf16 D=128")
        ax.legend()
    if res["decode"]:
        ax = axes[1]
        Bs = [r["B"] for r in res["decode"]]
        for key, lab in [("torch_inplace_us", "ours in-place (torch)"), ("jax_loop_step_us", "ours (JAX loop/step)"),
                         ("fla_inplace_us", "FLA in-place"), ("fla_new_us", "FLA new state")]:
            ys = [r.get(key) for r in res["decode"]]
            if any(y is not None for y in ys):
                ax.plot(Bs, ys, marker="o", label=lab)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch B (H=32)")
        ax.set_ylabel("µs per token")
        ax.set_title("decode, one token")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--skip-xla", action="store_true")
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--quick", action="store_true", help="two shapes per section")
    ap.add_argument("--decode-sweep", action="store_true", help="also sweep decode tiles (block_v, threads)")
    ap.add_argument("--skip-graph", action="store_true", help="skip the CUDA-graph JAX decode loop (subprocess)")
    ap.add_argument("--graph-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--replot", metavar="JSON", help="only rewrite the markdown and plot of a saved result file")
    ap.add_argument("--xla-max-tokens", type=int, default=1 << 19,
                    help="skip backend='xla' prefill above this B*T*H")
    args = ap.parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if args.graph_child:
        return decode_graph_child()
    if args.replot:
        res = json.loads(Path(args.replot).read_text())
        Path(args.replot).with_suffix(".md").write_text(markdown(res))
        print("plot:", plot(res, Path(args.replot).with_suffix(".png")))
        return 0
    import torch

    from gdn2_jax import _tilelang_ops

    have_chunk = "chunk_gdn2" in _tilelang_ops.IMPLEMENTED
    try:
        import fla.ops.gdn2  # noqa: F401

        fla_ok = True
    except Exception as e:
        print("FLA not importable:", e)
        fla_ok = False
    res = {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "gpu": gpu_info(),
           "versions": versions(), "have_chunk_kernels": have_chunk, "argv": sys.argv, "prefill": [], "decode": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = res["gpu"]["name"].replace("NVIDIA ", "").replace(" ", "-").lower() + "-" + res["date"][:10]

    def save():  # after every section, so a run cut short still leaves its numbers
        (out / f"bench-{tag}.json").write_text(json.dumps(res, indent=1))
        (out / f"bench-{tag}.md").write_text(markdown(res))

    res["copy"] = copy_bandwidth()
    print("copy", json.dumps(res["copy"]), flush=True)
    if args.decode_sweep:
        res["decode_sweep"] = decode_sweep(fla_ok)
        save()
    # most important first: a run cut short by its time limit keeps what it measured (saved after each section)
    if not args.skip_decode:
        bench_decode(args, res["decode"], fla_ok)
        save()
    if not args.skip_accuracy:
        res["accuracy"] = accuracy(fla_ok, have_chunk)
        save()
    if not args.skip_prefill:
        bench_prefill(args, res["prefill"], fla_ok, have_chunk, save)
    if not args.skip_decode and not args.skip_graph:
        res["decode_graph"] = decode_graph(res["decode"])
        save()
    if not args.skip_prefill and not args.skip_xla:
        bench_prefill_xla(args, res["prefill"], save)
    save()
    plotted = plot(res, out / f"bench-{tag}.png")
    print(markdown(res))
    print("wrote", out / f"bench-{tag}.json", "(plot)" if plotted else "(no matplotlib: no plot)")
    del torch


if __name__ == "__main__":
    main()

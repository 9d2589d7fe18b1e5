"""One-command benchmark of gdn2-jax against FLA 0.6.0 (docs: /work/shared/docs/benchmark-contract.md).

    python -m benchmarks.bench --out benchmarks/results                 # full grid (~6 min on an H200)
    python -m benchmarks.bench --quick                                  # two shapes per section
    python -m benchmarks.bench --sections prefill,decode                # some sections only
    python -m benchmarks.bench --decode-sweep                           # also the decode tile sweep (torch path)
    python -m benchmarks.bench --precompile [--arch sm_90a] [-j 8]      # build the kernels it uses (no GPU needed)
    python -m benchmarks.bench --replot benchmarks/results/latest.json  # rewrite the .md / .png of a result file
    python -m benchmarks.bench --selftest                               # CPU dry test of the pure-Python parts

Writes ``<out>/<gpu>-<date>.{json,md,png}`` and the same JSON as ``<out>/latest.json``; the JSON and markdown are
rewritten after every measured shape, so a run cut short keeps what it measured. Sections (all in one process,
ours and FLA timed shape by shape; compile / autotune time excluded by warm-up calls):

* ``prefill``: ``jax.jit`` of the public ``chunk_gdn2(..., initial_state=h0, output_final_state=True)`` (default
  backend) vs FLA ``chunk_gdn2`` under ``torch.inference_mode()``; plus the same kernels through torch
  (``kernels.torch_api``), each kernel launch alone (``stage_ms``), extra memory and the memory floor.
* ``train``: ``jax.jit(jax.value_and_grad(loss, argnums=(0..5)))``, ``loss = sum(o.astype(f32) * do)``, vs FLA's
  forward + ``backward()``.
* ``decode``: paths scan / donated / call / pool / spec4 through the public ``fused_recurrent_gdn2``
  (``backend="tilelang"``) and our kernel through torch, vs FLA ``fused_recurrent_gdn2_fwd(inplace_final_state=True)``;
  ``jit_floor``: a jitted step with ``donated``'s arguments and donation and a trivial body (JAX's dispatch floor).
* ``graph``: the ``scan`` path with CUDA-graph capturable targets (``GDN2_JAX_CUDA_GRAPH=1``, XLA command buffers), in
  a child process with a time limit (rows with path ``scan_graph``).
* ``accuracy``: RMS error ratios vs an fp64 oracle of ours and FLA on the same inputs (prefill o / state, decode
  after a 128-token in-place loop, gradients of q, k, v, g, b, w, h0).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from . import bench_lib as L
from .bench_lib import ARGS, D, attempt, ratio, record_error
from .bench_report import TIMING, markdown, plot

PREFILL_GRID = [(1, 4096, 16), (1, 16384, 16), (4, 4096, 32), (8, 2048, 32), (1, 32768, 32), (16, 1024, 32)]
QUICK_PREFILL = [PREFILL_GRID[0], PREFILL_GRID[3]]  # one H = 16 and one H = 32 shape
DECODE_B = [1, 4, 16, 64, 128]
QUICK_DECODE_B = [1, 128]
DECODE_H = 32
DECODE_BACKEND = "tilelang"  # the public op's backend on the decode paths (the CPU selftest sets "xla")
ACC_PREFILL, ACC_DECODE, ACC_TRAIN = (1, 512, 4), (1, 128, 4), (1, 256, 2)  # accuracy cases (B, T, H)
SECTIONS = ("prefill", "train", "decode", "graph", "accuracy", "sweep")
DEFAULT_SECTIONS = "prefill,train,decode,accuracy,graph"  # the experimental CUDA-graph child last

# timing parameters (kept small: the decode section must take < 60 s, the whole run ~6 min)
DECODE_STEPS = 100      # host-loop steps per repeat (one-token paths); 5 repeats
SCAN_CALLS = 10         # host-loop calls of the 16-token scan per repeat (160 tokens)
DECODE_BENCH = dict(warmup=10, rep=40)    # do_bench ms for decode
PREFILL_BENCH = dict(warmup=25, rep=100)
TRAIN_BENCH = dict(warmup=25, rep=200)
# XLA converts a while loop into a command buffer only when every thunk of its body is convertible; a scan's
# per-step slice of its inputs is a dynamic memcpy (command type DYNAMIC_SLICE_COPY_FUSION, which the flag parser
# of jaxlib 0.10-0.11 rejects) unless dynamic-slice fusion folds the slice into its consumer (DYNAMIC_SLICE_FUSION)
GRAPH_XLA_FLAGS = ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL,"
                   "DYNAMIC_SLICE_FUSION --xla_gpu_enable_dynamic_slice_fusion=true --xla_gpu_graph_min_graph_size=1")
GRAPH_XLA_FLAGS_MIN = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,WHILE,CONDITIONAL"


class Ctx:
    """What every section needs: the result dict, where to save it, the copy bandwidth and what is importable."""

    def __init__(self, args, res, out: Path, tag: str):
        self.args, self.res, self.out, self.tag = args, res, out, tag
        self.fla_ok = False
        self.kernels_ok = True
        budget = getattr(args, "time_budget", None)
        self.deadline = time.time() + budget if budget else None

    def left_s(self):
        """Seconds left of ``--time-budget`` (inf without one)."""
        return float("inf") if self.deadline is None else self.deadline - time.time()

    def skip(self, row) -> bool:
        """True (and the row marked) when ``--time-budget`` is spent: the remaining shapes are skipped."""
        if self.left_s() > 0:
            return False
        row["error"] = row.setdefault("errors", {})["skipped"] = "skipped: --time-budget spent"
        return True

    @property
    def copy_TBps(self):
        return (self.res.get("copy") or {}).get("TBps")

    def save(self, with_plot=False):
        """Rewrite ``<tag>.json``, ``latest.json`` and ``<tag>.md`` (atomically); the PNG when asked."""
        self.out.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.res, indent=1, default=_json_default)
        for name in (f"{self.tag}.json", "latest.json"):
            _atomic_write(self.out / name, text)
        try:
            _atomic_write(self.out / f"{self.tag}.md", markdown(self.res))
        except Exception as e:  # a report bug must not lose the measurements
            print("markdown failed:", repr(e), flush=True)
        if with_plot:
            try:
                plot(self.res, self.out / f"{self.tag}.png")
            except Exception as e:
                print("plot failed:", repr(e), flush=True)


def _json_default(x):
    try:
        return float(x)
    except Exception:
        return str(x)


def _atomic_write(path: Path, text: str):
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _free():
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    except Exception:
        pass


def _log(section, row):
    keep = {k: v for k, v in row.items() if not isinstance(v, dict) or k in ("stage_ms", "errors")}
    print(section, json.dumps(keep, default=_json_default), flush=True)


# ------------------------------------------------------------------------------------------------------ copy
def copy_bandwidth():
    """Device-to-device copy of 2 GiB with torch (``do_bench`` median), read + write bytes counted."""
    import torch

    n = 2 * 2**30 // 4
    a = torch.randn(n, device="cuda")
    b = torch.empty_like(a)
    ms = L.event_ms(lambda: b.copy_(a), warmup=25, rep=200)
    a = b = None  # noqa: F841  (free the 4 GiB before the sections run)
    torch.cuda.empty_cache()
    return {"bytes_rw": 2 * n * 4, "ms": ms, "TBps": 2 * n * 4 / (ms * 1e-3) / 1e12, "method": "torch copy_, do_bench"}


# --------------------------------------------------------------------------------------------------- prefill
def _grid_section(ctx: Ctx, name: str, row_fn, seed0: int, extra=()):
    """One row per prefill/train grid shape: measured by ``row_fn(ctx, row, seed)``, saved after each shape."""
    rows = ctx.res[name]
    for i, (B, T, H) in enumerate(QUICK_PREFILL if ctx.args.quick else PREFILL_GRID):
        row = {"B": B, "T": T, "H": H, "HV": H, "K": D, "V": D, "ours_ms": None, "fla_ms": None, "speedup": None}
        row.update({k: None for k in extra})
        rows.append(row)
        if ctx.skip(row):
            continue
        try:
            row_fn(ctx, row, seed=seed0 + i)
        except Exception as e:
            record_error(row, "row", e)
        _free()
        _log(name, row)
        ctx.save()


def section_prefill(ctx: Ctx):
    _grid_section(ctx, "prefill", _prefill_row, 100)


def _measure_jax(row, f, jx, *, target_s):
    """Our jitted JAX function ``f(*jx)``: compiled memory (``ours_peak_MiB``) and host-loop time (``ours_ms``)."""
    mem = attempt(row, "ours_mem", lambda: L.jax_compiled_memory(f, *jx))
    if mem:
        row["ours_peak_MiB"], row["ours_mem"] = mem["total_MiB"], mem
    t = attempt(row, "ours", lambda: L.host_ms(lambda: f(*jx), L.jax_sync, target_s=target_s))
    if t:
        row["ours_ms"], row["ours_n"] = t


def _prefill_row(ctx: Ctx, row, seed):
    import torch

    from gdn2_jax import backends

    B, T, H, HV = row["B"], row["T"], row["H"], row["HV"]
    nb = L.prefill_bytes(B, T, H, HV)
    row["floor_bytes"], row["floor_ms"] = nb, L.floor_ms(nb, ctx.copy_TBps)
    row["ours_backend"] = attempt(row, "backend", lambda: backends.resolve("auto", "chunk_gdn2"))
    x = L.torch_inputs(B, T, H, HV, seed=seed)
    a, h0 = [x[n] for n in ARGS], x["h0"]

    # ours: the public op through JAX, as a user calls it
    jx = [L.to_jax(x[n]) for n in ARGS + ("h0",)]
    jf = L.jax_prefill_fn()
    _measure_jax(row, jf, jx, target_s=0.05)

    # the same kernels through torch, whole pipeline and launch by launch
    if ctx.kernels_ok:
        from kernels import torch_api

        def ours_t():
            return torch_api.chunk_gdn2(*a, initial_state=h0, output_final_state=True)

        row["torch_ms"] = attempt(row, "torch", lambda: L.event_ms(ours_t, **PREFILL_BENCH))
        t = attempt(row, "torch_host", lambda: L.host_ms(ours_t, L.torch_sync, target_s=0.05))
        row["torch_host_ms"] = t[0] if t else None
        row["torch_peak_MiB"] = attempt(row, "torch_peak", lambda: L.torch_extra_peak_mib(ours_t))

        # host loops of both paths alternated, so that clock drift hits both (the device time of each path, from
        # a CUPTI trace, is benchmarks.jax_cost_probe's: a trace in this process could slow the later sections)
        alt = attempt(row, "alternated", lambda: L.alternated_ratios(lambda: jf(*jx), L.jax_sync, ours_t, L.torch_sync))
        row["jax_over_torch_alt_rounds"] = alt
        row["jax_over_torch_alt"] = statistics.median(alt) if alt else None

        def stages():
            from kernels import registry  # (the launches the public call runs: its per-call options too)

            call = registry.get("chunk_gdn2").options_for_call(N=B, HV=HV, V=L.D)
            calls = L.stage_callables(L.chunk_pipeline(H, HV, **call), {n: x[n] for n in ARGS + ("h0",)})
            return {name: L.event_ms(c, **PREFILL_BENCH) for name, c in calls}

        row["stage_ms"] = attempt(row, "stages", stages)
        if row["stage_ms"]:
            tot = sum(row["stage_ms"].values())
            row["stage_sum_ms"] = tot
            row["stage_share"] = {k: v / tot for k, v in row["stage_ms"].items()} if tot else None

    if ctx.fla_ok:
        from fla.ops.gdn2 import chunk_gdn2 as fla_chunk

        def fla_f():
            with torch.inference_mode():
                return fla_chunk(*a, initial_state=h0, output_final_state=True)

        row["fla_ms"] = attempt(row, "fla", lambda: L.event_ms(fla_f, **PREFILL_BENCH))
        t = attempt(row, "fla_host", lambda: L.host_ms(fla_f, L.torch_sync, target_s=0.05))
        row["fla_host_ms"] = t[0] if t else None
        row["fla_peak_MiB"] = attempt(row, "fla_peak", lambda: L.torch_extra_peak_mib(fla_f))

    row["speedup"] = ratio(row.get("fla_ms"), row.get("ours_ms"))
    row["speedup_host"] = ratio(row.get("fla_host_ms"), row.get("ours_ms"))
    row["speedup_torch"] = ratio(row.get("fla_ms"), row.get("torch_ms"))
    row["jax_over_torch"] = ratio(row.get("ours_ms"), row.get("torch_ms"))
    row["jax_over_torch_host"] = ratio(row.get("ours_ms"), row.get("torch_host_ms"))
    row["ours_over_floor"] = ratio(row.get("ours_ms"), row.get("floor_ms"))
    row["fla_over_floor"] = ratio(row.get("fla_ms"), row.get("floor_ms"))


# ----------------------------------------------------------------------------------------------------- train
def section_train(ctx: Ctx):
    _grid_section(ctx, "train", _train_row, 200, extra=("ours_peak_MiB", "fla_peak_MiB"))


def _train_row(ctx: Ctx, row, seed):

    from gdn2_jax import backends

    B, T, H, HV = row["B"], row["T"], row["H"], row["HV"]
    row["ours_backend"] = attempt(row, "backend", lambda: backends.resolve("auto", "chunk_gdn2"))
    x = L.torch_inputs(B, T, H, HV, seed=seed, h0=False)
    do = L.randn((B, T, HV, D), seed + 1)
    L.torch_sync()

    jx = [L.to_jax(x[n]) for n in ARGS] + [L.to_jax(do)]
    _measure_jax(row, L.jax_train_fn(), jx, target_s=0.1)

    if ctx.fla_ok:
        from fla.ops.gdn2 import chunk_gdn2 as fla_chunk

        leaves = [x[n].detach().clone().requires_grad_(True) for n in ARGS]

        def step():
            o, _ = fla_chunk(*leaves)
            (o.float() * do).sum().backward()

        def step_fresh():  # gradients from scratch each step (no accumulation kernel)
            for p in leaves:
                p.grad = None
            step()

        row["fla_ms"] = attempt(row, "fla", lambda: L.event_ms(step, grad_to_none=leaves, **TRAIN_BENCH))
        t = attempt(row, "fla_host", lambda: L.host_ms(step_fresh, L.torch_sync, target_s=0.1))
        row["fla_host_ms"] = t[0] if t else None
        for p in leaves:
            p.grad = None
        row["fla_peak_MiB"] = attempt(row, "fla_peak", lambda: L.torch_extra_peak_mib(step_fresh))
        for p in leaves:
            p.grad = None
    row["speedup"] = ratio(row.get("fla_ms"), row.get("ours_ms"))
    row["speedup_host"] = ratio(row.get("fla_host_ms"), row.get("ours_ms"))


# ---------------------------------------------------------------------------------------------------- decode
def _drow(B, path, tokens=1):
    return {"B": B, "H": DECODE_H, "HV": DECODE_H, "K": D, "V": D, "path": path, "tokens_per_step": tokens,
            "ours_us": None, "fla_inplace_us": None, "speedup": None, "state_TBps": None}


def _finish_drow(ctx: Ctx, row, state_bytes, fla: dict):
    row["state_bytes"] = state_bytes
    row["fla_inplace_us"] = fla.get("us")
    row["fla_inplace_host_us"] = fla.get("host_us")
    if fla.get("errors"):
        row.setdefault("errors", {}).update({f"fla.{k}": v for k, v in fla["errors"].items()})
        row.setdefault("error", next(iter(row["errors"].values())))
    us = row.get("ours_us")
    row["ours_us_per_token"] = us / row["tokens_per_step"] if us else None
    row["speedup"] = ratio(row["fla_inplace_us"], us)
    host = row.get("ours_host_us") if row["timing"] == "do_bench" else us  # like for like: host loop vs host loop
    row["speedup_host"] = ratio(row["fla_inplace_host_us"], host)
    # jit_floor moves no state: no bandwidth; its speedup (FLA / floor) is the ceiling of any jitted donated step
    moves = row["path"] != "jit_floor"
    row["state_TBps"] = state_bytes / (us * 1e-6) / 1e12 if us and moves else None
    row["copy_frac"] = ratio(row["state_TBps"], ctx.copy_TBps)
    if row["fla_inplace_us"]:
        row["fla_state_TBps"] = state_bytes / (row["fla_inplace_us"] * 1e-6) / 1e12
        row["fla_copy_frac"] = ratio(row["fla_state_TBps"], ctx.copy_TBps)


def _fla_time(holder, fn):
    """FLA in-place call: do_bench (``us``) and the host-clock loop (``host_us``) into ``holder``."""
    holder["us"] = attempt(holder, "do_bench", lambda: L.event_ms(fn, **DECODE_BENCH) * 1e3)
    t = attempt(holder, "host", lambda: L.host_ms(fn, L.torch_sync, n=DECODE_STEPS, warm=5))
    holder["host_us"] = t[0] * 1e3 if t else None
    return holder


def section_decode(ctx: Ctx):
    rows = ctx.res["decode"]
    fns = attempt(ctx.res.setdefault("decode_meta", {}), "jax_fns", lambda: L.jax_decode_fns(DECODE_BACKEND))
    for B in (QUICK_DECODE_B if ctx.args.quick else DECODE_B):
        t0 = time.time()
        if ctx.skip(row := _drow(B, "all")):
            rows.append(row)
            continue
        try:
            _decode_batch(ctx, rows, B, fns)
        except Exception as e:
            row = _drow(B, "setup")
            record_error(row, "setup", e)
            rows.append(row)
        _free()
        ctx.res["decode_meta"][f"B{B}_s"] = time.time() - t0
        ctx.save()


def _decode_batch(ctx: Ctx, rows, B, fns):
    import jax.numpy as jnp

    H = DECODE_H
    S, Lt = L.SCAN_STEPS, L.SPEC_L
    x = L.torch_inputs(B, S, H, H, seed=B)
    a1 = [x[n][:, :1].contiguous() for n in ARGS]
    a4 = [x[n][:, :Lt].contiguous() for n in ARGS]
    h0 = x["h0"]
    L.torch_sync()
    one = L.decode_state_bytes(B, H)  # read + write of [B, HV, K, V] fp32
    jx1 = [L.to_jax(t) for t in a1]
    fla_plain, fla_pool, fla_spec = {}, {}, {}
    if ctx.fla_ok:
        from fla.ops.gdn2.fused_recurrent import fused_recurrent_gdn2_fwd as fla_fwd

        h_f = h0.clone()
        _fla_time(fla_plain, lambda: fla_fwd(*a1, initial_state=h_f, output_final_state=True,
                                            inplace_final_state=True))

    def add(row, state_bytes, fla):
        _finish_drow(ctx, row, state_bytes, fla)
        rows.append(row)
        _log("decode", row)
        ctx.save()

    # torch: our kernel through kernels.torch_api, in place (kernel time vs host overhead)
    if ctx.kernels_ok:
        from kernels import torch_api

        row = _drow(B, "torch")
        row["timing"] = "do_bench"
        h_t = h0.clone()

        def tf():
            return torch_api.fused_recurrent_gdn2(*a1, initial_state=h_t, inplace_final_state=True)

        row["ours_us"] = attempt(row, "ours", lambda: L.event_ms(tf, **DECODE_BENCH) * 1e3)
        t = attempt(row, "ours_host", lambda: L.host_ms(tf, L.torch_sync, n=DECODE_STEPS, warm=5))
        row["ours_host_us"] = t[0] * 1e3 if t else None
        del h_t
        add(row, one, fla_plain)

    def jax_row(path, make, per_call_tokens=1, n=DECODE_STEPS, tokens=1):
        row = _drow(B, path, tokens)
        row["timing"] = "host loop"
        if fns is None:
            row["error"] = "jax step functions unavailable (see decode_meta.errors)"
            return row

        def run():
            step = make()
            ms, nn = L.host_ms(step, L.jax_sync, n=n, warm=5)
            row["steps_timed"] = nn * 5 * per_call_tokens
            return ms * 1e3 / per_call_tokens

        row["ours_us"] = attempt(row, "ours", run)
        return row

    # scan: 16 tokens per jitted call, state carried through lax.scan and donated between calls
    xs = [jnp.moveaxis(L.to_jax(x[n]), 1, 0)[:, :, None] for n in ARGS]  # [S, B, 1, ...]
    add(jax_row("scan", lambda: L.Carry(fns["scan"], L.to_jax_owned(h0), *xs), per_call_tokens=S, n=SCAN_CALLS),
        one, fla_plain)
    add(jax_row("donated", lambda: L.Carry(fns["donated"], L.to_jax_owned(h0), *jx1)), one, fla_plain)
    # jit_floor: donated's arguments and donation, trivial body (modifies one element of its own copy of h0)
    add(jax_row("jit_floor", lambda: L.Carry(fns["floor"], L.to_jax_owned(h0), *jx1)), one, fla_plain)
    add(jax_row("call", lambda: L.Carry(fns["call"], L.to_jax_owned(h0), *jx1)), one, fla_plain)

    # pool: continuous batching, pool [2B] updated at B random slots
    P = 2 * B
    pool_t = L.randn((P, H, D, D), B + 7)
    idx = L.pool_indices(B, P, seed=B)
    idx_t = L.to_device(idx)
    L.torch_sync()
    if ctx.fla_ok:
        _fla_time(fla_pool, lambda: fla_fwd(*a1, initial_state=pool_t, output_final_state=True,
                                           inplace_final_state=True, ssm_state_indices=idx_t))
    row = jax_row("pool", lambda: L.Carry(fns["pool"], L.to_jax_owned(pool_t), *jx1, jnp.asarray(idx)))
    if ctx.kernels_ok:
        row["torch_us"] = attempt(row, "torch", lambda: L.event_ms(
            lambda: torch_api.fused_recurrent_gdn2(*a1, initial_state=pool_t, ssm_state_indices=idx_t),
            **DECODE_BENCH) * 1e3)
    row["pool_slots"] = P
    add(row, one, fla_pool)
    del pool_t

    # spec4: 4 draft tokens per sequence, per-token slots [B, 4] of a pool [8B], num_accepted_tokens in [1, 4]
    P = 2 * Lt * B
    pool_t = L.randn((P, H, D, D), B + 8)
    idx = L.pool_indices(B, P, L=Lt, seed=B)
    nacc = L.accepted_tokens(B, Lt, seed=B)
    idx_t, nacc_t = L.to_device(idx), L.to_device(nacc)
    jx4 = [L.to_jax(t) for t in a4]
    L.torch_sync()
    if ctx.fla_ok:
        _fla_time(fla_spec, lambda: fla_fwd(*a4, initial_state=pool_t, output_final_state=True,
                                           inplace_final_state=True, ssm_state_indices=idx_t,
                                           num_accepted_tokens=nacc_t))
    row = jax_row("spec4", lambda: L.Carry(fns["spec"], L.to_jax_owned(pool_t), *jx4, jnp.asarray(idx),
                                           jnp.asarray(nacc)), tokens=Lt)
    if ctx.kernels_ok:
        row["torch_us"] = attempt(row, "torch", lambda: L.event_ms(
            lambda: torch_api.fused_recurrent_gdn2(*a4, initial_state=pool_t, ssm_state_indices=idx_t,
                                                   num_accepted_tokens=nacc_t), **DECODE_BENCH) * 1e3)
    row["pool_slots"] = P
    add(row, L.decode_state_bytes(B, H, reads=1, writes=Lt), fla_spec)


# ------------------------------------------------------------------------------------------- CUDA-graph child
def graph_child(bs: list[int]):
    """(Child process, XLA command buffers on) the ``scan`` path with CUDA-graph capturable targets vs the plain
    targets, per B: bitwise equality of outputs and state, and per-token host-loop times. Prints ``GRAPH {json}``."""
    import jax
    import jax.numpy as jnp

    S, H = L.SCAN_STEPS, DECODE_H
    for B in bs:
        row = {"B": B, "path": "scan_graph"}
        try:
            key = jax.random.PRNGKey(B)
            ks = jax.random.split(key, 7)
            nrm = lambda z: z / jnp.linalg.norm(z, axis=-1, keepdims=True)  # noqa: E731
            shp = (S, B, 1, H, D)
            xs = [nrm(jax.random.normal(ks[0], shp)).astype(jnp.bfloat16),
                  nrm(jax.random.normal(ks[1], shp)).astype(jnp.bfloat16),
                  (0.5 * jax.random.normal(ks[2], shp)).astype(jnp.bfloat16),
                  0.02 * jax.random.uniform(ks[3], shp, minval=-5.0, maxval=-0.1),
                  jax.random.uniform(ks[4], shp).astype(jnp.bfloat16),
                  jax.random.uniform(ks[5], shp).astype(jnp.bfloat16)]
            h = jax.random.normal(ks[6], (B, H, D, D))
            compiled = {}
            for mode, flag in (("plain", "0"), ("graph", "1")):  # the flag is read when the op is traced
                os.environ["GDN2_JAX_CUDA_GRAPH"] = flag
                compiled[mode] = L.jax_decode_fns(DECODE_BACKEND)["scan"].lower(h, *xs).compile()
            os.environ.pop("GDN2_JAX_CUDA_GRAPH", None)
            ref = compiled["plain"](jnp.array(h, copy=True), *xs)
            got = compiled["graph"](jnp.array(h, copy=True), *xs)
            row["graph_equal"] = bool(all(jnp.array_equal(r, g) for r, g in zip(ref, got)))
            for mode, key_ in (("graph", "ours_us"), ("plain", "plain_in_child_us")):
                ms, n = L.host_ms(L.Carry(compiled[mode], jnp.array(h, copy=True), *xs), L.jax_sync, n=SCAN_CALLS,
                                  warm=3)
                row[key_] = ms * 1e3 / S
            row["steps_timed"] = n * 5 * S
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:600]
        print("GRAPH " + json.dumps(row), flush=True)


def _run_graph_child(bs, flags, timeout):
    env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " " + flags).strip(), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "benchmarks.bench", "--graph-child", ",".join(map(str, bs))]
    try:
        p = subprocess.run(cmd, env=env, cwd=L.REPO, capture_output=True, text=True, timeout=timeout)
        out, err, rc = p.stdout, p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        dec = lambda s: s.decode(errors="replace") if isinstance(s, bytes) else (s or "")  # noqa: E731
        out, err, rc = dec(e.stdout), dec(e.stderr) + f"\n[timeout after {timeout} s]", "timeout"
    got = []
    for line in out.splitlines():
        if line.startswith("GRAPH "):
            try:
                got.append(json.loads(line[6:]))
            except json.JSONDecodeError:
                pass
    return got, err, rc


def section_graph(ctx: Ctx):
    bs = QUICK_DECODE_B if ctx.args.quick else DECODE_B
    t0 = time.time()
    flags = GRAPH_XLA_FLAGS
    timeout = min(ctx.args.graph_timeout, ctx.left_s())
    if timeout < 20:
        ctx.res["graph_child"] = {"rc": None, "skipped": "--time-budget spent"}
        return
    got, err, rc = _run_graph_child(bs, flags, timeout)
    if not got and rc not in (0, "timeout"):  # e.g. an XLA flag this jaxlib does not know: retry with the minimum
        print("graph child failed:", rc, err[-800:], "-- retrying with", GRAPH_XLA_FLAGS_MIN, flush=True)
        flags = GRAPH_XLA_FLAGS_MIN
        got, err, rc = _run_graph_child(bs, flags, min(ctx.args.graph_timeout, ctx.left_s()))
    scan = {r["B"]: r for r in ctx.res["decode"] if r.get("path") == "scan"}
    fla_src = {r["B"]: r for r in ctx.res["decode"] if r.get("path") in ("scan", "donated", "torch")}
    for g in got:
        row = _drow(g["B"], "scan_graph")
        row["timing"] = "host loop"
        row.update({k: v for k, v in g.items() if k not in ("B", "path")})
        if g.get("error"):
            row["errors"] = {"child": g["error"]}
        src = scan.get(g["B"]) or fla_src.get(g["B"]) or {}
        fla = {"us": src.get("fla_inplace_us"), "host_us": src.get("fla_inplace_host_us")}
        _finish_drow(ctx, row, L.decode_state_bytes(g["B"], DECODE_H), fla)
        ctx.res["decode"].append(row)
        _log("decode", row)
    missing = [B for B in bs if B not in {g["B"] for g in got}]
    for B in missing:  # the child died or timed out before this batch
        row = _drow(B, "scan_graph")
        row["timing"] = "host loop"
        row["error"] = f"child process rc={rc}, no result: {err.strip()[-300:]}"
        ctx.res["decode"].append(row)
    ctx.res["graph_child"] = {"rc": rc, "s": time.time() - t0, "xla_flags": flags,
                              "stderr_tail": err[-2000:] if rc != 0 else ""}
    if rc != 0:
        print("graph child failed:", rc, err[-1500:], flush=True)
    ctx.save()


# -------------------------------------------------------------------------------------------------- accuracy
def _arow(case, quantity, **kw):
    r = {"case": case, "quantity": quantity, "ours": None, "fla": None, "oracle": "fp64"}
    r.update(kw)
    return r


def section_accuracy(ctx: Ctx):
    rows = ctx.res["accuracy"]
    for fn in (_acc_prefill, _acc_decode, _acc_train):
        holder = {}
        if ctx.skip(holder):
            rows.append(_arow(fn.__name__, "skipped", **holder))
            continue
        try:
            fn(ctx, rows)
        except Exception as e:
            record_error(holder, fn.__name__, e)
            rows.append(_arow(fn.__name__, "setup", errors=holder["errors"], error=holder["error"]))
        _free()
        ctx.save()


def _acc_case(rows, shape, case, seed, state_name):
    """Spec §15 accuracy inputs of ``shape`` (B, T, H), their fp64 oracle and the two result rows (o, state),
    appended to ``rows``. Returns ``(x, args, h0, ref_o, ref_state, o_row, state_row)``."""
    B, T, H = shape
    x = L.torch_inputs(B, T, H, H, seed=seed, g_scale=1.0)
    a, h0 = [x[n] for n in ARGS], x["h0"]
    ref_o, ref_s = L.oracle_np(*(L.tnp(t) for t in a), L.tnp(h0), D ** -0.5)
    case = case.format(B=B, T=T, H=H, D=D)
    ro, rs = _arow(case, "o", bf16_floor=L.bf16_floor(ref_o)), _arow(case, state_name)
    rows += [ro, rs]
    return x, a, h0, ref_o, ref_s, ro, rs


def _acc_prefill(ctx: Ctx, rows):
    import torch

    x, a, h0, ref_o, ref_s, ro, rs = _acc_case(rows, ACC_PREFILL, "prefill B{B} T{T} H{H} D{D}", 123, "final_state")

    def ours():
        o, s = L.jax_prefill_fn()(*[L.to_jax(x[n]) for n in ARGS + ("h0",)])
        ro["ours"], rs["ours"] = L.rms(L.tnp(o), ref_o), L.rms(L.tnp(s), ref_s)

    attempt(ro, "ours", ours)
    if ctx.kernels_ok:
        from kernels import torch_api

        def ours_t():
            o, s = torch_api.chunk_gdn2(*a, initial_state=h0, output_final_state=True)
            ro["ours_torch"], rs["ours_torch"] = L.rms(L.tnp(o), ref_o), L.rms(L.tnp(s), ref_s)

        attempt(ro, "ours_torch", ours_t)
    if ctx.fla_ok:
        from fla.ops.gdn2 import chunk_gdn2 as fla_chunk

        def fla():
            with torch.inference_mode():
                o, s = fla_chunk(*a, initial_state=h0, output_final_state=True)
            ro["fla"], rs["fla"] = L.rms(L.tnp(o), ref_o), L.rms(L.tnp(s), ref_s)

        attempt(ro, "fla", fla)
    _log("accuracy", ro)
    _log("accuracy", rs)


def _acc_decode(ctx: Ctx, rows):
    x, a, h0, ref_o, ref_s, ro, rs = _acc_case(rows, ACC_DECODE, "decode B{B} H{H} D{D}, {T}-token in-place loop",
                                               321, "state")
    B, T, H = ACC_DECODE

    def ours():  # the public op, backend="tilelang", inplace_final_state=True, state donated, one call per token
        import jax.numpy as jnp

        step = L.jax_decode_fns(DECODE_BACKEND)["donated"]
        h = L.to_jax_owned(h0)
        toks = [[L.to_jax(x[n][:, t:t + 1].contiguous()) for n in ARGS] for t in range(T)]
        os_ = []
        for t in range(T):
            o, h = step(h, *toks[t])
            os_.append(o)
        ro["ours"], rs["ours"] = L.rms(L.tnp(jnp.concatenate(os_, axis=1)), ref_o), L.rms(L.tnp(h), ref_s)

    attempt(ro, "ours", ours)
    if ctx.kernels_ok:
        import torch

        from kernels import torch_api

        def ours_t():
            h = h0.clone()
            os_ = [torch_api.fused_recurrent_gdn2(*(z[:, t:t + 1].contiguous() for z in a), initial_state=h,
                                                  inplace_final_state=True)[0] for t in range(T)]
            ro["ours_torch"], rs["ours_torch"] = L.rms(L.tnp(torch.cat(os_, 1)), ref_o), L.rms(L.tnp(h), ref_s)

        attempt(ro, "ours_torch", ours_t)
    if ctx.fla_ok:
        import torch
        from fla.ops.gdn2.fused_recurrent import fused_recurrent_gdn2_fwd as fla_fwd

        def fla():
            h = h0.clone()
            os_ = [fla_fwd(*(z[:, t:t + 1].contiguous() for z in a), initial_state=h, output_final_state=True,
                           inplace_final_state=True)[0] for t in range(T)]
            ro["fla"], rs["fla"] = L.rms(L.tnp(torch.cat(os_, 1)), ref_o), L.rms(L.tnp(h), ref_s)

        attempt(ro, "fla", fla)
    _log("accuracy", ro)
    _log("accuracy", rs)


def _acc_train(ctx: Ctx, rows):

    B, T, H = ACC_TRAIN
    case = f"train grads B{B} T{T} H{H} D{D}"
    names = ARGS + ("h0",)
    x = L.torch_inputs(B, T, H, H, seed=77, g_scale=1.0)
    do = L.randn((B, T, H, D), 78)
    dht = L.randn((B, H, D, D), 79)
    L.torch_sync()
    ref = L.oracle_grads_fp64({n: L.tnp(x[n]) for n in names}, L.tnp(do), L.tnp(dht), D ** -0.5)
    rr = {n: _arow(case, f"d{n}") for n in names}
    rows += list(rr.values())
    first = rr["q"]

    def ours():
        grads = L.jax_grad_with_state_fn()(*[L.to_jax(x[n]) for n in names], L.to_jax(do), L.to_jax(dht))
        for n, gr in zip(names, grads):
            rr[n]["ours"] = L.rms(L.tnp(gr), ref[f"d{n}"])

    attempt(first, "ours", ours)
    if ctx.fla_ok:
        def fla():
            for n, gr in L.fla_grads(x, do, dht).items():
                rr[n[1:]]["fla"] = L.rms(L.tnp(gr), ref[n]) if gr is not None else None

        attempt(first, "fla", fla)
    for r in rr.values():
        _log("accuracy", r)


# ----------------------------------------------------------------------------------------------------- sweep
def section_sweep(ctx: Ctx):
    """Decode tile sweep through torch: every ``(block_v, threads)`` of ``TUNING_TILES``, in place, do_bench."""
    import torch

    from kernels import registry, torch_api
    from kernels.recurrent_fwd import TUNING_TILES

    rows = ctx.res.setdefault("decode_sweep", [])
    op = registry.get("fused_recurrent_gdn2")
    for B in ((1, 128) if ctx.args.quick else (1, 16, 128)):
        row = {"B": B, "H": DECODE_H, "tiles": [list(t) for t in TUNING_TILES]}
        rows.append(row)
        if ctx.skip(row):
            continue
        try:
            x = L.torch_inputs(B, 1, DECODE_H, DECODE_H, seed=7 + B)
            h_orig = x["h0"].clone()
            ins = {n: x[n] for n in ARGS + ("h0",)}
            ref = None
            for bv, th in TUNING_TILES:
                tag = f"bv{bv}_t{th}"
                pipe = op.pipeline(**registry.config(
                    H=DECODE_H, HV=DECODE_H, K=D, V=D, dtype="bfloat16", g_dtype="float32", scale=D ** -0.5,
                    use_initial_state=True, output_final_state=True, varlen=False, use_qk_l2norm=False,
                    inplace_state=True, block_v=bv, threads=th))

                def one():
                    nonlocal ref
                    h = h_orig.clone()  # correctness vs the first (default) tile on a fresh copy of the state
                    res = torch_api.run_pipeline(pipe, dict(ins, h0=h), out={"ht": h})
                    cur = torch.cat([res["o"].float().flatten(), h.flatten()])
                    ref = cur if ref is None else ref
                    row[f"{tag}_maxdiff"] = float((cur - ref).abs().max())
                    h = h_orig.clone()
                    return L.event_ms(lambda: torch_api.run_pipeline(pipe, dict(ins, h0=h), out={"ht": h}),
                                      **DECODE_BENCH) * 1e3

                row[f"{tag}_us"] = attempt(row, tag, one)
            if ctx.fla_ok:
                from fla.ops.gdn2.fused_recurrent import fused_recurrent_gdn2_fwd as fla_fwd

                a = [x[n] for n in ARGS]
                h = h_orig.clone()
                row["fla_inplace_us"] = attempt(row, "fla", lambda: L.event_ms(lambda: fla_fwd(
                    *a, initial_state=h, output_final_state=True, inplace_final_state=True), **DECODE_BENCH) * 1e3)
        except Exception as e:
            record_error(row, "row", e)
        _free()
        _log("sweep", row)
        ctx.save()


# ------------------------------------------------------------------------------------------------------ main
def precompile(arch: str, jobs: int, sweep: bool):
    """Compile every kernel variant the benchmark uses into ``$GDN2_JAX_CACHE_DIR`` (no GPU needed)."""
    from kernels import build

    by_op: dict[str, list] = {}
    for name, cfg in L.bench_kernel_configs(sweep=sweep):
        by_op.setdefault(name, []).append(cfg)
    n = 0
    for name, cfgs in by_op.items():
        n += len(build.build(cfgs, (name,), arch, jobs))
    print(f"{n} kernels for {arch}")
    return 0


def _parse_sections(text: str, sweep: bool) -> list[str]:
    out = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in out if s not in SECTIONS]
    if bad:
        raise SystemExit(f"--sections: unknown {bad}; choose from {', '.join(SECTIONS)}")
    if sweep and "sweep" not in out:
        out.append("sweep")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results", help="output folder (default benchmarks/results)")
    ap.add_argument("--quick", action="store_true", help="two shapes per section (prefill/train: (1,4096,16), "
                    "(8,2048,32); decode B in 1, 128)")
    ap.add_argument("--sections", default=DEFAULT_SECTIONS,
                    help=f"comma-separated, run in this order, from {', '.join(SECTIONS)} (default {DEFAULT_SECTIONS})")
    ap.add_argument("--decode-sweep", action="store_true", help="also run the decode tile sweep (section 'sweep')")
    ap.add_argument("--graph-timeout", type=float, default=120.0, help="time limit (s) of the CUDA-graph child")
    ap.add_argument("--time-budget", type=float, default=None, metavar="S",
                    help="soft limit (s) of the whole run: shapes that would start after it are skipped (marked in "
                         "the rows), so that an outer hard timeout does not cut a run blindly")
    ap.add_argument("--replot", metavar="JSON", help="only rewrite the .md and .png next to a saved result file")
    ap.add_argument("--precompile", action="store_true", help="only compile the kernels the benchmark uses")
    ap.add_argument("--arch", default="sm_90a", help="arch for --precompile (default sm_90a)")
    ap.add_argument("-j", "--jobs", type=int, default=4, help="parallel compiles for --precompile")
    ap.add_argument("--selftest", action="store_true", help="dry test of the pure-Python parts (CPU)")
    ap.add_argument("--graph-child", metavar="BS", help=argparse.SUPPRESS)
    # flags of the previous version (benchmarks/run_gpu.sh still passes them): mapped onto --sections
    for flag in ("--skip-prefill", "--skip-train", "--skip-decode", "--skip-graph", "--skip-accuracy", "--skip-xla"):
        ap.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--xla-max-tokens", type=int, help=argparse.SUPPRESS)  # the backend='xla' prefill rows are gone
    args = ap.parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU
    if args.graph_child:
        return graph_child([int(b) for b in args.graph_child.split(",")])
    if args.selftest:
        from . import bench_selftest

        return bench_selftest.main()
    if args.precompile:
        return precompile(args.arch, args.jobs, args.decode_sweep)
    if args.replot:
        p = Path(args.replot)
        res = json.loads(p.read_text())
        p.with_suffix(".md").write_text(markdown(res))
        print("plot:", plot(res, p.with_suffix(".png")))
        return 0
    sections = _parse_sections(args.sections, args.decode_sweep)
    skip = {s for s, f in (("prefill", args.skip_prefill), ("train", args.skip_train), ("decode", args.skip_decode),
                           ("graph", args.skip_graph or args.skip_decode), ("accuracy", args.skip_accuracy)) if f}
    sections = [s for s in sections if s not in skip]

    t_start = time.time()
    env = L.env_info()
    date = _dt.datetime.now(_dt.timezone.utc)
    res = {"schema": "gdn2-jax-bench/2", "date": date.strftime("%Y-%m-%dT%H:%M:%SZ"), "env": env, "copy": None,
           "timing": TIMING, "meta": {"argv": sys.argv, "quick": args.quick, "sections": sections, "done": [],
                                      "section_s": {}},
           "prefill": [], "train": [], "decode": [], "accuracy": []}
    out = Path(args.out)
    ctx = Ctx(args, res, out, f"{L.gpu_tag(env.get('gpu'))}-{date.strftime('%Y-%m-%d')}")
    print("env", json.dumps(env), flush=True)
    try:
        import fla.ops.gdn2  # noqa: F401
        from fla.ops.gdn2.fused_recurrent import fused_recurrent_gdn2_fwd  # noqa: F401

        ctx.fla_ok = True
    except Exception as e:
        res["meta"]["fla_error"] = f"{type(e).__name__}: {e}"[:300]
        print("FLA not importable:", e, flush=True)
    try:
        from kernels import torch_api  # noqa: F401
    except Exception as e:
        ctx.kernels_ok = False
        res["meta"]["torch_api_error"] = f"{type(e).__name__}: {e}"[:300]
    holder = {}
    res["copy"] = attempt(holder, "copy", copy_bandwidth)
    if holder:
        res["meta"]["copy_error"] = holder.get("error")
    print("copy", json.dumps(res["copy"]), flush=True)
    ctx.save()
    run = {"prefill": section_prefill, "train": section_train, "decode": section_decode, "graph": section_graph,
           "accuracy": section_accuracy, "sweep": section_sweep}
    for s in sections:
        t0 = time.time()
        print(f"== {s}", flush=True)
        try:
            run[s](ctx)
        except Exception as e:  # a section's own setup failed: record it, go on with the next section
            holder = {}
            record_error(holder, s, e)
            res["meta"].setdefault("section_errors", {})[s] = holder["error"]
        res["meta"]["section_s"][s] = time.time() - t0
        res["meta"]["done"].append(s)
        _free()
        ctx.save(with_plot=True)
        print(f"== {s} done in {time.time() - t0:.1f} s", flush=True)
    res["meta"]["total_s"] = time.time() - t_start
    ctx.save(with_plot=True)
    print(markdown(res))
    print("wrote", out / f"{ctx.tag}.json", out / "latest.json", out / f"{ctx.tag}.md", out / f"{ctx.tag}.png",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Helpers of ``benchmarks/bench.py``: environment, timing, inputs, fp64 oracles, memory floor, JAX step builders.

Nothing here runs at import time; jax, torch and triton are imported inside the functions that need them, so the
pure-Python parts (floor estimate, RMS, argument lists) import and run on any host.
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import statistics
import subprocess
import time
import traceback
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
ARGS = ("q", "k", "v", "g", "b", "w")
D = 128  # K = V = 128 throughout the grid
DEVICE = "cuda"  # torch device of the inputs (the CPU selftest sets "cpu")


# ----------------------------------------------------------------------------------------------- environment
def _version(dist: str):
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def git_state() -> dict:
    """``{"commit", "dirty", "dirty_files"}`` of the checkout (``"unknown"`` where git or .git is missing;
    ``$GDN2_BENCH_COMMIT`` overrides it)."""
    out = {"commit": "unknown", "dirty": None, "dirty_files": None}
    if os.environ.get("GDN2_BENCH_COMMIT"):  # a copied tree without .git: the runner says what it copied
        out.update(commit=os.environ["GDN2_BENCH_COMMIT"], commit_from="GDN2_BENCH_COMMIT")
        return out
    try:
        out["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                       timeout=20, check=True).stdout.strip() or "unknown"
        st = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                            capture_output=True, text=True, timeout=20, check=True).stdout
        files = [ln for ln in st.splitlines() if ln.strip()]
        out["dirty"], out["dirty_files"] = bool(files), len(files)
    except Exception as e:  # no git binary / not a checkout (a copied tree)
        out["git_error"] = f"{type(e).__name__}: {e}"[:200]
    return out


#: the code a benchmark measures: the kernels, the JAX package and the benchmark itself (``source_digest``)
DIGEST_DIRS = ("kernels", "gdn2_jax", "benchmarks")


def source_digest(root=None) -> str:
    """SHA-256 (hex) over the ``*.py`` files under ``DIGEST_DIRS`` of ``root`` (default: this checkout), each as
    its path relative to ``root`` and its bytes, in sorted path order: the same value for the same code, so that a
    run on a dirty tree can still be matched to the commit that holds that code. Skips what is not a regular file
    (e.g. an editor's lock link) and every path with a part that starts with ``.`` or is ``__pycache__``."""
    import hashlib

    root = Path(root) if root is not None else REPO
    files = []
    for d in DIGEST_DIRS:
        for f in (root / d).rglob("*.py"):
            rel = f.relative_to(root)
            if f.is_file() and not f.is_symlink() and not any(p.startswith(".") or p == "__pycache__"
                                                               for p in rel.parts):
                files.append((rel.as_posix(), f))
    h = hashlib.sha256()
    for rel, f in sorted(files):
        h.update(rel.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def env_info() -> dict:
    """The contract's ``env`` keys (gpu, driver, jax, jaxlib, torch, triton, tilelang, fla, commit) and a few more."""
    env = {"gpu": None, "driver": None}
    try:
        import torch

        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
            env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
            env["torch_cuda"] = torch.version.cuda
    except Exception as e:
        env["torch_error"] = repr(e)[:200]
    if env["gpu"] is None:
        try:
            import jax

            env["gpu"] = jax.devices()[0].device_kind
        except Exception:
            pass
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,memory.total,clocks.max.sm",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
        env["nvidia_smi"] = q.splitlines()[0] if q else None
        env["driver"] = q.split(",")[0].strip() if q else None
    except Exception as e:
        env["nvidia_smi"] = f"unavailable: {type(e).__name__}"
    for key, dist in (("jax", "jax"), ("jaxlib", "jaxlib"), ("torch", "torch"), ("triton", "triton"),
                      ("tilelang", "tilelang"), ("fla", "fla-core")):
        env[key] = _version(dist)
    for dist in ("jax-cuda13-plugin", "jax-cuda12-plugin", "apache-tvm-ffi", "jax-tvm-ffi", "numpy"):
        v = _version(dist)
        if v is not None:
            env[dist] = v
    env.update(git_state())
    try:  # (kernels/, gdn2_jax/, benchmarks/: see source_digest)
        env["source_digest"] = source_digest()
    except OSError as e:  # (an unreadable file: the run goes on without it)
        env["source_digest_error"] = f"{type(e).__name__}: {e}"[:200]
    env["python"] = platform.python_version()
    env["host"] = platform.node()
    env["cpus"] = os.cpu_count()
    env["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "")
    return env


def gpu_tag(name) -> str:
    """``"NVIDIA H200"`` -> ``"h200"`` (file-name safe)."""
    s = str(name or "unknown-gpu").replace("NVIDIA", "").strip().lower()
    s = "".join(c if c.isalnum() or c in "-_." else "-" for c in s)
    while "--" in s:
        s = s.replace("--", "-")
    return s.strip("-") or "gpu"


# ----------------------------------------------------------------------------------------------------- timing
def event_ms(fn, *, warmup=25, rep=100, grad_to_none=None) -> float:
    """``triton.testing.do_bench`` median in ms (CUDA events on torch's stream; L2 flushed before each call)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median"))


def host_ms(fn, sync, *, n=None, reps=5, warm=3, target_s=0.05, max_n=2000):
    """Host-clock loop: median over ``reps`` of (wall time of ``n`` back-to-back calls + one final sync) / n.

    ``sync(r)`` waits for the result ``r`` of the last call. ``n=None`` picks n so that one repeat takes about
    ``target_s`` (from one timed call after the warm-up). Returns ``(ms per call, n)``.
    """
    r = None
    for _ in range(warm):
        r = fn()
    sync(r)
    if n is None:
        t0 = time.perf_counter()
        r = fn()
        sync(r)
        one = max(time.perf_counter() - t0, 1e-6)
        n = int(min(max_n, max(3, target_s / one)))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            r = fn()
        sync(r)
        ts.append((time.perf_counter() - t0) / n * 1e3)
    return statistics.median(ts), n


def alternated_ratios(f_a, sync_a, f_b, sync_b, *, rounds=3, target_s=0.05) -> list[float]:
    """``rounds`` pairs of host-clock loops (:func:`host_ms`), ``f_a`` first in even rounds and ``f_b`` first in odd
    ones: the ratio a / b of each pair. Alternating the order spreads clock drift over both paths; take the median."""
    paths, out = ((f_a, sync_a), (f_b, sync_b)), []
    for i in range(rounds):
        ms = [0.0, 0.0]
        for j in ((0, 1) if i % 2 == 0 else (1, 0)):
            ms[j] = host_ms(*paths[j], target_s=target_s)[0]
        out.append(ms[0] / ms[1])
    return out


def trace_events(trace: Path) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of every device kernel, memset and memcpy in a chrome trace written by
    ``torch.profiler``, in start order. A kernel's name carries its grid (``name grid=[x, y, z]``): TileLang names
    every kernel ``main_kernel``."""
    events = json.loads(Path(trace).read_text())["traceEvents"]
    out = [(e["name"] + (f" grid={e['args']['grid']}" if "grid" in e.get("args", {}) else ""), float(e["ts"]),
            float(e.get("dur", 0.0)))
           for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")]
    out.sort(key=lambda t: t[1])
    return out


def trace_summary(events, calls: int) -> dict | None:
    """Device time of ``calls`` calls from :func:`trace_events`: busy (sum of durations; overlapping events count
    twice) and span (first start to last end) per call, idle gaps (time with no event running, between one
    event's start and the latest end before it), and per event name count / median / sum. ``None`` when there are
    no events."""
    if not events:
        return None
    by_name: dict[str, list[float]] = {}
    for name, _, dur in events:
        by_name.setdefault(name, []).append(dur)
    gaps, end = [], events[0][1] + events[0][2]
    for _, start, dur in events[1:]:
        gaps.append(max(0.0, start - end))
        end = max(end, start + dur)
    return {
        "n_events": len(events),
        "kernels": {n: {"count": len(d), "median_us": statistics.median(d), "sum_us": sum(d)}
                    for n, d in by_name.items()},
        "busy_us_per_call": sum(e[2] for e in events) / calls,
        "span_us_per_call": (end - events[0][1]) / calls,
        "gap_median_us": statistics.median(gaps) if gaps else None,
        "gap_max_us": max(gaps) if gaps else None,
        "gaps_over_5us": sorted(round(g, 1) for g in gaps if g > 5.0),
    }


def traced_calls(fn, sync, *, calls=10, trace_path: Path | None = None) -> dict | None:
    """One CUPTI trace (``torch.profiler``, which records every kernel of the process, XLA's too) of ``calls``
    back-to-back calls of ``fn`` after one warm call, then :func:`trace_summary`. The chrome trace goes to
    ``trace_path`` (else a temporary file). ``None`` when no device event was recorded (a CPU run)."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE != "cpu" else [])
    r = fn()
    sync(r)
    torch_sync()
    with profile(activities=acts) as prof:
        for _ in range(calls):
            r = fn()
        sync(r)
        torch_sync()
    with tempfile.TemporaryDirectory() as d:
        path = Path(trace_path or Path(d) / "trace.json")
        prof.export_chrome_trace(str(path))
        return trace_summary(trace_events(path), calls)


def torch_sync(_=None):
    if DEVICE != "cpu":
        import torch

        torch.cuda.synchronize()


def randn(shape, seed):
    """fp32 N(0,1) torch tensor on :data:`DEVICE` from its own generator."""
    import torch

    gen = torch.Generator(device=DEVICE).manual_seed(int(seed))
    return torch.randn(*shape, device=DEVICE, generator=gen)


def to_device(a):
    """numpy -> torch tensor on :data:`DEVICE`."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(a)).to(DEVICE)


def jax_sync(r=None):
    import jax

    jax.block_until_ready(r)


def torch_extra_peak_mib(fn) -> float:
    """Extra device memory of one call: torch ``max_memory_allocated`` during it minus allocated before."""
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    r = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del r
    return (peak - base) / 2**20


def jax_compiled_memory(jitted, *args) -> dict:
    """XLA's memory analysis of ``jitted`` at ``args``: temporaries + outputs (− aliased outputs), MiB.

    ``jitted.lower(...).compile()`` shares the executable with the later ``jitted(...)`` calls (no second compile).
    """
    ma = jitted.lower(*args).compile().memory_analysis()
    mib = lambda x: float(x) / 2**20  # noqa: E731
    return {"temp_MiB": mib(ma.temp_size_in_bytes), "output_MiB": mib(ma.output_size_in_bytes),
            "alias_MiB": mib(ma.alias_size_in_bytes),
            "total_MiB": mib(ma.temp_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes)}


def record_error(row: dict, what: str, e: BaseException) -> None:
    """Put ``what: ExcType: message`` into ``row["errors"]`` (and ``row["error"]`` for the first one)."""
    msg = f"{type(e).__name__}: {e}".strip()[:600]
    row.setdefault("errors", {})[what] = msg
    row.setdefault("error", f"{what}: {msg}")
    print(f"  [{what}] failed: {msg}", flush=True)
    traceback.print_exc()
    try:  # free what the failed measurement held (an OOM must not poison the next one)
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:
        pass


def attempt(row: dict, what: str, fn):
    """``fn()``, or None with the error recorded in ``row`` (one failing measurement keeps the rest of the row)."""
    try:
        return fn()
    except Exception as e:
        record_error(row, what, e)
        return None


def ratio(a, b):
    """a / b, or None when either is missing, not finite or b is 0."""
    try:
        a, b = float(a), float(b)
    except (TypeError, ValueError):
        return None
    if not (math.isfinite(a) and math.isfinite(b)) or b == 0:
        return None
    return a / b


# -------------------------------------------------------------------------------------------- memory floor
def prefill_bytes(B, T, H, HV, K=D, V=D, *, h0=True, ht=True) -> int:
    """Unavoidable HBM bytes of one prefill forward: q,k [B,T,H,K] + v,w [B,T,HV,V] + b [B,T,HV,K] bf16, g
    [B,T,HV,K] fp32, o [B,T,HV,V] bf16 written, and the fp32 states [B,HV,K,V] read (h0) / written (ht)."""
    bf16, f32 = 2, 4
    ins = 2 * B * T * H * K * bf16 + 2 * B * T * HV * V * bf16 + B * T * HV * K * bf16 + B * T * HV * K * f32
    out = B * T * HV * V * bf16
    state = B * HV * K * V * f32 * (int(bool(h0)) + int(bool(ht)))
    return int(ins + out + state)


def floor_ms(nbytes, copy_TBps):
    """Time to move ``nbytes`` at the measured copy bandwidth (read+write counted, like the copy), in ms."""
    if not copy_TBps:
        return None
    return nbytes / (copy_TBps * 1e12) * 1e3


def decode_state_bytes(B, HV, K=D, V=D, *, reads=1, writes=1) -> int:
    """State traffic of one decode step: ``reads`` + ``writes`` fp32 states [HV,K,V] per sequence."""
    return int(B * HV * K * V * 4 * (reads + writes))


# ------------------------------------------------------------------------------------------------------ inputs
def torch_inputs(B, T, H, HV, *, K=D, V=D, seed=0, g_scale=0.02, g_range=(-5.0, -0.1), h0=True, device=None):
    """Spec §15 inputs: q,k L2-normalised; v = 0.5·N(0,1); b,w ~ U(0,1) (bf16); g = g_scale·U(g_range) fp32;
    h0 ~ N(0,1) fp32 [B,HV,K,V]. ``g_scale=0.02`` is §15's timing setting, ``1.0`` its accuracy setting."""
    import torch

    device = device or DEVICE
    gen = torch.Generator(device=device).manual_seed(int(seed))
    kw = dict(device=device, generator=gen)
    f = torch.nn.functional.normalize
    x = dict(
        q=f(torch.randn(B, T, H, K, **kw), dim=-1).bfloat16(),
        k=f(torch.randn(B, T, H, K, **kw), dim=-1).bfloat16(),
        v=(0.5 * torch.randn(B, T, HV, V, **kw)).bfloat16(),
        g=(g_scale * (g_range[0] + (g_range[1] - g_range[0]) * torch.rand(B, T, HV, K, **kw))).float(),
        b=torch.rand(B, T, HV, K, **kw).bfloat16(),
        w=torch.rand(B, T, HV, V, **kw).bfloat16(),
    )
    if h0:
        x["h0"] = torch.randn(B, HV, K, V, **kw)
    if device != "cpu":
        torch.cuda.synchronize()  # JAX reads these through DLPack on its own stream
    return x


def to_jax(t):
    """Zero-copy JAX view of a torch tensor (keep the tensor alive; never donate the view)."""
    import jax.dlpack

    return jax.dlpack.from_dlpack(t)


def to_jax_owned(t):
    """A JAX-owned copy of a torch tensor (safe to donate)."""
    import jax.numpy as jnp

    return jnp.array(to_jax(t), copy=True)


def tnp(x) -> np.ndarray:
    """torch tensor / JAX array -> float64 numpy."""
    if hasattr(x, "detach"):
        return x.detach().float().cpu().numpy().astype(np.float64)
    return np.asarray(x, dtype=np.float64)


# ----------------------------------------------------------------------------------------------------- oracles
def rms(x, ref) -> float:
    """RMS(x − ref) / RMS(ref); NaN when x has non-finite values."""
    x = np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    if x.shape != ref.shape:
        raise ValueError(f"rms: shape {x.shape} vs reference {ref.shape}")
    if not np.all(np.isfinite(x)):
        return float("nan")
    den = np.sqrt(np.mean(ref * ref))
    return float(np.sqrt(np.mean((x - ref) ** 2)) / den) if den > 0 else float("nan")


def bf16_floor(ref) -> float:
    """RMS ratio of rounding the fp64 reference to bf16 (the best a bf16 output can do)."""
    import ml_dtypes

    r = np.asarray(ref, np.float64)
    return rms(r.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64), r)


def oracle_np(q, k, v, g, b, w, h0, scale):
    """fp64 token loop (dense, H == HV) on numpy arrays; returns ``(o, final state)``."""
    q, k, v, g, b, w = (np.asarray(x, np.float64) for x in (q, k, v, g, b, w))
    S = np.array(h0, np.float64, copy=True)
    o = np.zeros(v.shape)
    for t in range(q.shape[1]):
        S = np.exp(g[:, t])[..., None] * S
        u = w[:, t] * v[:, t] - np.einsum("bhk,bhkv->bhv", b[:, t] * k[:, t], S)
        S = S + k[:, t][..., None] * u[..., None, :]
        o[:, t] = scale * np.einsum("bhk,bhkv->bhv", q[:, t], S)
    return o, S


def _x64():
    import jax

    try:
        return jax.enable_x64(True)
    except (AttributeError, TypeError):  # older spelling
        from jax.experimental import enable_x64

        return enable_x64()


def oracle_grads_fp64(ins: dict, do, dht, scale) -> dict:
    """fp64 gradients of ``sum(o·do) + sum(ht·dht)`` w.r.t. q,k,v,g,b,w,h0 with ``gdn2_jax.naive_recurrent_gdn2``,
    jitted on the CPU under x64 (inputs: numpy arrays of the same quantised values the GPU paths get).
    Returns ``{"dq": ..., ..., "dh0": ..., "o": ..., "ht": ...}`` as float64 numpy."""
    import jax
    import jax.numpy as jnp

    import gdn2_jax

    cpu = jax.devices("cpu")[0]
    names = ARGS + ("h0",)
    with _x64(), jax.default_device(cpu):
        arrs = [jax.device_put(np.asarray(ins[n], np.float64), cpu) for n in names]
        do64 = jax.device_put(np.asarray(do, np.float64), cpu)
        dht64 = jax.device_put(np.asarray(dht, np.float64), cpu)

        def loss(q, k, v, g, b, w, h0, do, dht):
            o, ht = gdn2_jax.naive_recurrent_gdn2(q, k, v, g, b, w, scale=scale, initial_state=h0,
                                                  output_final_state=True)
            return jnp.sum(o * do) + jnp.sum(ht * dht), (o, ht)

        f = jax.jit(jax.grad(loss, argnums=tuple(range(7)), has_aux=True))
        grads, (o, ht) = f(*arrs, do64, dht64)
        assert grads[0].dtype == jnp.float64, grads[0].dtype
        out = {f"d{n}": np.asarray(gr, np.float64) for n, gr in zip(names, grads)}
        out["o"], out["ht"] = np.asarray(o, np.float64), np.asarray(ht, np.float64)
    return out


def fla_grads(x: dict, do, dht) -> dict:
    """FLA 0.6.0's gradients ``{"dq": ..., "dh0": ...}`` (torch) of ``sum(o·do) + sum(ht·dht)`` w.r.t. q,k,v,g,b,w,h0
    (``x``: torch inputs by name, as :func:`torch_inputs` makes them); None where FLA gives no gradient."""
    from fla.ops.gdn2 import chunk_gdn2 as fla_chunk

    names = ARGS + ("h0",)
    leaves = [x[n].detach().clone().requires_grad_(True) for n in names]
    o, ht = fla_chunk(*leaves[:6], initial_state=leaves[6], output_final_state=True)
    ((o.float() * do).sum() + (ht.float() * dht).sum()).backward()
    return {f"d{n}": p.grad for n, p in zip(names, leaves)}


# ------------------------------------------------------------------------------------------- JAX step builders
def _bk(backend):
    return {} if backend is None else {"backend": backend}


def jax_prefill_fn(backend=None):
    """``jax.jit`` of ``chunk_gdn2(q,k,v,g,b,w, initial_state=h0, output_final_state=True)`` (as a user calls it:
    ``backend=None`` leaves the default, ``"auto"``)."""
    import jax

    import gdn2_jax

    return jax.jit(lambda q, k, v, g, b, w, h0: gdn2_jax.chunk_gdn2(
        q, k, v, g, b, w, initial_state=h0, output_final_state=True, **_bk(backend)))


def jax_train_fn(backend=None):
    """``jax.jit(jax.value_and_grad(loss, argnums=(0..5)))``, ``loss = sum(o.astype(f32) * do)``; args
    ``(q,k,v,g,b,w,do)``."""
    import jax
    import jax.numpy as jnp

    import gdn2_jax

    def loss(q, k, v, g, b, w, do):
        o, _ = gdn2_jax.chunk_gdn2(q, k, v, g, b, w, **_bk(backend))
        return jnp.sum(o.astype(jnp.float32) * do)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5)))


def jax_grad_with_state_fn(backend=None):
    """Gradients of all seven inputs (q..w, h0) of ``sum(o·do) + sum(ht·dht)`` (accuracy section)."""
    import jax
    import jax.numpy as jnp

    import gdn2_jax

    def loss(q, k, v, g, b, w, h0, do, dht):
        o, ht = gdn2_jax.chunk_gdn2(q, k, v, g, b, w, initial_state=h0, output_final_state=True, **_bk(backend))
        return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(ht * dht)

    return jax.jit(jax.grad(loss, argnums=tuple(range(7))))


SCAN_STEPS = 16  # tokens per call of the "scan" decode path
SPEC_L = 4       # draft tokens per sequence of the "spec4" path


def jax_decode_fns(backend="tilelang") -> dict:
    """The decode step functions through the PUBLIC op ``gdn2_jax.fused_recurrent_gdn2``:

    * ``scan(h, q,k,v,g,b,w) -> (o [S,B,1,HV,V], h)``: ``lax.scan`` over the leading token axis (inputs
      ``[S,B,1,...]``), ``inplace_final_state=True``, state donated;
    * ``donated(h, q..w) -> (o, h)``: one token, ``inplace_final_state=True``, state donated;
    * ``floor(h, q..w) -> (o, h)``: the same arguments and donation as ``donated`` with a trivial body (``o = v * 1``,
      one element of ``h`` updated in place): JAX's per-call dispatch floor of a donated step on this host;
    * ``call(h, q..w) -> (o, h)``: the functional op (``output_final_state=True``), nothing donated;
    * ``pool(pool, q..w, idx[B]) -> (o, pool)``: continuous batching, pool donated;
    * ``spec(pool, q..w, idx[B,L], nacc[B]) -> (o, pool)``: speculative decoding (L draft tokens), pool donated.
    """
    import jax

    import gdn2_jax

    op = gdn2_jax.fused_recurrent_gdn2
    bk = _bk(backend)

    def scan(h, q, k, v, g, b, w):
        def body(h, xs):
            o, h = op(*xs, initial_state=h, inplace_final_state=True, **bk)
            return h, o

        h, os_ = jax.lax.scan(body, h, (q, k, v, g, b, w))
        return os_, h

    def donated(h, q, k, v, g, b, w):
        return op(q, k, v, g, b, w, initial_state=h, inplace_final_state=True, **bk)

    def floor(h, q, k, v, g, b, w):  # no kernel: o [B, 1, HV, V] in v's dtype, h updated in its donated buffer
        return v * 1, h.at[0, 0, 0, 0].add(1.0)

    def call(h, q, k, v, g, b, w):
        return op(q, k, v, g, b, w, initial_state=h, output_final_state=True, **bk)

    def pool(p, q, k, v, g, b, w, idx):
        return op(q, k, v, g, b, w, initial_state=p, ssm_state_indices=idx, **bk)

    def spec(p, q, k, v, g, b, w, idx, nacc):
        return op(q, k, v, g, b, w, initial_state=p, ssm_state_indices=idx, num_accepted_tokens=nacc, **bk)

    return {"scan": jax.jit(scan, donate_argnums=0), "donated": jax.jit(donated, donate_argnums=0),
            "floor": jax.jit(floor, donate_argnums=0), "call": jax.jit(call), "pool": jax.jit(pool, donate_argnums=0),
            "spec": jax.jit(spec, donate_argnums=0)}


class Carry:
    """Host-loop step that feeds the returned state into the next call: ``fn(state, *args) -> (o, state)``."""

    def __init__(self, fn, state, *args):
        self.fn, self.state, self.args = fn, state, args

    def __call__(self):
        o, self.state = self.fn(self.state, *self.args)
        return o, self.state


def pool_indices(B, P, L=None, seed=0):
    """``L=None``: B distinct slots of a pool of P (a random subset, random order) as int32 [B]; else [B, L]."""
    rng = np.random.default_rng(seed)
    n = B if L is None else B * L
    if n > P:
        raise ValueError(f"pool_indices: {n} distinct slots do not fit a pool of {P}")
    idx = rng.permutation(P)[:n].astype(np.int32)
    return idx if L is None else idx.reshape(B, L)


def accepted_tokens(B, L, seed=0):
    """``num_accepted_tokens`` [B] int32 in [1, L]."""
    return np.random.default_rng(seed + 1).integers(1, L + 1, size=B).astype(np.int32)


@functools.lru_cache(maxsize=None)
def torch_dtype(name: str):
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
            "int32": torch.int32}[name]


def chunk_pipeline(H, HV, K=D, V=D, *, h0=True, ht=True, **options):
    """The chunk_gdn2 pipeline ``kernels.torch_api.chunk_gdn2`` (and the JAX path) builds for bf16 / fp32 g;
    ``options`` are factory options of ``kernels.chunk_fwd.chunk_fwd_pipeline`` (kernel variants)."""
    from kernels import registry

    cfg = registry.config(H=H, HV=HV, K=K, V=V, dtype="bfloat16", g_dtype="float32", scale=K ** -0.5,
                          use_initial_state=h0, output_final_state=ht, varlen=False, use_qk_l2norm=False, **options)
    return registry.get("chunk_gdn2").pipeline(**cfg)


def stage_callables(pipe, inputs: dict, arch=None):
    """Per-launch callables of ``pipe`` on torch tensors, with every scratch / output buffer allocated once (as
    ``kernels.torch_api.run_pipeline`` allocates them). Runs all launches once in order (so that each launch
    reads valid scratch) and returns ``[(launch name, callable)]``."""
    import torch

    from kernels import _compile
    from kernels._pipeline import resolve_shape

    dev = inputs[pipe.inputs[0]].device
    arch = arch or _compile.device_arch(dev.index or 0)
    sizes = pipe.sizes({n: tuple(inputs[n].shape) for n in pipe.inputs})
    bufs = {n: inputs[n].contiguous() for n in pipe.inputs}
    for b in tuple(pipe.scratch) + tuple(pipe.outputs):
        bufs[b.name] = torch.empty(resolve_shape(b, sizes), dtype=torch_dtype(b.dtype), device=dev)
    calls, seen = [], {}
    for la in pipe.launches:
        fn = _compile.get_function(la, arch)
        args = [bufs[a] for a in la.args]
        name = la.name if la.name not in seen else f"{la.name}#{seen[la.name] + 1}"
        seen[la.name] = seen.get(la.name, 0) + 1
        calls.append((name, functools.partial(fn, *args)))
    for _, c in calls:
        c()
    torch.cuda.synchronize()
    return calls


# ------------------------------------------------------------------------------------ kernel configs (precompile)
def bench_kernel_configs(sweep=False) -> list[tuple[str, dict]]:
    """``(op name, factory kwargs)`` of every kernel variant the benchmark runs (bf16, fp32 g, K = V = 128), as the
    JAX and torch runners build them (``kernels.registry.config`` + options)."""
    from kernels import registry
    from kernels.chunk_fwd import STATE_WIDE_OPTIONS

    def cfg(H, h0=True, ht=True, **opt):
        return registry.config(H=H, HV=H, K=D, V=D, dtype="bfloat16", g_dtype="float32", scale=D ** -0.5,
                               use_initial_state=h0, output_final_state=ht, varlen=False, use_qk_l2norm=False,
                               **opt)

    out = []
    for H in (16, 32):
        out.append(("chunk_gdn2", cfg(H)))                    # prefill (JAX, torch, stages)
        out.append(("chunk_gdn2", cfg(H, h0=False, ht=False)))  # train forward
    out.append(("chunk_gdn2", cfg(32, **STATE_WIDE_OPTIONS)))   # prefill at B >= 4, H = 32 (inference_options)
    out.append(("chunk_gdn2", cfg(4)))                          # accuracy: prefill
    out.append(("chunk_gdn2", cfg(2)))                          # accuracy: gradients
    for H in (32, 4):
        out.append(("fused_recurrent_gdn2", cfg(H)))
        out.append(("fused_recurrent_gdn2", cfg(H, inplace_state=True)))
    out.append(("fused_recurrent_gdn2", cfg(32, inplace_state=True, state_pool="slot", num_accepted=False)))
    out.append(("fused_recurrent_gdn2", cfg(32, inplace_state=True, state_pool="token", num_accepted=True)))
    if sweep:
        from kernels.recurrent_fwd import TUNING_TILES

        for bv, th in TUNING_TILES:
            out.append(("fused_recurrent_gdn2", cfg(32, inplace_state=True, block_v=bv, threads=th)))
    return out

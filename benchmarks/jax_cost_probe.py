"""Where the JAX path's extra time over the torch path goes, at one prefill shape (GPU only).

The benchmark of record times the same two kernels through JAX (``ours_ms``, host loop) and through
``kernels.torch_api`` (``torch_ms`` by do_bench, ``torch_host_ms`` by host loop). At B1 T32768 H32 on H100s the
JAX path came out 2.0-5.1% slower (sessions 33 and 36) while the batched shapes were within 0-1.6%. This probe
answers whether that is kernel time (the same kernels running slower under XLA: buffer placement) or time between
kernels (dispatch, allocation, host callbacks):

1. host loops of both paths, alternated three times (order and drift);
2. one CUPTI trace (``torch.profiler``, which records every kernel of the process, XLA's too) of ``--calls``
   back-to-back calls of each path: per kernel name the median duration on each path, and the median idle time
   between consecutive kernels (gap) and per call (period).

Usage: ``python -m benchmarks.jax_cost_probe --out DIR [--shape B,T,H ...]``. Writes ``DIR/jax_cost_probe.json``
and prints one summary line per shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from . import bench_lib as L

ARGS = ("q", "k", "v", "g", "b", "w")


def _kernel_events(trace: Path):
    """(name, start_us, dur_us) of every device kernel / memset / memcpy in a chrome trace, in start order."""
    events = json.loads(trace.read_text())["traceEvents"]
    out = [(e["name"], float(e["ts"]), float(e.get("dur", 0.0))) for e in events
           if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")]
    out.sort(key=lambda t: t[1])
    return out


def _summarise(events, calls: int) -> dict:
    by_name: dict[str, list[float]] = {}
    for name, _, dur in events:
        by_name.setdefault(name, []).append(dur)
    gaps = [b[1] - (a[1] + a[2]) for a, b in zip(events, events[1:])]
    span = (events[-1][1] + events[-1][2] - events[0][1]) if events else 0.0
    return {
        "n_events": len(events),
        "kernels": {n[:90]: {"count": len(d), "median_us": statistics.median(d), "sum_us": sum(d)}
                    for n, d in by_name.items()},
        "busy_us_per_call": sum(e[2] for e in events) / calls,
        "span_us_per_call": span / calls,
        "gap_median_us": statistics.median(gaps) if gaps else None,
        "gap_max_us": max(gaps) if gaps else None,
        "gaps_over_5us": sorted(round(g, 1) for g in gaps if g > 5.0),
    }


def probe(B: int, T: int, H: int, calls: int, out: Path) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from kernels import torch_api

    x = L.torch_inputs(B, T, H, H, seed=100)
    a, h0 = [x[n] for n in ARGS], x["h0"]
    jx = [L.to_jax(x[n]) for n in ARGS + ("h0",)]
    f = L.jax_prefill_fn()

    def jax_call():
        return f(*jx)

    def torch_call():
        return torch_api.chunk_gdn2(*a, initial_state=h0, output_final_state=True)

    row = {"B": B, "T": T, "H": H, "host": []}
    for _ in range(3):  # alternated: order and drift
        j = L.host_ms(jax_call, L.jax_sync, target_s=0.05)[0]
        t = L.host_ms(torch_call, L.torch_sync, target_s=0.05)[0]
        row["host"].append({"jax_ms": j, "torch_ms": t, "ratio": j / t})
    row["torch_do_bench_ms"] = L.event_ms(torch_call, warmup=10, rep=50)

    for path, fn, sync in (("jax", jax_call, L.jax_sync), ("torch", torch_call, L.torch_sync)):
        r = fn()
        sync(r)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                r = fn()
            sync(r)
            torch.cuda.synchronize()
        trace = out / f"trace-{path}-B{B}-T{T}-H{H}.json"
        prof.export_chrome_trace(str(trace))
        row[path] = _summarise(_kernel_events(trace), calls)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", action="append", default=None, help="B,T,H (repeatable; default 1,32768,32 and 4,4096,32)")
    ap.add_argument("--calls", type=int, default=10)
    args = ap.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split(",")) for s in (args.shape or ["1,32768,32", "4,4096,32"])]
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for B, T, H in shapes:
        row = probe(B, T, H, args.calls, args.out)
        rows.append(row)
        j, t = row["jax"], row["torch"]
        print(f"PROBE B{B} T{T} H{H}: host ratios {[round(h['ratio'], 4) for h in row['host']]}; "
              f"busy/call jax {j['busy_us_per_call']:.1f} torch {t['busy_us_per_call']:.1f} us; "
              f"span/call jax {j['span_us_per_call']:.1f} torch {t['span_us_per_call']:.1f} us; "
              f"events jax {j['n_events']} torch {t['n_events']}", flush=True)
        for name in sorted(set(j["kernels"]) | set(t["kernels"])):
            kj, kt = j["kernels"].get(name), t["kernels"].get(name)
            print(f"   {name[:60]:60s} jax {kj and (kj['count'], round(kj['median_us'], 1))} "
                  f"torch {kt and (kt['count'], round(kt['median_us'], 1))}", flush=True)
        (args.out / "jax_cost_probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

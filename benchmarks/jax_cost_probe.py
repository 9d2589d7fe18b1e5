"""Where the JAX path's extra time over the torch path goes, at one prefill shape (GPU only).

The benchmark of record times the same two kernels through JAX (``ours_ms``, host loop) and through
``kernels.torch_api`` (``torch_ms`` by do_bench, ``torch_host_ms`` by host loop). At B1 T32768 H32 on H100s the
JAX path came out 2.0-5.1% slower (sessions 33 and 36) while the batched shapes were within 0-1.6%. This probe
answers whether that is kernel time (the same kernels running slower under XLA: buffer placement) or time between
kernels (dispatch, allocation, host callbacks):

1. host loops of both paths, alternated three times (order and drift);
2. one CUPTI trace of ``--calls`` back-to-back calls of each path (``bench_lib.traced_calls``): device busy time
   and span per call, per kernel name the median duration, and the idle gaps between consecutive kernels.

The benchmark's prefill rows carry the first (``jax_over_torch_alt``); the trace runs here, in its own process,
so that it cannot slow the benchmark's later sections.

Usage: ``python -m benchmarks.jax_cost_probe --out DIR [--shape B,T,H ...]``. Writes ``DIR/jax_cost_probe.json``
and prints one summary line per shape.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from . import bench_lib as L
from .bench_lib import ARGS


def probe(B: int, T: int, H: int, calls: int, out: Path) -> dict:
    from kernels import torch_api

    x = L.torch_inputs(B, T, H, H, seed=100)
    a, h0 = [x[n] for n in ARGS], x["h0"]
    jx = [L.to_jax(x[n]) for n in ARGS + ("h0",)]
    f = L.jax_prefill_fn()

    def jax_call():
        return f(*jx)

    def torch_call():
        return torch_api.chunk_gdn2(*a, initial_state=h0, output_final_state=True)

    row = {"B": B, "T": T, "H": H}
    row["host_ratios"] = L.alternated_ratios(jax_call, L.jax_sync, torch_call, L.torch_sync)
    row["torch_do_bench_ms"] = L.event_ms(torch_call, warmup=10, rep=50)
    for path, fn, sync in (("jax", jax_call, L.jax_sync), ("torch", torch_call, L.torch_sync)):
        row[path] = L.traced_calls(fn, sync, calls=calls, trace_path=out / f"trace-{path}-B{B}-T{T}-H{H}.json")
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
        (args.out / "jax_cost_probe.json").write_text(json.dumps(rows, indent=1))
        j, t = row["jax"], row["torch"]
        if j is None or t is None:
            print(f"PROBE B{B} T{T} H{H}: host ratios {row['host_ratios']}; a trace recorded no device event")
            continue
        print(f"PROBE B{B} T{T} H{H}: host ratios {[round(h, 4) for h in row['host_ratios']]}; "
              f"busy/call jax {j['busy_us_per_call']:.1f} torch {t['busy_us_per_call']:.1f} us; "
              f"span/call jax {j['span_us_per_call']:.1f} torch {t['span_us_per_call']:.1f} us; "
              f"events jax {j['n_events']} torch {t['n_events']}", flush=True)
        for name in sorted(set(j["kernels"]) | set(t["kernels"])):
            kj, kt = j["kernels"].get(name), t["kernels"].get(name)
            print(f"   {name[:80]:80s} jax {kj and (kj['count'], round(kj['median_us'], 1))} "
                  f"torch {kt and (kt['count'], round(kt['median_us'], 1))}", flush=True)


if __name__ == "__main__":
    main()

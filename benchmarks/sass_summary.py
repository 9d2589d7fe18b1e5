"""Summarise an Nsight Compute per-SASS export (``run_gpu.sh ncusrc``'s ``intra_sass.csv``): executed warp
instructions, warp-stall samples and shared-memory wavefronts (total / bank-conflict excess) per opcode, and the
same three per code region (SASS address order, cut at the given instruction indices).

    python -m benchmarks.sass_summary intra_sass.csv [--regions 0,1200,3000] [--top 30]
"""

from __future__ import annotations

import argparse
import collections
import csv
import sys


def load(path: str) -> list[dict]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    names = rows[head]
    out = []
    for r in rows[head + 1:]:
        if len(r) < len(names) or not r[0].startswith("0x"):
            continue
        d = dict(zip(names, r))
        src = d["Source"].strip()
        tok = src.split()
        op = tok[1] if tok and tok[0].startswith("@") and len(tok) > 1 else (tok[0] if tok else "?")

        def num(key):
            v = d.get(key, "0").replace(",", "")
            return float(v) if v not in ("", "-") else 0.0

        out.append(dict(op=op.split(".")[0], inst=num("Instructions Executed"),
                        stall=num("Warp Stall Sampling (All Samples)"), wf=num("L1 Wavefronts Shared"),
                        excess=num("L1 Wavefronts Shared Excessive")))
    return out


def table(rows, key, top):
    tot = {k: sum(r[k] for r in rows) for k in ("inst", "stall", "wf", "excess")}
    agg = collections.defaultdict(lambda: collections.Counter())
    for r in rows:
        for k in ("inst", "stall", "wf", "excess"):
            agg[key(r)][k] += r[k]
    lines = [f"total {tot['inst']:.0f} warp instructions, stall samples {tot['stall']:.0f}, shared wavefronts "
             f"{tot['wf'] / 1e6:.1f} M (excess {tot['excess'] / 1e6:.1f} M)"]
    for name, c in sorted(agg.items(), key=lambda kv: -kv[1]["inst"])[:top]:
        lines.append(f"{name:10s} {c['inst'] / 1e6:7.1f} M {100 * c['inst'] / max(tot['inst'], 1):5.1f}%  stall "
                     f"{c['stall']:7.0f} ({100 * c['stall'] / max(tot['stall'], 1):4.1f}%)  smem wavefronts "
                     f"{c['wf'] / 1e6:6.1f} M excess {c['excess'] / 1e6:5.1f} M")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--regions", default=None, help="comma-separated instruction indices that start each region")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args(argv)
    rows = load(a.csv)
    print("\n".join(table(rows, lambda r: r["op"], a.top)))
    if a.regions:
        cuts = sorted(int(x) for x in a.regions.split(","))
        for i, r in enumerate(rows):
            r["region"] = sum(i >= c for c in cuts)
        print("by region (instruction index ranges starting at " + a.regions + "):")
        print("\n".join(table(rows, lambda r: f"region {r['region']}", len(cuts) + 1)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""GPU dev/check script for the chunked prefill kernels (``kernels/chunk_fwd.py``), H3a's working tool.

One process: compile (or load from the disk cache) every pipeline variant, check it against an fp64 token-loop
oracle on identical quantised inputs (outputs and scratch poisoned with NaN, run twice => bit-identical), then
time the six prefill grid shapes of spec §15 against FLA 0.6.0 ``chunk_gdn2`` in the same process. Prints a short
table last. Usage (on the GPU machine)::

    python benchmarks/chunk_dev.py [--check] [--bench] [--nofla] [--variants 256x2,256] [--bv 0,64]
                                   [--cases 0,2] [--shapes 0,4] [--json out.json]

``--precompile ARCH`` (no GPU needed) only builds the kernels into the disk cache (``$GDN2_JAX_CACHE_DIR``).
"""

import argparse
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kernels import _compile  # noqa: E402
from kernels.chunk_fwd import chunk_fwd_pipeline  # noqa: E402

BENCH_SHAPES = [(1, 4096, 16), (1, 16384, 16), (4, 4096, 32), (8, 2048, 32), (1, 32768, 32), (16, 1024, 32)]
FLA_REF_MS = [0.974, 1.243, 1.909, 1.902, 4.505, 1.895]  # spec §15
FLA_RUN1_MS = [0.636, 1.418, 1.908, 1.892, 4.539, 1.883]  # this script's first H200 run (same process as v1)

# (name, dict of case parameters) -- small correctness cases
CASES = [
    dict(name="bf16 T=300 K=V=128 h0 sweep", B=2, T=300, H=2, HV=2, K=128, V=128, dtype="bfloat16",
         g_dtype="float32", h0=True, ht=True, l2=False, cu=None, sweep=True),
    dict(name="bf16 T=1", B=2, T=1, H=2, HV=2, K=128, V=128, dtype="bfloat16", g_dtype="float32", h0=True,
         ht=True, l2=False, cu=None, sweep=True),
    dict(name="bf16 varlen GVA2 l2 h0", B=1, T=400, H=1, HV=2, K=128, V=128, dtype="bfloat16", g_dtype="float32",
         h0=True, ht=True, l2=True, cu=[0, 15, 15, 100, 256, 257, 400], sweep=True),
    dict(name="fp16 K=V=64 GVA2 g-bf16", B=2, T=200, H=2, HV=4, K=64, V=64, dtype="float16", g_dtype="bfloat16",
         h0=False, ht=True, l2=True, cu=None, sweep=False),
    dict(name="bf16 K=64 V=128 nostate", B=1, T=130, H=2, HV=2, K=64, V=128, dtype="bfloat16", g_dtype="float32",
         h0=False, ht=False, l2=False, cu=None, sweep=True),
    dict(name="bf16 spec11 1x512x4 D128", B=1, T=512, H=4, HV=4, K=128, V=128, dtype="bfloat16",
         g_dtype="float32", h0=True, ht=True, l2=False, cu=None, sweep=False, fla=True),
    dict(name="bf16 spec11 2x1000x2 D64", B=2, T=1000, H=2, HV=2, K=64, V=64, dtype="bfloat16",
         g_dtype="float32", h0=True, ht=True, l2=False, cu=None, sweep=False, fla=True),
    dict(name="bf16 varlen many short", B=1, T=2000, H=2, HV=2, K=128, V=128, dtype="bfloat16", g_dtype="float32",
         h0=True, ht=True, l2=False, cu="random40", sweep=True),
]


def _intra_kw(intra):
    """``"256x2"`` -> intra_threads=256, intra_min_blocks=2 (the pipeline default)."""
    th, _, mb = intra.partition("x")
    return dict(intra_threads=int(th), intra_min_blocks=int(mb or 1))


def pipe_for(c, bv=None, intra="256x2"):
    return chunk_fwd_pipeline(H=c["H"], HV=c["HV"], K=c["K"], V=c["V"], dtype=c["dtype"], g_dtype=c["g_dtype"],
                              scale=c["K"] ** -0.5, use_initial_state=c["h0"], output_final_state=c["ht"],
                              varlen=c["cu"] is not None, use_qk_l2norm=c["l2"], block_v=bv, **_intra_kw(intra))


def bench_pipe(H, bv, intra="256x2"):
    return chunk_fwd_pipeline(H=H, HV=H, K=128, V=128, dtype="bfloat16", g_dtype="float32", scale=128 ** -0.5,
                              use_initial_state=False, output_final_state=True, varlen=False, use_qk_l2norm=False,
                              block_v=bv, **_intra_kw(intra))


def precompile(arch, bvs, variants, cases):
    pipes = [pipe_for(CASES[i], None, iv) for iv in variants for i in cases]
    pipes += [bench_pipe(H, bv, iv) for iv in variants for H in (16, 32) for bv in bvs]
    seen = set()
    for p in pipes:
        for la in p.launches:
            k = _compile.cache_key(la, arch)
            if k in seen:
                continue
            seen.add(k)
            t = time.time()
            _compile.compile_launch(la, arch)
            print(f"compiled {la.name} {dict(la.key[2:]) if len(la.key) > 2 else ''} in {time.time() - t:.1f}s",
                  flush=True)


# ----------------------------------------------------------------------------------------------------------------
def run_pipeline(pipe, arrays, torch, poison=True, bufs=None):
    """Run ``pipe`` on torch tensors; returns the dict of all buffers (scratch + outputs)."""
    arch = _compile.device_arch()
    shapes = {n: tuple(arrays[n].shape) for n in pipe.inputs}
    dev = arrays["q"].device
    if bufs is None:
        bufs = {}
        for name, shp in pipe.buffer_shapes(shapes).items():
            dt = next(b.dtype for b in tuple(pipe.scratch) + tuple(pipe.outputs) if b.name == name)
            bufs[name] = torch.empty(shp, dtype=getattr(torch, dt), device=dev)
            if poison:
                bufs[name].fill_(float("nan"))
    fns = [_compile.get_function(la, arch) for la in pipe.launches]
    allb = dict(arrays)
    allb.update(bufs)
    for la, fn in zip(pipe.launches, fns):
        fn(*[allb[a] for a in la.args])
    return bufs


def make_inputs(torch, c, seed, g_scale=1.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    B, T, H, HV, K, V = c["B"], c["T"], c["H"], c["HV"], c["K"], c["V"]
    dt = getattr(torch, c["dtype"])
    q = torch.randn(B, T, H, K, device="cuda", generator=gen, dtype=torch.float64)
    k = torch.randn(B, T, H, K, device="cuda", generator=gen, dtype=torch.float64)
    if not c["l2"]:
        q = q / q.norm(dim=-1, keepdim=True)
        k = k / k.norm(dim=-1, keepdim=True)
    v = 0.5 * torch.randn(B, T, HV, V, device="cuda", generator=gen, dtype=torch.float64)
    w = torch.rand(B, T, HV, V, device="cuda", generator=gen, dtype=torch.float64)
    if c.get("sweep"):
        levels = torch.tensor([0.0, -1e-3, -0.1, -6.0, -20.0, -60.0], device="cuda", dtype=torch.float64)
        idx = torch.randint(0, 6, (B, T, HV, K), device="cuda", generator=gen)
        # mostly mild decay with a sprinkle of extreme channels, mixed within every chunk
        mild = -torch.rand(B, T, HV, K, device="cuda", generator=gen, dtype=torch.float64) * 0.2
        g = torch.where(torch.rand(B, T, HV, K, device="cuda", generator=gen) < 0.3, levels[idx], mild)
        bl = torch.tensor([0.0, 1.0, 2.0], device="cuda", dtype=torch.float64)
        bidx = torch.randint(0, 3, (B, T, HV, K), device="cuda", generator=gen)
        b = torch.where(torch.rand(B, T, HV, K, device="cuda", generator=gen) < 0.3, bl[bidx],
                        torch.rand(B, T, HV, K, device="cuda", generator=gen, dtype=torch.float64))
        # correlated keys in part of the sequence
        if T >= 8:
            k[:, T // 2: T // 2 + 8] = k[:, T // 2: T // 2 + 1] + 0.05 * k[:, T // 2: T // 2 + 8]
            if not c["l2"]:
                k = k / k.norm(dim=-1, keepdim=True)
    else:
        g = -(0.1 + 4.9 * torch.rand(B, T, HV, K, device="cuda", generator=gen, dtype=torch.float64)) * g_scale
        b = torch.rand(B, T, HV, K, device="cuda", generator=gen, dtype=torch.float64)
    cu = c["cu"]
    if cu == "random40":
        cuts = torch.randint(0, T + 1, (39,), generator=torch.Generator().manual_seed(seed)).sort().values.tolist()
        cu = [0] + cuts + [T]
    N = len(cu) - 1 if cu is not None else B
    h0 = torch.randn(N, HV, K, V, device="cuda", generator=gen, dtype=torch.float32)
    x = dict(q=q.to(dt), k=k.to(dt), v=v.to(dt), g=g.to(getattr(torch, c["g_dtype"])), b=b.to(dt), w=w.to(dt))
    if c["h0"]:
        x["h0"] = h0
    if cu is not None:
        x["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device="cuda")
    return x


def oracle(torch, x, c):
    """fp64 token loop on the quantised inputs (spec §3), GVA by repeat, varlen by resetting."""
    dt = getattr(torch, c["dtype"])
    q, k = x["q"], x["k"]
    if c["l2"]:
        def l2(a):
            af = a.double()
            return (af * torch.rsqrt((af * af).sum(-1, keepdim=True) + 1e-6)).to(dt)
        q, k = l2(q), l2(k)
    grp = c["HV"] // c["H"]
    q = q.double().repeat_interleave(grp, dim=2)
    k = k.double().repeat_interleave(grp, dim=2)
    v, g, b, w = (x[n].double() for n in ("v", "g", "b", "w"))
    B, T, HV, K = g.shape
    V = v.shape[-1]
    scale = K ** -0.5
    cu = x.get("cu_seqlens")
    if cu is not None:
        cu = cu.tolist()
        N = len(cu) - 1
        starts = {cu[n]: n for n in range(N) if cu[n + 1] > cu[n]}
        ends = {cu[n + 1] - 1: n for n in range(N) if cu[n + 1] > cu[n]}
    else:
        N = B
    h0 = x["h0"].double() if "h0" in x else torch.zeros(N, HV, K, V, dtype=torch.float64, device="cuda")
    ht = h0.clone()
    o = torch.empty(B, T, HV, V, dtype=torch.float64, device="cuda")
    S = h0.clone() if cu is None else None
    for t in range(T):
        if cu is not None:
            if t in starts:
                S = h0[starts[t]][None].clone()
        S = torch.exp(g[:, t])[..., None] * S
        u = w[:, t] * v[:, t] - torch.einsum("bhk,bhkv->bhv", b[:, t] * k[:, t], S)
        S = S + k[:, t][..., None] * u[..., None, :]
        o[:, t] = scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S)
        if cu is not None and t in ends:
            ht[ends[t]] = S[0]
    if cu is None:
        ht = S
    return o, ht


def ratio(torch, x, ref):
    x = x.double()
    ref = ref.double()
    return float(((x - ref) ** 2).mean().sqrt() / (ref ** 2).mean().sqrt().clamp_min(1e-300))


def check(torch, results, variants, cases, use_fla):
    ok_all = True
    for ci in cases:
        c = CASES[ci]
        x = make_inputs(torch, c, seed=100 + ci)
        ref_o, ref_h = oracle(torch, x, c)
        for iv in variants:
            bv = None
            pipe = pipe_for(c, bv, iv)
            try:
                out1 = run_pipeline(pipe, x, torch)
                torch.cuda.synchronize()
                out2 = run_pipeline(pipe, x, torch)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001
                print(f"FAIL {c['name']} bv={bv}: {type(e).__name__}: {e}", flush=True)
                ok_all = False
                continue
            o = out1["o"]
            nan_o = int(torch.isnan(o.float()).sum())
            ro = ratio(torch, o, ref_o)
            det = torch.equal(out1["o"], out2["o"])
            line = dict(case=c["name"], intra=iv, o_ratio=ro, nan_o=nan_o, deterministic=det)
            if c["ht"]:
                nan_h = int(torch.isnan(out1["ht"]).sum())
                line.update(ht_ratio=ratio(torch, out1["ht"], ref_h), nan_ht=nan_h,
                            deterministic=det and torch.equal(out1["ht"], out2["ht"]))
            if c.get("fla") and use_fla:
                try:
                    from fla.ops.gdn2 import chunk_gdn2
                    fo, fh = chunk_gdn2(x["q"], x["k"], x["v"], x["g"], x["b"], x["w"], scale=c["K"] ** -0.5,
                                        initial_state=x.get("h0"), output_final_state=True)
                    line.update(fla_o_ratio=ratio(torch, fo, ref_o), fla_ht_ratio=ratio(torch, fh, ref_h))
                except Exception as e:  # noqa: BLE001
                    line.update(fla_error=str(e)[:200])
            bad = nan_o or not det or ro > 1e-2 or (c["ht"] and (line["nan_ht"] or line["ht_ratio"] > 1e-2))
            ok_all &= not bad
            print(("BAD " if bad else "ok  ") + json.dumps(line), flush=True)
            results.setdefault("check", []).append(line)
    return ok_all


def bench(torch, results, bvs, shapes, variants, use_fla):
    import triton.testing

    rows = []
    for si, (B, T, H) in enumerate(shapes):
        c = dict(B=B, T=T, H=H, HV=H, K=128, V=128, dtype="bfloat16", g_dtype="float32", h0=False, ht=True,
                 l2=False, cu=None, sweep=False)
        x = make_inputs(torch, c, seed=7, g_scale=0.02)
        if use_fla:
            from fla.ops.gdn2 import chunk_gdn2
            with torch.no_grad():
                f = lambda: chunk_gdn2(x["q"], x["k"], x["v"], x["g"], x["b"], x["w"],  # noqa: E731
                                       scale=128 ** -0.5, output_final_state=True)
                fo, fh = f()
                t_fla = triton.testing.do_bench(f, warmup=50, rep=200, return_mode="median")
        else:
            fo = fh = None
            t_fla = FLA_RUN1_MS[BENCH_SHAPES.index((B, T, H))]
        row = dict(B=B, T=T, H=H, fla_ms=t_fla, fla_same_run=bool(use_fla))
        ref = {}
        for iv, bv in itertools.product(variants, bvs):
            tag = f"{iv}/bv{bv}"
            pipe = bench_pipe(H, bv, iv)
            bufs = run_pipeline(pipe, x, torch)
            if fo is not None:
                o_ratio_vs_fla = ratio(torch, bufs["o"], fo)
                ht_ratio_vs_fla = ratio(torch, bufs["ht"], fh)
            elif not ref:
                ref = dict(o=bufs["o"].clone(), ht=bufs["ht"].clone(), tag=tag)
                o_ratio_vs_fla = ht_ratio_vs_fla = 0.0
            else:  # vs the first variant of this run
                o_ratio_vs_fla = ratio(torch, bufs["o"], ref["o"])
                ht_ratio_vs_fla = ratio(torch, bufs["ht"], ref["ht"])
            arch = _compile.device_arch()
            fns = [_compile.get_function(la, arch) for la in pipe.launches]
            allb = dict(x)
            allb.update(bufs)
            argl = [[allb[a] for a in la.args] for la in pipe.launches]

            def ours():
                for fn, a in zip(fns, argl):
                    fn(*a)

            t = triton.testing.do_bench(ours, warmup=50, rep=200, return_mode="median")
            t1 = triton.testing.do_bench(lambda: fns[0](*argl[0]), warmup=20, rep=100, return_mode="median")
            t2 = triton.testing.do_bench(lambda: fns[1](*argl[1]), warmup=20, rep=100, return_mode="median")
            row[f"{tag}_ms"] = t
            row[f"{tag}_intra_ms"] = t1
            row[f"{tag}_state_ms"] = t2
            row[f"{tag}_o_vs_ref"] = o_ratio_vs_fla
            row[f"{tag}_ht_vs_ref"] = ht_ratio_vs_fla
            del bufs, allb, argl
        print(json.dumps(row), flush=True)
        rows.append(row)
        del x
        torch.cuda.empty_cache()
    results["bench"] = rows
    tags = [f"{iv}/bv{bv}" for iv, bv in itertools.product(variants, bvs)]
    print("\n| B | T | H | FLA ms | " + " | ".join(f"{t} ms (intra+state) | x FLA" for t in tags) + " |")
    for r in rows:
        cells = []
        for t in tags:
            cells.append(f"{r[f'{t}_ms']:.3f} ({r[f'{t}_intra_ms']:.3f}+{r[f'{t}_state_ms']:.3f})")
            cells.append(f"{r['fla_ms'] / r[f'{t}_ms']:.2f}")
        print(f"| {r['B']} | {r['T']} | {r['H']} | {r['fla_ms']:.3f} | " + " | ".join(cells) + " |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--bv", default="0", help="state-kernel V-blocks; 0 = the pipeline default")
    ap.add_argument("--variants", default="256x2",
                    help="intra-kernel variants THREADS[xMIN_BLOCKS], comma separated")
    ap.add_argument("--cases", default="all", help="indices into CASES")
    ap.add_argument("--nofla", action="store_true", help="skip FLA (bench uses FLA_RUN1_MS)")
    ap.add_argument("--shapes", default="all")
    ap.add_argument("--json", default=None)
    ap.add_argument("--precompile", default=None, metavar="ARCH")
    args = ap.parse_args()
    bvs = [int(s) or None for s in args.bv.split(",")]
    variants = args.variants.split(",")
    cases = list(range(len(CASES))) if args.cases == "all" else [int(i) for i in args.cases.split(",")]
    if args.precompile:
        precompile(args.precompile, bvs, variants, cases)
        return
    import torch

    results = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
    ok = True
    t = time.time()
    if args.check:
        ok = check(torch, results, variants, cases, not args.nofla)
        print(f"check {'PASSED' if ok else 'FAILED'} ({time.time() - t:.0f}s)", flush=True)
    if args.bench:
        shapes = BENCH_SHAPES if args.shapes == "all" else [BENCH_SHAPES[int(i)] for i in args.shapes.split(",")]
        bench(torch, results, bvs, shapes, variants, not args.nofla)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

"""Markdown report and plot of a ``benchmarks/bench.py`` result dict (pure Python; matplotlib only for the PNG)."""

from __future__ import annotations

import math

TIMING = {
    "prefill": ("`ours_ms`: the jitted public `chunk_gdn2` through JAX, host-clock loop (n back-to-back calls, one "
                "final `block_until_ready`, median of 5 repeats); `torch_ms` (the same kernels through "
                "`kernels.torch_api.chunk_gdn2`), `fla_ms` (FLA under `torch.inference_mode()`) and `stage_ms` (each "
                "launch alone, buffers allocated once): `triton.testing.do_bench` medians (CUDA events, L2 flushed "
                "before each call); `torch_host_ms` / `fla_host_ms`: the host-clock loop of the JAX path. "
                "JAX / torch (alt): median of 3 pairs of host loops, in alternating order (JAX first, then torch first)."),
    "train": ("`ours_ms`: `jax.jit(jax.value_and_grad(loss, argnums=(0..5)))`, host-clock loop; `fla_ms`: FLA forward + "
              "`backward()` with `do_bench` (`grad_to_none` = the six inputs); `fla_host_ms`: the host-clock loop. "
              "Peak: torch `max_memory_allocated` − allocated before one step; JAX: XLA memory analysis "
              "(temporaries + outputs)."),
    "decode": ("`scan`, `donated`, `jit_floor`, `call`, `pool`, `spec4`, `scan_graph`: host-clock loops of n steps "
               "(each feeding the returned state into the next call), one final sync, median of 5 repeats; `scan` is "
               "per token (16 tokens per call). `torch` (our kernel through `kernels.torch_api`, in place) and every "
               "`fla_inplace_us`: `do_bench` (CUDA events, L2 flushed before each call, so a small state is read from "
               "HBM); `fla_inplace_host_us` / `ours_host_us`: the same host-clock loop as the JAX paths. The host "
               "loops do not flush L2: at B <= 4 the state (<= 8 MiB) stays in L2 and `state_TBps` may exceed the "
               "copy bandwidth. `jit_floor`: the same arguments and donation as `donated` with a trivial body "
               "(`o = v * 1`, one element of the state updated in place), i.e. JAX's per-call dispatch floor of a "
               "donated step on this host, timed by the same loop; it moves no state (no `state_TBps`) and its "
               "speedup is the ceiling any jitted donated step can reach against FLA."),
}


def _f(x, nd=3):
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, float):
        if x == 0:
            return "0"
        return f"{x:.{nd}f}" if abs(x) >= 10 ** (-nd + 1) or abs(x) >= 1 else f"{x:.2e}"
    return str(x)


def _x(x):
    """A ratio as ``1.23x``."""
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.2f}x"


def _pct(x):
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{100 * x:.0f}%"


def _stages(r):
    st = r.get("stage_ms") or {}
    if not st:
        return "—"
    tot = sum(v for v in st.values() if v) or float("nan")
    return ", ".join(f"{k.replace('gdn2_', '')} {_f(v)} ({_pct(v / tot if v else None)})" for k, v in st.items())


def _err(r):
    e = r.get("errors") or ({} if not r.get("error") else {"row": r["error"]})
    return "; ".join(f"{k}: {v[:90]}" for k, v in e.items())


def _shape(r):
    return f"{r.get('B')} | {r.get('T')} | {r.get('H')}"


def markdown(res: dict) -> str:
    env = res.get("env", {})
    copy = res.get("copy") or {}
    commit = env.get("commit", "unknown")
    dirty = env.get("dirty")
    L = [f"# GDN-2 benchmark — {env.get('gpu')} ({res.get('date')})", "",
         f"GPU {env.get('gpu')} (cc {env.get('capability', '?')}), driver {env.get('driver')}; jax {env.get('jax')}, "
         f"jaxlib {env.get('jaxlib')}, torch {env.get('torch')}, triton {env.get('triton')}, tilelang "
         f"{env.get('tilelang')}, FLA {env.get('fla')}. Commit `{commit}`"
         + (" (working tree dirty: uncommitted changes)" if dirty else " (clean)" if dirty is False else "") + "."
         + (f" Source digest `{env['source_digest'][:16]}` (`benchmarks.bench_lib.source_digest`: kernels/, gdn2_jax/, "
            "benchmarks/)." if env.get("source_digest") else ""),
         ""]
    if copy.get("TBps"):
        L += [f"**Device-to-device copy bandwidth measured in this run: {copy['TBps']:.2f} TB/s** (read + write counted; "
              f"torch `copy_` of {copy.get('bytes_rw', 0) / 2 / 2**30:.0f} GiB, `do_bench` median). Floors and "
              "bandwidth fractions below use it.", ""]
    else:
        L += ["Copy bandwidth: not measured in this run.", ""]
    meta = res.get("meta", {})
    L += [f"Command: `{' '.join(meta.get('argv', []))}`; sections run: {', '.join(meta.get('done', [])) or 'none'}"
          + (f"; section seconds: {', '.join(f'{k} {v:.0f}' for k, v in meta.get('section_s', {}).items())}"
             if meta.get("section_s") else "") + ". `speedup = fla / ours`.", ""]
    if res.get("notes"):
        L += ["## Notes", ""] + [f"* {n}" for n in res["notes"]] + [""]

    rows = _rows(res, "prefill")
    if rows:
        L += ["## Prefill forward, bf16 q/k/v/b/w, fp32 g, K = V = 128, H = HV, initial + final state", "",
              "Timing: " + TIMING["prefill"] + " Floor: bytes of q,k,v,b,w (bf16), g (fp32), o (bf16) and the two fp32 "
              "states over the copy bandwidth.", "",
              "| B | T | H | ours ms (JAX) | FLA ms | speedup | speedup (host) | torch ms | JAX / torch | JAX / torch "
              "(host) | JAX / torch (alt) | floor ms | ours / floor | stages ms (share) | "
              "extra MiB ours / torch / FLA | backend |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            L.append(f"| {_shape(r)} | {_f(r.get('ours_ms'))} | {_f(r.get('fla_ms'))} | {_x(r.get('speedup'))} | "
                     f"{_x(r.get('speedup_host'))} | "
                     f"{_f(r.get('torch_ms'))} | {_f(r.get('jax_over_torch'))} | {_f(r.get('jax_over_torch_host'))} | "
                     f"{_f(r.get('jax_over_torch_alt'))} | "
                     f"{_f(r.get('floor_ms'))} | {_x(r.get('ours_over_floor'))} | {_stages(r)} | "
                     f"{_f(r.get('ours_peak_MiB'), 0)} / {_f(r.get('torch_peak_MiB'), 0)} / "
                     f"{_f(r.get('fla_peak_MiB'), 0)} | {r.get('ours_backend', '—')} |")
        bad = [r for r in rows if r.get("jax_over_torch") is not None and r["jax_over_torch"] > 1.05]
        L.append("")
        if bad:
            L += ["JAX path more than 5% over torch (do_bench) at: "
                  + ", ".join(f"({_shape(r).replace(' | ', ',')}) {r['jax_over_torch']:.3f}" for r in bad), ""]
        L += _errors(rows)

    rows = _rows(res, "train")
    if rows:
        L += ["## Training step (forward + gradients of q, k, v, g, b, w), same inputs, no initial state", "",
              "Timing: " + TIMING["train"], "",
              "| B | T | H | ours ms (JAX) | FLA ms | speedup | FLA host ms | speedup (host) | extra MiB ours / FLA "
              "| backend |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            L.append(f"| {_shape(r)} | {_f(r.get('ours_ms'))} | {_f(r.get('fla_ms'))} | {_x(r.get('speedup'))} | "
                     f"{_f(r.get('fla_host_ms'))} | {_x(r.get('speedup_host'))} | {_f(r.get('ours_peak_MiB'), 0)} / "
                     f"{_f(r.get('fla_peak_MiB'), 0)} | {r.get('ours_backend', '—')} |")
        L.append("")
        L += _errors(rows)

    rows = _rows(res, "decode")
    if rows:
        L += ["## Decode, H = HV = 32, K = V = 128, fp32 state [B, 32, 128, 128], bf16 inputs", "",
              "Timing: " + TIMING["decode"] + " Paths: `scan` jitted `lax.scan` over 16 tokens, "
              "`inplace_final_state=True`, state donated; `donated` one-token jitted step, `inplace_final_state=True`, "
              "state donated; `jit_floor` the same jitted step with a trivial body (no kernel: the per-call "
              "dispatch floor, see above); `call` the functional op (new state each step, nothing donated); `pool` "
              "state pool [2B, ...] updated at `ssm_state_indices` [B] (random slots), pool donated; `spec4` 4 draft "
              "tokens per sequence, `ssm_state_indices` [B, 4] + `num_accepted_tokens`, pool [8B, ...] donated "
              "(time per step of 4 tokens; FLA: the same call of `fused_recurrent_gdn2_fwd`); `torch` our kernel "
              "through `kernels.torch_api` in place; `scan_graph` = `scan` with `GDN2_JAX_CUDA_GRAPH=1` and XLA "
              "command buffers (child process). `state_TBps` counts the state read + write (spec4: 1 read + 4 writes "
              "per sequence; none for `jit_floor`); `% copy` = state_TBps / copy bandwidth.", "",
              "| B | path | tokens / step | ours µs / step | timing | FLA in-place µs | speedup | FLA host µs | "
              "speedup (host) | ours host µs | state TB/s | % copy |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(rows, key=lambda r: (r.get("B") or 0, _PATHS.get(r.get("path"), 99))):
            L.append(f"| {r.get('B')} | {r.get('path')} | {r.get('tokens_per_step', 1)} | {_f(r.get('ours_us'), 1)} | "
                     f"{r.get('timing', '—')} | {_f(r.get('fla_inplace_us'), 1)} | {_x(r.get('speedup'))} | "
                     f"{_f(r.get('fla_inplace_host_us'), 1)} | {_x(r.get('speedup_host'))} | "
                     f"{_f(r.get('ours_host_us'), 1)} | {_f(r.get('state_TBps'), 2)} | {_pct(r.get('copy_frac'))} |")
        L.append("")
        g = [r for r in rows if r.get("path") == "scan_graph"]
        if g:
            L += ["CUDA-graph scan: results equal to the plain scan (bitwise): "
                  + ", ".join(f"B={r.get('B')}: {r.get('graph_equal')}" for r in g), ""]
        L += _errors(rows)
    gi = res.get("graph_child")
    if gi and gi.get("rc") not in (0, None):
        L += [f"CUDA-graph child process failed (rc {gi.get('rc')}): `{(gi.get('stderr_tail') or '')[-300:]}`", ""]

    rows = _rows(res, "accuracy")
    if rows:
        L += ["## Accuracy vs an fp64 oracle, RMS(x − ref) / RMS(ref), same quantised inputs", "",
              "Inputs: spec §15 accuracy distribution (q, k L2-normalised, v = 0.5·N(0,1), b, w ~ U(0,1), "
              "g ~ U(−5, −0.1), random fp32 h0). Forward oracle: fp64 numpy token loop; gradient oracle: "
              "`jax.grad` of `gdn2_jax.naive_recurrent_gdn2` in float64 on the CPU, loss = sum(o·do) + sum(ht·dht).", "",
              "| case | quantity | ours | FLA | oracle | bf16 floor |", "|---|---|---|---|---|---|"]
        for r in rows:
            L.append(f"| {r.get('case')} | {r.get('quantity')} | {_f(r.get('ours'))} | {_f(r.get('fla'))} | "
                     f"{r.get('oracle')} | {_f(r.get('bf16_floor'))} |")
        L.append("")
        L += _errors(rows)

    rows = _rows(res, "decode_sweep")
    if rows:
        keys = sorted({k for r in rows for k in r if k.endswith("_us") and k != "fla_inplace_us"})
        L += ["## Decode tile sweep (our kernel through torch, in place, `do_bench` µs; bvX_tY = V columns per "
              "block, threads; the first of `TUNING_TILES` is the default)", "",
              "| B | " + " | ".join(keys) + " | FLA in-place µs |", "|---|" + "---|" * (len(keys) + 1)]
        for r in rows:
            L.append(f"| {r.get('B')} | " + " | ".join(_f(r.get(k), 1) for k in keys)
                     + f" | {_f(r.get('fla_inplace_us'), 1)} |")
        L.append("")
        L += _errors(rows)
    return "\n".join(L) + "\n"


_PATHS = {p: i for i, p in enumerate(("torch", "scan", "scan_graph", "donated", "jit_floor", "call", "pool", "spec4"))}


def _rows(res, key):
    """The rows of a section (a list of dicts; anything else, e.g. an older file's layout, gives none)."""
    rows = res.get(key) or []
    return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []


def _errors(rows):
    errs = [(r, _err(r)) for r in rows if r.get("errors") or r.get("error")]
    if not errs:
        return []
    out = ["Errors:", ""]
    for r, e in errs:
        tag = ", ".join(f"{k}={r[k]}" for k in ("case", "quantity", "B", "T", "H", "path") if k in r)
        out.append(f"* {tag}: {e}")
    return out + [""]


def plot(res: dict, path) -> bool:
    """Prefill / train speedup bars and decode per-token times; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    for ax, key, title in ((axes[0], "prefill", "prefill forward"), (axes[1], "train", "train step (fwd + bwd)")):
        rows = [r for r in _rows(res, key) if r.get("speedup")]
        if not rows:
            ax.text(0.5, 0.5, f"{key}: not measured", ha="center", va="center")
            ax.axis("off")
            continue
        labels = [f"{r['B']},{r['T']},{r['H']}" for r in rows]
        ys = [r["speedup"] for r in rows]
        bars = ax.bar(range(len(rows)), ys, color=["tab:green" if y >= 1 else "tab:red" for y in ys])
        for b_, y in zip(bars, ys):
            ax.text(b_.get_x() + b_.get_width() / 2, y, f"{y:.2f}", ha="center", va="bottom", fontsize=8)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(rows)), labels, rotation=20)
        ax.set_xlabel("B, T, H")
        ax.set_ylabel("speedup = FLA / ours")
        ax.set_title(f"{title}, bf16, K=V=128")
    ax = axes[2]
    rows = _rows(res, "decode")
    if rows:
        for name in sorted({r.get("path") for r in rows if r.get("path")}, key=lambda p: _PATHS.get(p, 99)):
            pts = sorted((r["B"], r.get("ours_us_per_token")) for r in rows
                         if r.get("path") == name and r.get("ours_us_per_token"))
            if pts and name == "jit_floor":  # no kernel: the dispatch floor the one-token host loops sit on
                ax.plot(*zip(*pts), marker=".", ls=":", color="0.5", label="JAX dispatch floor (jit_floor)")
            elif pts:
                ax.plot(*zip(*pts), marker="o", label=f"ours {name}")
        pts = sorted({(r["B"], r.get("fla_inplace_us")) for r in rows
                      if r.get("path") == "donated" and r.get("fla_inplace_us")})
        if pts:
            ax.plot(*zip(*pts), marker="s", ls="--", color="k", label="FLA in-place (do_bench)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch B (H = HV = 32)")
        ax.set_ylabel("µs per token")
        ax.set_title("decode (spec4: per token = per step / 4)")
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "decode: not measured", ha="center", va="center")
        ax.axis("off")
    fig.suptitle(f"GDN-2 vs FLA {res.get('env', {}).get('fla')} on {res.get('env', {}).get('gpu')} "
                 f"({res.get('date', '')[:10]})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

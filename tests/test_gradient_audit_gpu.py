"""Gradient audit of the training path against FLA 0.6.0 on the same inputs (issue 7, deliverable 3; marked ``cuda``).

The acceptance of issue 7 on the spec distribution: each of the seven gradients (q, k, v, g, b, w and the initial
state) of ``sum(o·do) + sum(ht·dht)`` within 3.5e-3 of the fp64 oracle by RMS ratio, and never above FLA's ratio
on the same quantised inputs. Here both run in one process: ``gdn2_jax.chunk_gdn2`` (the default backend, the
TileLang forward and backward kernels through ``custom_vjp``) and FLA's ``chunk_gdn2`` autograd, against
``benchmarks.bench_lib.oracle_grads_fp64`` (jax.grad of the fp64 token loop on the CPU). Inputs: the benchmark's
gradient case (``bench.py::_acc_train``, B1 T256 H2, D = 128; q, k L2-normalised bf16, v = 0.5 N(0, 1), b, w
~ U(0, 1), g ~ U(-5, -0.1) fp32, h0, do, dht ~ N(0, 1)), seed 77 as the benchmark plus five more, with
``kernels.defaults`` as they are (since session 17 they hold session 16's precision options ``z_split``,
``qg_split``; with session 15's, dh0 was 1.5-5.5% above FLA's and dq 0.5% above on one seed). Each case first
checks that two calls give bit-identical gradients and that none is NaN or infinite. The oracle's and FLA's
gradients are computed once per seed. With ``GDN2_AUDIT_OUT`` set (``benchmarks/run_gpu.sh`` does), each case
appends its ratios, ours and FLA's, as one ``GRADAUDIT`` JSON line.

The rest of the audit lives beside the other backends' cases: ``tests/test_backends.py`` (swept magnitudes, g per
channel down to -60 mixed within a chunk, b in [0, 2], correlated keys, ragged T, varlen with empty sequences, GVA,
initial state; limits 1e-2 / 2e-2; bit-identical reruns), ``tests/test_tilelang_gpu.py`` (the torch path's
gradients equal to the JAX path's) and ``tests/test_stages.py`` (each backward launch against its xla twin).
"""

from __future__ import annotations

import functools
import json
import os

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

SEEDS = (77, 1, 2, 3, 4, 5)
LIMIT = 3.5e-3  # issue 7: each of the seven gradients on the spec distribution
#: the gaps to FLA measured on the GPU and still open: (gradient, seed) -> (ceiling, why). A case whose only failures
#: are these FLA comparisons, each at most its ceiling (the measured ratio plus a little), is an expected failure
#: (``pytest.xfail``, after every other check); a gap elsewhere, or one that grew, fails.
#: Empty since session 19: the last one, db on seed 4 (3.157e-3 vs FLA's 2.524e-3, the WY launch's TF32
#: truncation), closed by ``wy_tf32_round="dy_min"`` (2.329e-3 on the H200).
KNOWN_GAPS: dict = {}


@functools.lru_cache(maxsize=None)
def _case(seed):
    """The inputs of one seed (torch, on the GPU), the fp64 oracle's gradients and FLA's RMS ratios: computed once
    per seed."""
    from benchmarks import bench_lib as L

    B, T, H, D = 1, 256, 2, L.D
    names = L.ARGS + ("h0",)
    x = L.torch_inputs(B, T, H, H, seed=seed, g_scale=1.0)
    do = L.randn((B, T, H, D), seed + 1)
    dht = L.randn((B, H, D, D), seed + 2)
    L.torch_sync()
    ref = L.oracle_grads_fp64({n: L.tnp(x[n]) for n in names}, L.tnp(do), L.tnp(dht), D ** -0.5)
    fla = L.fla_grads(x, do, dht)
    return x, do, dht, ref, {f"d{n}": L.rms(L.tnp(fla[f"d{n}"]), ref[f"d{n}"]) for n in names}


@pytest.mark.parametrize("seed", SEEDS)
def test_seven_gradients_within_limit_and_never_above_fla(seed):
    try:
        import fla.ops.gdn2  # noqa: F401
    except Exception as e:  # pragma: no cover - FLA needs triton and a GPU
        pytest.skip(f"fla 0.6.0 not importable: {e}")
    from benchmarks import bench_lib as L

    names = L.ARGS + ("h0",)
    x, do, dht, ref, fla = _case(seed)
    f = L.jax_grad_with_state_fn()
    args = [L.to_jax(x[n]) for n in names] + [L.to_jax(do), L.to_jax(dht)]
    grads = f(*args)
    again = f(*args)
    row = {"seed": seed}
    for n, gr, gr2 in zip(names, grads, again):
        a = np.asarray(gr)
        assert np.array_equal(a.view(np.uint8), np.asarray(gr2).view(np.uint8)), f"d{n}: reruns differ"
        assert np.all(np.isfinite(a.astype(np.float32))), f"d{n}: not finite"
        row[f"ours:d{n}"] = L.rms(a.astype(np.float64), ref[f"d{n}"])
        row[f"fla:d{n}"] = fla[f"d{n}"]
    path = os.environ.get("GDN2_AUDIT_OUT")  # (the GPU driver collects the ratios: benchmarks/run_gpu.sh)
    if path:
        with open(path, "a") as fh:
            fh.write("GRADAUDIT " + json.dumps(row) + "\n")
    bad = [f"d{n}" for n in names if not (row[f"ours:d{n}"] <= LIMIT and row[f"ours:d{n}"] <= row[f"fla:d{n}"])]
    msg = f"seed {seed}: " + "; ".join(f"{d}: ours {row['ours:' + d]:.3e} vs fla {row['fla:' + d]:.3e}" for d in bad)
    assert all(row["ours:" + d] <= LIMIT for d in bad), f"above {LIMIT}: {msg}"
    gaps = [KNOWN_GAPS.get((d, seed)) for d in bad]
    if bad and all(g is not None and row["ours:" + d] <= g[0] for d, g in zip(bad, gaps)):
        pytest.xfail(msg + " | " + "; ".join(g[1] for g in gaps))
    assert not bad, msg

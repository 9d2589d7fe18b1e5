"""Cross-check against torch (CPU): an independent float64 torch recurrence written from spec §3, and
FLA's own ``naive_recurrent_gdn2`` (``fla/ops/gdn2/naive.py``, loaded by file path without importing
``fla``, which needs triton) when fla-core is installed.

Compared: outputs, final states and all seven gradients (q, k, v, g, b, w, initial_state) of
``naive_recurrent_gdn2``, ``naive_chunk_gdn2``, ``chunk_gdn2(backend="xla")`` and
``fused_recurrent_gdn2(backend="xla")`` (jax.vjp) with torch autograd, for the loss
``Σ o·do + Σ ht·dht`` with random cotangents. Metric RMS(x − ref)/RMS(ref): <= 1e-10 in float64 (x64),
<= 1e-5 in float32 (and for FLA, whose naive code always computes in float32).
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from _oracle import GRAD_NAMES, NAMES, make_inputs, rms_ratio  # noqa: E402

import gdn2_jax  # noqa: E402

TOL = {"float64": 1e-10, "float32": 1e-5}
FLA_TOL = 1e-5  # FLA's naive reference computes in float32 whatever the input dtype

FUNCS = {
    "naive_recurrent_gdn2": gdn2_jax.naive_recurrent_gdn2,
    "naive_chunk_gdn2": gdn2_jax.naive_chunk_gdn2,
    "chunk_gdn2_xla": functools.partial(gdn2_jax.chunk_gdn2, backend="xla"),
    "fused_recurrent_gdn2_xla": functools.partial(gdn2_jax.fused_recurrent_gdn2, backend="xla"),
}

# Problem configurations. T crosses the C = 64 chunk boundary with a partial last chunk; the varlen one has
# zero-length sequences, a sequence longer than one chunk, GVA, raw (un-normalised) q/k with the in-kernel
# L2 norm, and a non-default scale.
CONFIGS = {
    "dense_gva": dict(B=2, T=70, H=2, HV=4, K=5, V=3, cu=None, l2=False, scale=None, seed=11),
    "varlen_gva_l2": dict(B=1, T=100, H=1, HV=2, K=4, V=6, cu=[0, 0, 29, 29, 100], l2=True, scale=0.7,
                          seed=12),
}


# ------------------------------------------------------------------------------------------------------
# Independent float64 torch implementation (spec §3), written with explicit per-sequence loops.
# ------------------------------------------------------------------------------------------------------
def torch_l2norm(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def torch_gdn2(q, k, v, g, b, w, *, scale=None, h0=None, cu=None, l2norm=False):
    """o ``[B,T,HV,V]`` and final states ``[N,HV,K,V]``. Value head j reads qk head j // (HV/H)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K ** -0.5 if scale is None else scale
    if l2norm:
        q, k = torch_l2norm(q), torch_l2norm(k)
    qk_head = torch.arange(HV) // (HV // H)
    segments = [(n, n, 0, T) for n in range(B)] if cu is None else [
        (n, 0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    rows = [[] for _ in range(B)]
    finals = []
    for n, bi, start, end in segments:
        S = torch.zeros(HV, K, V, dtype=v.dtype) if h0 is None else h0[n]
        for t in range(start, end):
            qt, kt = q[bi, t, qk_head], k[bi, t, qk_head]  # [HV, K]
            Sbar = torch.exp(g[bi, t])[:, :, None] * S  # decay each key row
            u = w[bi, t] * v[bi, t] - torch.einsum("hk,hkv->hv", b[bi, t] * kt, Sbar)  # gated write - read
            S = Sbar + kt[:, :, None] * u[:, None, :]  # rank-1 write along the un-gated key
            rows[bi].append(scale * torch.einsum("hk,hkv->hv", qt, S))  # read the updated state
        finals.append(S)
    o = torch.stack([torch.stack(r) for r in rows])
    return o, torch.stack(finals)


# ------------------------------------------------------------------------------------------------------
# FLA's naive reference, loaded by path; adapted to GVA (repeat q/k heads), varlen (per sequence) and the
# in-kernel L2 norm (it expects pre-normalised q/k).
# ------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _fla_naive():
    spec = importlib.util.find_spec("fla")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "ops" / "gdn2" / "naive.py"
    if not path.is_file():
        return None
    mspec = importlib.util.spec_from_file_location("_fla_gdn2_naive_by_path", path)
    mod = importlib.util.module_from_spec(mspec)
    mspec.loader.exec_module(mod)
    return mod.naive_recurrent_gdn2


def fla_gdn2(q, k, v, g, b, w, *, scale=None, h0=None, cu=None, l2norm=False):
    fla_naive = _fla_naive()
    B, T, H, K = q.shape
    HV = v.shape[2]
    scale = K ** -0.5 if scale is None else scale
    if l2norm:
        q, k = torch_l2norm(q), torch_l2norm(k)
    q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)  # "(h g)" order
    if cu is None:
        return fla_naive(q, k, v, g, b, w, scale=scale, initial_state=h0, output_final_state=True)
    outs, finals = [], []
    for n in range(len(cu) - 1):
        s, e = cu[n], cu[n + 1]
        o_n, h_n = fla_naive(*(x[:, s:e] for x in (q, k, v, g, b, w)), scale=scale,
                             initial_state=None if h0 is None else h0[n:n + 1], output_final_state=True)
        outs.append(o_n)
        finals.append(h_n[0])
    return torch.cat(outs, dim=1), torch.stack(finals)


# ------------------------------------------------------------------------------------------------------
# Problem data, torch results (cached per config) and JAX results (cached per function/config/dtype).
# ------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _problem(config: str):
    c = CONFIGS[config]
    N = c["B"] if c["cu"] is None else len(c["cu"]) - 1
    x = make_inputs(c["seed"], c["B"], c["T"], c["H"], c["HV"], c["K"], c["V"], np.float64, N=N,
                    normalize_qk=not c["l2"], as_numpy=True)
    rng = np.random.default_rng(c["seed"] + 1000)
    do = rng.standard_normal((c["B"], c["T"], c["HV"], c["V"]))
    dht = rng.standard_normal((N, c["HV"], c["K"], c["V"]))
    return x, do, dht


def _torch_results(impl, config: str, dtype: str):
    """Outputs, final state and the seven gradients from torch autograd in float64 on the inputs rounded
    to ``dtype`` (so a float32 JAX run is judged on exactly the values it saw)."""
    c = CONFIGS[config]
    x, do, dht = _problem(config)
    ts = {n: torch.tensor(a.astype(dtype).astype(np.float64), requires_grad=True) for n, a in x.items()}
    o, ht = impl(*(ts[n] for n in NAMES), scale=c["scale"], h0=ts["h0"], cu=c["cu"], l2norm=c["l2"])
    loss = (o * torch.tensor(do.astype(dtype).astype(np.float64))).sum() + \
        (ht * torch.tensor(dht.astype(dtype).astype(np.float64))).sum()
    grads = torch.autograd.grad(loss, [ts[n] for n in GRAD_NAMES])
    res = {"o": o.detach().numpy(), "ht": ht.detach().numpy()}
    res.update({"d" + n: gr.numpy() for n, gr in zip(GRAD_NAMES, grads)})
    return res


@functools.lru_cache(maxsize=None)
def _oracle_results(config: str, dtype: str):
    return _torch_results(torch_gdn2, config, dtype)


@functools.lru_cache(maxsize=None)
def _fla_results(config: str):
    return _torch_results(fla_gdn2, config, "float64")


@functools.lru_cache(maxsize=None)
def _jax_results(fn_name: str, config: str, dtype: str):
    c = CONFIGS[config]
    x, do, dht = _problem(config)
    fn = FUNCS[fn_name]
    with jax.enable_x64(dtype == "float64"):
        xs = [jnp.asarray(x[n].astype(dtype)) for n in GRAD_NAMES]
        cu = None if c["cu"] is None else jnp.asarray(c["cu"], jnp.int32)

        def f(q, k, v, g, b, w, h0):
            return fn(q, k, v, g, b, w, scale=c["scale"], initial_state=h0, output_final_state=True,
                      use_qk_l2norm_in_kernel=c["l2"], cu_seqlens=cu)

        @jax.jit
        def run(*xs):
            (o, ht), vjp = jax.vjp(f, *xs)
            return o, ht, vjp((jnp.asarray(do, o.dtype), jnp.asarray(dht, ht.dtype)))

        o, ht, grads = run(*xs)
        assert o.dtype == np.dtype(dtype) and ht.dtype == np.dtype(dtype)
        res = {"o": np.asarray(o), "ht": np.asarray(ht)}
        res.update({"d" + n: np.asarray(gr) for n, gr in zip(GRAD_NAMES, grads)})
    return res


QUANTITIES = ["o", "ht"] + ["d" + n for n in GRAD_NAMES]


def _compare(got, ref, tol):
    ratios = {qname: rms_ratio(got[qname], ref[qname]) for qname in QUANTITIES}
    bad = {qname: r for qname, r in ratios.items() if not r <= tol}
    assert not bad, f"RMS ratio above {tol:g}: {bad} (all: {ratios})"


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("fn_name", list(FUNCS))
def test_matches_independent_torch_fp64(fn_name, config, dtype):
    _compare(_jax_results(fn_name, config, dtype), _oracle_results(config, dtype), TOL[dtype])


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("fn_name", list(FUNCS))
def test_matches_fla_naive(fn_name, config):
    if _fla_naive() is None:
        pytest.skip("fla-core is not installed")
    _compare(_jax_results(fn_name, config, "float64"), _fla_results(config), FLA_TOL)


def test_torch_oracle_agrees_with_fla_and_fla_was_not_imported():
    if _fla_naive() is None:
        pytest.skip("fla-core is not installed")
    _compare(_oracle_results("dense_gva", "float64"), _fla_results("dense_gva"), FLA_TOL)
    assert "fla" not in sys.modules  # loaded by file path only (importing fla needs triton)

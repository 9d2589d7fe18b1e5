"""GPU tests of the TileLang kernels (``backend="tilelang"``) through JAX and the torch path.

Ground truth: an fp64 numpy token loop (written here, independent of the code under test) on the *same
quantised* inputs the kernels see. Metric: RMS(out − ref)/RMS(ref). Inputs are swept over magnitudes: g per
channel drawn from {0, -1e-3, -0.1, -6, -20, -60} (mixed inside every chunk), b from {0, 1, 2}, random and
highly correlated keys, zero / random / absent initial states. The torch path writes into NaN-poisoned output
buffers so an unwritten element fails.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

G_LEVELS = np.array([0.0, -1e-3, -0.1, -6.0, -20.0, -60.0])
B_LEVELS = np.array([0.0, 1.0, 2.0])


# ----------------------------------------------------------------------------------------------- oracle + data
def oracle(q, k, v, g, b, w, h0, scale, cu=None, l2norm=False):
    """fp64 token loop. q,k [B,T,H,K]; v,w [B,T,HV,V]; g,b [B,T,HV,K]; h0 [N,HV,K,V] or None.

    Returns (o [B,T,HV,V], ht [N,HV,K,V], states [T, N, HV, K, V] after every token of dense input).
    """
    q, k, v, g, b, w = (np.asarray(x, np.float64) for x in (q, k, v, g, b, w))
    if l2norm:
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // H
    q, k = np.repeat(q, G, axis=2), np.repeat(k, G, axis=2)
    segs = [(n, n, 0, T) for n in range(B)] if cu is None else [
        (n, 0, int(cu[n]), int(cu[n + 1])) for n in range(len(cu) - 1)]
    N = len(segs)
    h0 = np.zeros((N, HV, K, V)) if h0 is None else np.asarray(h0, np.float64)
    o = np.zeros((B, T, HV, V))
    ht = np.zeros((N, HV, K, V))
    states = np.zeros((T, N, HV, K, V)) if cu is None else None
    for n, bb, s, e in segs:
        S = h0[n].copy()
        for t in range(s, e):
            S = np.exp(g[bb, t])[:, :, None] * S
            u = w[bb, t] * v[bb, t] - np.einsum("hk,hkv->hv", b[bb, t] * k[bb, t], S)
            S = S + k[bb, t][:, :, None] * u[:, None, :]
            o[bb, t] = scale * np.einsum("hk,hkv->hv", q[bb, t], S)
            if states is not None:
                states[t, n] = S
        ht[n] = S
    return o, ht, states


def make(seed, B, T, H, HV, K, V, dtype="bfloat16", g_dtype="float32", N=None, h0="random", corr_keys=False,
         dist="swept"):
    """Swept-magnitude inputs as numpy arrays already rounded to the kernel dtypes (returned as float32 copies
    plus the dtype names), so oracle and kernels see identical values."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    N = B if N is None else N
    q = rng.standard_normal((B, T, H, K))
    if corr_keys:  # highly correlated keys: one shared direction plus a little noise
        base = rng.standard_normal((1, 1, H, K))
        k = base + 0.05 * rng.standard_normal((B, T, H, K))
    else:
        k = rng.standard_normal((B, T, H, K))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    if dist == "swept":
        g = G_LEVELS[rng.integers(0, len(G_LEVELS), (B, T, HV, K))] * rng.uniform(0.5, 1.0, (B, T, HV, K))
        g[..., :2] = 0.0  # some channels never decay
        b = B_LEVELS[rng.integers(0, 3, (B, T, HV, K))] * rng.uniform(0.0, 1.0, (B, T, HV, K)) ** 0.25
        np.clip(b, 0, 2, out=b)
    else:  # spec §11 / §15 accuracy distribution
        g = rng.uniform(-5.0, -0.1, (B, T, HV, K))
        b = rng.uniform(0.0, 1.0, (B, T, HV, K))
    x = dict(q=q, k=k, v=0.5 * rng.standard_normal((B, T, HV, V)), g=g, b=b,
             w=rng.uniform(0.0, 1.0, (B, T, HV, V)))
    dt = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    gdt = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[g_dtype]
    out = {n: a.astype(gdt if n == "g" else dt) for n, a in x.items()}
    if h0 == "random":
        out["h0"] = rng.standard_normal((N, HV, K, V)).astype(np.float32)
    elif h0 == "zero":
        out["h0"] = np.zeros((N, HV, K, V), np.float32)
    return out


def rms(x, ref):
    x = np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    assert np.all(np.isfinite(x)), "non-finite values in the output (unwritten / NaN-poisoned elements?)"
    return float(np.sqrt(np.mean((x - ref) ** 2)) / np.sqrt(np.mean(ref * ref)))


def bf16_floor(ref, dtype):
    """RMS ratio from rounding the exact output to the output dtype (the best any kernel can do)."""
    import ml_dtypes

    dt = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    return rms(np.asarray(ref).astype(dt).astype(np.float64), ref)


# ---------------------------------------------------------------------------------------------- framework glue
def jnp_inputs(x):
    import jax.numpy as jnp

    return {n: jnp.asarray(a) for n, a in x.items()}


def torch_inputs(x):
    import torch

    out = {}
    for n, a in x.items():
        if a.dtype.name == "bfloat16":
            out[n] = torch.from_numpy(a.astype(np.float32)).to("cuda", torch.bfloat16)
        else:
            out[n] = torch.from_numpy(np.ascontiguousarray(a)).to("cuda")
    return out


def to_np(t):
    import torch

    if isinstance(t, torch.Tensor):
        return t.float().cpu().numpy() if t.dtype in (torch.bfloat16, torch.float16) else t.cpu().numpy()
    return np.asarray(t).astype(np.float32) if np.asarray(t).dtype.itemsize == 2 else np.asarray(t)


def run_jax(op, x, *, cu=None, output_final_state=True, l2=False, scale=None, h0=True):
    import gdn2_jax

    j = jnp_inputs(x)
    fn = getattr(gdn2_jax, op)
    kw = dict(initial_state=j.get("h0") if h0 else None, output_final_state=output_final_state,
              use_qk_l2norm_in_kernel=l2, scale=scale, backend="tilelang")
    if cu is not None:
        import jax.numpy as jnp

        kw["cu_seqlens"] = jnp.asarray(np.asarray(cu, np.int32))
    o, ht = fn(*(j[n] for n in ("q", "k", "v", "g", "b", "w")), **kw)
    return o, ht


def run_torch_poisoned(op, x, *, cu=None, output_final_state=True, l2=False, scale=None, h0=True):
    """Torch path through run_pipeline with NaN-filled output buffers."""
    import torch

    from kernels import torch_api

    t = torch_inputs(x)
    B, T, H, K = t["q"].shape
    HV, V = t["v"].shape[2:]
    kw = dict(H=H, HV=HV, K=K, V=V, dtype=str(t["q"].dtype)[6:], g_dtype=str(t["g"].dtype)[6:],
              scale=K ** -0.5 if scale is None else scale, use_initial_state=h0 and "h0" in t,
              output_final_state=output_final_state, varlen=cu is not None, use_qk_l2norm=l2)
    pipe = (torch_api.chunk_pipeline if op == "chunk_gdn2" else torch_api.recurrent_pipeline)(**kw)
    ins = {n: t[n] for n in ("q", "k", "v", "g", "b", "w")}
    if kw["use_initial_state"]:
        ins["h0"] = t["h0"]
    if cu is not None:
        ins["cu_seqlens"] = torch.tensor(np.asarray(cu), dtype=torch.int32, device="cuda")
    shapes = pipe.buffer_shapes({n: tuple(a.shape) for n, a in ins.items()})
    out = {b.name: torch.full(shapes[b.name], float("nan"), dtype=getattr(torch, b.dtype), device="cuda")
           for b in pipe.outputs}
    res = torch_api.run_pipeline(pipe, ins, out=out)
    torch.cuda.synchronize()
    return res["o"], res.get("ht")


_HAS_CHUNK = importlib.util.find_spec("kernels.chunk_fwd") is not None
OPS = ["fused_recurrent_gdn2",
       pytest.param("chunk_gdn2", marks=pytest.mark.skipif(not _HAS_CHUNK, reason="kernels/chunk_fwd.py not present"))]

# Limits vs the fp64 oracle: o / final state. Decode: the output-dtype rounding floor (None) and 1e-5 everywhere.
# Chunk: issue 3 acceptance (3.5e-3 / 2.5e-3) on the spec distribution; on the swept-magnitude inputs (b up to 2,
# g down to -60) FLA's own test tolerance (spec §11: 5e-3), and test_vs_fla_060 keeps us within 1.5x FLA.
LIMITS = {"fused_recurrent_gdn2": (None, 1e-5), "chunk_gdn2": (5e-3, 5e-3)}
ACCEPTANCE = {"fused_recurrent_gdn2": (1.8e-3, 1e-5), "chunk_gdn2": (3.5e-3, 2.5e-3)}


def check_acc(op, o, ht, ref_o, ref_ht, dtype, limits=None):
    r_o = rms(to_np(o), ref_o)
    floor = bf16_floor(ref_o, dtype)
    lim_o, lim_s = (limits or LIMITS)[op]
    if lim_o is None:  # decode: at the output-dtype rounding floor (acceptance: <= 1.8e-3 in bf16)
        lim_o = floor * 1.08 + 1e-5
    assert r_o <= lim_o, (op, r_o, lim_o, floor)
    if ht is not None:
        r_s = rms(to_np(ht), ref_ht)
        assert r_s <= lim_s, (op, r_s, lim_s)
    return r_o


# ------------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype,KV,H,HV,T,h0", [
    ("bfloat16", 128, 2, 2, 1, "random"),
    ("bfloat16", 128, 2, 4, 5, "zero"),
    ("bfloat16", 64, 1, 3, 100, "random"),
    ("float16", 128, 2, 4, 64, "random"),
    ("float16", 64, 2, 2, 130, None),
    ("bfloat16", 128, 4, 8, 200, "random"),
])
def test_dense_vs_oracle_poisoned_torch_equals_jax(op, dtype, KV, H, HV, T, h0):
    if op == "fused_recurrent_gdn2" and T > 64:
        T = T // 4  # the token loop is for short inputs; keep the test quick
    x = make(1000 + T + KV, 2, T, H, HV, KV, KV, dtype, h0=h0 or "random")
    use_h0 = h0 is not None
    ref_o, ref_ht, _ = oracle(*(x[n] for n in ("q", "k", "v", "g", "b", "w")), x["h0"] if use_h0 else None,
                              KV ** -0.5)
    o_t, ht_t = run_torch_poisoned(op, x, h0=use_h0)
    check_acc(op, o_t, ht_t, ref_o, ref_ht, dtype)
    o_j, ht_j = run_jax(op, x, h0=use_h0)
    # same kernels, same inputs: bit-for-bit
    np.testing.assert_array_equal(to_np(o_j), to_np(o_t))
    np.testing.assert_array_equal(np.asarray(ht_j), to_np(ht_t))
    # run twice: bit-identical
    o_j2, ht_j2 = run_jax(op, x, h0=use_h0)
    np.testing.assert_array_equal(to_np(o_j2), to_np(o_j))
    np.testing.assert_array_equal(np.asarray(ht_j2), np.asarray(ht_j))


@pytest.mark.parametrize("op", OPS)
def test_acceptance_accuracy_spec_distribution(op):
    """Issue 3 acceptance on the spec §15 accuracy setting (bf16, D=128, g~U(-5,-0.1), b,w~U(0,1), random h0)."""
    T = 512 if op == "chunk_gdn2" else 64
    x = make(2024, 1, T, 4, 4, 128, 128, "bfloat16", dist="spec")
    ref_o, ref_ht, _ = oracle(*(x[n] for n in ("q", "k", "v", "g", "b", "w")), x["h0"], 128 ** -0.5)
    o, ht = run_jax(op, x)
    r = check_acc(op, o, ht, ref_o, ref_ht, "bfloat16", limits=ACCEPTANCE)
    print(f"{op}: o ratio {r:.3e} (bf16 floor {bf16_floor(ref_o, 'bfloat16'):.3e}), "
          f"state ratio {rms(np.asarray(ht), ref_ht):.3e}")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("g_dtype,l2,corr", [("bfloat16", False, True), ("float32", True, False)])
def test_gate_dtype_l2norm_correlated_keys(op, g_dtype, l2, corr):
    x = make(7, 1, 40, 2, 4, 128, 128, "bfloat16", g_dtype=g_dtype, corr_keys=corr)
    if l2:  # unnormalised q/k: the kernel normalises
        rng = np.random.default_rng(3)
        for n in ("q", "k"):
            x[n] = (x[n].astype(np.float32) * rng.uniform(0.5, 3.0, x[n].shape[:-1] + (1,))).astype(x[n].dtype)
    ref_o, ref_ht, _ = oracle(*(x[n] for n in ("q", "k", "v", "g", "b", "w")), x["h0"], 0.3, l2norm=l2)
    o, ht = run_torch_poisoned(op, x, l2=l2, scale=0.3)
    check_acc(op, o, ht, ref_o, ref_ht, "bfloat16")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("cu", [[0, 1, 5, 5, 17, 20], [0, 64, 65, 150, 151, 300]])
def test_varlen_uneven(op, cu):
    T = cu[-1]
    if op == "fused_recurrent_gdn2" and T > 64:
        cu = [c // 5 for c in cu]
        T = cu[-1]
    N = len(cu) - 1
    x = make(11 + T, 1, T, 2, 4, 64, 64, "bfloat16", N=N)
    ref_o, ref_ht, _ = oracle(*(x[n] for n in ("q", "k", "v", "g", "b", "w")), x["h0"], 0.125, cu=cu)
    o, ht = run_torch_poisoned(op, x, cu=cu)
    check_acc(op, o, ht, ref_o, ref_ht, "bfloat16")
    o_j, ht_j = run_jax(op, x, cu=cu)
    np.testing.assert_array_equal(to_np(o_j), to_np(o))
    np.testing.assert_array_equal(np.asarray(ht_j), to_np(ht))


@pytest.mark.parametrize("op", OPS)
def test_chained_calls_equal_one_long_call(op):
    T1, T2 = (3, 4) if op == "fused_recurrent_gdn2" else (64, 100)
    x = make(21, 2, T1 + T2, 2, 4, 128, 128, "bfloat16")
    first = {n: (a[:, :T1] if n != "h0" else a) for n, a in x.items()}
    o1, h1 = run_jax(op, first)
    second = {n: a[:, T1:] for n, a in x.items() if n != "h0"}
    second["h0"] = np.asarray(h1)
    o2, h2 = run_jax(op, second)
    o, h = run_jax(op, x)
    o_chain = np.concatenate([to_np(o1), to_np(o2)], axis=1)
    if op == "fused_recurrent_gdn2":  # the state stays fp32 between calls: identical arithmetic
        np.testing.assert_array_equal(o_chain, to_np(o))
        np.testing.assert_array_equal(np.asarray(h2), np.asarray(h))
    else:
        assert rms(o_chain, to_np(o)) < 2e-3
        assert rms(np.asarray(h2), np.asarray(h)) < 1e-3


def test_decode_audit_128_tokens():
    """Carry the state through 128 changing tokens, one jitted decode call per token, checking every step."""
    import jax
    import jax.numpy as jnp

    import gdn2_jax

    B, H, HV, K = 3, 2, 4, 128
    x = make(99, B, 128, H, HV, K, K, "bfloat16")
    _, _, states = oracle(*(x[n] for n in ("q", "k", "v", "g", "b", "w")), x["h0"], K ** -0.5)
    ref_o, _, _ = oracle(*(x[n] for n in ("q", "k", "v", "g", "b", "w")), x["h0"], K ** -0.5)
    j = jnp_inputs(x)

    @jax.jit
    def step(S, q, k, v, g, b, w):
        return gdn2_jax.fused_recurrent_gdn2(q, k, v, g, b, w, initial_state=S, output_final_state=True,
                                             backend="tilelang")

    S = j["h0"]
    worst_o = worst_s = 0.0
    for t in range(128):
        o, S = step(S, *(j[n][:, t:t + 1] for n in ("q", "k", "v", "g", "b", "w")))
        r_o = rms(to_np(o)[:, 0], ref_o[:, t])
        r_s = rms(np.asarray(S), states[t])
        worst_o, worst_s = max(worst_o, r_o), max(worst_s, r_s)
        assert r_o <= 1.8e-3 * 1.5, (t, r_o)
        assert r_s <= 1e-5, (t, r_s)
    print(f"decode audit: worst o ratio {worst_o:.3e}, worst state ratio {worst_s:.3e}")


def test_decode_inplace_paths():
    """Torch in-place state update and the JAX aliased (donated) step equal the functional call."""
    import jax
    import torch

    from gdn2_jax._tilelang_ops import fused_recurrent_gdn2_inplace
    from kernels import torch_api

    x = make(5, 4, 1, 2, 4, 128, 128, "bfloat16")
    ref_o, ref_ht, _ = oracle(*(x[n] for n in ("q", "k", "v", "g", "b", "w")), x["h0"], 128 ** -0.5)
    t = torch_inputs(x)
    o_f, ht_f = torch_api.fused_recurrent_gdn2(*(t[n] for n in ("q", "k", "v", "g", "b", "w")),
                                               initial_state=t["h0"].clone(), output_final_state=True)
    h = t["h0"].clone()
    ptr = h.data_ptr()
    o_i, ht_i = torch_api.fused_recurrent_gdn2(*(t[n] for n in ("q", "k", "v", "g", "b", "w")), initial_state=h,
                                               inplace_final_state=True)
    torch.cuda.synchronize()
    assert ht_i.data_ptr() == ptr
    np.testing.assert_array_equal(to_np(h), to_np(ht_f))
    np.testing.assert_array_equal(to_np(o_i), to_np(o_f))
    check_acc("fused_recurrent_gdn2", o_i, h, ref_o, ref_ht, "bfloat16")
    j = jnp_inputs(x)
    f = jax.jit(fused_recurrent_gdn2_inplace, donate_argnums=6)
    o_j, ht_j = f(*(j[n] for n in ("q", "k", "v", "g", "b", "w")), j["h0"])
    np.testing.assert_array_equal(np.asarray(ht_j), to_np(ht_f))
    np.testing.assert_array_equal(to_np(o_j), to_np(o_f))


@pytest.mark.parametrize("op", OPS)
def test_vmap_folds_into_batch(op):
    import jax
    import jax.numpy as jnp

    import gdn2_jax

    T = 5 if op == "fused_recurrent_gdn2" else 70
    xs = [make(40 + i, 2, T, 2, 4, 64, 64, "bfloat16") for i in range(3)]
    stacked = {n: jnp.stack([jnp.asarray(x[n]) for x in xs]) for n in xs[0]}
    fn = getattr(gdn2_jax, op)

    def f(q, k, v, g, b, w, h0):
        return fn(q, k, v, g, b, w, initial_state=h0, output_final_state=True, backend="tilelang")

    o, ht = jax.jit(jax.vmap(f))(*(stacked[n] for n in ("q", "k", "v", "g", "b", "w", "h0")))
    for i, x in enumerate(xs):
        o_i, ht_i = run_jax(op, x)
        np.testing.assert_array_equal(to_np(o[i]), to_np(o_i))
        np.testing.assert_array_equal(np.asarray(ht[i]), np.asarray(ht_i))


@pytest.mark.parametrize("op", OPS)
def test_grad_through_tilelang_forward_matches_xla(op):
    import jax
    import jax.numpy as jnp

    import gdn2_jax

    x = make(3, 1, 6, 1, 2, 64, 64, "bfloat16")
    j = jnp_inputs(x)
    fn = getattr(gdn2_jax, op)

    def loss(backend, v, h0):
        o, ht = fn(j["q"], j["k"], v, j["g"], j["b"], j["w"], initial_state=h0, output_final_state=True,
                   backend=backend)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(ht)

    gt = jax.grad(lambda v, h: loss("tilelang", v, h), argnums=(0, 1))(j["v"], j["h0"])
    gx = jax.grad(lambda v, h: loss("xla", v, h), argnums=(0, 1))(j["v"], j["h0"])
    for a, b in zip(gt, gx):  # the backward is the xla VJP at the same inputs
        np.testing.assert_allclose(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)),
                                   rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(gt[1]).max()) > 0


@pytest.mark.parametrize("op", OPS)
def test_vs_fla_060(op):
    torch = pytest.importorskip("torch")
    try:
        from fla.ops.gdn2 import chunk_gdn2 as fla_chunk
        from fla.ops.gdn2 import fused_recurrent_gdn2 as fla_rec
    except Exception as e:  # pragma: no cover - FLA needs triton
        pytest.skip(f"fla 0.6.0 not importable: {e}")
    H = HV = 4
    T = 6 if op == "fused_recurrent_gdn2" else 300
    x = make(77, 2, T, H, HV, 128, 128, "bfloat16")
    ref_o, ref_ht, _ = oracle(*(x[n] for n in ("q", "k", "v", "g", "b", "w")), x["h0"], 128 ** -0.5)
    t = torch_inputs(x)
    args = [t[n] for n in ("q", "k", "v", "g", "b", "w")]
    if op == "fused_recurrent_gdn2":
        fo, fh = fla_rec(*args, initial_state=t["h0"], output_final_state=True)
    else:
        fo, fh = fla_chunk(*args, initial_state=t["h0"], output_final_state=True)
    o, ht = run_jax(op, x)
    assert rms(to_np(o), to_np(fo)) < 5e-3
    assert rms(np.asarray(ht), to_np(fh)) < 5e-3
    # both against the oracle: ours no worse than FLA * 1.5
    r_ours, r_fla = rms(to_np(o), ref_o), rms(to_np(fo), ref_o)
    assert r_ours <= max(1.5 * r_fla, 2e-3), (r_ours, r_fla)
    print(f"{op}: o ratio ours {r_ours:.3e} fla {r_fla:.3e}; state ours {rms(np.asarray(ht), ref_ht):.3e} "
          f"fla {rms(to_np(fh), ref_ht):.3e}")

"""GPU / torch specific tests of the TileLang kernels (``backend="tilelang"``), marked ``cuda``.

The behaviour cases (forward vs oracle over T, head dims, dtypes and initial states; gradients; varlen; GVA;
jit / vmap; bad inputs and the kernels' support errors; determinism) are written once in ``test_backends.py`` and
run there for every backend, tilelang included. Here only what needs the GPU or torch: the torch path
(``kernels.torch_api``) writing into NaN-poisoned output buffers (an unwritten element fails) and its bit equality
with the JAX path, torch's in-place state update, chained calls, the 128-token decode audit, the issue 3
acceptance case on the spec distribution, and the comparison with FLA 0.6.0.

Ground truth: the fp64 numpy token loop ``_backends.oracle`` on the *same quantised* inputs the kernels see
(``_backends.make``: g per channel from {0, -1e-3, -0.1, -6, -20, -60} mixed inside every chunk, b from {0, 1, 2},
random and highly correlated keys, zero / random / absent initial states). Metric: RMS(out − ref)/RMS(ref); limits
``_backends.LIMITS`` / ``ACCEPTANCE``.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from _backends import ACCEPTANCE, LIMITS, NAMES, bf16_floor, make, oracle, rms

pytestmark = pytest.mark.cuda


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
    """The public JAX op with ``backend="tilelang"`` on the numpy inputs ``x``; returns (o, ht)."""
    import gdn2_jax

    j = jnp_inputs(x)
    fn = getattr(gdn2_jax, op)
    kw = {"initial_state": j.get("h0") if h0 else None, "output_final_state": output_final_state,
          "use_qk_l2norm_in_kernel": l2, "scale": scale, "backend": "tilelang"}
    if cu is not None:
        import jax.numpy as jnp

        kw["cu_seqlens"] = jnp.asarray(np.asarray(cu, np.int32))
    return fn(*(j[n] for n in NAMES), **kw)


def run_torch_poisoned(op, x, *, cu=None, output_final_state=True, l2=False, scale=None, h0=True):
    """Torch path: the op's pipeline (``kernels.registry``) through ``torch_api.run_pipeline`` with NaN-filled
    output buffers, so that an element the kernels do not write fails the accuracy check."""
    import torch

    from kernels import registry, torch_api

    t = torch_inputs(x)
    H, K = t["q"].shape[2:]
    HV, V = t["v"].shape[2:]
    cfg = registry.config(H=H, HV=HV, K=K, V=V, dtype=str(t["q"].dtype)[6:], g_dtype=str(t["g"].dtype)[6:],
                          scale=K ** -0.5 if scale is None else scale, use_initial_state=h0 and "h0" in t,
                          output_final_state=output_final_state, varlen=cu is not None, use_qk_l2norm=l2)
    pipe = registry.get(op).pipeline(**cfg)
    ins = {n: t[n] for n in NAMES}
    if cfg["use_initial_state"]:
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


def check_acc(op, o, ht, ref_o, ref_ht, dtype, limits=None):
    """o (torch or JAX) and the final state against the oracle at ``limits`` (default ``LIMITS``); o's ratio."""
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
def _torch_equals_jax(op, x, ref_o, ref_ht, dtype, **kw):
    """The torch path into NaN-poisoned buffers is within the limits of the oracle (so every element was written)
    and bit-identical to the JAX path (same kernels, same inputs)."""
    o_t, ht_t = run_torch_poisoned(op, x, **kw)
    check_acc(op, o_t, ht_t, ref_o, ref_ht, dtype)
    o_j, ht_j = run_jax(op, x, **kw)
    np.testing.assert_array_equal(to_np(o_j), to_np(o_t))
    np.testing.assert_array_equal(np.asarray(ht_j), to_np(ht_t))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype,KV,H,HV,T,h0", [
    ("bfloat16", 128, 2, 2, 1, "random"),
    ("bfloat16", 128, 2, 4, 5, "zero"),
    ("bfloat16", 64, 1, 3, 100, "random"),
    ("float16", 128, 2, 4, 64, "random"),
    ("float16", 64, 2, 2, 130, None),
    ("bfloat16", 128, 4, 8, 200, "random"),
])
def test_dense_torch_poisoned_equals_jax(op, dtype, KV, H, HV, T, h0):
    """Dense inputs: bf16 / fp16, K = V in {64, 128}, GVA, random / zero / absent initial state."""
    if op == "fused_recurrent_gdn2" and T > 64:
        T = T // 4  # the token loop is for short inputs; keep the test quick
    x = make(1000 + T + KV, 2, T, H, HV, KV, KV, dtype, h0=h0 or "random")
    use_h0 = h0 is not None
    ref_o, ref_ht, _ = oracle(*(x[n] for n in NAMES), x["h0"] if use_h0 else None, KV ** -0.5)
    _torch_equals_jax(op, x, ref_o, ref_ht, dtype, h0=use_h0)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("g_dtype,l2,corr", [("bfloat16", False, True), ("float32", True, False)])
def test_gate_dtype_l2norm_correlated_keys_torch_poisoned_equals_jax(op, g_dtype, l2, corr):
    """A bf16 decay with highly correlated keys, and the in-kernel L2 norm of unnormalised q/k; scale 0.3."""
    x = make(7, 1, 40, 2, 4, 128, 128, "bfloat16", g_dtype=g_dtype, corr_keys=corr)
    if l2:  # unnormalised q/k: the kernel normalises
        rng = np.random.default_rng(3)
        for n in ("q", "k"):
            x[n] = (x[n].astype(np.float32) * rng.uniform(0.5, 3.0, x[n].shape[:-1] + (1,))).astype(x[n].dtype)
    ref_o, ref_ht, _ = oracle(*(x[n] for n in NAMES), x["h0"], 0.3, l2norm=l2)
    _torch_equals_jax(op, x, ref_o, ref_ht, "bfloat16", l2=l2, scale=0.3)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("cu", [[0, 1, 5, 5, 17, 20], [0, 64, 65, 150, 151, 300]])
def test_varlen_torch_poisoned_equals_jax(op, cu):
    """Packed uneven sequences, an empty one included (``cu_seqlens`` passed to the kernels as int32)."""
    T = cu[-1]
    if op == "fused_recurrent_gdn2" and T > 64:
        cu = [c // 5 for c in cu]
        T = cu[-1]
    N = len(cu) - 1
    x = make(11 + T, 1, T, 2, 4, 64, 64, "bfloat16", N=N)
    ref_o, ref_ht, _ = oracle(*(x[n] for n in NAMES), x["h0"], 0.125, cu=cu)
    _torch_equals_jax(op, x, ref_o, ref_ht, "bfloat16", cu=cu, scale=0.125)


@pytest.mark.parametrize("op", OPS)
def test_acceptance_accuracy_spec_distribution(op):
    """Issue 3 acceptance on the spec §15 accuracy setting (bf16, D=128, g~U(-5,-0.1), b,w~U(0,1), random h0)."""
    T = 512 if op == "chunk_gdn2" else 64
    x = make(2024, 1, T, 4, 4, 128, 128, "bfloat16", dist="spec")
    ref_o, ref_ht, _ = oracle(*(x[n] for n in NAMES), x["h0"], 128 ** -0.5)
    o, ht = run_jax(op, x)
    r = check_acc(op, o, ht, ref_o, ref_ht, "bfloat16", limits=ACCEPTANCE)
    print(f"{op}: o ratio {r:.3e} (bf16 floor {bf16_floor(ref_o, 'bfloat16'):.3e}), "
          f"state ratio {rms(np.asarray(ht), ref_ht):.3e}")


@pytest.mark.parametrize("op", OPS)
def test_chained_calls_equal_one_long_call(op):
    """Two calls, the second from the first's final state, equal one call over the whole input (decode: bit for
    bit, the state stays fp32 between calls; chunk: to bf16 accuracy, the chunk grid differs)."""
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

    import gdn2_jax

    B, H, HV, K = 3, 2, 4, 128
    x = make(99, B, 128, H, HV, K, K, "bfloat16")
    ref_o, _, states = oracle(*(x[n] for n in NAMES), x["h0"], K ** -0.5)
    j = jnp_inputs(x)

    @jax.jit
    def step(S, q, k, v, g, b, w):
        return gdn2_jax.fused_recurrent_gdn2(q, k, v, g, b, w, initial_state=S, output_final_state=True,
                                             backend="tilelang")

    S = j["h0"]
    worst_o = worst_s = 0.0
    for t in range(128):
        o, S = step(S, *(j[n][:, t:t + 1] for n in NAMES))
        r_o = rms(to_np(o)[:, 0], ref_o[:, t])
        r_s = rms(np.asarray(S), states[t])
        worst_o, worst_s = max(worst_o, r_o), max(worst_s, r_s)
        assert r_o <= 1.8e-3 * 1.5, (t, r_o)
        assert r_s <= 1e-5, (t, r_s)
    print(f"decode audit: worst o ratio {worst_o:.3e}, worst state ratio {worst_s:.3e}")


def test_decode_inplace_paths():
    """Torch's in-place state update (``inplace_final_state=True`` writes into the given tensor) and the JAX
    aliased, donated step (public API) equal torch's functional call bit for bit, and the oracle."""
    import jax
    import torch

    import gdn2_jax
    from kernels import torch_api

    x = make(5, 4, 1, 2, 4, 128, 128, "bfloat16")
    ref_o, ref_ht, _ = oracle(*(x[n] for n in NAMES), x["h0"], 128 ** -0.5)
    t = torch_inputs(x)
    o_f, ht_f = torch_api.fused_recurrent_gdn2(*(t[n] for n in NAMES), initial_state=t["h0"].clone(),
                                               output_final_state=True)
    h = t["h0"].clone()
    ptr = h.data_ptr()
    o_i, ht_i = torch_api.fused_recurrent_gdn2(*(t[n] for n in NAMES), initial_state=h, inplace_final_state=True)
    torch.cuda.synchronize()
    assert ht_i.data_ptr() == ptr
    np.testing.assert_array_equal(to_np(h), to_np(ht_f))
    np.testing.assert_array_equal(to_np(o_i), to_np(o_f))
    check_acc("fused_recurrent_gdn2", o_i, h, ref_o, ref_ht, "bfloat16")
    j = jnp_inputs(x)
    f = jax.jit(lambda q, k, v, g, b, w, h0: gdn2_jax.fused_recurrent_gdn2(
        q, k, v, g, b, w, initial_state=h0, inplace_final_state=True, backend="tilelang"), donate_argnums=6)
    o_j, ht_j = f(*(j[n] for n in NAMES), j["h0"])
    np.testing.assert_array_equal(np.asarray(ht_j), to_np(ht_f))
    np.testing.assert_array_equal(to_np(o_j), to_np(o_f))


@pytest.mark.parametrize("op", OPS)
def test_vs_fla_060(op):
    pytest.importorskip("torch")
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


# ---------------------------------------------------------------------------- chunk kernel precision options
PRECISION_OPTIONS = {
    "v5": {"aqk_split": False},
    "tf32_round": {"tf32_round": True, "aqk_split": False},
    "exact_self": {"exact_self": True, "aqk_split": False},
    "default": {},  # aqk_split
    "all": {"tf32_round": True, "exact_self": True},
}


def test_chunk_precision_options_vs_oracle():
    """The intra/state kernels' precision options (``kernels/chunk_fwd.py``: TF32 operands rounded to nearest, fp32
    self terms on Aqk's diagonal, Aqk as bf16 + residual, the default since session 5) on the spec §15 accuracy case
    against the fp64 oracle. ``benchmarks/emulate_chunk.py`` predicts o ratios of 3.27e-3 (v5: no residual),
    2.90e-3 (default) and 2.81e-3 (all) on CPU-drawn inputs; session 5 measured 3.21-3.31e-3 (v5) and 2.87-2.95e-3
    (default) over six seeds. Each variant stays within the acceptance limits and reruns bit-identically; the
    default is at least 5% better than v5 and all three options together no worse than the default."""
    import torch

    from kernels import registry, torch_api

    x = make(2024, 1, 512, 4, 4, 128, 128, "bfloat16", dist="spec")
    ref_o, ref_ht, _ = oracle(*(x[n] for n in NAMES), x["h0"], 128 ** -0.5)
    t = torch_inputs(x)
    cfg = registry.config(H=4, HV=4, K=128, V=128, dtype="bfloat16", g_dtype="float32", scale=128 ** -0.5,
                          use_initial_state=True, output_final_state=True, varlen=False, use_qk_l2norm=False)
    ratio = {}
    for name, opt in PRECISION_OPTIONS.items():
        pipe = registry.get("chunk_gdn2").pipeline(**cfg, **opt)
        outs = [torch_api.run_pipeline(pipe, {n: t[n] for n in pipe.inputs}) for _ in range(2)]
        torch.cuda.synchronize()
        assert torch.equal(outs[0]["o"], outs[1]["o"]) and torch.equal(outs[0]["ht"], outs[1]["ht"]), name
        ratio[name] = check_acc("chunk_gdn2", to_np(outs[0]["o"]), to_np(outs[0]["ht"]), ref_o, ref_ht, "bfloat16",
                                limits=ACCEPTANCE)
        print(f"{name}: o ratio {ratio[name]:.4e}, state ratio {rms(to_np(outs[0]['ht']), ref_ht):.4e}")
    assert ratio["default"] <= 0.95 * ratio["v5"], ratio
    assert ratio["all"] <= ratio["default"] * 1.001, ratio


# ------------------------------------------------------------------------------------------- torch autograd
@pytest.mark.skipif(not _HAS_CHUNK, reason="kernels/chunk_fwd.py not present")
@pytest.mark.parametrize("H,HV,KV,T,dtype,g_dtype,l2,varlen,ofs", [
    (2, 2, 128, 130, "bfloat16", "float32", False, False, True),
    (1, 2, 64, 70, "bfloat16", "float32", False, True, True),
    (2, 2, 64, 65, "bfloat16", "bfloat16", True, False, True),
    (2, 4, 128, 63, "float16", "float32", True, False, False),
    (2, 2, 128, 1, "bfloat16", "float32", False, False, False),
])
def test_torch_autograd_chunk_equals_jax_grads(H, HV, KV, T, dtype, g_dtype, l2, varlen, ofs):
    """``kernels.torch_api.chunk_gdn2`` under ``torch.autograd``: the seven gradients of ``<o, do> + <ht, dht>``
    equal the JAX path's (``jax.grad`` through the tilelang backend's custom_vjp): bit for bit where both run only
    the kernels (no l2 norm), within 2e-3 RMS where the L2 norm's backward runs in torch vs jnp (their fp32
    reductions may round differently before the 16-bit cast). Also: the dtypes and shapes of the inputs, no NaN,
    inputs unchanged, two backward passes bit-identical, ``o`` equal to the no-grad call's, the gradients vs the
    fp64 oracle within the JAX path's limit (no-l2 cases), and an unused final state (``ofs`` off) works."""
    import jax
    import jax.numpy as jnp
    import torch

    import gdn2_jax
    from _backends import oracle_grads
    from kernels import torch_api

    cu = [0, 30, 30, T] if varlen else None
    B, N = (1, 3) if varlen else (2, 2)
    x = make(90 + T, B, T, H, HV, KV, KV, dtype, g_dtype, N=N)
    rng = np.random.default_rng(91)
    do = rng.standard_normal((B, T, HV, KV)).astype(np.float32)
    dht = rng.standard_normal((N, HV, KV, KV)).astype(np.float32) if ofs else np.zeros((N, HV, KV, KV), np.float32)
    names = NAMES + ("h0",)
    cu_j = None if cu is None else jnp.asarray(cu, jnp.int32)

    def loss(q, k, v, g, b, w, h0):
        o, ht = gdn2_jax.chunk_gdn2(q, k, v, g, b, w, initial_state=h0, output_final_state=ofs, cu_seqlens=cu_j,
                                    use_qk_l2norm_in_kernel=l2, backend="tilelang")
        s = jnp.sum(o.astype(jnp.float32) * do)
        return s + jnp.sum(ht * dht) if ofs else s

    j = jnp_inputs(x)
    want = dict(zip(names, jax.jit(jax.grad(loss, argnums=tuple(range(7))))(*(j[n] for n in names))))

    t = torch_inputs(x)
    before = {n: a.clone() for n, a in t.items()}
    leaves = {n: t[n].detach().clone().requires_grad_() for n in names}
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device="cuda")
    do_t, dht_t = torch.from_numpy(do).cuda(), torch.from_numpy(dht).cuda()

    def torch_grads():
        o, ht = torch_api.chunk_gdn2(*(leaves[n] for n in NAMES), initial_state=leaves["h0"],
                                     output_final_state=ofs, use_qk_l2norm_in_kernel=l2, cu_seqlens=cu_t)
        assert (ht is not None) == ofs
        s = (o.float() * do_t).sum() + ((ht * dht_t).sum() if ofs else 0)
        gr = torch.autograd.grad(s, [leaves[n] for n in names])
        return o.detach(), dict(zip(names, gr))

    o1, got = torch_grads()
    o2, again = torch_grads()
    torch.cuda.synchronize()
    with torch.no_grad():
        o0, _ = torch_api.chunk_gdn2(*(t[n] for n in NAMES), initial_state=t["h0"], output_final_state=ofs,
                                     use_qk_l2norm_in_kernel=l2, cu_seqlens=cu_t)
    np.testing.assert_array_equal(to_np(o1), to_np(o0))
    if not l2:
        ref = oracle_grads(*(x[n] for n in NAMES), x["h0"], KV ** -0.5, do, dht, cu=cu)
    for n in names:
        a = got[n]
        assert a.dtype == t[n].dtype and tuple(a.shape) == tuple(t[n].shape), (n, a.dtype, a.shape)
        assert torch.isfinite(a).all(), n
        np.testing.assert_array_equal(to_np(a), to_np(again[n]), err_msg=f"rerun {n}")
        if l2:
            assert rms(to_np(a), np.asarray(want[n], np.float32)) <= 2e-3, n
        else:
            np.testing.assert_array_equal(to_np(a), np.asarray(want[n], np.float32), err_msg=n)
            lim = 2e-2 if n in ("g", "b", "w") else 1e-2  # (issue 7's swept-magnitude audit limits)
            assert rms(to_np(a), ref[n]) <= lim, (n, rms(to_np(a), ref[n]))
    for n, a in before.items():
        assert torch.equal(t[n], a), n


@pytest.mark.skipif(not _HAS_CHUNK, reason="kernels/chunk_fwd.py not present")
def test_torch_autograd_only_some_inputs_and_no_grad_mode():
    """With only v requiring grad, o and the final state carry a graph and v's gradient is finite and nonzero;
    under ``torch.no_grad`` the call is the plain forward (``o`` carries no graph) and gives the same ``o``."""
    import torch

    from kernels import torch_api

    x = make(5, 1, 100, 2, 2, 64, 64)
    t = torch_inputs(x)
    v = t["v"].clone().requires_grad_()
    o, ht = torch_api.chunk_gdn2(t["q"], t["k"], v, t["g"], t["b"], t["w"], initial_state=t["h0"],
                                 output_final_state=True)
    assert o.requires_grad and ht.requires_grad
    (o.float().sum() + ht.sum()).backward()
    assert v.grad is not None and torch.isfinite(v.grad).all() and v.grad.abs().max() > 0
    with torch.no_grad():
        o2, _ = torch_api.chunk_gdn2(t["q"], t["k"], v, t["g"], t["b"], t["w"], initial_state=t["h0"])
    assert not o2.requires_grad
    np.testing.assert_array_equal(to_np(o2), to_np(o.detach()))

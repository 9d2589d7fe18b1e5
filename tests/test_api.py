"""Public API behaviour: GVA, the KDA / Gated DeltaNet reductions (spec §3), composition with
jit / vmap / grad / checkpoint, backend dispatch, prefill -> decode state hand-off, and the fused recurrent
op over T in {1, 63, 64, 65, 200}.

Float64 (``x64`` fixture) comparisons use RMS ratio <= 1e-10 (spec §11).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _oracle import GRAD_NAMES, make_inputs, rms_ratio

from gdn2_jax import backends, chunk_gdn2, fused_recurrent_gdn2, naive_chunk_gdn2, naive_recurrent_gdn2

TOL64 = 1e-10

FUNCS = {
    "naive_recurrent_gdn2": naive_recurrent_gdn2,
    "naive_chunk_gdn2": naive_chunk_gdn2,
    "chunk_gdn2_xla": functools.partial(chunk_gdn2, backend="xla"),
    "fused_recurrent_gdn2_xla": functools.partial(fused_recurrent_gdn2, backend="xla"),
}
PUBLIC = {
    "chunk_gdn2": chunk_gdn2,
    "fused_recurrent_gdn2": fused_recurrent_gdn2,
}


def _loss_and_grads(fn, x, do, dht, **kw):
    """(o, ht) and d/d(q,k,v,g,b,w,h0) of Σ o·do + Σ ht·dht, jitted."""

    def loss(q, k, v, g, b, w, h0):
        o, ht = fn(q, k, v, g, b, w, initial_state=h0, output_final_state=True, **kw)
        return jnp.sum(o * do) + jnp.sum(ht * dht), (o, ht)

    f = jax.jit(jax.grad(loss, argnums=tuple(range(7)), has_aux=True))
    grads, (o, ht) = f(*(x[n] for n in GRAD_NAMES))
    return o, ht, dict(zip(GRAD_NAMES, grads))


def _cotangents(seed, x):
    rng = np.random.default_rng(seed)
    B, T, HV, V = x["v"].shape
    do = jnp.asarray(rng.standard_normal((B, T, HV, V)), x["v"].dtype)
    dht = jnp.asarray(rng.standard_normal(x["h0"].shape), x["h0"].dtype)
    return do, dht


# ------------------------------------------------------------------------------------------------------
# GVA == explicitly repeated heads
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fn_name", list(FUNCS))
def test_gva_equals_repeated_heads(x64, fn_name):
    fn = FUNCS[fn_name]
    H, G = 2, 3
    x = make_inputs(21, 2, 70, H, H * G, 4, 5, jnp.float64)
    do, dht = _cotangents(22, x)
    o, ht, d = _loss_and_grads(fn, x, do, dht)
    # value head j reads qk head j // G: repeat each qk head G times in place ("(h g)" order)
    xr = dict(x, q=jnp.repeat(x["q"], G, axis=2), k=jnp.repeat(x["k"], G, axis=2))
    o_r, ht_r, d_r = _loss_and_grads(fn, xr, do, dht)
    assert rms_ratio(o, o_r) <= TOL64 and rms_ratio(ht, ht_r) <= TOL64
    for n in ("v", "g", "b", "w", "h0"):
        assert rms_ratio(d[n], d_r[n]) <= TOL64, n
    for n in ("q", "k"):  # the gradient of a shared qk head is the sum over its value-head group
        summed = d_r[n].reshape(*d_r[n].shape[:2], H, G, -1).sum(axis=3)
        assert rms_ratio(d[n], summed) <= TOL64, n
    # and the mapping is not the "tile" order j % H (which would give a different answer)
    xt = dict(x, q=jnp.tile(x["q"], (1, 1, G, 1)), k=jnp.tile(x["k"], (1, 1, G, 1)))
    o_t, _ = fn(*(xt[n] for n in "qkvgbw"), initial_state=xt["h0"])
    assert rms_ratio(o, o_t) > 1e-3


# ------------------------------------------------------------------------------------------------------
# KDA and Gated DeltaNet reductions (spec §3): b = β·1_K, w = β·1_V gives KDA; plus g = γ·1_K gives GDN.
# ------------------------------------------------------------------------------------------------------
def kda_reference(q, k, v, g, beta, scale, h0):
    """Independent KDA / Gated DeltaNet token loop: S = D S; S += β k (v − Sᵀk)ᵀ; o = scale Sᵀq.

    q, k [B,T,H,K]; v [B,T,H,V]; beta [B,T,H]; g [B,T,H,K] (KDA) or [B,T,H] (scalar decay, Gated DeltaNet).
    """
    decay = jnp.exp(g)[..., None] if g.ndim == 4 else jnp.exp(g)[..., None, None]
    S = h0
    outs = []
    for t in range(q.shape[1]):
        S = decay[:, t] * S
        pred = jnp.einsum("bhkv,bhk->bhv", S, k[:, t])
        S = S + beta[:, t, :, None, None] * jnp.einsum("bhk,bhv->bhkv", k[:, t], v[:, t] - pred)
        outs.append(scale * jnp.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return jnp.stack(outs, axis=1), S


def _tied(x, beta, gamma=None):
    K, V = x["q"].shape[-1], x["v"].shape[-1]
    out = dict(x, b=beta[..., None] * jnp.ones(K, beta.dtype), w=beta[..., None] * jnp.ones(V, beta.dtype))
    if gamma is not None:
        out["g"] = gamma[..., None] * jnp.ones(K, gamma.dtype)
    return out


@pytest.mark.parametrize("fn_name", list(FUNCS))
@pytest.mark.parametrize("variant", ["kda", "gated_deltanet"])
def test_kda_and_gated_deltanet_reductions(x64, fn_name, variant):
    fn = FUNCS[fn_name]
    B, T, H, K, V = 1, 67, 2, 4, 3
    x = make_inputs(31, B, T, H, H, K, V, jnp.float64)
    rng = np.random.default_rng(32)
    beta = jnp.asarray(rng.uniform(0, 1, (B, T, H)))
    gamma = jnp.asarray(rng.uniform(-2, -0.05, (B, T, H))) if variant == "gated_deltanet" else None
    xt = _tied(x, beta, gamma)
    scale = K ** -0.5
    o_ref, ht_ref = kda_reference(x["q"], x["k"], x["v"], xt["g"] if gamma is None else gamma, beta, scale,
                                  x["h0"])
    o, ht = jax.jit(lambda *a: fn(*a[:6], initial_state=a[6], output_final_state=True))(
        *(xt[n] for n in GRAD_NAMES))
    assert rms_ratio(o, o_ref) <= TOL64 and rms_ratio(ht, ht_ref) <= TOL64


@pytest.mark.parametrize("fn_name", ["chunk_gdn2_xla", "fused_recurrent_gdn2_xla"])
def test_kda_tie_gradient_identity(x64, fn_name):
    """dβ = Σ_K db + Σ_V dw (and dγ = Σ_K dg), with dβ, dγ from autodiff of the independent KDA loop."""
    fn = FUNCS[fn_name]
    B, T, H, K, V = 1, 66, 1, 3, 4
    x = make_inputs(41, B, T, H, H, K, V, jnp.float64)
    rng = np.random.default_rng(42)
    beta = jnp.asarray(rng.uniform(0, 1, (B, T, H)))
    gamma = jnp.asarray(rng.uniform(-2, -0.05, (B, T, H)))
    do, dht = _cotangents(43, x)
    scale = K ** -0.5

    def kda_loss(beta, gamma):
        o, ht = kda_reference(x["q"], x["k"], x["v"], gamma, beta, scale, x["h0"])
        return jnp.sum(o * do) + jnp.sum(ht * dht)

    dbeta, dgamma = jax.grad(kda_loss, argnums=(0, 1))(beta, gamma)
    _, _, d = _loss_and_grads(fn, _tied(x, beta, gamma), do, dht)
    assert rms_ratio(d["b"].sum(-1) + d["w"].sum(-1), dbeta) <= TOL64
    assert rms_ratio(d["g"].sum(-1), dgamma) <= TOL64


# ------------------------------------------------------------------------------------------------------
# Composition: jit, vmap, grad, checkpoint (remat)
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", list(PUBLIC))
def test_jit_vmap_grad_remat_compose(x64, op):
    fn = functools.partial(PUBLIC[op], backend="xla")
    P, B, T, H, HV, K, V = 2, 1, 70, 1, 2, 3, 4
    xs = [make_inputs(50 + p, B, T, H, HV, K, V, jnp.float64) for p in range(P)]
    cts = [_cotangents(60 + p, x) for p, x in enumerate(xs)]
    # reference: per problem, grad of the token-loop ground truth
    refs = [_loss_and_grads(naive_recurrent_gdn2, x, *ct) for x, ct in zip(xs, cts)]

    def loss(q, k, v, g, b, w, h0, do, dht):
        o, ht = fn(q, k, v, g, b, w, initial_state=h0, output_final_state=True)
        return jnp.sum(o * do) + jnp.sum(ht * dht)

    stacked = [jnp.stack([x[n] for x in xs]) for n in GRAD_NAMES]
    dos = jnp.stack([c[0] for c in cts])
    dhts = jnp.stack([c[1] for c in cts])
    composed = jax.jit(jax.vmap(jax.grad(jax.checkpoint(loss), argnums=tuple(range(7)))))
    grads = composed(*stacked, dos, dhts)
    for p in range(P):
        for i, n in enumerate(GRAD_NAMES):
            assert rms_ratio(grads[i][p], refs[p][2][n]) <= TOL64, (p, n)

    # forward under vmap(jit) equals the per-problem eager calls
    fwd = jax.vmap(jax.jit(lambda *a: fn(*a[:6], initial_state=a[6], output_final_state=True)))
    o, ht = fwd(*stacked)
    for p in range(P):
        assert rms_ratio(o[p], refs[p][0]) <= TOL64 and rms_ratio(ht[p], refs[p][1]) <= TOL64

    # second-order: grad of a scalar of the gradient (jvp-of-vjp through the op) is finite and matches
    # the ground truth's
    def gnorm(f, x):
        def inner(v):
            o, _ = f(x["q"], x["k"], v, x["g"], x["b"], x["w"], initial_state=x["h0"],
                     output_final_state=True)
            return jnp.sum(o * o)
        return jax.grad(lambda v: jnp.sum(jax.grad(inner)(v) ** 2))(x["v"])

    d2 = jax.jit(lambda x: gnorm(fn, x))(xs[0])
    d2_ref = jax.jit(lambda x: gnorm(naive_recurrent_gdn2, x))(xs[0])
    assert rms_ratio(d2, d2_ref) <= 1e-9


@pytest.mark.parametrize("op", list(PUBLIC))
def test_varlen_under_jit_with_traced_cu_seqlens(x64, op):
    fn = functools.partial(PUBLIC[op], backend="xla")
    x = make_inputs(70, 1, 90, 1, 2, 3, 4, jnp.float64, N=3)
    f = jax.jit(lambda cu, *a: fn(*a[:6], initial_state=a[6], output_final_state=True, cu_seqlens=cu))
    for cu in ([0, 10, 75, 90], [0, 0, 66, 90]):  # same shape: one trace, two different segmentations
        cu = jnp.asarray(cu, jnp.int32)
        o, ht = f(cu, *(x[n] for n in GRAD_NAMES))
        o_ref, ht_ref = naive_recurrent_gdn2(*(x[n] for n in "qkvgbw"), initial_state=x["h0"],
                                             output_final_state=True, cu_seqlens=cu)
        assert rms_ratio(o, o_ref) <= TOL64 and rms_ratio(ht, ht_ref) <= TOL64
    assert f._cache_size() == 1


# ------------------------------------------------------------------------------------------------------
# fused_recurrent over T in {1, 63, 64, 65, 200} against the (independent) chunked reference
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
def test_fused_recurrent_matches_chunk_reference(x64, T):
    x = make_inputs(80 + T, 2, T, 1, 2, 5, 3, jnp.float64)
    do, dht = _cotangents(90 + T, x)
    o, ht, d = _loss_and_grads(functools.partial(fused_recurrent_gdn2, backend="xla"), x, do, dht)
    o_r, ht_r, d_r = _loss_and_grads(naive_chunk_gdn2, x, do, dht)
    assert rms_ratio(o, o_r) <= TOL64 and rms_ratio(ht, ht_r) <= TOL64
    for n in GRAD_NAMES:
        assert rms_ratio(d[n], d_r[n]) <= TOL64, n


def test_prefill_then_decode_equals_one_call(x64):
    """chunk_gdn2 over a prompt, then fused_recurrent_gdn2 token by token from its final state, equals one
    long call; also for a 3-token decode step and for varlen prompts."""
    T0, T1 = 70, 5
    x = make_inputs(100, 2, T0 + T1, 2, 4, 4, 3, jnp.float64)
    o_full, ht_full = chunk_gdn2(*(x[n] for n in "qkvgbw"), initial_state=x["h0"], output_final_state=True)
    o_pre, state = chunk_gdn2(*(x[n][:, :T0] for n in "qkvgbw"), initial_state=x["h0"],
                              output_final_state=True)
    outs = [o_pre]
    step = jax.jit(lambda s, *a: fused_recurrent_gdn2(*a, initial_state=s, output_final_state=True))
    for t in range(T0, T0 + T1 - 3):
        o_t, state = step(state, *(x[n][:, t:t + 1] for n in "qkvgbw"))
        outs.append(o_t)
    o_t, state = step(state, *(x[n][:, T0 + T1 - 3:] for n in "qkvgbw"))
    outs.append(o_t)
    assert rms_ratio(jnp.concatenate(outs, axis=1), o_full) <= TOL64
    assert rms_ratio(state, ht_full) <= TOL64


# ------------------------------------------------------------------------------------------------------
# Backend dispatch
# ------------------------------------------------------------------------------------------------------
def _gpu_present():
    return any(d.platform == "gpu" for d in jax.devices())


@pytest.mark.parametrize("op", list(PUBLIC))
def test_auto_backend_is_xla_on_cpu(op):
    if _gpu_present():
        pytest.skip("a GPU is present: 'auto' may pick the TileLang kernels")
    assert backends.resolve("auto", op) == "xla"
    x = make_inputs(110, 1, 20, 1, 2, 4, 3, jnp.float32)
    args = [x[n] for n in "qkvgbw"]
    o_a, ht_a = PUBLIC[op](*args, initial_state=x["h0"], output_final_state=True, backend="auto")
    o_x, ht_x = PUBLIC[op](*args, initial_state=x["h0"], output_final_state=True, backend="xla")
    np.testing.assert_array_equal(np.asarray(o_a), np.asarray(o_x))
    np.testing.assert_array_equal(np.asarray(ht_a), np.asarray(ht_x))
    assert rms_ratio(o_a, naive_recurrent_gdn2(*args, initial_state=x["h0"])[0]) <= 1e-5


@pytest.mark.parametrize("op", list(PUBLIC))
def test_tilelang_backend_without_gpu_raises_not_implemented(op):
    if _gpu_present():
        pytest.skip("a GPU is present (the TileLang path is tested by the cuda-marked kernel tests)")
    x = make_inputs(120, 1, 8, 1, 1, 64, 64, jnp.bfloat16)  # dtype and dims the kernels support
    with pytest.raises(NotImplementedError) as excinfo:
        PUBLIC[op](*(x[n] for n in "qkvgbw"), backend="tilelang")
    msg = str(excinfo.value)
    assert op in msg and "tilelang" in msg.lower() and "xla" in msg, msg

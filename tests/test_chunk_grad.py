"""Gradients of the chunked WY form.

``chunk_gdn2(backend="xla")`` (custom_vjp, hand-written chunk-level VJP of spec §7.2) and ``naive_chunk_gdn2``
(plain autodiff) against ``jax.grad`` through the token loop ``naive_recurrent_gdn2`` in float64, with random
cotangents on both the output and the final state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _oracle import make_inputs, rms_ratio
from jax.test_util import check_grads
from test_chunk import CASES, IMPLS, TOL64, _xla, cached, case_inputs, strong_decay_g

from gdn2_jax import chunk_gdn2, naive_recurrent_gdn2

OUT_NAMES = ("o", "ht", "dq", "dk", "dv", "dg", "db", "dw", "dh0")


def cotangents(x, seed):
    """Random cotangents (do, dht) for the output and the final state, in the state's dtype."""
    rng = np.random.default_rng(seed)
    do = jnp.asarray(rng.standard_normal(x["v"].shape), x["h0"].dtype)
    dht = jnp.asarray(rng.standard_normal(x["h0"].shape), x["h0"].dtype)
    return do, dht


def value_and_grads(fn, x, *, h0, l2, cu=None, seed=0, jit=True):
    """o, final state and the seven gradients of <o, do> + <ht, dht> for random do, dht (fixed by seed)."""
    do, dht = cotangents(x, seed)

    def loss(q, k, v, g, b, w, s0, cu):
        o, ht = fn(q, k, v, g, b, w, initial_state=s0 if h0 else None, output_final_state=True,
                   use_qk_l2norm_in_kernel=l2, cu_seqlens=cu)
        return jnp.sum(o.astype(do.dtype) * do) + jnp.sum(ht * dht), (o, ht)

    gf = jax.value_and_grad(loss, argnums=tuple(range(7)), has_aux=True)
    if jit:
        gf = jax.jit(gf)
    (_, (o, ht)), grads = gf(*(x[n] for n in "qkvgbw"), x["h0"], cu)
    return dict(zip(OUT_NAMES, (o, ht) + tuple(grads)))


def assert_close(res, ref, tol, skip=()):
    ratios = {n: rms_ratio(res[n], ref[n]) for n in OUT_NAMES if n not in skip}
    bad = {n: r for n, r in ratios.items() if not r <= tol}
    assert not bad, f"RMS ratios above {tol}: {bad} (all: {ratios})"
    return ratios


_REF_CACHE: dict = {}


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("T,gva,h0,l2", CASES)
def test_grads_match_recurrent_fp64(x64, impl, T, gva, h0, l2):
    x = case_inputs(200, T, gva, l2)
    ref = cached(_REF_CACHE, (T, gva, h0, l2),
                 lambda: value_and_grads(naive_recurrent_gdn2, x, h0=h0, l2=l2, seed=T))
    res = value_and_grads(IMPLS[impl], x, h0=h0, l2=l2, seed=T)
    assert_close(res, ref, TOL64, skip=() if h0 else ("dh0",))


@pytest.mark.slow
@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_varlen_grads_traced_cu_seqlens(x64, impl):
    """Packed sequences incl. a zero-length one; cu_seqlens is a (traced) jit argument."""
    cu = [0, 15, 15, 100, 130]
    x = make_inputs(51, 1, 130, 1, 2, 8, 6, jnp.float64, N=4)
    cu_arr = jnp.asarray(cu, jnp.int32)
    ref = value_and_grads(naive_recurrent_gdn2, x, h0=True, l2=True, cu=cu_arr, seed=5)
    res = value_and_grads(IMPLS[impl], x, h0=True, l2=True, cu=cu_arr, seed=5)
    assert_close(res, ref, TOL64)
    # the empty sequence: its final state is h0[1], so dh0[1] is exactly the final-state cotangent
    np.testing.assert_array_equal(np.asarray(res["dh0"][1]), np.asarray(cotangents(x, 5)[1][1]))


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("gate", ["strong", "zero"])
def test_grads_extreme_gates_fp64(x64, impl, gate):
    """g mixing 0 … −60 per channel (G ~ −thousands within a chunk), or g = 0; b in [0, 2]."""
    x = make_inputs(61, 1, 130, 1, 2, 8, 6, jnp.float64, b_range=(0.0, 2.0))
    x["g"] = strong_decay_g(62, x["g"].shape, jnp.float64) if gate == "strong" else jnp.zeros_like(x["g"])
    ref = value_and_grads(naive_recurrent_gdn2, x, h0=True, l2=False, seed=6)
    res = value_and_grads(IMPLS[impl], x, h0=True, l2=False, seed=6)
    for n in OUT_NAMES:
        assert bool(jnp.all(jnp.isfinite(res[n]))), n
    assert_close(res, ref, TOL64)


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_grads_strong_decay_fp32_finite_and_accurate(impl):
    x32 = make_inputs(63, 1, 130, 1, 2, 8, 6, jnp.float32, b_range=(0.0, 2.0), as_numpy=True)
    x32["g"] = np.asarray(strong_decay_g(64, x32["g"].shape, jnp.float32))
    with jax.enable_x64(True):
        ref = value_and_grads(naive_recurrent_gdn2, {n: jnp.asarray(a.astype(np.float64)) for n, a in x32.items()},
                              h0=True, l2=False, seed=7)
        ref = {n: np.asarray(a) for n, a in ref.items()}
    res = value_and_grads(IMPLS[impl], {n: jnp.asarray(a) for n, a in x32.items()}, h0=True, l2=False, seed=7)
    for n in OUT_NAMES:
        assert bool(jnp.all(jnp.isfinite(res[n]))), n
    assert_close(res, ref, 1e-5)


def test_fp32_grads_vs_fp64_oracle():
    x32 = make_inputs(71, 2, 150, 2, 4, 16, 8, jnp.float32, as_numpy=True)
    with jax.enable_x64(True):
        ref = value_and_grads(naive_recurrent_gdn2, {n: jnp.asarray(a.astype(np.float64)) for n, a in x32.items()},
                              h0=True, l2=True, seed=8)
        ref = {n: np.asarray(a) for n, a in ref.items()}
    res = value_and_grads(_xla, {n: jnp.asarray(a) for n, a in x32.items()}, h0=True, l2=True, seed=8)
    for n in OUT_NAMES:
        assert res[n].dtype == jnp.float32, n
    assert_close(res, ref, 1e-5)


def test_grad_dtypes_follow_inputs():
    """dq, dk, dv, db, dw in the input dtypes, dg in g's dtype, dh0 in the state dtype (spec §9.9)."""
    x = make_inputs(73, 1, 70, 1, 2, 8, 8, jnp.float32)
    xb = {n: (a if n in ("g", "h0") else a.astype(jnp.bfloat16)) for n, a in x.items()}
    x_ref = {n: a.astype(jnp.float32) for n, a in xb.items()}
    res = value_and_grads(_xla, xb, h0=True, l2=True, seed=9)
    ref = value_and_grads(naive_recurrent_gdn2, x_ref, h0=True, l2=True, seed=9)
    for n, name in zip(OUT_NAMES[2:], "qkvgbw"):
        assert res[n].dtype == xb[name].dtype, n
    assert res["dh0"].dtype == jnp.float32
    # the values still agree with the fp32 oracle on the same quantised inputs (bf16 output / grad rounding)
    assert_close(res, ref, 1e-2)


# --------------------------------------------------------------------------------------------------
# numerical gradients
# --------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("varlen", [False, True])
def test_check_grads_all_seven_inputs(x64, varlen):
    T = 70  # two chunks, the second partial
    if varlen:
        x = make_inputs(81, 1, T, 1, 2, 3, 2, jnp.float64, N=3)
        cu = jnp.asarray([0, 5, 5, T], jnp.int32)
    else:
        x = make_inputs(82, 2, T, 1, 2, 3, 2, jnp.float64)
        cu = None

    @jax.jit
    def f(q, k, v, g, b, w, s0):
        return chunk_gdn2(q, k, v, g, b, w, initial_state=s0, output_final_state=True,
                          use_qk_l2norm_in_kernel=True, cu_seqlens=cu, backend="xla")

    check_grads(f, tuple(x[n] for n in "qkvgbw") + (x["h0"],), order=1, modes=["rev"])


# --------------------------------------------------------------------------------------------------
# composition with JAX transformations
# --------------------------------------------------------------------------------------------------

def _loss(q, k, v, g, b, w, s0):
    o, ht = chunk_gdn2(q, k, v, g, b, w, initial_state=s0, output_final_state=True, backend="xla")
    return jnp.sum(jnp.sin(o)) + jnp.sum(ht * ht)


def _loss_ref(q, k, v, g, b, w, s0):
    o, ht = naive_recurrent_gdn2(q, k, v, g, b, w, initial_state=s0, output_final_state=True)
    return jnp.sum(jnp.sin(o)) + jnp.sum(ht * ht)


def _args(x):
    return tuple(x[n] for n in "qkvgbw") + (x["h0"],)


@pytest.mark.slow
def test_jit_grad_and_checkpoint(x64):
    x = make_inputs(91, 1, 80, 1, 2, 6, 5, jnp.float64)
    ref = jax.grad(_loss_ref, argnums=tuple(range(7)))(*_args(x))
    for f in (jax.jit(jax.grad(_loss, argnums=tuple(range(7)))),
              jax.jit(jax.grad(jax.checkpoint(_loss), argnums=tuple(range(7))))):
        got = f(*_args(x))
        for a, r in zip(got, ref):
            assert rms_ratio(a, r) <= TOL64


def test_grad_wrt_initial_state_under_jit(x64):
    x = make_inputs(92, 2, 66, 1, 1, 6, 5, jnp.float64)
    f = jax.jit(jax.grad(_loss, argnums=6))
    r = jax.grad(_loss_ref, argnums=6)(*_args(x))
    assert rms_ratio(f(*_args(x)), r) <= TOL64


@pytest.mark.slow
def test_vmap_forward_and_grad(x64):
    """vmap over a leading axis of all inputs equals a Python loop over it."""
    n = 3
    xs = [make_inputs(93 + i, 1, 70, 1, 2, 6, 5, jnp.float64) for i in range(n)]
    stacked = tuple(jnp.stack([x[m] for x in xs]) for m in ("q", "k", "v", "g", "b", "w", "h0"))

    def fwd(q, k, v, g, b, w, s0):
        return chunk_gdn2(q, k, v, g, b, w, initial_state=s0, output_final_state=True, backend="xla")

    o, ht = jax.jit(jax.vmap(fwd))(*stacked)
    grads = jax.jit(jax.vmap(jax.grad(_loss, argnums=tuple(range(7)))))(*stacked)
    ref_fwd = jax.jit(lambda *a: naive_recurrent_gdn2(*a[:6], initial_state=a[6], output_final_state=True))
    ref_grad = jax.jit(jax.grad(_loss_ref, argnums=tuple(range(7))))
    for i, x in enumerate(xs):
        o_ref, ht_ref = ref_fwd(*_args(x))
        assert rms_ratio(o[i], o_ref) <= TOL64
        assert rms_ratio(ht[i], ht_ref) <= TOL64
        g_ref = ref_grad(*_args(x))
        for a, r in zip(grads, g_ref):
            assert rms_ratio(a[i], r) <= TOL64


@pytest.mark.slow
def test_vmap_grad_varlen_batched_cu_seqlens(x64):
    """vmap over packed batches whose cu_seqlens differ (batched, traced), incl. zero-length sequences."""
    xs = [make_inputs(96 + i, 1, 40, 1, 2, 4, 3, jnp.float64, N=3) for i in range(2)]
    stacked = tuple(jnp.stack([x[m] for x in xs]) for m in ("q", "k", "v", "g", "b", "w", "h0"))
    cus = jnp.asarray([[0, 10, 10, 40], [0, 0, 39, 40]], jnp.int32)

    def loss(fn, q, k, v, g, b, w, s0, cu):
        o, ht = fn(q, k, v, g, b, w, initial_state=s0, output_final_state=True, cu_seqlens=cu)
        return jnp.sum(jnp.sin(o)) + jnp.sum(ht * ht)

    got = jax.jit(jax.vmap(jax.grad(functools.partial(loss, _xla), argnums=tuple(range(7)))))(*stacked, cus)
    ref_grad = jax.jit(jax.grad(functools.partial(loss, naive_recurrent_gdn2), argnums=tuple(range(7))))
    for i, x in enumerate(xs):
        for a, r in zip(got, ref_grad(*_args(x), cus[i])):
            assert rms_ratio(a[i], r) <= TOL64


# --------------------------------------------------------------------------------------------------
# memory: the custom VJP saves the inputs, not per-token states
# --------------------------------------------------------------------------------------------------

def _residual_elements(f, args, K, V):
    """(total residual elements, elements of residuals whose trailing dims are a [K, V] state)."""
    _, vjp_fn = jax.vjp(f, *args)
    leaves = [leaf for leaf in jax.tree_util.tree_leaves(vjp_fn) if hasattr(leaf, "shape")]
    total = sum(int(np.prod(leaf.shape)) for leaf in leaves)
    states = sum(int(np.prod(leaf.shape)) for leaf in leaves if tuple(leaf.shape[-2:]) == (K, V))
    return total, states


def test_backward_residuals_are_not_per_token_states():
    B, T, H, HV, K, V = 1, 256, 1, 2, 48, 40
    x = make_inputs(95, B, T, H, HV, K, V, jnp.float32)
    per_token_states = B * T * HV * K * V  # what a token-level autodiff scan saves

    def make(fn):
        def f(q, k, v, g, b, w, s0):
            return fn(q, k, v, g, b, w, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        return f

    total, states = _residual_elements(make(_xla), _args(x), K, V)
    # at most h0 plus one state per chunk may be kept; the rest are O(T·(K+V)) inputs (~1/7 of the states here)
    assert states <= (B + T // 64) * HV * K * V
    assert total < per_token_states // 3
    # the same measurement flags the token-loop reference, which does store per-token states
    total_ref, states_ref = _residual_elements(make(naive_recurrent_gdn2), _args(x), K, V)
    assert states_ref >= per_token_states


@pytest.mark.parametrize("form", ["dense", "two_levels"])
@pytest.mark.parametrize("case", ["strong_fp64", "varlen_fp64", "gva_fp32"])
def test_other_intra_forms_grads(monkeypatch, case, form):
    """The xla VJP with the intra stage's pairwise decays as dense [C, C, K] factors (``_FACTORED_INTRA`` off) or
    factored on two levels (``_FACTORED_LEVELS = 2``; the default since session 6, one level of 16-row
    sub-chunks, is what every other test here runs) against the fp64 token loop: g down to -60 per channel
    (finite everywhere), packed sequences with an empty one, GVA with L2 norm in float32."""
    from gdn2_jax.xla import chunk as xla_chunk

    if form == "dense":
        monkeypatch.setattr(xla_chunk, "_FACTORED_INTRA", False)
    else:
        monkeypatch.setattr(xla_chunk, "_FACTORED_LEVELS", 2)
    if case == "gva_fp32":
        x32 = make_inputs(71, 2, 150, 2, 4, 16, 8, jnp.float32, as_numpy=True)
        with jax.enable_x64(True):
            ref = value_and_grads(naive_recurrent_gdn2, {n: jnp.asarray(a.astype(np.float64))
                                                         for n, a in x32.items()}, h0=True, l2=True, seed=8)
            ref = {n: np.asarray(a) for n, a in ref.items()}
        res = value_and_grads(_xla, {n: jnp.asarray(a) for n, a in x32.items()}, h0=True, l2=True, seed=8)
        assert_close(res, ref, 1e-5)
        return
    with jax.enable_x64(True):
        cu = None
        if case == "varlen_fp64":
            x = make_inputs(51, 1, 130, 1, 2, 8, 6, jnp.float64, N=4)
            cu = jnp.asarray([0, 15, 15, 100, 130], jnp.int32)
        else:
            x = make_inputs(61, 1, 130, 1, 2, 8, 6, jnp.float64, b_range=(0.0, 2.0))
            x["g"] = strong_decay_g(62, x["g"].shape, jnp.float64)
        ref = value_and_grads(naive_recurrent_gdn2, x, h0=True, l2=case == "varlen_fp64", cu=cu, seed=6)
        res = value_and_grads(_xla, x, h0=True, l2=case == "varlen_fp64", cu=cu, seed=6)
        for n in OUT_NAMES:
            assert bool(jnp.all(jnp.isfinite(res[n]))), n
        assert_close(res, ref, TOL64)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_backward_from_kernel_states_equals_xla_vjp(x64, varlen):
    """``xla.chunk.chunk_backward_from_states`` (the jnp part of the ``backend="tilelang"`` backward), fed the
    states the kernels save and the reverse state pass computes, laid out as the kernels store them (chunk slots
    ``[B, NT, HV, K, V]``, varlen slots ``seq + cu[seq] // 64 + j``; token-major R and dR), gives the xla VJP's
    q, k, v, g, b, w gradients: GVA, L2 norm, a partial last chunk, packed sequences with an empty one."""
    from gdn2_jax.xla import chunk as xc
    from gdn2_jax.xla import layout

    C = xc.CHUNK_SIZE
    cu = jnp.asarray([0, 70, 70, 150], jnp.int32) if varlen else None
    B, T, N = (1, 150, 3) if varlen else (2, 150, 2)
    x = make_inputs(81, B, T, 2, 4, 16, 8, jnp.float64, N=N)
    do, dht = cotangents(x, 9)
    want = value_and_grads(_xla, x, h0=True, l2=True, cu=cu, seed=9)

    # the kernels' inputs and results, built from the xla passes
    qh, kh = xc.prepare_qk(x["q"], x["k"], 2, True)
    ins = (qh, kh) + tuple(x[n] for n in "vgbw")
    plan = layout.varlen_plan(cu, T, C) if varlen else None
    to_c = lambda a: layout.to_chunks(a, plan, C)  # noqa: E731
    from_c = (lambda a: layout.dense_from_chunks(a, T)) if plan is None else (
        lambda a: layout.varlen_from_chunks(a, plan))
    xs = [to_c(a) for a in ins]
    NC = xs[0].shape[0]
    if plan is None:
        seq = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[None], (NC, B))
        reset = jnp.broadcast_to((jnp.arange(NC) == 0)[:, None], (NC, B))
        dS_end_all = jnp.zeros((NC, B) + dht.shape[1:], dht.dtype).at[-1].set(dht)
    else:
        seq, reset = plan.seq[:, None], plan.reset[:, None]
        last = jnp.where(plan.has, plan.last, NC)  # (no chunk for an empty sequence: dropped)
        dS_end_all = jnp.zeros((NC, 1) + dht.shape[1:], dht.dtype).at[last, 0].add(dht, mode="drop")
    S0s, R, dR, dS_end, _ = xc._state_passes_with_grads(x["q"].shape[-1] ** -0.5, *xs, x["h0"], seq, reset,
                                                        to_c(do), dS_end_all)
    if plan is None:
        h, dh = (jnp.moveaxis(a, 0, 1) for a in (S0s, dS_end))
    else:  # scatter the used chunks into their kernel slots (the rest stays NaN: must not be read)
        NT = T // C + N
        sl = jnp.where(plan.real, plan.kslot, NT)
        h, dh = (jnp.full((1, NT) + a.shape[2:], jnp.nan, a.dtype).at[0, sl].set(a[:, 0], mode="drop")
                 for a in (S0s, dS_end))
    got = xc.chunk_backward_from_states(x["q"].shape[-1] ** -0.5, 2, True, *(x[n] for n in "qkvgbw"), cu, h,
                                        from_c(R), dh, from_c(dR), do)
    for name, a in zip(("dq", "dk", "dv", "dg", "db", "dw"), got):
        assert a.dtype == x[name[1]].dtype and a.shape == x[name[1]].shape, name
        assert rms_ratio(a, want[name]) <= 1e-10, (name, rms_ratio(a, want[name]))

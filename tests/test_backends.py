"""Behaviour of the public ops, written once and run against each backend.

Every case runs for both ops with a ``backend`` argument (``chunk_gdn2``, ``fused_recurrent_gdn2``) and for each
backend, described by ``_backends.BACKENDS``:

* ``backend="xla"`` (pure jnp, here on the CPU): float64 inputs under x64, so that 1e-10 separates a right answer
  from a wrong one, and float16 inputs (float32 math, o at the float16 rounding floor);
* ``backend="tilelang"`` (the TileLang kernels, marked ``cuda``: skipped without an NVIDIA Hopper GPU and the
  ``cuda`` extra): bfloat16 inputs with a float32 decay, and float16 inputs, at the limits of
  ``_backends.LIMITS`` (decode: o at the output-dtype rounding floor, state 1e-5; chunk: 5e-3 on these swept
  inputs).

Ground truth: the fp64 numpy token loop ``_backends.oracle`` (independent of the code under test) on the *same
quantised inputs* the backend sees; metric RMS(out − ref)/RMS(ref). Inputs are swept over magnitudes: g per channel
from {0, -1e-3, -0.1, -6, -20, -60} mixed inside every chunk, b from {0, 1, 2}. Gradients: the xla backend against
the fp64 numpy reverse pass ``_backends.oracle_grads``; on the tilelang backend ``chunk_gdn2``'s (backward kernels)
against the same reverse pass, ``fused_recurrent_gdn2``'s (the xla VJP recomputing the forward) against the xla
backend's gradient at the same inputs. Only the public API is used.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _backends import BACKENDS, NAMES, make, oracle, oracle_grads, rms, to_np

import gdn2_jax

OPS = ("chunk_gdn2", "fused_recurrent_gdn2")


@pytest.fixture(params=["xla", pytest.param("tilelang", marks=pytest.mark.cuda)])
def backend(request):
    """The backend descriptor; the xla cases run with x64 on (float64 math for the float64 inputs)."""
    be = BACKENDS[request.param]
    if be.x64:
        request.getfixturevalue("x64")
    return be


def _jnp(x):
    return {n: jnp.asarray(a) for n, a in x.items()}


def call(be, op, x, *, h0=True, cu=None, final=True, l2=False, scale=None):
    """``op`` on the inputs ``x`` (numpy, converted to jax arrays) through ``backend=be.name``; returns (o, ht)."""
    j = _jnp(x)
    fn = getattr(gdn2_jax, op)
    return fn(*(j[n] for n in NAMES), initial_state=j["h0"] if h0 else None, output_final_state=final,
              use_qk_l2norm_in_kernel=l2, scale=scale,
              cu_seqlens=None if cu is None else jnp.asarray(np.asarray(cu, np.int32)), backend=be.name)


def ref(x, scale, *, h0=True, cu=None, l2=False):
    """(o, ht) of the fp64 oracle on the inputs ``x``."""
    o, ht, _ = oracle(*(x[n] for n in NAMES), x["h0"] if h0 else None, scale, cu=cu, l2norm=l2)
    return o, ht


# ------------------------------------------------------------------------------------------ forward vs oracle
# (T, K = V, precision, h0, H, HV): every T of the op, both head dims, "main" dtypes and float16 ("half"), random /
# zero / absent initial state, with and without GVA.
CHUNK_CASES = [
    (1, 128, "main", "random", 2, 2), (1, 64, "half", None, 1, 2),
    (63, 64, "main", None, 1, 3), (63, 128, "main", "zero", 2, 2),
    (64, 128, "half", "random", 2, 4), (64, 64, "main", "random", 2, 2),
    (65, 64, "main", "zero", 2, 2), (65, 128, "main", None, 1, 2),
    (200, 128, "main", "random", 2, 4), (200, 64, "half", None, 2, 2),
]
FUSED_CASES = [
    (1, 128, "main", "random", 2, 2), (1, 64, "half", None, 1, 1),
    (5, 64, "main", "zero", 2, 4), (5, 128, "half", "random", 1, 3),
    (33, 128, "main", None, 2, 4), (33, 64, "main", "random", 2, 2),
]
FORWARD = [("chunk_gdn2",) + c for c in CHUNK_CASES] + [("fused_recurrent_gdn2",) + c for c in FUSED_CASES]


@pytest.mark.parametrize("op,T,KV,precision,h0,H,HV", FORWARD,
                         ids=[f"{c[0]}-T{c[1]}-K{c[2]}-{c[3]}-h0{c[4]}-H{c[5]}HV{c[6]}" for c in FORWARD])
def test_forward_matches_fp64_oracle(backend, op, T, KV, precision, h0, H, HV):
    """Dense o and final state against the fp64 oracle on the same quantised inputs, at the backend's limits; o in
    q's dtype, the state in float32 (float64 for float64 inputs); no NaN / inf (``rms`` fails on them)."""
    dtype, g_dtype = backend.dtypes(precision)
    x = make(1000 + 7 * T + KV + HV, 2, T, H, HV, KV, KV, dtype, g_dtype, h0=h0 or "random")
    ref_o, ref_ht = ref(x, KV ** -0.5, h0=h0 is not None)
    o, ht = call(backend, op, x, h0=h0 is not None)
    assert str(o.dtype) == dtype and o.shape == (2, T, HV, KV)
    assert str(ht.dtype) == backend.state_dtype(dtype) and ht.shape == (2, HV, KV, KV)
    backend.check(op, o, ht, ref_o, ref_ht, dtype)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("g_dtype,l2,corr", [("bfloat16", False, True), ("main", True, False)],
                         ids=["g_bf16-correlated_keys", "l2norm"])
def test_forward_l2norm_scale_gate_dtype_correlated_keys(backend, op, g_dtype, l2, corr):
    """A bfloat16 decay with highly correlated keys (one direction plus 5% noise: the ill-conditioned WY solve),
    and in-kernel L2 norm of unnormalised q/k (rows scaled by 0.5 ... 3), both with a non-default scale."""
    dtype, main_g = backend.dtypes("main")
    x = make(7, 1, 40 if op == "chunk_gdn2" else 9, 2, 4, 128, 128, dtype,
             main_g if g_dtype == "main" else g_dtype, corr_keys=corr)
    if l2:  # unnormalised q/k: the op normalises
        rng = np.random.default_rng(3)
        for n in ("q", "k"):
            x[n] = (x[n].astype(np.float64) * rng.uniform(0.5, 3.0, x[n].shape[:-1] + (1,))).astype(x[n].dtype)
    ref_o, ref_ht = ref(x, 0.3, l2=l2)
    o, ht = call(backend, op, x, l2=l2, scale=0.3)
    backend.check(op, o, ht, ref_o, ref_ht, dtype)


# ---------------------------------------------------------------------------------------------------- varlen
VARLEN = [[0, 1, 5, 5, 17, 20], [0, 64, 65, 150, 151, 300]]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("cu", VARLEN, ids=["short-empty", "chunk-boundaries"])
def test_varlen_uneven_and_empty_sequences(backend, op, cu):
    """Packed sequences of uneven lengths (1-token ones, ones crossing chunk boundaries, empty ones) each start
    from their own initial state; an empty sequence's final state is exactly its initial state."""
    if op == "fused_recurrent_gdn2" and cu[-1] > 64:
        cu = [c // 5 for c in cu]  # the token loop is for short inputs: [0, 12, 13, 30, 30, 60]
    T, N = cu[-1], len(cu) - 1
    dtype, g_dtype = backend.dtypes("main")
    x = make(11 + T, 1, T, 2, 4, 64, 64, dtype, g_dtype, N=N)
    ref_o, ref_ht = ref(x, 0.125, cu=cu)
    o, ht = call(backend, op, x, cu=cu, scale=0.125)
    assert ht.shape == (N, 4, 64, 64)
    backend.check(op, o, ht, ref_o, ref_ht, dtype)
    for n in range(N):
        if cu[n + 1] == cu[n]:
            np.testing.assert_array_equal(np.asarray(ht[n]), x["h0"][n])
        else:  # a non-empty one moved away from it (so the check above is not vacuous)
            assert rms(np.asarray(ht[n]), x["h0"][n]) > 1e-2


# ------------------------------------------------------------------------------------------------------- GVA
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("G", [2, 3])
def test_gva_equals_repeated_heads(backend, op, G):
    """HV = G·H value heads: value head j reads q/k head j // G. Equals the call with q/k heads repeated in place
    (bit for bit on the kernels, 1e-10 on xla), matches the oracle, and the "tile" order j % H differs."""
    H, HV, T = 2, 2 * G, 70 if op == "chunk_gdn2" else 6
    dtype, g_dtype = backend.dtypes("main")
    x = make(21 + G, 2, T, H, HV, 64, 64, dtype, g_dtype)
    o, ht = call(backend, op, x)
    backend.check(op, o, ht, *ref(x, 0.125), dtype)
    xr = dict(x, q=np.repeat(x["q"], G, axis=2), k=np.repeat(x["k"], G, axis=2))
    o_r, ht_r = call(backend, op, xr)
    backend.assert_same(o, o_r, "o")
    backend.assert_same(ht, ht_r, "ht")
    xt = dict(x, q=np.tile(x["q"], (1, 1, G, 1)), k=np.tile(x["k"], (1, 1, G, 1)))
    o_t, _ = call(backend, op, xt)
    assert rms(to_np(o_t), to_np(o)) > 1e-2


# -------------------------------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_gradients_of_all_seven_inputs(backend, op, varlen):
    """d/d(q, k, v, g, b, w, initial_state) of <o, do> + <ht, dht> (random cotangents), with GVA (HV = 2H) and,
    varlen, an empty sequence. xla: against the fp64 numpy reverse pass at 1e-10. tilelang: ``chunk_gdn2``
    trains through its backward kernels, checked against the fp64 reverse pass (``Backend.grad_limit``);
    ``fused_recurrent_gdn2``'s backward is the xla VJP at the same inputs, so it must equal the xla backend's
    gradient (rtol = atol = 1e-5). Gradients come back in their inputs' dtypes."""
    T = 70 if op == "chunk_gdn2" else 6
    cu = [0, 5, 5, T] if varlen else None
    B, N = (1, 3) if varlen else (2, 2)
    dtype, g_dtype = backend.dtypes("main")
    x = make(3 + T, B, T, 1, 2, 64, 64, dtype, g_dtype, N=N)
    rng = np.random.default_rng(4)
    sdt = backend.state_dtype(dtype)
    do = rng.standard_normal((B, T, 2, 64)).astype(sdt)
    dht = rng.standard_normal((N, 2, 64, 64)).astype(sdt)
    fn = getattr(gdn2_jax, op)
    cu_j = None if cu is None else jnp.asarray(cu, jnp.int32)

    def grads(name, xx):
        def loss(q, k, v, g, b, w, h0):
            o, ht = fn(q, k, v, g, b, w, initial_state=h0, output_final_state=True, cu_seqlens=cu_j, backend=name)
            return jnp.sum(o.astype(do.dtype) * do) + jnp.sum(ht * dht)

        j = _jnp(xx)
        out = jax.jit(jax.grad(loss, argnums=tuple(range(7))))(*(j[n] for n in NAMES + ("h0",)))
        return dict(zip(NAMES + ("h0",), out))

    got = grads(backend.name, x)
    for n, a in got.items():
        assert a.dtype == x[n].dtype and a.shape == x[n].shape, (n, a.dtype, a.shape)
    if op in backend.grads_vs_xla:
        want = grads("xla", x)
        for n in got:
            a, r = np.asarray(got[n], np.float32), np.asarray(want[n], np.float32)
            assert np.abs(r).max() > 0, n
            np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-5, err_msg=n)
    else:
        want = oracle_grads(*(x[n] for n in NAMES), x["h0"], 0.125, do, dht, cu=cu)
        for n in got:
            assert np.abs(want[n]).max() > 0, n
            r = rms(np.asarray(got[n], np.float64), want[n])
            assert r <= backend.grad_limit(op, dtype, n), (n, r)


# ----------------------------------------------------------------------------------------------- jit and vmap
@pytest.mark.parametrize("op", OPS)
def test_jit_equals_eager_and_traced_cu_seqlens_compile_once(backend, op):
    """Under jax.jit the op computes what the eager call computes (bit for bit on the kernels); with cu_seqlens a
    jit argument (traced) one compiled function serves two segmentations of the same length, each equal to the
    eager call with those (concrete) offsets and to the oracle."""
    T = 70 if op == "chunk_gdn2" else 9
    dtype, g_dtype = backend.dtypes("main")
    fn = getattr(gdn2_jax, op)
    x = make(31, 2, T, 2, 4, 64, 64, dtype, g_dtype)
    f = jax.jit(lambda q, k, v, g, b, w, h0: fn(q, k, v, g, b, w, initial_state=h0, output_final_state=True,
                                                backend=backend.name))
    o_j, ht_j = f(*(jnp.asarray(x[n]) for n in NAMES + ("h0",)))
    o_e, ht_e = call(backend, op, x)
    backend.check(op, o_j, ht_j, *ref(x, 0.125), dtype)
    backend.assert_same(o_j, o_e, "o")
    backend.assert_same(ht_j, ht_e, "ht")

    xv = make(32, 1, T, 2, 4, 64, 64, dtype, g_dtype, N=3)
    fv = jax.jit(lambda cu, q, k, v, g, b, w, h0: fn(q, k, v, g, b, w, initial_state=h0, output_final_state=True,
                                                     cu_seqlens=cu, backend=backend.name))
    s = 10 if op == "chunk_gdn2" else 3
    for cu in ([0, s, s, T], [0, 0, T - 4, T]):
        o, ht = fv(jnp.asarray(cu, jnp.int32), *(jnp.asarray(xv[n]) for n in NAMES + ("h0",)))
        backend.check(op, o, ht, *ref(xv, 0.125, cu=cu), dtype)
        o_e, ht_e = call(backend, op, xv, cu=cu)
        backend.assert_same(o, o_e, f"o {cu}")
        backend.assert_same(ht, ht_e, f"ht {cu}")
    assert fv._cache_size() == 1


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_vmap_equals_per_item_calls(backend, op, varlen):
    """jax.vmap over a leading axis of every input (and, varlen, of differing cu_seqlens, so traced) equals a
    Python loop of per-item calls: bit for bit on the kernels (vmap folds into their batch / packed axis)."""
    T = 70 if op == "chunk_gdn2" else 5
    dtype, g_dtype = backend.dtypes("main")
    fn = getattr(gdn2_jax, op)
    if varlen:
        s = 10 if op == "chunk_gdn2" else 2
        cus = [[0, s, s, T], [0, 0, T - 1, T], [0, T, T, T]]
        xs = [make(40 + i, 1, T, 2, 4, 64, 64, dtype, g_dtype, N=3) for i in range(3)]
    else:
        cus = [None] * 3
        xs = [make(40 + i, 2, T, 2, 4, 64, 64, dtype, g_dtype) for i in range(3)]
    stacked = [jnp.asarray(np.stack([x[n] for x in xs])) for n in NAMES + ("h0",)]

    def f(q, k, v, g, b, w, h0, cu):
        return fn(q, k, v, g, b, w, initial_state=h0, output_final_state=True, cu_seqlens=cu, backend=backend.name)

    if varlen:
        o, ht = jax.jit(jax.vmap(f))(*stacked, jnp.asarray(cus, jnp.int32))
    else:
        o, ht = jax.jit(jax.vmap(lambda *a: f(*a, None)))(*stacked)
    for i, (x, cu) in enumerate(zip(xs, cus)):
        o_i, ht_i = call(backend, op, x, cu=cu)
        backend.check(op, o_i, ht_i, *ref(x, 0.125, cu=cu), dtype)
        backend.assert_same(o[i], o_i, f"o[{i}]")
        backend.assert_same(ht[i], ht_i, f"ht[{i}]")


@pytest.mark.parametrize("op", OPS)
def test_vmap_invalid_traced_cu_seqlens_poisons_only_its_item(backend, op):
    """vmap over packed batches with batched (traced) cu_seqlens where the middle item's offsets are invalid (they
    start at 3): that item's o and final state are NaN, and the valid items on either side are exactly their own
    calls (an invalid neighbour must not leak tokens into them)."""
    T = 70 if op == "chunk_gdn2" else 9
    s = 10 if op == "chunk_gdn2" else 2
    dtype, g_dtype = backend.dtypes("main")
    fn = getattr(gdn2_jax, op)
    cus = [[0, s, s, T], [3, 3 + s, 3 + s, T], [0, 0, T - 1, T]]
    xs = [make(45 + i, 1, T, 2, 4, 64, 64, dtype, g_dtype, N=3) for i in range(3)]
    stacked = [jnp.asarray(np.stack([x[n] for x in xs])) for n in NAMES + ("h0",)]

    def f(q, k, v, g, b, w, h0, cu):
        return fn(q, k, v, g, b, w, initial_state=h0, output_final_state=True, cu_seqlens=cu, backend=backend.name)

    o, ht = jax.jit(jax.vmap(f))(*stacked, jnp.asarray(cus, jnp.int32))
    assert np.isnan(to_np(o[1])).all() and np.isnan(np.asarray(ht[1])).all()
    for i in (0, 2):
        o_i, ht_i = call(backend, op, xs[i], cu=cus[i])
        backend.assert_same(o[i], o_i, f"o[{i}]")
        backend.assert_same(ht[i], ht_i, f"ht[{i}]")


def test_traced_out_of_range_cu_seqlens_poison_and_stay_inside_the_buffers(backend):
    """Traced cu_seqlens whose chunks would reach outside the packed batch (ending past T, starting below 0,
    decreasing, a sequence of 2**20 tokens): o, the final state and all seven gradients are NaN, the inputs are
    unchanged, and a valid call afterwards is bit-identical to the same call before. On the tilelang backend this is
    the test of ``locate_chunk``'s clamp: the intra launches (forward and backward) run without TileLang's bounds
    checks, so an unclamped chunk would load and store rows past the buffers."""
    T = 130
    dtype, g_dtype = backend.dtypes("main")
    x = make(47, 1, T, 2, 4, 64, 64, dtype, g_dtype, N=3)
    j = _jnp(x)

    def loss(q, k, v, g, b, w, h0, cu):
        o, ht = gdn2_jax.chunk_gdn2(q, k, v, g, b, w, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                     backend=backend.name)
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(ht), (o, ht)

    vg = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(7)), has_aux=True))
    args = [j[n] for n in NAMES] + [j["h0"]]
    good = jnp.asarray([0, 50, 64, T], jnp.int32)
    before = jax.tree.leaves(vg(*args, good))
    assert all(np.isfinite(to_np(a)).all() for a in before)
    for bad in ([0, 50, 64, T + 200], [-200, 50, 64, T], [0, 100, 30, T], [0, 50, 64, 1 << 20],
                [0, T + 64, T + 64, T]):
        (val, (o, ht)), grads = vg(*args, jnp.asarray(bad, jnp.int32))
        for name, a in [("loss", val), ("o", o), ("ht", ht)] + list(zip(NAMES + ("h0",), grads)):
            assert np.isnan(to_np(a)).all(), (bad, name)
    for n, a in zip(NAMES + ("h0",), args):
        np.testing.assert_array_equal(to_np(a), to_np(x[n]), err_msg=n)
    for a, b in zip(before, jax.tree.leaves(vg(*args, good))):
        np.testing.assert_array_equal(to_np(a), to_np(b))


# ------------------------------------------------------------------------------------------------ determinism
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_two_runs_are_bit_identical(backend, op, varlen):
    """The same call twice gives bit-identical o and final state (no atomics / races), and the output does not
    depend on output_final_state (False returns None for the state and the same o)."""
    T = 130 if op == "chunk_gdn2" else 7
    cu = ([0, 3, 3, 64, T] if op == "chunk_gdn2" else [0, 3, 3, 5, T]) if varlen else None
    dtype, g_dtype = backend.dtypes("main")
    x = make(51, 1 if varlen else 2, T, 2, 4, 128, 128, dtype, g_dtype, N=4 if varlen else None)
    o1, ht1 = call(backend, op, x, cu=cu)
    o2, ht2 = call(backend, op, x, cu=cu)
    backend.check(op, o1, ht1, *ref(x, 128 ** -0.5, cu=cu), dtype)
    np.testing.assert_array_equal(np.asarray(o2), np.asarray(o1))
    np.testing.assert_array_equal(np.asarray(ht2), np.asarray(ht1))
    o3, ht3 = call(backend, op, x, cu=cu, final=False)
    assert ht3 is None
    backend.assert_same(o3, o1, "o without the final state")


# ------------------------------------------------------------------------------------------------- bad inputs
def _sub(x, **over):
    """Positional arrays of ``x`` with some replaced, and the keyword arguments among ``over``."""
    pos = {n: x[n] for n in NAMES}
    kw = {"initial_state": x["h0"]}
    for name, val in over.items():
        (pos if name in pos else kw)[name] = val
    return pos, kw


def _nan_at(x, name, value):
    a = x[name].copy()
    a[1, 3, 2, 1] = value
    return {name: a}


# (case id, builder(x dense B=2, xv packed B=1) -> (pos, kw), exception, argument named in the message)
B_, T_, H_, HV_, K_ = 2, 5, 2, 4, 64
BAD = [
    ("q_rank3", lambda x, xv: _sub(x, q=x["q"].reshape(B_, T_, H_ * K_)), ValueError, "q"),
    ("v_rank5", lambda x, xv: _sub(x, v=x["v"][..., None]), ValueError, "v"),
    ("k_heads", lambda x, xv: _sub(x, k=x["k"][:, :, :1]), ValueError, "k"),
    ("v_T", lambda x, xv: _sub(x, v=x["v"][:, :-1]), ValueError, "v"),
    ("w_V", lambda x, xv: _sub(x, w=x["w"][..., :-1]), ValueError, "w"),
    ("g_K", lambda x, xv: _sub(x, g=x["g"][..., :-1]), ValueError, "g"),
    ("b_heads", lambda x, xv: _sub(x, b=x["b"][:, :, :H_]), ValueError, "b"),
    ("HV_not_multiple_of_H", lambda x, xv: _sub(x, **{n: x[n][:, :, :3] for n in "vgbw"}, initial_state=None),
     ValueError, "v"),
    ("q_int", lambda x, xv: _sub(x, q=x["q"].astype(np.int32)), TypeError, "q"),
    ("g_int", lambda x, xv: _sub(x, g=x["g"].astype(np.int64)), TypeError, "g"),
    ("w_bool", lambda x, xv: _sub(x, w=x["w"].astype(np.float32) > 0.5), TypeError, "w"),
    ("q_list", lambda x, xv: _sub(x, q=x["q"].astype(np.float32).tolist()), TypeError, "q"),
    ("h0_wrong_N", lambda x, xv: _sub(x, initial_state=x["h0"][:1]), ValueError, "initial_state"),
    ("h0_wrong_heads", lambda x, xv: _sub(x, initial_state=x["h0"][:, :H_]), ValueError, "initial_state"),
    ("h0_int", lambda x, xv: _sub(x, initial_state=x["h0"].astype(np.int32)), TypeError, "initial_state"),
    ("h0_fp16", lambda x, xv: _sub(x, initial_state=x["h0"].astype(np.float16)), TypeError, "initial_state"),
    ("cu_with_B2", lambda x, xv: _sub(x, cu_seqlens=np.array([0, 2, T_], np.int32)), ValueError, "cu_seqlens"),
    ("cu_start1", lambda x, xv: _sub(xv, cu_seqlens=np.array([1, 3, 7], np.int32)), ValueError, "cu_seqlens"),
    ("cu_decreasing", lambda x, xv: _sub(xv, cu_seqlens=np.array([0, 5, 3, 7], np.int32), initial_state=None),
     ValueError, "cu_seqlens"),
    ("cu_end_short", lambda x, xv: _sub(xv, cu_seqlens=np.array([0, 3, 6], np.int32)), ValueError, "cu_seqlens"),
    ("cu_end_long", lambda x, xv: _sub(xv, cu_seqlens=np.array([0, 3, 8], np.int32)), ValueError, "cu_seqlens"),
    ("cu_float", lambda x, xv: _sub(xv, cu_seqlens=np.array([0.0, 3.0, 7.0], np.float32)), TypeError,
     "cu_seqlens"),
    ("cu_2d", lambda x, xv: _sub(xv, cu_seqlens=np.array([[0, 3, 7]], np.int32)), ValueError, "cu_seqlens"),
    ("cu_len1", lambda x, xv: _sub(xv, cu_seqlens=np.array([0], np.int32), initial_state=None), ValueError,
     "cu_seqlens"),
    ("cu_list", lambda x, xv: _sub(xv, cu_seqlens=[0, 3, 7]), TypeError, "cu_seqlens"),
    ("cu_h0_N", lambda x, xv: _sub(xv, cu_seqlens=np.array([0, 7], np.int32)), ValueError, "initial_state"),
    ("scale_zero", lambda x, xv: _sub(x, scale=0.0), ValueError, "scale"),
    ("scale_nan", lambda x, xv: _sub(x, scale=math.nan), ValueError, "scale"),
    ("scale_str", lambda x, xv: _sub(x, scale="0.5"), TypeError, "scale"),
    ("scale_bool", lambda x, xv: _sub(x, scale=True), TypeError, "scale"),
    ("final_int", lambda x, xv: _sub(x, output_final_state=1), TypeError, "output_final_state"),
    ("final_str", lambda x, xv: _sub(x, output_final_state="yes"), TypeError, "output_final_state"),
    ("final_none", lambda x, xv: _sub(x, output_final_state=None), TypeError, "output_final_state"),
    ("l2_int", lambda x, xv: _sub(x, use_qk_l2norm_in_kernel=0), TypeError, "use_qk_l2norm_in_kernel"),
    ("g_nan", lambda x, xv: _sub(x, **_nan_at(x, "g", np.nan)), ValueError, "g"),
    ("b_inf", lambda x, xv: _sub(x, **_nan_at(x, "b", np.inf)), ValueError, "b"),
    ("w_nan", lambda x, xv: _sub(x, **_nan_at(x, "w", np.nan)), ValueError, "w"),
]
BAD_FUSED = [  # the serving arguments of fused_recurrent_gdn2
    ("inplace_int", lambda x, xv: _sub(x, inplace_final_state=1), TypeError, "inplace_final_state"),
    ("inplace_without_h0", lambda x, xv: _sub(x, inplace_final_state=True, initial_state=None), ValueError,
     "initial_state"),
    ("accepted_without_indices", lambda x, xv: _sub(x, num_accepted_tokens=np.ones(B_, np.int32)), ValueError,
     "ssm_state_indices"),
]
BAD_CASES = [pytest.param(op, *c, id=f"{op}-{c[0]}") for op in OPS for c in BAD] + \
    [pytest.param("fused_recurrent_gdn2", *c, id=f"fused_recurrent_gdn2-{c[0]}") for c in BAD_FUSED]


def _assert_names(excinfo, op, arg):
    msg = str(excinfo.value)
    assert msg.startswith(op + ":"), f"message does not name the op: {msg!r}"
    assert f"`{arg}`" in msg, f"message does not name `{arg}`: {msg!r}"


@pytest.mark.parametrize("op,case,build,exc,arg", BAD_CASES)
def test_bad_input_raises_naming_the_argument_before_any_transfer(backend, op, case, build, exc, arg):
    """Wrong shapes, dtypes, HV not a multiple of H, bad cu_seqlens, bad scale, non-bool flags and NaN gates raise
    a TypeError / ValueError starting with the op and naming the argument, in Python, before anything runs: the
    inputs are numpy arrays in the backend's dtypes and ``jax.transfer_guard("disallow")`` fails any jnp work on
    them. Only the named problem is wrong (the rest would be a valid call of this backend)."""
    dtype, g_dtype = backend.dtypes("main")
    x = make(61, B_, T_, H_, HV_, K_, K_, dtype, g_dtype)
    xv = make(62, 1, 7, H_, HV_, K_, K_, dtype, g_dtype, N=2)
    pos, kw = build(x, xv)
    fn = getattr(gdn2_jax, op)
    with jax.transfer_guard("disallow"), pytest.raises(exc) as excinfo:
        fn(*(pos[n] for n in NAMES), backend=backend.name, **kw)
    _assert_names(excinfo, op, arg)


def _support_case(case, dtype, g_dtype):
    """Inputs a backend with kernels cannot take; everything else at the backend's dtypes."""
    K, V = {"K48": (48, 64), "V48": (64, 48)}.get(case, (64, 64))
    if case == "q_float32":
        dtype, g_dtype = "float32", "float32"
    x = make(71, 2, 9, 2, 4, K, V, dtype, g_dtype)
    if case == "k_mixed":
        x["k"] = x["k"].astype(np.float32).astype(np.float16)
    if case == "g_float16":
        x["g"] = x["g"].astype(np.float16)
    return x, dtype


SUPPORT = [
    ("q_float32", TypeError, "`q` in bfloat16 or float16"),
    ("k_mixed", TypeError, "`k` in q's dtype"),
    ("g_float16", TypeError, "`g` in float32 or bfloat16"),
    ("K48", ValueError, "key head dim K in"),
    ("V48", ValueError, "value head dim V in"),
]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case,exc,needle", SUPPORT, ids=[c[0] for c in SUPPORT])
def test_inputs_outside_kernel_support(backend, op, case, exc, needle):
    """float32 q, mixed q/k dtypes, a float16 decay, K or V = 48 (``kernels.registry`` Support): the kernels'
    backend raises naming the argument (and that it is backend='tilelang'), in Python before anything runs; the
    xla backend takes the same inputs and matches the oracle (float32 math: 1e-5; 16-bit o: its rounding floor)."""
    dtype, g_dtype = backend.dtypes("main")
    x, dtype = _support_case(case, dtype, g_dtype)
    fn = getattr(gdn2_jax, op)
    K = x["q"].shape[-1]
    if backend.kernel_support:
        with jax.transfer_guard("disallow"), pytest.raises(exc, match=needle) as excinfo:
            fn(*(x[n] for n in NAMES), initial_state=x["h0"], output_final_state=True, backend=backend.name)
        msg = str(excinfo.value)
        assert msg.startswith(op + ":") and "backend='tilelang'" in msg, msg
    else:
        o, ht = call(backend, op, x)
        assert str(o.dtype) == dtype
        backend.check(op, o, ht, *ref(x, K ** -0.5), dtype)

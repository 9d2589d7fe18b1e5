"""Forward of the chunked WY form: ``naive_chunk_gdn2`` and ``chunk_gdn2(backend="xla")``.

The oracle is ``naive_recurrent_gdn2`` (token loop) in float64. Gradients are in ``test_chunk_grad.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _oracle import make_inputs, rms_ratio

from gdn2_jax import chunk_gdn2, naive_chunk_gdn2, naive_recurrent_gdn2

TOL64 = 1e-10


def _xla(*a, **kw):
    return chunk_gdn2(*a, backend="xla", **kw)


IMPLS = {"naive_chunk": naive_chunk_gdn2, "xla": _xla}

# (T, gva, with_h0, l2norm): every T of {1, 63, 64, 65, 200} twice, and all 8 (gva, h0, l2) combinations.
CASES = [
    (1, True, True, False), (1, False, True, True),  # T = 1 needs h0 (else db, dg are exactly 0)
    (63, True, False, True), (63, False, True, False),
    (64, True, True, True), (64, False, False, False),
    (65, True, False, False), (65, False, True, True),
    (200, True, True, True), (200, False, False, True),
]


_REF_CACHE: dict = {}


def case_inputs(seed, T, gva, l2):
    """fp64 inputs of one CASES entry: B = 2, H = 2, HV = 4 (GVA) or 2, K = 8 != V = 6."""
    H, HV = (2, 4) if gva else (2, 2)
    return make_inputs(seed + T, 2, T, H, HV, 8, 6, jnp.float64, normalize_qk=not l2)


def cached(cache, key, thunk):
    """The oracle of a case is computed once and shared by both implementations (saves compile time)."""
    if key not in cache:
        cache[key] = thunk()
    return cache[key]


def _run(fn, x, *, h0, l2, cu=None, jit=True, **kw):
    def f(q, k, v, g, b, w, s0, cu):
        return fn(q, k, v, g, b, w, initial_state=s0 if h0 else None, output_final_state=True,
                  use_qk_l2norm_in_kernel=l2, cu_seqlens=cu, **kw)
    if jit:
        f = jax.jit(f)
    return f(*(x[n] for n in "qkvgbw"), x["h0"], cu)


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("T,gva,h0,l2", CASES)
def test_forward_matches_recurrent_fp64(x64, impl, T, gva, h0, l2):
    x = case_inputs(100, T, gva, l2)
    o_ref, ht_ref = cached(_REF_CACHE, (T, gva, h0, l2), lambda: _run(naive_recurrent_gdn2, x, h0=h0, l2=l2))
    o, ht = _run(IMPLS[impl], x, h0=h0, l2=l2)
    assert o.dtype == jnp.float64 and ht.dtype == jnp.float64
    assert rms_ratio(o, o_ref) <= TOL64
    assert rms_ratio(ht, ht_ref) <= TOL64


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 10**9])  # 10**9: clamped to T, never allocated
def test_naive_chunk_other_chunk_sizes(x64, chunk_size):
    x = make_inputs(7, 1, 37, 1, 2, 5, 4, jnp.float64)
    o_ref, ht_ref = _run(naive_recurrent_gdn2, x, h0=True, l2=False)
    o, ht = _run(naive_chunk_gdn2, x, h0=True, l2=False, chunk_size=chunk_size)
    assert rms_ratio(o, o_ref) <= TOL64
    assert rms_ratio(ht, ht_ref) <= TOL64


def test_naive_chunk_bad_chunk_size():
    x = make_inputs(0, 1, 8, 1, 1, 4, 4)
    for bad in (0, -64):
        with pytest.raises(ValueError, match="chunk_size"):
            naive_chunk_gdn2(*(x[n] for n in "qkvgbw"), chunk_size=bad)
    for bad in (16.0, True, "64"):
        with pytest.raises(TypeError, match="chunk_size"):
            naive_chunk_gdn2(*(x[n] for n in "qkvgbw"), chunk_size=bad)
    o_np, _ = naive_chunk_gdn2(*(x[n] for n in "qkvgbw"), chunk_size=np.int64(4))  # numpy ints are ints
    o_py, _ = naive_chunk_gdn2(*(x[n] for n in "qkvgbw"), chunk_size=4)
    np.testing.assert_array_equal(np.asarray(o_np), np.asarray(o_py))


# --------------------------------------------------------------------------------------------------
# varlen
# --------------------------------------------------------------------------------------------------

def _per_sequence(x, cu, *, h0, l2):
    """Oracle: run every packed sequence on its own (B = 1) and concatenate."""
    os, hts = [], []
    for n in range(len(cu) - 1):
        s, e = cu[n], cu[n + 1]
        if e == s:  # zero-length sequence: no output, the final state is its initial state
            hts.append(x["h0"][n] if h0 else jnp.zeros_like(x["h0"][n]))
            continue
        xs = {name: x[name][:, s:e] for name in "qkvgbw"}
        xs["h0"] = x["h0"][n:n + 1]
        o, ht = _run(naive_recurrent_gdn2, xs, h0=h0, l2=l2)
        os.append(o)
        hts.append(ht[0])
    return jnp.concatenate(os, axis=1), jnp.stack(hts)


VARLEN = [[0, 15, 15, 100, 130], [0, 0, 64, 129, 130, 130]]


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("cu", VARLEN)
def test_varlen_matches_per_sequence_loop(x64, impl, cu):
    T, N = cu[-1], len(cu) - 1
    x = make_inputs(11 + N, 1, T, 1, 2, 8, 6, jnp.float64, N=N)
    o_ref, ht_ref = _per_sequence(x, cu, h0=True, l2=False)
    o, ht = _run(IMPLS[impl], x, h0=True, l2=False, cu=jnp.asarray(cu, jnp.int32))
    assert rms_ratio(o, o_ref) <= TOL64
    assert rms_ratio(ht, ht_ref) <= TOL64
    # the zero-length sequences end in exactly their initial state
    for n in range(N):
        if cu[n + 1] == cu[n]:
            np.testing.assert_array_equal(np.asarray(ht[n]), np.asarray(x["h0"][n]))


@pytest.mark.slow
@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_varlen_traced_cu_seqlens_one_compile(x64, impl):
    """cu_seqlens is a jit argument (traced): one compiled function serves different splits."""
    T, N = 130, 4
    x = make_inputs(23, 1, T, 2, 2, 8, 6, jnp.float64, N=N, normalize_qk=False)
    traces = []

    @jax.jit
    def f(q, k, v, g, b, w, s0, cu):
        traces.append(1)
        return IMPLS[impl](q, k, v, g, b, w, initial_state=s0, output_final_state=True,
                           use_qk_l2norm_in_kernel=True, cu_seqlens=cu)

    for cu in ([0, 15, 15, 100, 130], [0, 70, 70, 71, 130], [0, 130, 130, 130, 130]):
        o, ht = f(*(x[n] for n in "qkvgbw"), x["h0"], jnp.asarray(cu, jnp.int32))
        o_ref, ht_ref = _per_sequence(x, cu, h0=True, l2=True)
        assert rms_ratio(o, o_ref) <= TOL64
        assert rms_ratio(ht, ht_ref) <= TOL64
    assert len(traces) == 1


# --------------------------------------------------------------------------------------------------
# strong decay, no decay, negative eigenvalues
# --------------------------------------------------------------------------------------------------

def strong_decay_g(seed, shape, dtype):
    """g per (token, channel) drawn from {0, -1e-3, -0.1, -6, -20, -60}: G reaches ~ -thousands in a chunk."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.choice(np.array([0.0, -1e-3, -0.1, -6.0, -20.0, -60.0]), size=shape), dtype)


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("gate", ["strong", "zero"])
def test_forward_extreme_gates_fp64(x64, impl, gate):
    x = make_inputs(31, 1, 130, 1, 2, 8, 6, jnp.float64, b_range=(0.0, 2.0))
    x["g"] = strong_decay_g(32, x["g"].shape, jnp.float64) if gate == "strong" else jnp.zeros_like(x["g"])
    o_ref, ht_ref = _run(naive_recurrent_gdn2, x, h0=True, l2=False)
    o, ht = _run(IMPLS[impl], x, h0=True, l2=False)
    assert bool(jnp.all(jnp.isfinite(o))) and bool(jnp.all(jnp.isfinite(ht)))
    assert rms_ratio(o, o_ref) <= TOL64
    assert rms_ratio(ht, ht_ref) <= TOL64


# --------------------------------------------------------------------------------------------------
# precision / dtypes
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_fp32_vs_fp64_oracle(impl):
    x32 = make_inputs(41, 2, 150, 2, 4, 16, 8, jnp.float32, as_numpy=True)
    with jax.enable_x64(True):
        x64_ = {n: jnp.asarray(a.astype(np.float64)) for n, a in x32.items()}
        o_ref, ht_ref = _run(naive_recurrent_gdn2, x64_, h0=True, l2=True)
        o_ref, ht_ref = np.asarray(o_ref), np.asarray(ht_ref)
    o, ht = _run(IMPLS[impl], {n: jnp.asarray(a) for n, a in x32.items()}, h0=True, l2=True)
    assert o.dtype == jnp.float32 and ht.dtype == jnp.float32
    assert rms_ratio(o, o_ref) <= 1e-5
    assert rms_ratio(ht, ht_ref) <= 1e-5


def test_bf16_inputs_dtype_and_accuracy():
    """bf16 q/k/v/b/w with fp32 g and state: o comes back in bf16, state fp32, values near the fp32 oracle."""
    x = make_inputs(43, 1, 100, 1, 2, 16, 8, jnp.float32)
    xb = {n: (a if n in ("g", "h0") else a.astype(jnp.bfloat16)) for n, a in x.items()}
    x_ref = {n: a.astype(jnp.float32) for n, a in xb.items()}  # the same quantised values, in fp32
    o_ref, ht_ref = _run(naive_recurrent_gdn2, x_ref, h0=True, l2=False)
    o, ht = _run(_xla, xb, h0=True, l2=False)
    assert o.dtype == jnp.bfloat16 and ht.dtype == jnp.float32
    assert rms_ratio(o, o_ref) <= 5e-3  # bf16 output rounding (spec §11: ~1.6e-3)
    assert rms_ratio(ht, ht_ref) <= 1e-5


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("varlen", [False, True])
def test_no_tokens_final_state_is_initial_state(impl, varlen):
    """T = 0 (dense) or only empty sequences (varlen): the final state is h0 and d(final)/d(h0) is identity."""
    x = make_inputs(45, 1, 0, 1, 2, 4, 3, N=2 if varlen else 1)
    cu = jnp.zeros((3,), jnp.int32) if varlen else None
    dht = jnp.asarray(np.random.default_rng(46).standard_normal(x["h0"].shape), jnp.float32)

    def f(s0):
        o, ht = IMPLS[impl](*(x[n] for n in "qkvgbw"), initial_state=s0, output_final_state=True, cu_seqlens=cu)
        return jnp.sum(ht * dht), (o, ht)

    (_, (o, ht)), dh0 = jax.value_and_grad(f, has_aux=True)(x["h0"])
    assert o.shape == (1, 0, 2, 3)
    np.testing.assert_array_equal(np.asarray(ht), np.asarray(x["h0"]))
    np.testing.assert_array_equal(np.asarray(dh0), np.asarray(dht))


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_cpu_program_has_no_custom_calls(impl):
    """The compiled CPU program (forward and backward) is plain XLA ops: no jaxlib CPU custom call.

    jaxlib 0.10's CPU triangular solve is a custom call that fans out into the XLA intra-op pool it runs on and
    waits there; two of them in parallel deadlocked a 2-core CI machine. The (I + T)^-1 solve is therefore
    built from matmuls (``_chunk._unit_lower_inverse``); this keeps any such custom call from coming back.
    """
    x = make_inputs(3, 1, 70, 1, 2, 8, 6, jnp.float32)

    def loss(q, k, v, g, b, w, h0):
        o, ht = IMPLS[impl](q, k, v, g, b, w, initial_state=h0, output_final_state=True)
        return jnp.sum(o) + jnp.sum(ht)

    args = tuple(x[n] for n in "qkvgbw") + (x["h0"],)
    hlo = jax.jit(jax.grad(loss, argnums=tuple(range(7)))).lower(*args).compile().as_text()
    assert "dot(" in hlo or "dot." in hlo, "expected matmuls in the compiled program"
    assert "custom-call" not in hlo, [ln for ln in hlo.splitlines() if "custom-call" in ln][:3]

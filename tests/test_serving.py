"""The serving API of ``fused_recurrent_gdn2``: a state pool (FLA's continuous batching / speculative decoding).

``initial_state`` is a pool ``[P, HV, K, V]``; ``ssm_state_indices`` ``[N]`` (one slot per sequence) or ``[N, L]``
(one slot per token), optionally ``num_accepted_tokens`` ``[N]``; ``inplace_final_state=True`` aliases the final
state to ``initial_state``. Semantics: the ``fused_recurrent_gdn2`` docstring (``gdn2_jax/ops.py``).

Ground truth: an fp64 numpy token loop written here (independent of the code under test) on the same quantised
inputs, run per sequence from the pool slot the semantics name (zeros for a padding slot), with its own pool
bookkeeping. Every case runs for ``backend="xla"`` (CPU) and ``backend="tilelang"`` (marked ``cuda``): bf16 inputs,
o at the bf16 rounding floor of the oracle, pool rows at RMS ratio 1e-5, untouched slots bit-identical.

Both backends also: argument checks (Python, before any backend runs), traced-invalid poisoning, functional
semantics (an undonated pool is unchanged), a donated step returns the pool in the donated buffer, and the compiled
donated step / ``lax.scan`` of steps holds no state-sized copy. CPU lowering of the tilelang pool step: one custom
call whose result aliases the pool operand, donation, the aliased call inside a ``lax.scan`` body. GPU only: the
torch path equals the JAX tilelang path bit for bit.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import gdn2_jax

BACKENDS = ["xla", pytest.param("tilelang", marks=pytest.mark.cuda)]
NAMES = ("q", "k", "v", "g", "b", "w")
H, HV, K, V = 2, 4, 32, 32  # GVA: value head j reads q/k head j // 2
SCALE = K ** -0.5
G_LEVELS = np.array([0.0, -1e-3, -0.05, -0.5, -6.0, -60.0])
BF = ml_dtypes.bfloat16


@pytest.fixture(autouse=True)
def _xla_on_cpu(request):
    """``backend="xla"`` cases run on the CPU also on a GPU host (f32 matmuls there may use TF32, and the pool
    rows are checked at 1e-5)."""
    cs = getattr(request.node, "callspec", None)
    if cs is not None and cs.params.get("backend") == "xla":
        with jax.default_device(jax.devices("cpu")[0]):
            yield
    else:
        yield


# ------------------------------------------------------------------------------------------ inputs / oracle
def make(seed, B, T, P=None, *, l2=False):
    """numpy inputs already rounded to the kernel dtypes (q, k, v, b, w bf16; g fp32) and a pool ``[P, ...]`` fp32.

    g per channel from G_LEVELS (down to -60, mixed), b in [0, 2], w in [0, 1]; q, k unit norm unless ``l2``
    (then unnormalised: the op normalises)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, H, K))
    k = rng.standard_normal((B, T, H, K))
    if l2:
        q *= rng.uniform(0.5, 3.0, (B, T, H, 1))
        k *= rng.uniform(0.5, 3.0, (B, T, H, 1))
    else:
        q /= np.linalg.norm(q, axis=-1, keepdims=True)
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g = G_LEVELS[rng.integers(0, len(G_LEVELS), (B, T, HV, K))] * rng.uniform(0.5, 1.0, (B, T, HV, K))
    x = dict(q=q.astype(BF), k=k.astype(BF), v=(0.5 * rng.standard_normal((B, T, HV, V))).astype(BF),
             g=g.astype(np.float32), b=rng.uniform(0.0, 2.0, (B, T, HV, K)).astype(BF),
             w=rng.uniform(0.0, 1.0, (B, T, HV, V)).astype(BF))
    if P is not None:
        x["pool"] = rng.standard_normal((P, HV, K, V)).astype(np.float32)
    return x


def run_tokens(x, bb, t0, t1, S0, l2=False):
    """fp64 token loop over tokens [t0, t1) of batch row ``bb``. Returns (o [n, HV, V], states [n, HV, K, V]).

    ``l2``: normalise q, k in fp64 (both backends keep the normalised q / k in fp32, not rounded to bf16)."""
    f = {n: np.asarray(x[n][bb, t0:t1], np.float64) for n in NAMES}
    q, k = f["q"], f["k"]
    if l2:
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    q, k = np.repeat(q, HV // H, axis=1), np.repeat(k, HV // H, axis=1)
    S = np.array(S0, np.float64)
    o = np.zeros((t1 - t0, HV, V))
    states = np.zeros((t1 - t0, HV, K, V))
    for t in range(t1 - t0):
        S = np.exp(f["g"][t])[:, :, None] * S
        u = f["w"][t] * f["v"][t] - np.einsum("hk,hkv->hv", f["b"][t] * k[t], S)
        S = S + k[t][:, :, None] * u[:, None, :]
        o[t] = SCALE * np.einsum("hk,hkv->hv", q[t], S)
        states[t] = S
    return o, states


def pool_oracle(x, pool, idx, acc=None, cu=None, l2=False):
    """The pool semantics, sequence by sequence. Returns (o [B, T, HV, V], new pool fp64, written slots)."""
    idx = np.asarray(idx)
    B, T = x["q"].shape[:2]
    segs = [(n, n, 0, T) for n in range(B)] if cu is None else [
        (n, 0, int(cu[n]), int(cu[n + 1])) for n in range(len(cu) - 1)]
    new = np.asarray(pool, np.float64).copy()
    written = set()
    o = np.zeros((B, T, HV, V))
    for n, bb, s, e in segs:
        if idx.ndim == 1:
            s0 = int(idx[n])
        else:
            s0 = int(idx[n, 0 if acc is None else int(acc[n]) - 1])
        S0 = pool[s0] if s0 >= 0 else np.zeros((HV, K, V))
        on, st = run_tokens(x, bb, s, e, S0, l2)
        o[bb, s:e] = on
        if idx.ndim == 1:
            if s0 >= 0 and e > s:  # an empty sequence writes its start state back: the row stays bit-identical
                new[s0] = st[-1]
                written.add(s0)
        else:
            for t in range(e - s):
                if t < idx.shape[1] and idx[n, t] >= 0:
                    new[int(idx[n, t])] = st[t]
                    written.add(int(idx[n, t]))
    return o, new, written


def rms(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    assert x.shape == ref.shape, (x.shape, ref.shape)
    assert np.all(np.isfinite(x)), "non-finite values"
    den = np.sqrt(np.mean(ref * ref))
    assert den > 0, "all-zero reference: the check would be vacuous"
    return float(np.sqrt(np.mean((x - ref) ** 2)) / den)


def check_o(o, ref_o):
    """o at the bf16 rounding floor of the exact output (the best a bf16 output can do)."""
    o = np.asarray(o).astype(np.float64)
    floor = rms(ref_o.astype(BF).astype(np.float64), ref_o)
    r = rms(o, ref_o)
    assert r <= floor * 1.08 + 1e-5, (r, floor)


def check_pool(new_pool, ref_pool, written, pool_in, *, tol=1e-5):
    """Written rows: each at RMS ratio <= tol vs the oracle; every other row bit-identical to ``pool_in``."""
    got = np.asarray(new_pool)
    assert got.dtype == np.float32 and got.shape == pool_in.shape
    assert written, "no slot written: the check would be vacuous"
    for s in sorted(written):
        r = rms(got[s], ref_pool[s])
        assert r <= tol, (s, r)
    untouched = [s for s in range(pool_in.shape[0]) if s not in written]
    np.testing.assert_array_equal(got[untouched], pool_in[untouched])


def call(backend, x, pool, idx, acc=None, cu=None, l2=False, **kw):
    j = [jnp.asarray(x[n]) for n in NAMES]
    return gdn2_jax.fused_recurrent_gdn2(
        *j, initial_state=jnp.asarray(pool), ssm_state_indices=None if idx is None else jnp.asarray(idx),
        num_accepted_tokens=None if acc is None else jnp.asarray(acc),
        cu_seqlens=None if cu is None else jnp.asarray(np.asarray(cu, np.int32)), use_qk_l2norm_in_kernel=l2,
        backend=backend, **kw)


def tokens(x, t):
    return tuple(jnp.asarray(x[n][:, t:t + 1]) for n in NAMES)


# ------------------------------------------------------------------------------------------- slot mode [N]
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("idx_dtype", [np.int32, np.int64])
def test_slot_mode_dense(backend, idx_dtype):
    x = make(1, B=3, T=3, P=7)
    idx = np.array([4, -1, 1], idx_dtype)  # sequence 1 is padding: starts from zero, writes nothing
    o, new = call(backend, x, x["pool"], idx)
    ref_o, ref_pool, written = pool_oracle(x, x["pool"], idx)
    assert written == {4, 1}
    assert o.shape == (3, 3, HV, V) and o.dtype == jnp.bfloat16 and new.shape == x["pool"].shape
    check_o(o, ref_o)
    check_pool(new, ref_pool, written, x["pool"])
    # the padding sequence's output is the zero-start one, not one from any pool row (e.g. a wrapped slot -1)
    o_pad, _ = run_tokens(x, 1, 0, 3, x["pool"][-1])
    assert rms(np.asarray(o)[1].astype(np.float64), o_pad) > 0.1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("l2", [False, True])
def test_slot_mode_varlen_with_empty_sequence(backend, l2):
    cu = [0, 2, 2, 5, 6]  # sequence 1 is empty
    x = make(2, B=1, T=6, P=6, l2=l2)
    idx = np.array([5, 0, -1, 2], np.int32)  # empty sequence on slot 0 (unchanged), padding sequence 2
    o, new = call(backend, x, x["pool"], idx, cu=cu, l2=l2)
    ref_o, ref_pool, written = pool_oracle(x, x["pool"], idx, cu=cu, l2=l2)
    assert written == {5, 2}
    check_o(o, ref_o)
    check_pool(new, ref_pool, written, x["pool"])  # slot 0 (empty sequence) bit-identical too


# ---------------------------------------------------------------------------------------- token mode [N, L]
TOKEN_IDX = np.array([[2, 5, 9, -1],   # 3 tokens: states to 2, 5, 9; column 3 unused
                      [-1, 0, 3, 7],   # starts from zero without num_accepted_tokens; token 0 not written
                      [6, 1, -1, 8]],  # token 2 not written
                     np.int32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("acc", [None, (2, 4, 1)])
def test_token_mode_dense(backend, acc):
    x = make(3, B=3, T=3, P=11)
    acc = None if acc is None else np.array(acc, np.int32)
    o, new = call(backend, x, x["pool"], TOKEN_IDX, acc=acc)
    ref_o, ref_pool, written = pool_oracle(x, x["pool"], TOKEN_IDX, acc=acc)
    assert written == {2, 5, 9, 0, 3, 6, 1}
    check_o(o, ref_o)
    check_pool(new, ref_pool, written, x["pool"])
    if acc is not None:  # the start slots idx[n, acc[n] - 1] = 5, 7, 6: a start from idx[n, 0] would differ
        ref_o0, _, _ = pool_oracle(x, x["pool"], TOKEN_IDX)
        assert rms(np.asarray(o).astype(np.float64), ref_o0) > 0.05


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("acc", [None, (3, 1, 2)])
def test_token_mode_varlen(backend, acc):
    cu = [0, 3, 3, 4]  # lengths 3, 0, 1
    idx = np.array([[2, 5, 0],    # with acc 3: starts from slot 0 and then overwrites it after token 2
                    [1, -1, -1],  # empty: slot 1 never written
                    [4, 6, 3]], np.int32)
    x = make(4, B=1, T=4, P=8)
    acc = None if acc is None else np.array(acc, np.int32)
    o, new = call(backend, x, x["pool"], idx, acc=acc, cu=cu)
    ref_o, ref_pool, written = pool_oracle(x, x["pool"], idx, acc=acc, cu=cu)
    assert written == {2, 5, 0, 4}
    check_o(o, ref_o)
    check_pool(new, ref_pool, written, x["pool"])


# ---------------------------------------------------------------------------- continuous batching audit
@pytest.mark.parametrize("backend", BACKENDS)
def test_continuous_batching_audit_128_steps(backend):
    """128 jitted decode steps (one token each, fresh tokens every step, the pool donated): requests join
    (their slot reset to a fresh state) and leave, lanes are reshuffled every step, idle lanes are padding.
    Every step: o of every lane vs the oracle, written pool rows vs the oracle pool, all other rows unchanged."""
    lanes, P, steps = 4, 9, 128
    rng = np.random.default_rng(5)
    x = make(6, B=lanes, T=steps, P=P)
    pool_ref = x["pool"].astype(np.float64)  # oracle pool

    def _reset(pool, slot, state):
        return pool.at[slot].set(state)

    reset_slot = jax.jit(_reset, donate_argnums=0)

    def _step(pool, idx, q, k, v, g, b, w):
        return gdn2_jax.fused_recurrent_gdn2(q, k, v, g, b, w, initial_state=pool, ssm_state_indices=idx,
                                             backend=backend)

    step = jax.jit(_step, donate_argnums=0)
    pool = jnp.asarray(x["pool"])
    active = {}  # request id -> (slot, tokens left)
    free = list(range(P))
    next_id = joined = left = 0
    for t in range(steps):
        # leave: finished requests free their slot; join: new requests take a free slot, reset to a fresh state
        for r in [r for r, (s, n) in active.items() if n == 0]:
            free.append(active.pop(r)[0])
            left += 1
        while len(active) < lanes and rng.random() < 0.7:
            s = free.pop(int(rng.integers(len(free))))
            fresh = rng.standard_normal((HV, K, V)).astype(np.float32)
            pool = reset_slot(pool, s, jnp.asarray(fresh))
            pool_ref[s] = fresh
            active[next_id] = (s, int(rng.integers(3, 40)))
            next_id += 1
            joined += 1
        order = rng.permutation(lanes)  # request -> lane, reshuffled every step
        idx = -np.ones(lanes, np.int32)
        for lane, r in zip(order, list(active)):
            idx[lane] = active[r][0]
            active[r] = (active[r][0], active[r][1] - 1)
        before = np.array(pool, copy=True)  # host copy: the device buffer is donated below
        o, pool = step(pool, jnp.asarray(idx), *tokens(x, t))
        ref_o = np.zeros((lanes, 1, HV, V))
        written = set()
        for lane in range(lanes):
            s = int(idx[lane])
            on, st = run_tokens(x, lane, t, t + 1, pool_ref[s] if s >= 0 else np.zeros((HV, K, V)))
            ref_o[lane] = on
            if s >= 0:
                pool_ref[s] = st[-1]
                written.add(s)
        check_o(o, ref_o)
        if written:
            check_pool(pool, pool_ref, written, before)
        else:
            np.testing.assert_array_equal(np.asarray(pool), before)
    assert joined >= 8 and left >= 4, (joined, left)  # the schedule really churned


# ------------------------------------------------------------------------------------- speculative decoding
@pytest.mark.parametrize("backend", BACKENDS)
def test_speculative_decoding_loop(backend):
    """4 draft tokens per step, a random accepted prefix, the next step passes num_accepted_tokens. The
    accepted outputs and the final states equal an oracle that ran only the accepted tokens."""
    N, L, steps = 3, 4, 8
    P = N * L + 3
    rng = np.random.default_rng(7)
    perm = rng.permutation(P)
    idx = perm[:N * L].reshape(N, L).astype(np.int32)  # each sequence owns L scattered slots
    spare = perm[N * L:]
    x0 = make(8, B=N, T=1, P=P)
    pool0 = x0["pool"]
    S_ref = [pool0[idx[n, 0]].astype(np.float64) for n in range(N)]  # acc = 1 at the start: slot idx[n, 0]

    def _step(pool, idx, acc, q, k, v, g, b, w):
        return gdn2_jax.fused_recurrent_gdn2(q, k, v, g, b, w, initial_state=pool, ssm_state_indices=idx,
                                             num_accepted_tokens=acc, backend=backend)

    step = jax.jit(_step, donate_argnums=0)
    pool = jnp.asarray(pool0)
    acc = np.ones(N, np.int32)
    accepted = []
    for s in range(steps):
        x = make(100 + s, B=N, T=L)
        o, pool = step(pool, jnp.asarray(idx), jnp.asarray(acc), *(jnp.asarray(x[n]) for n in NAMES))
        got = np.asarray(pool)
        new_acc = rng.integers(1, L + 1, N).astype(np.int32)
        accepted += new_acc.tolist()
        for n in range(N):
            on, st = run_tokens(x, n, 0, L, S_ref[n])  # every draft token, from the last accepted state
            check_o(np.asarray(o)[n], on)
            for t in range(L):  # the state after draft token t lies in slot idx[n, t]
                assert rms(got[idx[n, t]], st[t]) <= 1e-5, (s, n, t)
            a = int(new_acc[n])
            S_ref[n] = run_tokens(x, n, 0, a, S_ref[n])[1][-1]  # the oracle runs the accepted tokens only
        np.testing.assert_array_equal(got[spare], pool0[spare])
        acc = new_acc
    final = np.asarray(pool)
    for n in range(N):  # where the next step would start
        assert rms(final[idx[n, acc[n] - 1]], S_ref[n]) <= 1e-5, n
    assert 1 in accepted and L in accepted and len(set(accepted)) == L  # every prefix length occurred


# ------------------------------------------------------------------------------------------- validation
def _small(P=5, T=2, N=3):
    x = make(9, B=N, T=T, P=P)
    return [jnp.asarray(x[n]) for n in NAMES], jnp.asarray(x["pool"])


@pytest.mark.parametrize("backend", ["xla", "tilelang"])  # checked in Python before any backend is chosen
def test_validation_errors_name_the_argument(backend):
    arrs, pool = _small()
    fn = gdn2_jax.fused_recurrent_gdn2
    i32 = lambda *a: jnp.asarray(np.array(a, np.int32))  # noqa: E731
    tok = i32([0, 1], [2, 3], [-1, 4])
    cases = [
        (dict(ssm_state_indices=jnp.asarray([0.0, 1.0, 2.0])), TypeError, r"`ssm_state_indices`.*integer"),
        (dict(ssm_state_indices=[0, 1, 2]), TypeError, r"`ssm_state_indices`"),
        (dict(ssm_state_indices=i32(0, 1, 2, 3)), ValueError, r"`ssm_state_indices`.*N=3"),
        (dict(ssm_state_indices=jnp.zeros((3, 2, 1), jnp.int32)), ValueError, r"`ssm_state_indices`.*\[N, L\]"),
        (dict(ssm_state_indices=i32([0], [1], [2])), ValueError, r"`ssm_state_indices`.*L >= T"),
        (dict(ssm_state_indices=i32(1, 1, -1)), ValueError, r"`ssm_state_indices`.*repeat"),
        (dict(ssm_state_indices=i32([0, 1], [2, 3], [1, 4])), ValueError, r"`ssm_state_indices`.*repeat"),
        (dict(ssm_state_indices=i32(0, 5, 2)), ValueError, r"`ssm_state_indices`.*< P=5"),
        (dict(ssm_state_indices=tok, num_accepted_tokens=i32(1, 0, 2)), ValueError,
         r"`num_accepted_tokens`.*\[1, L=2\]"),
        (dict(ssm_state_indices=tok, num_accepted_tokens=i32(1, 3, 2)), ValueError,
         r"`num_accepted_tokens`.*\[1, L=2\]"),
        (dict(ssm_state_indices=i32(0, 1, 2), num_accepted_tokens=i32(1, 1, 1)), ValueError,
         r"`num_accepted_tokens`.*per-token"),
        (dict(num_accepted_tokens=i32(1, 1, 1)), ValueError, r"`num_accepted_tokens`.*`ssm_state_indices`"),
        (dict(ssm_state_indices=tok, num_accepted_tokens=jnp.ones(3)), TypeError, r"`num_accepted_tokens`"),
        (dict(ssm_state_indices=tok, num_accepted_tokens=i32(1, 1)), ValueError, r"`num_accepted_tokens`.*\(3,\)"),
    ]
    for kw, exc, pat in cases:
        with pytest.raises(exc, match=pat):
            fn(*arrs, initial_state=pool, backend=backend, **kw)
    for bad_pool in (jnp.zeros((5, HV, K, V + 1)), jnp.zeros((5, HV + 1, K, V)), jnp.zeros((HV, K, V)),
                     jnp.zeros((0, HV, K, V))):
        with pytest.raises(ValueError, match=r"`initial_state`.*pool.*\[P, 4, 32, 32\]"):
            fn(*arrs, initial_state=bad_pool, ssm_state_indices=i32(0, 1, 2), backend=backend)
    with pytest.raises(TypeError, match=r"`initial_state`.*float32"):
        fn(*arrs, initial_state=pool.astype(jnp.bfloat16), ssm_state_indices=i32(0, 1, 2), backend=backend)
    with pytest.raises(ValueError, match=r"`ssm_state_indices`.*`initial_state`"):
        fn(*arrs, ssm_state_indices=i32(0, 1, 2), backend=backend)
    with pytest.raises(ValueError, match=r"`inplace_final_state=True`.*`initial_state`"):
        fn(*arrs, inplace_final_state=True, backend=backend)
    with pytest.raises(TypeError, match=r"`inplace_final_state`"):
        fn(*arrs, initial_state=pool[:3], inplace_final_state=1, backend=backend)


TRACED_BAD = [  # (ssm_state_indices, num_accepted_tokens, slots the call writes): P = 6, T = 2
    ([2, 2, -1], None, {2}),                        # duplicate slot
    ([1, 9, -1], None, {1}),                        # slot >= P (the -1 padding must not wrap to slot 5)
    ([[0, 3], [1, 4], [-1, 2]], [1, 0, 2], {0, 3, 1, 4, 2}),  # num_accepted_tokens 0
    ([[0, 3], [1, 4], [-1, 2]], [1, 3, 2], {0, 3, 1, 4, 2}),  # num_accepted_tokens > L
    ([[0, 3], [1, 0], [-1, 2]], None, {0, 3, 1, 2}),          # duplicate across sequences
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("idx,acc,written", TRACED_BAD)
def test_traced_invalid_indices_poison_outputs_and_written_slots(backend, idx, acc, written):
    x = make(10, B=3, T=2, P=6)

    @jax.jit
    def f(pool, idx, acc, *a):
        return gdn2_jax.fused_recurrent_gdn2(*a, initial_state=pool, ssm_state_indices=idx,
                                             num_accepted_tokens=acc, backend=backend)

    idx = jnp.asarray(np.array(idx, np.int32))
    o, new = f(jnp.asarray(x["pool"]), idx, None if acc is None else jnp.asarray(np.array(acc, np.int32)),
               *(jnp.asarray(x[n]) for n in NAMES))
    o, new = np.asarray(o).astype(np.float32), np.asarray(new)
    assert np.isnan(o).all()
    for s in range(6):
        if s in written:
            assert np.isnan(new[s]).all(), s
        elif s not in np.asarray(idx):  # slots the call names but does not write are not checked
            np.testing.assert_array_equal(new[s], x["pool"][s])  # finite and unchanged


@pytest.mark.parametrize("backend", BACKENDS)
def test_traced_valid_indices_equal_concrete(backend):
    """The device-side check of traced indices changes nothing for valid ones (bit for bit)."""
    x = make(11, B=3, T=3, P=11)
    acc = np.array([2, 4, 1], np.int32)
    o_c, p_c = call(backend, x, x["pool"], TOKEN_IDX, acc=acc)
    f = jax.jit(lambda pool, idx, acc, *a: gdn2_jax.fused_recurrent_gdn2(
        *a, initial_state=pool, ssm_state_indices=idx, num_accepted_tokens=acc, backend=backend))
    o_t, p_t = f(jnp.asarray(x["pool"]), jnp.asarray(TOKEN_IDX), jnp.asarray(acc), *(jnp.asarray(x[n]) for n in NAMES))
    np.testing.assert_array_equal(np.asarray(o_t).astype(np.float32), np.asarray(o_c).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(p_t), np.asarray(p_c))


# ------------------------------------------------------------------------------------ functional semantics
@pytest.mark.parametrize("backend", BACKENDS)
def test_pool_not_donated_is_unchanged(backend):
    x = make(12, B=3, T=2, P=6)
    pool = jnp.asarray(x["pool"])
    idx = jnp.asarray(np.array([3, -1, 0], np.int32))
    f = jax.jit(lambda pool, idx, *a: gdn2_jax.fused_recurrent_gdn2(*a, initial_state=pool,
                                                                    ssm_state_indices=idx, backend=backend))
    for run in (lambda: call(backend, x, pool, idx), lambda: f(pool, idx, *(jnp.asarray(x[n]) for n in NAMES))):
        _, new = run()
        assert new is not pool and not pool.is_deleted()
        np.testing.assert_array_equal(np.asarray(pool), x["pool"])  # the caller's pool: untouched
        new = np.asarray(new)
        assert not np.array_equal(new[3], x["pool"][3]) and not np.array_equal(new[0], x["pool"][0])
        np.testing.assert_array_equal(new[[1, 2, 4, 5]], x["pool"][[1, 2, 4, 5]])


@pytest.mark.parametrize("backend", BACKENDS)
def test_donated_step_reuses_the_pool_buffer(backend):
    """A donated jitted pool step returns the pool in the donated buffer (slot and token mode)."""
    x = make(13, B=3, T=2, P=8)
    for idx, acc in ((np.array([5, -1, 2], np.int32), None),
                     (np.array([[0, 1], [2, 3], [-1, 7]], np.int32), np.array([2, 1, 1], np.int32))):
        f = jax.jit(lambda pool, idx, acc, *a: gdn2_jax.fused_recurrent_gdn2(
            *a, initial_state=pool, ssm_state_indices=idx, num_accepted_tokens=acc, backend=backend),
            donate_argnums=0)
        pool = jnp.asarray(x["pool"])
        ptr = pool.unsafe_buffer_pointer()
        o, new = f(pool, jnp.asarray(idx), None if acc is None else jnp.asarray(acc),
                   *(jnp.asarray(x[n]) for n in NAMES))
        assert pool.is_deleted()
        assert new.unsafe_buffer_pointer() == ptr
        ref_o, ref_pool, written = pool_oracle(x, x["pool"], idx, acc)
        check_o(o, ref_o)
        check_pool(new, ref_pool, written, x["pool"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("varlen", [False, True])
def test_inplace_final_state_without_pool_equals_functional(backend, varlen):
    cu = [0, 2, 2, 5] if varlen else None
    x = make(14, B=1 if varlen else 3, T=5 if varlen else 2, P=3)
    h0 = jnp.asarray(x["pool"])  # [N, HV, K, V]: a plain initial state, no pool
    j = [jnp.asarray(x[n]) for n in NAMES]
    kw = dict(cu_seqlens=None if cu is None else jnp.asarray(np.array(cu, np.int32)), backend=backend)
    o_f, h_f = gdn2_jax.fused_recurrent_gdn2(*j, initial_state=h0, output_final_state=True, **kw)
    o_i, h_i = gdn2_jax.fused_recurrent_gdn2(*j, initial_state=h0, inplace_final_state=True, **kw)
    np.testing.assert_array_equal(np.asarray(o_i).astype(np.float32), np.asarray(o_f).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(h_i), np.asarray(h_f))
    np.testing.assert_array_equal(np.asarray(h0), x["pool"])  # not donated: the caller's state is unchanged
    f = jax.jit(lambda h, *a: gdn2_jax.fused_recurrent_gdn2(*a, initial_state=h, inplace_final_state=True, **kw),
                donate_argnums=0)
    o_d, h_d = f(jnp.asarray(x["pool"]), *j)
    np.testing.assert_array_equal(np.asarray(o_d).astype(np.float32), np.asarray(o_f).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(h_d), np.asarray(h_f))
    # and the functional result is the oracle's
    ref_o, ref_h, written = pool_oracle(x, x["pool"], np.arange(3, dtype=np.int32), cu=cu)
    check_o(o_f, ref_o)
    check_pool(h_f, ref_h, written, x["pool"])


# ------------------------------------------------------------------------------------- lowering (CPU)
S = jax.ShapeDtypeStruct


@pytest.fixture
def _pretend_hopper(monkeypatch):
    """Lowering for CUDA needs no GPU: let backend="tilelang" pass the device check on this CPU host (nothing is
    compiled or run; ``_tilelang`` registers targets only when JAX really has CUDA devices)."""
    from gdn2_jax import backends

    monkeypatch.setattr(backends, "tilelang_supported_device", lambda: True)
    monkeypatch.setattr(backends, "cuda_extra_installed", lambda: True)


def _lower(f, specs, **kw):
    return jax.jit(f, **kw).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


def _custom_calls(txt):
    return [line for line in txt.splitlines() if "stablehlo.custom_call" in line]


def _token_specs(N, T, P=None):
    bf = jnp.bfloat16
    specs = [S((N, T, H, K), bf), S((N, T, H, K), bf), S((N, T, HV, V), bf), S((N, T, HV, K), jnp.float32),
             S((N, T, HV, K), bf), S((N, T, HV, V), bf)]
    return specs + ([S((P, HV, K, V), jnp.float32)] if P else [])


ALIAS_POOL = "output_operand_alias<output_tuple_indices = [1], operand_index = 6,"


@pytest.mark.parametrize("mode", ["slot", "token", "token+acc"])
def test_lowering_pool_step_one_aliased_custom_call(_pretend_hopper, mode):
    N, P, L = 3, 8, 2
    idx_spec = S((N,), jnp.int32) if mode == "slot" else S((N, L), jnp.int32)
    specs = _token_specs(N, 1, P) + [idx_spec] + ([S((N,), jnp.int32)] if mode == "token+acc" else [])

    def f(q, k, v, g, b, w, pool, idx, acc=None):
        return gdn2_jax.fused_recurrent_gdn2(q, k, v, g, b, w, initial_state=pool, ssm_state_indices=idx,
                                             num_accepted_tokens=acc, backend="tilelang")

    pool_t = f"tensor<{P}x{HV}x{K}x{V}xf32>"
    for donate in (False, True):
        txt = _lower(f, specs, **({"donate_argnums": 6} if donate else {}))
        calls = _custom_calls(txt)
        assert len(calls) == 1, calls
        call_ = calls[0]
        assert re.search(r"custom_call @gdn2_recurrent_fwd_[0-9a-f]{12}\(", call_)
        assert ALIAS_POOL in call_  # result 1 (the new pool) is operand 6 (the pool), updated in place
        assert call_.count("#stablehlo.output_operand_alias<") == 1  # the pool, nothing else
        ops = re.findall(r"tensor<[^>]*>", call_.rsplit(" : (", 1)[1].split(") -> ")[0])  # operand types
        bf = lambda *d: "tensor<" + "x".join(map(str, d)) + "xbf16>"  # noqa: E731
        want = [bf(N, 1, H, K), bf(N, 1, H, K), bf(N, 1, HV, V), f"tensor<{N}x1x{HV}x{K}xf32>", bf(N, 1, HV, K),
                bf(N, 1, HV, V), pool_t, "tensor<3xi32>" if mode == "slot" else f"tensor<{N}x{L}xi32>"]
        want += ["tensor<3xi32>"] if mode == "token+acc" else []
        # q, k, v, g, b, w, pool (operand 6), indices (, num_accepted_tokens) (, the traced indices' poison factor)
        assert ops[:len(want)] == want and ops[len(want):] in ([], ["tensor<1xf32>"]), ops
        assert f"-> (tensor<{N}x1x{HV}x{V}xbf16>, {pool_t})" in call_
        main = next(line for line in txt.splitlines() if "func.func public @main" in line)
        pool_arg = re.search(r"%arg6: " + re.escape(pool_t) + r"( \{[^}]*\})?", main).group(0)
        assert ("tf.aliasing_output = 1" in pool_arg) == donate, pool_arg  # donated pool -> result 1
        assert main.count("tf.aliasing_output") == int(donate)


def _funcs(txt):
    """{function name: its text} of a lowered module."""
    out, name, buf = {}, None, []
    for line in txt.splitlines():
        m = re.match(r"\s*func\.func (?:public |private )?@([\w.$-]+)\(", line)
        if m:
            if name:
                out[name] = "\n".join(buf)
            name, buf = m.group(1), []
        buf.append(line)
    if name:
        out[name] = "\n".join(buf)
    return out


def _while_body_calls(txt):
    """Custom-call lines reachable from the body (``do { ... }``) of the (single) while loop in ``main``."""
    funcs = _funcs(txt)
    main = funcs["main"]
    assert main.count("stablehlo.while") == 1, "expected one loop"
    body = main.split("} do {", 1)[1]
    found, todo, seen = [], [body], set()
    while todo:
        t = todo.pop()
        found += [line for line in t.splitlines() if "stablehlo.custom_call" in line]
        for callee in re.findall(r"call @([\w.$-]+)\(", t):
            if callee not in seen and callee in funcs:
                seen.add(callee)
                todo.append(funcs[callee])
    return found


@pytest.mark.parametrize("pool", [False, True])
def test_lowering_scan_carrying_state_aliases_inside_loop_body(_pretend_hopper, pool):
    """``lax.scan`` over tokens carrying the state (or the pool) with ``inplace_final_state=True``: the custom call
    in the loop body writes the carried state in place (its result aliases the state operand)."""
    N, steps, P = 3, 16, 5
    xs = [S((steps,) + s.shape, s.dtype) for s in _token_specs(N, 1)]
    state = S((P if pool else N, HV, K, V), jnp.float32)
    idx = np.array([4, -1, 1], np.int32)  # concrete (numpy) slots: no device-side check in the body

    def f(state, *xs):
        def body(S_, x):
            o, S2 = gdn2_jax.fused_recurrent_gdn2(*x, initial_state=S_, inplace_final_state=True,
                                                  ssm_state_indices=idx if pool else None, backend="tilelang")
            return S2, o
        return jax.lax.scan(body, state, xs)

    txt = _lower(f, [state] + xs, donate_argnums=0)
    calls = _while_body_calls(txt)
    assert len(calls) == 1, calls
    assert ALIAS_POOL in calls[0]
    assert len(_custom_calls(txt)) == 1  # no second kernel call outside the loop
    main = next(line for line in txt.splitlines() if "func.func public @main" in line)
    assert "%arg0: tensor<" + f"{state.shape[0]}x{HV}x{K}x{V}xf32> {{tf.aliasing_output = 0" in main


# ================================================================ compiled programs; GPU-only checks
def _hlo_state_copies(hlo: str, shape: tuple) -> list:
    """Instructions of a compiled HLO module that copy a buffer of ``shape`` (f32): ``copy`` / ``copy-start``
    instructions and copy fusions whose result has that shape."""
    dims = ",".join(map(str, shape))
    res = re.compile(r"=\s*f32\[" + dims + r"\]\{[^}]*\}\s+(copy(-start)?\(|fusion\(.*calls=%?[\w.]*copy)")
    return [line.strip() for line in hlo.splitlines() if res.search(line)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_steps_hold_no_state_copy(backend):
    """The compiled (a) donated pool step and (b) ``lax.scan`` of 16 steps carrying the state with
    ``inplace_final_state=True`` hold no copy of a state-sized buffer (the xla backend, on CPU, too)."""
    N, P, steps = 3, 8, 16
    x = make(15, B=N, T=steps, P=P)
    pool = jnp.asarray(x["pool"])
    idx = jnp.asarray(np.array([5, -1, 2], np.int32))

    def step(pool, idx, *a):
        return gdn2_jax.fused_recurrent_gdn2(*a, initial_state=pool, ssm_state_indices=idx, backend=backend)

    toks = tokens(x, 0)
    donated = jax.jit(step, donate_argnums=0).lower(pool, idx, *toks).compile().as_text()
    assert _hlo_state_copies(donated, (P, HV, K, V)) == []
    # the detector sees the copy XLA must make when the pool is not donated (the call stays functional)
    kept = jax.jit(step).lower(pool, idx, *toks).compile().as_text()
    assert _hlo_state_copies(kept, (P, HV, K, V)), "no copy found where one is required: detector broken?"

    xs = [jnp.asarray(np.moveaxis(x[n], 1, 0)[:, :, None]) for n in NAMES]  # [steps, N, 1, ...]
    h0 = jnp.asarray(x["pool"][:N])

    def scan(h, *xs):
        def body(S_, t):
            o, S2 = gdn2_jax.fused_recurrent_gdn2(*t, initial_state=S_, inplace_final_state=True, backend=backend)
            return S2, o
        return jax.lax.scan(body, h, xs)

    scanned = jax.jit(scan, donate_argnums=0).lower(h0, *xs).compile().as_text()
    assert _hlo_state_copies(scanned, (N, HV, K, V)) == []
    # and the loop computes the token-by-token result
    ht, o = jax.jit(scan)(h0, *xs)
    for n in range(N):
        on, st = run_tokens(x, n, 0, steps, x["pool"][n])
        check_o(np.asarray(o)[:, n, 0], on)
        assert rms(np.asarray(ht)[n], st[-1]) <= 1e-5


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["slot", "slot-varlen", "token", "token+acc"])
def test_gpu_torch_pool_path_equals_jax_bitwise(mode):
    import torch

    from kernels import torch_api

    cu = [0, 2, 2, 5] if mode == "slot-varlen" else None
    x = make(16, B=1 if cu else 3, T=5 if cu else 3, P=11)
    idx = {"slot": np.array([4, -1, 1], np.int32), "slot-varlen": np.array([7, 0, -1], np.int32)}.get(mode, TOKEN_IDX)
    acc = np.array([2, 4, 1], np.int32) if mode == "token+acc" else None
    o_j, p_j = call("tilelang", x, x["pool"], idx, acc=acc, cu=cu)

    def t(a):
        if a.dtype == BF:
            return torch.from_numpy(a.astype(np.float32)).to("cuda", torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(a)).to("cuda")

    pool_t = t(x["pool"])
    ptr = pool_t.data_ptr()
    o_t, p_t = torch_api.fused_recurrent_gdn2(
        *(t(x[n]) for n in NAMES), initial_state=pool_t, ssm_state_indices=t(idx),
        num_accepted_tokens=None if acc is None else t(acc),
        cu_seqlens=None if cu is None else t(np.array(cu, np.int32)))
    torch.cuda.synchronize()
    assert p_t.data_ptr() == ptr  # updated in place
    np.testing.assert_array_equal(o_t.float().cpu().numpy(), np.asarray(o_j).astype(np.float32))
    np.testing.assert_array_equal(p_t.cpu().numpy(), np.asarray(p_j))
    ref_o, ref_pool, written = pool_oracle(x, x["pool"], idx, acc=acc, cu=cu)
    check_o(o_j, ref_o)
    check_pool(p_j, ref_pool, written, x["pool"])


# ------------------------------------------------------------------------- wide / unsigned indices, dtypes
@pytest.mark.parametrize("backend", BACKENDS)
def test_wide_and_unsigned_indices_never_wrap(backend):
    """Slot indices are compared in their own dtype before any int32 cast: a numpy int64 -2**32 + 2 is padding
    (not slot 2), an unsigned 2**32 - 1 traced under jit is out of range (NaN, not padding), and a concrete
    2**32 + 1 is a ValueError (not slot 1)."""
    x = make(7, B=2, T=1, P=4)
    j = [jnp.asarray(x[n]) for n in NAMES]

    def op(idx):  # numpy indices passed as they are (jnp.asarray would itself wrap int64 without x64)
        return gdn2_jax.fused_recurrent_gdn2(*j, initial_state=jnp.asarray(x["pool"]), ssm_state_indices=idx,
                                             backend=backend)

    o, new = op(np.array([-2**32 + 2, -1], np.int64))
    np.testing.assert_array_equal(np.asarray(new), x["pool"])  # both sequences are padding: nothing written
    ref_o, _, written = pool_oracle(x, x["pool"], np.array([-1, -1]))
    assert written == set()
    check_o(o, ref_o)
    with pytest.raises(ValueError, match="ssm_state_indices"):
        op(np.array([2**32 + 1, 1], np.int64))
    f = jax.jit(lambda idx: gdn2_jax.fused_recurrent_gdn2(*j, initial_state=jnp.asarray(x["pool"]),
                                                          ssm_state_indices=idx, backend=backend))
    o, new = f(jnp.asarray([2**32 - 1, 3], jnp.uint32))
    assert np.isnan(np.asarray(o, np.float32)).all() and np.isnan(np.asarray(new)[3]).all()
    assert np.isfinite(np.asarray(new)[:3]).all()  # no slot but the written one is touched


@pytest.mark.parametrize("backend", BACKENDS)
def test_pool_checks_inplace_flag_type(backend):
    x = make(8, B=2, T=1, P=4)
    with pytest.raises(TypeError, match="inplace_final_state"):
        call(backend, x, x["pool"], np.array([1, 2]), inplace_final_state="yes")


def test_inplace_state_keeps_its_dtype_under_x64(x64):
    """float64 inputs under x64 compute in float64, but an in-place float32 state stays float32, so a scan can
    carry it (same type in and out)."""
    rng = np.random.default_rng(3)
    B, H, K = 2, 1, 4
    xs = [jnp.asarray(rng.standard_normal((B, 3, H, K))) for _ in range(3)]
    g = -jnp.abs(jnp.asarray(rng.standard_normal((B, 3, H, K))))
    bw = [jnp.asarray(rng.uniform(0, 1, (B, 3, H, K))) for _ in range(2)]
    S0 = jnp.asarray(rng.standard_normal((B, H, K, K)), jnp.float32)

    def body(S, t):
        o, S = gdn2_jax.fused_recurrent_gdn2(*(a[:, t][:, None] for a in xs + [g] + bw), initial_state=S,
                                             inplace_final_state=True, backend="xla")
        return S, o

    S, o = jax.lax.scan(body, S0, jnp.arange(3))
    assert S.dtype == jnp.float32 and o.dtype == jnp.float64
    _, S_ref = gdn2_jax.naive_recurrent_gdn2(*(xs + [g] + bw), initial_state=S0.astype(jnp.float64),
                                             output_final_state=True)
    assert float(jnp.max(jnp.abs(S - S_ref))) < 1e-5

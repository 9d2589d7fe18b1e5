"""CPU tests of the Flax NNX GDN-2 layer (flax_layers.GatedDeltaNet2) and its FLA weight conversion.

The oracle (`_reference_layer`) recomputes the layer independently in plain jnp from an FLA-format
state_dict (FLA key names and torch layouts), with an explicit per-token convolution loop and the token-loop
op `naive_recurrent_gdn2`. It shares no code with flax_layers.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flax_layers import (GatedDeltaNet2, GatedRMSNorm, GDN2Cache, ShortConvolution, cache_from_fla, cache_to_fla,
                         from_fla_state_dict, load_fla_state_dict, to_fla_state_dict)
from gdn2_jax import backends, naive_recurrent_gdn2

D_MODEL, HEAD_DIM, H = 24, 8, 2


def ratio(ref, x):
    ref = np.asarray(ref, np.float64)
    x = np.asarray(x, np.float64)
    return float(np.sqrt(np.mean((ref - x) ** 2)) / np.sqrt(np.mean(ref ** 2)))


def make_layer(seed=0, *, num_v_heads=H, gate_activation="silu", allow_neg_eigval=False, randomize=True, **kw):
    layer = GatedDeltaNet2(D_MODEL, head_dim=HEAD_DIM, num_heads=H, num_v_heads=num_v_heads,
                           gate_activation=gate_activation, allow_neg_eigval=allow_neg_eigval,
                           rngs=nnx.Rngs(seed), **kw)
    if randomize:
        # The NVlabs init (gain 2**-2.5) makes every projection tiny; larger random weights exercise all
        # terms (gates far from 0.5, norm scale != 1, non-zero gate bias) at O(1) magnitudes.
        rng = np.random.default_rng(seed + 100)
        sd = to_fla_state_dict(layer)
        for key, val in sd.items():
            if key.endswith("_proj.weight") or key.endswith(".0.weight") or key.endswith(".1.weight"):
                sd[key] = rng.standard_normal(val.shape) / math.sqrt(val.shape[1])
            elif key in ("g_proj.1.bias", "o_norm.weight"):
                sd[key] = rng.uniform(0.5, 1.5, val.shape) * (1 if key == "o_norm.weight" else 0.3)
        load_fla_state_dict(layer, sd)
    return layer


def rand_x(seed, B, T, d=D_MODEL):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((B, T, d)), jnp.float32)


def _reference_layer(sd, x, *, num_heads, head_dim, gate_activation, allow_neg_eigval, cache=None, eps=1e-5):
    """Plain-jnp GDN-2 layer from FLA-layout weights. x [B,T,d]. cache: FLA dict or None. -> (y, cache dict)."""
    B, T, _ = x.shape
    K = head_dim
    V = sd["f_proj.0.weight"].shape[0]
    HV = sd["v_proj.weight"].shape[0] // V

    def lin(name, z):
        return z @ sd[name].T

    new_conv = []
    branches = []
    for i, n in enumerate("qkv"):
        z = lin(f"{n}_proj.weight", x)
        wt = sd[f"{n}_conv1d.weight"][:, 0, :]  # [D, W]
        W = wt.shape[1]
        hist = (jnp.zeros((B, z.shape[-1], W)) if cache is None else cache["conv_state"][i])  # [B, D, W]
        seq = jnp.concatenate([jnp.swapaxes(hist, 1, 2), z], axis=1)  # [B, W+T, D], token t at W+t
        out = []
        for t in range(T):
            window = seq[:, W + t - (W - 1):W + t + 1]  # inputs t-W+1 .. t
            out.append(jnp.einsum("bwd,dw->bd", window, wt))
        branches.append(jax.nn.silu(jnp.stack(out, axis=1)))
        new_conv.append(jnp.swapaxes(seq[:, -W:], 1, 2))
    q, k, v = branches
    f = lin("f_proj.1.weight", lin("f_proj.0.weight", x)) + sd["dt_bias"]
    g = -jnp.exp(sd["A_log"])[:, None] * jax.nn.softplus(f.reshape(B, T, num_heads, K))
    b = jax.nn.sigmoid(lin("b_proj.weight", x)).reshape(B, T, num_heads, K) * (2.0 if allow_neg_eigval else 1.0)
    w = jax.nn.sigmoid(lin("w_proj.weight", x)).reshape(B, T, HV, V)
    rep = HV // num_heads
    g = jnp.repeat(g, rep, axis=2)
    b = jnp.repeat(b, rep, axis=2)
    o, state = naive_recurrent_gdn2(q.reshape(B, T, num_heads, K), k.reshape(B, T, num_heads, K),
                                    v.reshape(B, T, HV, V), g, b, w,
                                    initial_state=None if cache is None else cache["recurrent_state"],
                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    gate = (lin("g_proj.1.weight", lin("g_proj.0.weight", x)) + sd["g_proj.1.bias"]).reshape(B, T, HV, V)
    normed = o / jnp.sqrt(jnp.mean(o * o, axis=-1, keepdims=True) + eps) * sd["o_norm.weight"]
    act = jax.nn.sigmoid(gate) if gate_activation == "sigmoid" else gate * jax.nn.sigmoid(gate)
    y = lin("o_proj.weight", (normed * act).reshape(B, T, HV * V))
    return y, {"recurrent_state": state, "conv_state": tuple(new_conv)}


def reference(layer, x, cache=None):
    sd = {k: jnp.asarray(v) for k, v in to_fla_state_dict(layer).items()}
    fcache = None if cache is None else {k: (tuple(map(jnp.asarray, v)) if isinstance(v, tuple) else jnp.asarray(v))
                                         for k, v in cache_to_fla(cache).items()}
    return _reference_layer(sd, x, num_heads=layer.num_heads, head_dim=layer.head_dim,
                            gate_activation=layer.gate_activation, allow_neg_eigval=layer.allow_neg_eigval,
                            cache=fcache)


def assert_cache_close(ref, got, tol):
    ref = cache_to_fla(ref) if isinstance(ref, GDN2Cache) else ref
    got = cache_to_fla(got)
    assert ratio(ref["recurrent_state"], got["recurrent_state"]) <= tol
    for a, b in zip(ref["conv_state"], got["conv_state"]):
        assert ratio(a, b) <= tol


# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_v_heads,gate_activation,allow_neg_eigval,deterministic", [
    pytest.param(H, "silu", False, True, id="H2-HV2-silu-recurrent"),
    pytest.param(2 * H, "sigmoid", True, False, id="H2-HV4-GVA-sigmoid-negeig-chunk"),
])
def test_layer_matches_independent_reference(num_v_heads, gate_activation, allow_neg_eigval, deterministic):
    layer = make_layer(1, num_v_heads=num_v_heads, gate_activation=gate_activation, allow_neg_eigval=allow_neg_eigval)
    x = rand_x(2, 2, 11)
    warm = make_layer(1, num_v_heads=num_v_heads)  # any cache with non-trivial content
    _, cache = warm(rand_x(3, 2, 6), deterministic=True)
    y, new = layer(x, cache=cache, deterministic=deterministic)
    y_ref, cache_ref = reference(layer, x, cache)
    assert float(jnp.sqrt(jnp.mean(y_ref ** 2))) > 1e-2  # the comparison is not between near-zeros
    assert ratio(y_ref, y) <= 1e-5
    assert_cache_close(cache_ref, new, 1e-5)


def test_gradients_match_reference():
    layer = make_layer(4, num_v_heads=2 * H, gate_activation="sigmoid")
    layer.train()
    x = rand_x(5, 2, 9)
    r = rand_x(6, 2, 9)

    def loss_layer(m):
        y, _ = m(x)
        return jnp.sum(y * r)

    sd = {k: jnp.asarray(v) for k, v in to_fla_state_dict(layer).items()}
    grads = nnx.grad(loss_layer)(layer)
    gl = nnx.clone(layer)  # a copy holding the gradients, to read them in FLA layout
    nnx.update(gl, grads)
    g_layer = to_fla_state_dict(gl)

    def loss_ref(sd):
        y, _ = _reference_layer(sd, x, num_heads=H, head_dim=HEAD_DIM, gate_activation="sigmoid",
                                allow_neg_eigval=False)
        return jnp.sum(y * r)

    g_ref = jax.grad(loss_ref)(sd)
    assert set(g_ref) == set(g_layer)
    for key in g_ref:
        assert np.all(np.isfinite(g_layer[key])), key
        assert ratio(g_ref[key], g_layer[key]) <= 1e-4, key


@pytest.mark.parametrize("T,n", [(13, 4), (5, 3)], ids=["prefill9+decode4", "prefill2+decode3-shorter-than-conv"])
def test_prefill_then_decode_equals_one_prefill(T, n):
    layer = make_layer(7, num_v_heads=2 * H)
    layer.eval()
    x = rand_x(8, 2, T)
    y_full, c_full = layer(x)
    y, cache = layer(x[:, :T - n])
    ys = [y]
    for t in range(T - n, T):
        yt, cache = layer(x[:, t:t + 1], cache=cache)
        ys.append(yt)
    y_steps = jnp.concatenate(ys, axis=1)
    assert ratio(y_full, y_steps) <= 1e-5
    assert_cache_close(c_full, cache, 1e-5)
    y_ref, c_ref = reference(layer, x)
    assert ratio(y_ref, y_full) <= 1e-5
    assert_cache_close(c_ref, c_full, 1e-5)


@pytest.mark.parametrize("deterministic", [True, False], ids=["eval", "train-chunk"])
def test_chunked_prefill_continues_from_cache(deterministic):
    layer = make_layer(9)
    x = rand_x(10, 2, 15)
    y_full, c_full = layer(x, deterministic=deterministic)
    y1, c1 = layer(x[:, :6], deterministic=deterministic)
    y2, c2 = layer(x[:, 6:], cache=c1, deterministic=deterministic)
    assert ratio(y_full, jnp.concatenate([y1, y2], axis=1)) <= 1e-5
    assert_cache_close(c_full, c2, 1e-5)


@pytest.mark.parametrize("deterministic", [True, False], ids=["eval", "train-chunk"])
def test_padded_batch_equals_unpadded_runs(deterministic):
    layer = make_layer(11, num_v_heads=2 * H)
    T = 9
    lengths_and_offsets = [(9, 0), (5, 4), (6, 0), (2, 7), (0, 0)]  # full, left-pad, right-pad, short, empty
    B = len(lengths_and_offsets)
    seqs = [rand_x(20 + i, 1, L) for i, (L, _) in enumerate(lengths_and_offsets)]
    _, cache = make_layer(12, num_v_heads=2 * H)(rand_x(13, B, 5), deterministic=True)  # filled cache
    x = np.asarray(rand_x(14, B, T)) * 3.0  # garbage at padded positions
    mask = np.zeros((B, T), bool)
    for i, (L, off) in enumerate(lengths_and_offsets):
        x[i, off:off + L] = np.asarray(seqs[i][0])
        mask[i, off:off + L] = True
    y, new = layer(jnp.asarray(x), cache=cache, attention_mask=jnp.asarray(mask), deterministic=deterministic)
    assert np.all(np.asarray(y)[~mask] == 0)
    for i, (L, off) in enumerate(lengths_and_offsets):
        one = jax.tree.map(lambda a: a[i:i + 1], cache)
        if L == 0:
            ref_cache = one
        else:
            y_i, ref_cache = reference(layer, seqs[i], one)
            assert ratio(y_i[0], y[i, off:off + L]) <= 1e-5, i
        assert_cache_close(ref_cache, jax.tree.map(lambda a: a[i:i + 1], new), 1e-5)


def test_packed_sequences_equal_per_sequence_runs():
    layer = make_layer(15, num_v_heads=2 * H)
    cu = [0, 5, 5, 6, 8, 16]  # includes an empty sequence and sequences shorter than the conv window
    N = len(cu) - 1
    x = rand_x(16, 1, cu[-1])
    _, cache = make_layer(17, num_v_heads=2 * H)(rand_x(18, N, 4), deterministic=True)
    for det in (True, False):
        y, new = layer(x, cache=cache, cu_seqlens=jnp.asarray(cu, jnp.int32), deterministic=det)
        for n in range(N):
            one = jax.tree.map(lambda a: a[n:n + 1], cache)
            if cu[n + 1] == cu[n]:
                ref_cache = one
            else:
                y_n, ref_cache = reference(layer, x[:, cu[n]:cu[n + 1]], one)
                assert ratio(y_n, y[:, cu[n]:cu[n + 1]]) <= 1e-5, (det, n)
            assert_cache_close(ref_cache, jax.tree.map(lambda a: a[n:n + 1], new), 1e-5)
    # without a cache every sequence starts from zeros (state and conv window)
    y0, _ = layer(x, cu_seqlens=jnp.asarray(cu, jnp.int32), deterministic=True)
    y_ref, _ = reference(layer, x[:, cu[3]:cu[4]])
    assert ratio(y_ref, y0[:, cu[3]:cu[4]]) <= 1e-5
    # numpy offsets under nnx.jit are constants (no tracer error), same result
    y_np, _ = nnx.jit(lambda m, x: m(x, cu_seqlens=np.asarray(cu), deterministic=True))(layer, x)
    assert ratio(y0, y_np) <= 1e-6


def test_jit_nnx_jit_and_donated_decode():
    layer = make_layer(19)
    layer.eval()
    x = rand_x(21, 2, 8)
    y_eager, c_eager = layer(x[:, :5])

    @nnx.jit
    def prefill(m, x):
        return m(x)

    @nnx.jit(donate_argnames="cache")
    def step(m, x, cache):
        return m(x, cache=cache)

    y, cache = prefill(layer, x[:, :5])
    assert ratio(y_eager, y) <= 1e-6
    ys = []
    for t in range(5, 8):
        yt, cache = step(layer, x[:, t:t + 1], cache)
        ys.append(yt)
    y_ref, c_ref = reference(layer, x)
    assert ratio(y_ref[:, 5:], jnp.concatenate(ys, axis=1)) <= 1e-5
    assert_cache_close(c_ref, cache, 1e-5)

    graphdef, params = nnx.split(layer)

    @jax.jit
    def pure(params, x):
        return nnx.merge(graphdef, params)(x)

    y_jax, _ = pure(params, x[:, :5])
    assert ratio(y_eager, y_jax) <= 1e-6


def test_float64_layer_state_dtype_same_from_prefill_and_decode(x64):
    """A float64 layer under x64: the recurrent state comes back float32 whether the call starts without a cache
    (prefill) or from ``init_cache`` (decode), as documented, and prefill-then-decode equals one prefill."""
    layer = GatedDeltaNet2(D_MODEL, head_dim=HEAD_DIM, num_heads=H, dtype=jnp.float64, param_dtype=jnp.float64,
                           rngs=nnx.Rngs(3))
    layer.eval()
    x = jnp.asarray(rand_x(31, 2, 6), jnp.float64)
    y, c = layer(x)
    assert y.dtype == jnp.float64 and c.recurrent_state.dtype == jnp.float32
    y1, c1 = layer(x[:, :4], cache=layer.init_cache(2))
    y2, c2 = layer(x[:, 4:], cache=c1)
    assert c1.recurrent_state.dtype == c2.recurrent_state.dtype == jnp.float32
    assert ratio(y, jnp.concatenate([y1, y2], axis=1)) <= 1e-6
    assert ratio(c.recurrent_state, c2.recurrent_state) <= 1e-6


def test_param_dtypes_and_bf16_compute():
    layer = GatedDeltaNet2(D_MODEL, head_dim=HEAD_DIM, num_heads=H, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                           rngs=nnx.Rngs(0))
    dtypes = {jnp.dtype(p.dtype) for p in jax.tree.leaves(nnx.state(layer, nnx.Param))}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}
    cache = layer.init_cache(2)
    assert cache.recurrent_state.dtype == jnp.float32 and cache.conv_state[0].dtype == jnp.bfloat16
    # bf16 compute agrees with the float32 layer holding the same (bf16-representable) weights
    ref_layer = make_layer(0, randomize=False)
    load_fla_state_dict(ref_layer, to_fla_state_dict(layer, dtype=np.float32))
    sd = to_fla_state_dict(make_layer(22), dtype=np.float32)
    sd = {k: np.asarray(jnp.asarray(v, jnp.bfloat16).astype(jnp.float32)) for k, v in sd.items()}
    load_fla_state_dict(layer, sd)
    load_fla_state_dict(ref_layer, sd)
    x = rand_x(23, 2, 10)
    y16, c16 = layer(x.astype(jnp.bfloat16), cache=cache, deterministic=True)
    y32, c32 = ref_layer(x, deterministic=True)
    assert y16.dtype == jnp.bfloat16 and c16.recurrent_state.dtype == jnp.float32
    assert c16.conv_state[2].dtype == jnp.bfloat16
    assert ratio(y32, y16) <= 2e-2
    assert ratio(c32.recurrent_state, c16.recurrent_state) <= 2e-2


def test_initialisation_follows_reference():
    layer = GatedDeltaNet2(64, head_dim=16, num_heads=4, rngs=nnx.Rngs(3))
    a = np.exp(np.asarray(layer.A_log[...]))
    assert a.min() >= 1.0 and a.max() <= 16.0 and a.std() > 1.0
    dt = np.asarray(jax.nn.softplus(layer.dt_bias[...]))
    assert dt.min() >= 1e-3 * (1 - 1e-4) and dt.max() <= 1e-1 * (1 + 1e-4)
    assert np.log(dt).std() > 0.5  # log-uniform over two decades, not a constant
    kq = np.asarray(layer.q_proj.kernel[...])  # Xavier-uniform, gain 2**-2.5: U(-l, l)
    limit = 2 ** -2.5 * math.sqrt(6 / (64 + 64))
    assert np.abs(kq).max() <= limit and np.abs(kq).max() > 0.9 * limit
    assert abs(kq.std() - limit / math.sqrt(3)) < 0.1 * limit
    kc = np.asarray(layer.q_conv1d.kernel[...])  # PyTorch Conv1d default: U(-1/sqrt(W), 1/sqrt(W))
    assert np.abs(kc).max() <= 0.5 and np.abs(kc).max() > 0.45
    assert np.all(np.asarray(layer.g_proj.layers[1].bias[...]) == 0)
    assert np.all(np.asarray(layer.o_norm.scale[...]) == 1)


def test_fla_state_dict_keys_shapes_and_roundtrip():
    layer = make_layer(24, num_v_heads=2 * H, expand_v=2.0)
    sd = to_fla_state_dict(layer)
    d, Dk, V = D_MODEL, H * HEAD_DIM, 2 * HEAD_DIM
    Dv = 2 * H * V
    expect = {
        "A_log": (H,), "dt_bias": (Dk,), "q_proj.weight": (Dk, d), "k_proj.weight": (Dk, d),
        "v_proj.weight": (Dv, d), "q_conv1d.weight": (Dk, 1, 4), "k_conv1d.weight": (Dk, 1, 4),
        "v_conv1d.weight": (Dv, 1, 4), "f_proj.0.weight": (V, d), "f_proj.1.weight": (Dk, V),
        "b_proj.weight": (Dk, d), "w_proj.weight": (Dv, d), "g_proj.0.weight": (V, d), "g_proj.1.weight": (Dv, V),
        "g_proj.1.bias": (Dv,), "o_norm.weight": (V,), "o_proj.weight": (d, Dv),
    }
    assert {k: v.shape for k, v in sd.items()} == expect
    # torch layouts: Linear weight [out, in] and y = x @ W.T; conv weight [D, 1, W] with the newest tap last
    x = rand_x(25, 1, 1)
    np.testing.assert_allclose(np.asarray(layer.q_proj(x))[0, 0], np.asarray(x)[0, 0] @ sd["q_proj.weight"].T,
                               rtol=1e-5, atol=1e-6)
    y, _ = layer.q_conv1d(jnp.ones((1, 1, Dk), jnp.float32))
    np.testing.assert_allclose(np.asarray(y)[0, 0], np.asarray(jax.nn.silu(sd["q_conv1d.weight"][:, 0, -1])),
                               rtol=1e-5)
    back = from_fla_state_dict(sd, rngs=nnx.Rngs(99))
    assert back.gate_activation == "sigmoid" and back.num_v_heads == 2 * H and back.head_v_dim == V
    for a, b in zip(jax.tree.leaves(nnx.state(layer, nnx.Param)), jax.tree.leaves(nnx.state(back, nnx.Param))):
        assert a.shape == b.shape and np.array_equal(np.asarray(a), np.asarray(b))
    assert all(np.array_equal(sd[k], v) for k, v in to_fla_state_dict(back).items())
    c = layer.init_cache(3)
    c = jax.tree.map(lambda z: z + jnp.asarray(np.random.default_rng(0).standard_normal(z.shape), z.dtype), c)
    c2 = cache_from_fla(cache_to_fla(c))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(c), jax.tree.leaves(c2)))


def test_bad_inputs_raise_clear_errors():
    layer = make_layer(26, randomize=False)
    x = rand_x(27, 2, 5)
    with pytest.raises(ValueError, match="attention_mask"):
        layer(x, attention_mask=jnp.ones((2, 4), bool))
    with pytest.raises(ValueError, match="not both"):
        layer(x[:1], attention_mask=jnp.ones((1, 5), bool), cu_seqlens=jnp.array([0, 5]))
    with pytest.raises(ValueError, match="cache"):
        layer(x, cache=layer.init_cache(3))
    with pytest.raises(ValueError, match="x"):
        layer(x[..., :-1])
    sd = to_fla_state_dict(layer)
    sd.pop("A_log")
    with pytest.raises(ValueError, match="A_log"):
        load_fla_state_dict(layer, sd)
    sd = to_fla_state_dict(layer)
    sd["o_proj.weight"] = sd["o_proj.weight"].T
    with pytest.raises(ValueError, match="o_proj.weight"):
        load_fla_state_dict(layer, sd)
    with pytest.raises(ValueError, match="num_v_heads"):
        GatedDeltaNet2(16, head_dim=8, num_heads=2, num_v_heads=3, rngs=nnx.Rngs(0))


def test_sharding_metadata_on_parameters():
    mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        layer = GatedDeltaNet2(D_MODEL, head_dim=HEAD_DIM, num_heads=H, sharding=("data", "model"),
                               rngs=nnx.Rngs(0))
        meta = {k: v.get_metadata().get("out_sharding") for k, v in nnx.to_flat_state(nnx.state(layer, nnx.Param))}
        y, _ = nnx.jit(lambda m, x: m(x))(layer, rand_x(28, 1, 3))
    assert meta[("q_proj", "kernel")] == ("data", "model")
    assert meta[("o_proj", "kernel")] == ("model", "data")
    assert meta[("f_proj", "layers", 0, "kernel")] == ("data", None)
    assert meta[("g_proj", "layers", 1, "bias")] == ("model",)
    assert meta[("v_conv1d", "kernel")] == (None, "model")
    assert meta[("A_log",)] == ("model",)
    assert np.all(np.isfinite(np.asarray(y)))


# ----------------------------------------------------------------------------------------------------------
# Argument validation: every bad input raises a TypeError/ValueError naming the argument, before any computation.
def _small(**kw):
    return GatedDeltaNet2(D_MODEL, head_dim=HEAD_DIM, num_heads=H, rngs=nnx.Rngs(0), **kw)


def _swap_cache(layer, **fields):
    return layer.init_cache(2)._replace(**fields)


_X = rand_x(30, 2, 5)
_BAD_CALLS = [  # (id, call(layer), exception, argument named in the message)
    ("deterministic-str-call", lambda m: m(_X, deterministic="no"), TypeError, "deterministic"),
    ("deterministic-int-call", lambda m: m(_X, deterministic=1), TypeError, "deterministic"),
    ("deterministic-str-ctor", lambda m: _small(deterministic="False"), TypeError, "deterministic"),
    ("norm_eps-zero", lambda m: _small(norm_eps=0.0), ValueError, "norm_eps"),
    ("norm_eps-nan", lambda m: _small(norm_eps=float("nan")), ValueError, "norm_eps"),
    ("norm_eps-f32-underflow", lambda m: _small(norm_eps=1e-40), ValueError, "norm_eps"),  # (NaN on zero rows before)
    ("norm_eps-f32-overflow", lambda m: _small(norm_eps=1e300), ValueError, "norm_eps"),  # (o all zeros before)
    ("expand_v-timedelta", lambda m: _small(expand_v=np.timedelta64(2)), TypeError, "expand_v"),
    ("mask-float-half", lambda m: m(_X, attention_mask=jnp.full((2, 5), 0.5)), TypeError, "attention_mask"),
    ("mask-complex", lambda m: m(_X, attention_mask=jnp.ones((2, 5), jnp.complex64)), TypeError, "attention_mask"),
    ("mask-int-minus1", lambda m: m(_X, attention_mask=np.full((2, 5), -1)), ValueError, "attention_mask"),
    ("mask-int-2", lambda m: m(_X, attention_mask=jnp.full((2, 5), 2)), ValueError, "attention_mask"),
    ("mask-list", lambda m: m(_X, attention_mask=[[1] * 5] * 2), TypeError, "attention_mask"),
    ("cu_seqlens-list", lambda m: m(_X[:1], cu_seqlens=[0, 2, 5]), TypeError, "cu_seqlens"),
    ("cu_seqlens-2d", lambda m: m(_X[:1], cu_seqlens=jnp.array([[0, 5]])), ValueError, "cu_seqlens"),
    ("cu_seqlens-end", lambda m: m(_X[:1], cu_seqlens=jnp.array([0, 4])), ValueError, "cu_seqlens"),
    ("x-list", lambda m: m(np.asarray(_X).tolist()), TypeError, "x"),
    ("x-int", lambda m: m(jnp.ones((2, 5, D_MODEL), jnp.int32)), TypeError, "x"),
    ("cache-tuple", lambda m: m(_X, cache=tuple(m.init_cache(2))), TypeError, "cache"),
    ("cache-dict", lambda m: m(_X, cache=m.init_cache(2)._asdict()), TypeError, "cache"),
    ("cache-conv-width", lambda m: m(_X, cache=_swap_cache(m, conv_state=tuple(
        c[..., 1:] for c in m.init_cache(2).conv_state))), ValueError, "cache.conv_state[0]"),
    ("cache-conv-channels", lambda m: m(_X, cache=_swap_cache(m, conv_state=(
        jnp.zeros((2, 3, 4)),) * 3)), ValueError, "cache.conv_state[0]"),
    ("cache-other-head_dim", lambda m: m(_X, cache=GatedDeltaNet2(D_MODEL, head_dim=4, num_heads=H,
                                                                 rngs=nnx.Rngs(0)).init_cache(2)),
     ValueError, "cache.recurrent_state"),
    ("cache-bf16-state", lambda m: m(_X, cache=_swap_cache(m, recurrent_state=jnp.zeros(
        (2, H, HEAD_DIM, HEAD_DIM), jnp.bfloat16))), TypeError, "cache.recurrent_state"),
    ("cache-conv-None", lambda m: m(_X, cache=_swap_cache(m, conv_state=None)), ValueError, "cache.conv_state"),
    ("x-nan", lambda m: m(_X.at[1, 3, 4].set(jnp.nan)), ValueError, "x"),
    ("x-inf-numpy", lambda m: m(np.asarray(_X.at[0, 0, 0].set(-jnp.inf))), ValueError, "x"),
    ("mode-array", lambda m: _small(mode=np.array(["chunk"])), TypeError, "mode"),
    ("gate_activation-array", lambda m: _small(gate_activation=np.array(["silu"])), TypeError, "gate_activation"),
    ("gate_activation-array2", lambda m: _small(gate_activation=np.array(["silu", "x"])), TypeError,
     "gate_activation"),
    ("gate_activation-int", lambda m: _small(gate_activation=1), TypeError, "gate_activation"),
    ("train_mode-bad", lambda m: _small(train_mode="recurrent"), ValueError, "train_mode"),
    ("hidden_size-str", lambda m: GatedDeltaNet2("a", rngs=nnx.Rngs(0)), TypeError, "hidden_size"),
    ("hidden_size-huge", lambda m: GatedDeltaNet2(10**30, rngs=nnx.Rngs(0)), ValueError, "hidden_size"),  # (MLIR)
    ("conv_size-2**63", lambda m: _small(conv_size=2**63), ValueError, "conv_size"),
    # sizes within int64 whose products overflowed inside XLA (a process abort) or MLIR, or broke the random init
    ("hidden_size-2**59", lambda m: GatedDeltaNet2(2**59, head_dim=8, num_heads=2, rngs=nnx.Rngs(0)), ValueError,
     "hidden_size"),
    ("hidden_size-int64-max", lambda m: GatedDeltaNet2(2**63 - 1, head_dim=8, num_heads=2, rngs=nnx.Rngs(0)),
     ValueError, "hidden_size"),
    ("num_heads-2**61", lambda m: GatedDeltaNet2(16, head_dim=8, num_heads=2**61, rngs=nnx.Rngs(0)), ValueError,
     "num_heads"),
    ("conv_size-2**59", lambda m: _small(conv_size=2**59), ValueError, "conv_size"),
    ("batch_size-2**62", lambda m: m.init_cache(2**62), ValueError, "batch_size"),
    ("hidden_size-float", lambda m: GatedDeltaNet2(32.0, rngs=nnx.Rngs(0)), TypeError, "hidden_size"),
    ("conv_size-float", lambda m: _small(conv_size=2.5), TypeError, "conv_size"),
    ("num_heads-bool", lambda m: GatedDeltaNet2(D_MODEL, num_heads=True, rngs=nnx.Rngs(0)), TypeError, "num_heads"),
    ("head_dim-zero", lambda m: GatedDeltaNet2(D_MODEL, head_dim=0, rngs=nnx.Rngs(0)), ValueError, "head_dim"),
    ("expand_v-str", lambda m: _small(expand_v="2"), TypeError, "expand_v"),
    ("sharding-1-tuple", lambda m: _small(sharding=("embed",)), TypeError, "sharding"),
    ("kernel_init-str", lambda m: _small(kernel_init="xavier"), TypeError, "kernel_init"),
    ("rngs-None", lambda m: GatedDeltaNet2(D_MODEL, head_dim=HEAD_DIM, num_heads=H, rngs=None), TypeError, "rngs"),
    ("dtype-int32", lambda m: _small(dtype=jnp.int32), TypeError, "dtype"),
    ("param_dtype-int8", lambda m: _small(param_dtype=jnp.int8), TypeError, "param_dtype"),
    ("use_short_conv-str", lambda m: _small(use_short_conv="no"), TypeError, "use_short_conv"),
    ("allow_neg_eigval-int", lambda m: _small(allow_neg_eigval=2), TypeError, "allow_neg_eigval"),
    ("batch_size-negative", lambda m: m.init_cache(-1), ValueError, "batch_size"),
    ("batch_size-float", lambda m: m.init_cache(2.5), TypeError, "batch_size"),
    ("batch_size-str", lambda m: m.init_cache("a"), TypeError, "batch_size"),
]


@pytest.fixture(scope="module")
def small_layer():
    return make_layer(31, randomize=False)


@pytest.mark.parametrize("call,exc,name", [c[1:] for c in _BAD_CALLS], ids=[c[0] for c in _BAD_CALLS])
def test_bad_arguments_name_the_argument(small_layer, call, exc, name):
    with pytest.raises(exc, match=re.escape(f"`{name}`")):
        call(small_layer)


def test_sizes_may_be_numpy_ints():
    """As the docstring says: NumPy integer sizes build the same layer as Python ints (and are stored as Python
    ints); a float or bool size is refused with a message that says what is taken."""
    ref = GatedDeltaNet2(D_MODEL, head_dim=HEAD_DIM, num_heads=H, num_v_heads=2 * H, conv_size=3, rngs=nnx.Rngs(0))
    layer = GatedDeltaNet2(np.int64(D_MODEL), head_dim=np.int32(HEAD_DIM), num_heads=np.int16(H),
                           num_v_heads=np.uint8(2 * H), conv_size=np.int64(3), rngs=nnx.Rngs(0))
    sizes = ("hidden_size", "head_dim", "num_heads", "num_v_heads", "conv_size")
    assert [type(getattr(layer, n)) for n in sizes] == [int] * 5
    assert [getattr(layer, n) for n in sizes] == [getattr(ref, n) for n in sizes]
    x = rand_x(34, 2, 5)
    y_ref, c_ref = ref(x, cache=ref.init_cache(2), deterministic=True)
    y, c = layer(x, cache=layer.init_cache(np.int32(2)), deterministic=True)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))
    assert_cache_close(c_ref, c, 0.0)
    for bad in (np.float32(8.0), np.bool_(True)):
        with pytest.raises(TypeError, match=re.escape("`head_dim` must be a positive int (a Python or NumPy integer, "
                                                      "not a bool)")):
            GatedDeltaNet2(D_MODEL, head_dim=bad, num_heads=H, rngs=nnx.Rngs(0))


def test_valid_argument_variants_agree():
    """Integer masks, numpy inputs, np.bool_ flags and traced masks under nnx.jit give the bool-mask result."""
    layer = make_layer(32)
    x = rand_x(33, 2, 7)
    mask = np.ones((2, 7), bool)
    mask[0, :3] = False
    mask[1, 5:] = False
    y_ref, c_ref = layer(x, attention_mask=jnp.asarray(mask), deterministic=True)
    assert float(jnp.sqrt(jnp.mean(y_ref ** 2))) > 1e-2
    y_int, c_int = layer(np.asarray(x), attention_mask=mask.astype(np.int32), deterministic=np.bool_(True))
    assert ratio(y_ref, y_int) <= 1e-6
    assert_cache_close(c_ref, c_int, 1e-6)
    y_jit, c_jit = nnx.jit(lambda m, x, am: m(x, attention_mask=am, deterministic=True))(
        layer, x, jnp.asarray(mask, jnp.int8))
    assert ratio(y_ref, y_jit) <= 1e-5
    assert_cache_close(c_ref, c_jit, 1e-5)


@pytest.mark.skipif(backends.tilelang_available("chunk_gdn2"), reason="the TileLang kernels can run here")
@pytest.mark.parametrize("deterministic,arg", [(True, "backend"), (False, "train_backend")])
@pytest.mark.parametrize("T", [5, 70])  # fused_recurrent (T <= 64 in inference) and chunk
def test_unavailable_tilelang_backend_raises_before_computing(deterministic, arg, T):
    layer = _small(**{arg: "tilelang"})

    class Boom(nnx.Module):
        def __call__(self, x):
            raise AssertionError("the projections ran before the backend check")

    layer.q_proj = layer.f_proj = Boom()
    with pytest.raises(NotImplementedError, match=re.escape(f"`{arg}`='tilelang'")):
        layer(rand_x(34, 1, T), deterministic=deterministic)


@pytest.mark.parametrize("arg", ["backend", "train_backend"])
@pytest.mark.parametrize("bad,exc", [("cuda", ValueError), (None, TypeError), (1, TypeError)])
def test_bad_backend_names_the_argument(arg, bad, exc):
    """An unknown name is a ValueError, a non-str a TypeError (as the ops' `backend`)."""
    with pytest.raises(exc, match=re.escape(f"`{arg}`")):
        _small(**{arg: bad})


@pytest.mark.parametrize("activation,exc", [(np.array(["silu"]), TypeError), (np.array(["silu", "x"]), TypeError),
                                            (1, TypeError), ("relu", ValueError)])
def test_submodule_activation_must_be_an_option_string(activation, exc):
    """An array holding 'silu' compared equal through `in` and was stored as the activation; now a TypeError
    (a non-str) or ValueError (an unknown str), as for the ops' `backend`."""
    with pytest.raises(exc, match="GatedRMSNorm: `activation`"):
        GatedRMSNorm(8, activation=activation)
    with pytest.raises(exc, match="ShortConvolution: `activation`"):
        ShortConvolution(8, activation=activation, rngs=nnx.Rngs(0))
    assert GatedRMSNorm(8, activation="sigmoid").activation == "sigmoid"
    assert ShortConvolution(8, activation=None, rngs=nnx.Rngs(0)).activation is None


class _EqualsAnything(str):
    """A str subclass whose ``==`` claims equality with anything."""

    def __eq__(self, other):
        return True

    __hash__ = str.__hash__


@pytest.mark.parametrize("arg", ["gate_activation", "mode", "train_mode", "backend", "train_backend"])
def test_layer_options_are_judged_and_stored_as_plain_str(arg):
    """A str subclass claiming equality with every option passed the check and was stored as given (so a later
    ``== "chunk"`` test would take its word); its plain value is checked and a NumPy str is stored as a str."""
    with pytest.raises(ValueError, match=re.escape(f"`{arg}` must be one of")):
        _small(**{arg: _EqualsAnything("bogus")})
    good = {"gate_activation": "sigmoid", "mode": "fused_recurrent", "train_mode": "fused_recurrent",
            "backend": "xla", "train_backend": "xla"}[arg]
    layer = _small(**{arg: np.str_(good)})
    assert type(getattr(layer, arg)) is str and getattr(layer, arg) == good
    if arg == "gate_activation":
        assert type(layer.o_norm.activation) is str
    with pytest.raises(ValueError, match="GatedRMSNorm: `activation`"):
        GatedRMSNorm(8, activation=_EqualsAnything("relu"))
    with pytest.raises(ValueError, match="ShortConvolution: `activation`"):
        ShortConvolution(8, activation=_EqualsAnything("relu"), rngs=nnx.Rngs(0))


def test_gate_activation_assigned_later_is_what_the_layer_computes():
    """``layer.gate_activation`` set after construction used to change the attribute only (the norm kept the old
    activation): now it is the norm's, checked on assignment, and the layer computes what a layer built with it
    computes."""
    x = rand_x(40, 2, 6)
    layer, built = make_layer(3), make_layer(3, gate_activation="sigmoid")
    y_silu, _ = layer(x, deterministic=True)
    layer.gate_activation = np.str_("sigmoid")
    assert type(layer.gate_activation) is str and layer.o_norm.activation == "sigmoid"
    y_set, _ = layer(x, deterministic=True)
    y_built, _ = built(x, deterministic=True)
    np.testing.assert_array_equal(np.asarray(y_set), np.asarray(y_built))
    assert not np.allclose(np.asarray(y_set), np.asarray(y_silu))
    for bad, exc in (("relu", ValueError), (1, TypeError), (_EqualsAnything("relu"), ValueError)):
        with pytest.raises(exc, match=re.escape("GatedDeltaNet2: `gate_activation`")):
            layer.gate_activation = bad
    assert layer.gate_activation == "sigmoid"


class _Boom(nnx.Module):
    def __call__(self, x):
        raise AssertionError("the projections ran before the check")


@pytest.mark.parametrize("arg,deterministic", [("mode", True), ("train_mode", False), ("backend", True),
                                               ("train_backend", False)])
@pytest.mark.parametrize("bad,exc", [("fused", ValueError), (None, TypeError)])
@pytest.mark.parametrize("T", [5, 70])  # (inference takes the recurrent op at T <= 64 whatever `mode` says)
def test_options_reassigned_later_are_checked_when_used(arg, deterministic, bad, exc, T):
    """An option assigned after construction is checked by the call that uses it, before the projections run
    (``layer.mode = "fused"`` silently ran the chunk op)."""
    layer = _small()
    setattr(layer, arg, bad)
    layer.q_proj = layer.f_proj = _Boom()
    with pytest.raises(exc, match=re.escape(f"GatedDeltaNet2: `{arg}`")):
        layer(rand_x(41, 1, T), deterministic=deterministic)


@pytest.mark.parametrize("where,attr,bad,match", [
    ("o_norm", "eps", -1.0, "GatedRMSNorm: `eps`"), ("o_norm", "activation", "relu", "GatedRMSNorm: `activation`"),
    ("v_conv1d", "activation", "relu", "ShortConvolution: `activation`")])
def test_submodule_attributes_reassigned_later_are_checked_before_the_projections(where, attr, bad, match):
    layer = _small()
    setattr(getattr(layer, where), attr, bad)
    layer.q_proj = layer.f_proj = _Boom()
    with pytest.raises(ValueError, match=re.escape(match)):
        layer(_X, deterministic=True)


def test_norm_eps_stored_as_array_data_is_used_as_it_is():
    """An eps a user stores as data (an array, e.g. to tune it) is not a static option: it runs, also under jit."""
    norm = GatedRMSNorm(8)
    x, gate = rand_x(43, 1, 3, d=8)[0], rand_x(44, 1, 3, d=8)[0]
    want = norm(x, gate)
    norm.eps = nnx.data(jnp.float32(1e-5))
    np.testing.assert_array_equal(np.asarray(norm(x, gate)), np.asarray(want))
    np.testing.assert_allclose(np.asarray(nnx.jit(lambda m, a, b: m(a, b))(norm, x, gate)), np.asarray(want),
                               rtol=1e-6)


def test_norm_eps_assigned_later_is_what_the_layer_computes():
    """``layer.norm_eps`` was a copy: reassigning it changed nothing computed while ``fla_layer_kwargs`` reported the
    new value. Now it is the norm's eps, checked on assignment."""
    from flax_layers.convert import fla_layer_kwargs
    x = rand_x(42, 2, 6)
    layer, built = make_layer(5, gate_activation="sigmoid"), make_layer(5, gate_activation="sigmoid", norm_eps=10.0)
    y_before, _ = layer(x, deterministic=True)
    layer.norm_eps = 10.0
    assert layer.o_norm.eps == 10.0 and fla_layer_kwargs(layer)["norm_eps"] == 10.0
    y_set, _ = layer(x, deterministic=True)
    np.testing.assert_array_equal(np.asarray(y_set), np.asarray(built(x, deterministic=True)[0]))
    assert not np.allclose(np.asarray(y_set), np.asarray(y_before))
    for bad, exc in ((-1.0, ValueError), (1e-40, ValueError), ("1e-5", TypeError)):
        with pytest.raises(exc, match=re.escape("GatedDeltaNet2: `norm_eps`")):
            layer.norm_eps = bad
    assert layer.norm_eps == 10.0


def test_fla_layer_kwargs_refuses_what_no_fla_layer_computes():
    """FLA's layer gates with a sigmoid: kwargs for a SiLU-gated layer described a different model."""
    from flax_layers.convert import fla_layer_kwargs
    with pytest.raises(ValueError, match="`gate_activation`='silu'"):
        fla_layer_kwargs(make_layer(6))
    layer = make_layer(6, gate_activation="sigmoid")
    kw = fla_layer_kwargs(layer)
    assert kw["mode"] == "chunk" and kw["allow_neg_eigval"] is False
    layer.mode = "fused"
    with pytest.raises(ValueError, match=re.escape("fla_layer_kwargs: `layer.mode`")):
        fla_layer_kwargs(layer)
    layer.mode, layer.allow_neg_eigval = "chunk", "no"
    with pytest.raises(TypeError, match=re.escape("fla_layer_kwargs: `layer.allow_neg_eigval`")):
        fla_layer_kwargs(layer)


def test_flags_reassigned_later_are_checked_when_used():
    """``allow_neg_eigval = "False"`` (truthy) doubled b silently; ``use_short_conv`` flipped on a layer built
    without convolutions failed with an AttributeError, and the other way skipped the convolutions."""
    layer = _small()
    layer.allow_neg_eigval = "False"
    with pytest.raises(TypeError, match=re.escape("GatedDeltaNet2: `allow_neg_eigval` must be a bool")):
        layer(_X, deterministic=True)
    for built_with in (True, False):
        layer = _small(use_short_conv=built_with)
        layer.use_short_conv = not built_with
        with pytest.raises(ValueError, match=re.escape("GatedDeltaNet2: `use_short_conv` cannot change")):
            layer(_X, deterministic=True)


def test_submodule_attributes_reassigned_later_are_checked_when_used():
    norm, conv = GatedRMSNorm(8), ShortConvolution(8, rngs=nnx.Rngs(0))
    norm.activation, conv.activation = "relu", "relu"
    with pytest.raises(ValueError, match=re.escape("GatedRMSNorm: `activation`")):
        norm(jnp.ones((1, 8)), jnp.ones((1, 8)))
    with pytest.raises(ValueError, match=re.escape("ShortConvolution: `activation`")):
        conv(jnp.ones((1, 3, 8)))
    norm = GatedRMSNorm(8)
    norm.eps = -1.0  # (NaN before)
    with pytest.raises(ValueError, match=re.escape("GatedRMSNorm: `eps`")):
        norm(jnp.ones((1, 8)), jnp.ones((1, 8)))


def test_traced_deterministic_gets_the_static_argument_hint():
    """``deterministic`` traced (passed through ``jax.jit`` as an array) names the argument and says how to pass it."""
    layer = _small()
    graphdef, state = nnx.split(layer)

    def f(state, x, det):
        return nnx.merge(graphdef, state)(x, deterministic=det)[0]

    with pytest.raises(TypeError, match="`deterministic` must be a bool") as excinfo:
        jax.jit(f)(state, _X, True)
    msg = str(excinfo.value)
    assert "got a traced value" in msg and "static_argnums / static_argnames" in msg and "a Python bool" in msg, msg


@pytest.mark.parametrize("build,exc,name", [
    (lambda: ShortConvolution(-1, rngs=nnx.Rngs(0)), ValueError, "features"),  # (MLIR)
    (lambda: ShortConvolution(8, 0, rngs=nnx.Rngs(0)), ValueError, "kernel_size"),
    (lambda: ShortConvolution(8, 2.0, rngs=nnx.Rngs(0)), TypeError, "kernel_size"),
    (lambda: ShortConvolution(2**40, 2**40, rngs=nnx.Rngs(0)), ValueError, "kernel_size"),
    (lambda: ShortConvolution(8, use_bias="no", rngs=nnx.Rngs(0)), TypeError, "use_bias"),
    (lambda: GatedRMSNorm(-2), ValueError, "features"),
    (lambda: GatedRMSNorm(4, eps=-1.0), ValueError, "eps"),  # (NaN before)
    (lambda: GatedRMSNorm(4, eps="1e-5"), TypeError, "eps"),
])
def test_submodules_check_their_sizes(build, exc, name):
    """The public submodules, built directly, name a bad size / eps / flag (they failed in MLIR, with a
    ZeroDivisionError, took 'no' as True, or gave NaN for a negative eps)."""
    with pytest.raises(exc, match=re.escape(f"`{name}`")):
        build()

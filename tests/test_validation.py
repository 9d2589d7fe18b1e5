"""Every bad input raises a clear ValueError/TypeError naming the argument, before any computation.

"Before any computation" is checked three ways:
* every case runs with numpy inputs under ``jax.transfer_guard("disallow")``: any jnp operation on them
  would need a host-to-device transfer and fail with a JaxRuntimeError instead of our error;
* every shape/dtype case also raises from ``jax.eval_shape`` on ``ShapeDtypeStruct`` inputs (no arrays
  exist at all: the error comes from shapes alone, at trace time);
* a subprocess imports gdn2_jax, makes bad calls, and checks that JAX never initialised a backend.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _oracle import make_inputs

from gdn2_jax import chunk_gdn2, fused_recurrent_gdn2, naive_chunk_gdn2, naive_recurrent_gdn2

FUNCS = {
    "chunk_gdn2": chunk_gdn2,
    "fused_recurrent_gdn2": fused_recurrent_gdn2,
    "naive_recurrent_gdn2": naive_recurrent_gdn2,
    "naive_chunk_gdn2": naive_chunk_gdn2,
}
PUBLIC_OPS = ("chunk_gdn2", "fused_recurrent_gdn2")  # the ones with a `backend` argument

B, T, H, HV, K, V = 2, 5, 2, 4, 3, 2


def _rng_inputs(B=B, T=T, H=H, HV=HV, K=K, V=V, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, H, K)).astype(np.float32)
    k = rng.standard_normal((B, T, H, K)).astype(np.float32)
    v = rng.standard_normal((B, T, HV, V)).astype(np.float32)
    g = rng.uniform(-2, -0.1, (B, T, HV, K)).astype(np.float32)
    b = rng.uniform(0, 1, (B, T, HV, K)).astype(np.float32)
    w = rng.uniform(0, 1, (B, T, HV, V)).astype(np.float32)
    return dict(q=q, k=k, v=v, g=g, b=b, w=w)


def _args(**over):
    """Valid dense arguments with some replaced: returns (positional dict, keyword dict)."""
    pos = _rng_inputs()
    kw = {}
    for name, val in over.items():
        (pos if name in pos else kw)[name] = val
    return pos, kw


def _varlen(cu, T_=7, **over):
    pos = _rng_inputs(B=1, T=T_)
    kw = dict(cu_seqlens=np.asarray(cu, np.int32) if not isinstance(cu, np.ndarray) else cu)
    for name, val in over.items():
        (pos if name in pos else kw)[name] = val
    return pos, kw


def _with(name, shape=None, dtype=np.float32, fill=None):
    a = np.random.default_rng(1).uniform(-1, -0.1, shape).astype(dtype) if fill is None else fill
    return {name: a}


def _nan_at(name, value):
    pos = _rng_inputs()
    x = pos[name].copy()
    x[1, 3, 2, 1] = value
    return {name: x}


# (case id, builder -> (pos, kw), exception, argument named in the message, shape-only?)
# shape-only cases are also checked through jax.eval_shape on ShapeDtypeStruct inputs.
CASES = [
    # ranks
    ("q_rank3", lambda: _args(**_with("q", (B, T, H * K))), ValueError, "q", True),
    ("v_rank5", lambda: _args(**_with("v", (B, T, HV, V, 1))), ValueError, "v", True),
    ("g_rank3", lambda: _args(**_with("g", (B, T, HV * K))), ValueError, "g", True),
    # mismatched B / T / H / dims
    ("k_heads", lambda: _args(**_with("k", (B, T, H + 1, K))), ValueError, "k", True),
    ("k_T", lambda: _args(**_with("k", (B, T + 1, H, K))), ValueError, "k", True),
    ("v_B", lambda: _args(**_with("v", (B + 1, T, HV, V)), **_with("w", (B + 1, T, HV, V))),
     ValueError, "v", True),
    ("v_T", lambda: _args(**_with("v", (B, T - 1, HV, V)), **_with("w", (B, T - 1, HV, V))),
     ValueError, "v", True),
    ("w_V", lambda: _args(**_with("w", (B, T, HV, V + 1))), ValueError, "w", True),
    ("w_heads", lambda: _args(**_with("w", (B, T, HV - 1, V))), ValueError, "w", True),
    ("g_K", lambda: _args(**_with("g", (B, T, HV, K + 1))), ValueError, "g", True),
    ("g_B", lambda: _args(**_with("g", (B + 1, T, HV, K))), ValueError, "g", True),
    ("b_heads", lambda: _args(**_with("b", (B, T, H, K))), ValueError, "b", True),
    ("b_T", lambda: _args(**_with("b", (B, T + 2, HV, K))), ValueError, "b", True),
    # HV not a multiple of H
    ("HV_not_multiple", lambda: _args(**_with("v", (B, T, 3, V)), **_with("w", (B, T, 3, V)),
                                      **_with("g", (B, T, 3, K)), **_with("b", (B, T, 3, K))),
     ValueError, "v", True),
    # K or V unsupported
    ("K_zero", lambda: _args(**_with("q", (B, T, H, 0)), **_with("k", (B, T, H, 0)),
                             **_with("g", (B, T, HV, 0)), **_with("b", (B, T, HV, 0))),
     ValueError, "q", True),
    ("V_zero", lambda: _args(**_with("v", (B, T, HV, 0)), **_with("w", (B, T, HV, 0))),
     ValueError, "v", True),
    # non-arrays and non-float dtypes
    ("q_list", lambda: _args(q=np.zeros((B, T, H, K)).tolist()), TypeError, "q", False),
    ("q_int", lambda: _args(**_with("q", (B, T, H, K), np.int32)), TypeError, "q", True),
    ("g_int", lambda: _args(**_with("g", (B, T, HV, K), np.int32)), TypeError, "g", True),
    ("b_int", lambda: _args(**_with("b", (B, T, HV, K), np.int64)), TypeError, "b", True),
    ("w_bool", lambda: _args(w=np.ones((B, T, HV, V), bool)), TypeError, "w", True),
    ("g_complex", lambda: _args(**_with("g", (B, T, HV, K), np.complex64)), TypeError, "g", True),
    # initial_state
    ("h0_wrong_N", lambda: _args(**_with("initial_state", (B + 1, HV, K, V))), ValueError,
     "initial_state", True),
    ("h0_wrong_heads", lambda: _args(**_with("initial_state", (B, H, K, V))), ValueError,
     "initial_state", True),
    ("h0_transposed", lambda: _args(**_with("initial_state", (B, HV, V, K))), ValueError,
     "initial_state", True),
    ("h0_rank3", lambda: _args(**_with("initial_state", (B, HV, K * V))), ValueError,
     "initial_state", True),
    ("h0_bf16", lambda: _args(**_with("initial_state", (B, HV, K, V), jnp.bfloat16)), TypeError,
     "initial_state", True),
    ("h0_fp16", lambda: _args(**_with("initial_state", (B, HV, K, V), np.float16)), TypeError,
     "initial_state", True),
    ("h0_int", lambda: _args(**_with("initial_state", (B, HV, K, V), np.int32)), TypeError,
     "initial_state", True),
    ("h0_list", lambda: _args(initial_state=np.zeros((B, HV, K, V)).tolist()), TypeError,
     "initial_state", False),
    # cu_seqlens
    ("cu_B2", lambda: _args(cu_seqlens=np.array([0, 2, T], np.int32)), ValueError, "cu_seqlens", True),
    ("cu_start1", lambda: _varlen([1, 3, 7]), ValueError, "cu_seqlens", False),
    ("cu_decreasing", lambda: _varlen([0, 5, 3, 7]), ValueError, "cu_seqlens", False),
    ("cu_end_short", lambda: _varlen([0, 3, 6]), ValueError, "cu_seqlens", False),
    ("cu_end_long", lambda: _varlen([0, 3, 8]), ValueError, "cu_seqlens", False),
    ("cu_float", lambda: _varlen(np.array([0.0, 3.0, 7.0], np.float32)), TypeError, "cu_seqlens", True),
    ("cu_bool", lambda: _varlen(np.array([False, True], bool)), TypeError, "cu_seqlens", True),
    ("cu_2d", lambda: _varlen(np.array([[0, 3, 7]], np.int32)), ValueError, "cu_seqlens", True),
    ("cu_len1", lambda: _varlen(np.array([0], np.int32)), ValueError, "cu_seqlens", True),
    ("cu_list", lambda: _varlen([0, 3, 7], cu_seqlens=[0, 3, 7]), TypeError, "cu_seqlens", False),
    ("cu_h0_N", lambda: _varlen([0, 3, 7], initial_state=np.zeros((3, HV, K, V), np.float32)),
     ValueError, "initial_state", True),
    # scale
    ("scale_zero", lambda: _args(scale=0.0), ValueError, "scale", True),
    ("scale_negative", lambda: _args(scale=-0.5), ValueError, "scale", True),
    ("scale_nan", lambda: _args(scale=math.nan), ValueError, "scale", True),
    ("scale_inf", lambda: _args(scale=math.inf), ValueError, "scale", True),
    ("scale_huge_int", lambda: _args(scale=10 ** 400), ValueError, "scale", True),  # (beyond float's range)
    ("scale_f32_overflow", lambda: _args(scale=1e300), ValueError, "scale", True),  # (inf / NaN in o before)
    ("scale_f32_underflow", lambda: _args(scale=1e-300), ValueError, "scale", True),  # (o all zeros before)
    ("scale_str", lambda: _args(scale="0.5"), TypeError, "scale", True),
    ("scale_bool", lambda: _args(scale=True), TypeError, "scale", True),
    ("scale_list", lambda: _args(scale=[0.5]), TypeError, "scale", True),
    ("scale_vector", lambda: _args(scale=np.array([0.5, 0.5])), TypeError, "scale", True),
    ("scale_timedelta", lambda: _args(scale=np.timedelta64(1)), TypeError, "scale", True),  # (a np.signedinteger)
    ("scale_timedelta_0d", lambda: _args(scale=np.array(np.timedelta64(2))), TypeError, "scale", True),
    ("scale_shape_dtype_struct", lambda: _args(scale=jax.ShapeDtypeStruct((), jnp.float32)), TypeError, "scale",
     True),  # (float() failed on it before, without naming scale)
    # flags
    ("flag_final_int", lambda: _args(output_final_state=1), TypeError, "output_final_state", True),
    ("flag_final_str", lambda: _args(output_final_state="yes"), TypeError, "output_final_state", True),
    ("flag_final_none", lambda: _args(output_final_state=None), TypeError, "output_final_state", True),
    ("flag_l2_int", lambda: _args(use_qk_l2norm_in_kernel=0), TypeError, "use_qk_l2norm_in_kernel", True),
    # NaN / inf in concrete gates
    ("g_nan", lambda: _args(**_nan_at("g", np.nan)), ValueError, "g", False),
    ("g_neg_inf", lambda: _args(**_nan_at("g", -np.inf)), ValueError, "g", False),
    ("b_inf", lambda: _args(**_nan_at("b", np.inf)), ValueError, "b", False),
    ("w_nan", lambda: _args(**_nan_at("w", np.nan)), ValueError, "w", False),
]

BACKEND_CASES = [
    ("backend_unknown", lambda: _args(backend="cuda"), ValueError, "backend", True),
    ("backend_case", lambda: _args(backend="XLA"), ValueError, "backend", True),
    ("backend_none", lambda: _args(backend=None), TypeError, "backend", True),
]


def _call(fn_name, pos, kw):
    f = FUNCS[fn_name]
    return f(pos["q"], pos["k"], pos["v"], pos["g"], pos["b"], pos["w"], **kw)


def _all_cases():
    for fn_name in FUNCS:
        for case in CASES:
            yield pytest.param(fn_name, *case, id=f"{fn_name}-{case[0]}")
        if fn_name in PUBLIC_OPS:
            for case in BACKEND_CASES:
                yield pytest.param(fn_name, *case, id=f"{fn_name}-{case[0]}")


def _assert_names(excinfo, fn_name, arg):
    msg = str(excinfo.value)
    assert f"`{arg}`" in msg, f"message does not name `{arg}`: {msg!r}"
    assert msg.startswith(fn_name + ":"), f"message does not name the function: {msg!r}"


@pytest.mark.parametrize("fn_name,case,build,exc,arg,shape_only", list(_all_cases()))
def test_bad_input_raises_before_any_transfer(fn_name, case, build, exc, arg, shape_only):
    pos, kw = build()
    with jax.transfer_guard("disallow"):  # any jnp work on the numpy inputs would raise JaxRuntimeError
        with pytest.raises(exc) as excinfo:
            _call(fn_name, pos, kw)
    _assert_names(excinfo, fn_name, arg)


def _abstract(x):
    if isinstance(x, np.ndarray):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return x


@pytest.mark.parametrize(
    "fn_name,case,build,exc,arg,shape_only",
    [p for p in _all_cases() if p.values[-1]],
)
def test_bad_shape_or_dtype_raises_at_trace_time(fn_name, case, build, exc, arg, shape_only):
    pos, kw = build()
    arrays = {n: _abstract(x) for n, x in {**pos, **kw}.items() if isinstance(x, np.ndarray)}
    static = {n: x for n, x in kw.items() if n not in arrays}

    def f(arrs):
        full = {**arrs, **static}
        return _call(fn_name, {n: full.pop(n) for n in "qkvgbw"}, full)

    with pytest.raises(exc) as excinfo:
        jax.eval_shape(f, arrays)
    _assert_names(excinfo, fn_name, arg)


@pytest.mark.parametrize("fn_name", list(FUNCS))
def test_scale_range_is_float32_normal(fn_name):
    """``scale`` is taken up to the ends of float32's normal range and refused just beyond them (a subnormal
    scale gave an all-zero o, one above float32's max inf / NaN)."""
    tiny, big = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
    pos = _rng_inputs()
    for ok in (tiny, big, 1, np.float32(0.25), np.asarray(0.25)):
        _call(fn_name, pos, dict(scale=ok))
    for bad in (np.nextafter(tiny, 0.0), 1e-39, np.nextafter(big, math.inf), 1e39):
        with pytest.raises(ValueError, match="`scale` must lie in float32's normal range") as excinfo:
            _call(fn_name, pos, dict(scale=bad))
        _assert_names(excinfo, fn_name, "scale")


def test_scale_docstrings_state_the_range():
    from gdn2_jax.validation import SCALE_RANGE

    assert SCALE_RANGE == "float32's normal range [1.1754943508222875e-38, 3.4028234663852886e+38]"
    for fn_name, f in FUNCS.items():
        doc = " ".join(f.__doc__.split())  # (the docstring wraps lines)
        assert "scale: real number multiplying q" in doc and f"in {SCALE_RANGE} (ValueError outside it" in doc, fn_name
        assert "only makes the scale representable" in doc, fn_name


@pytest.mark.parametrize("fn_name", list(FUNCS))
def test_scale_printed_bounds_are_accepted(fn_name):
    """The bounds the message prints are taken as written (the rounded 3.4028235e+38 printed before was above
    float32's max and refused)."""
    from gdn2_jax.validation import SCALE_RANGE

    low, high = (float(x) for x in SCALE_RANGE.split("[")[1].rstrip("]").split(", "))
    pos = _rng_inputs()
    for ok in (low, high):
        _call(fn_name, pos, dict(scale=ok))


@pytest.mark.parametrize("fn_name", list(FUNCS))
def test_scale_type_error_says_what_is_accepted(fn_name):
    """The TypeError for a non-real ``scale`` lists what is taken (ints and 0-d arrays too, so not "a Python
    float"), and what it lists is taken."""
    pos = _rng_inputs()
    for ok in (2, 0.5, np.int64(2), np.float32(0.5), np.asarray(2), np.asarray(0.5, np.float32), jnp.asarray(0.5)):
        _call(fn_name, pos, dict(scale=ok))
    accepted = "must be a real number (a Python or NumPy int or float, or a 0-d integer or floating-point array)"
    for bad in ("0.5", True, np.bool_(True), [0.5], 0.5j, np.asarray(0.5j), np.array([0.5, 0.5])):
        with pytest.raises(TypeError) as excinfo:
            _call(fn_name, pos, dict(scale=bad))
        _assert_names(excinfo, fn_name, "scale")
        assert accepted in str(excinfo.value) and "Python float" not in str(excinfo.value), str(excinfo.value)
    with pytest.raises(TypeError, match="`scale` must be a static real number, got a traced value") as excinfo:
        jax.jit(lambda s: _call(fn_name, pos, dict(scale=s)))(0.5)
    assert "Python float" not in str(excinfo.value)
    assert "hashable" in str(excinfo.value)  # (a 0-d array through static_argnames is refused as unhashable)


class _EqualsAnything(str):
    """A str subclass whose ``==`` and ``__str__`` lie: an option check must judge its plain str value."""

    def __eq__(self, other):
        return True

    __hash__ = str.__hash__

    def __str__(self):
        return "xla"


@pytest.mark.parametrize("fn_name", PUBLIC_OPS)
def test_backend_is_judged_as_its_plain_str(fn_name):
    """A str subclass claiming equality with every option passed the ``in`` test (and would have compared equal to
    "auto" when the backend is resolved); its plain value is what is checked now. A NumPy str is a str: taken."""
    pos = _rng_inputs()
    with pytest.raises(ValueError, match="`backend` must be one of") as excinfo:
        _call(fn_name, pos, dict(backend=_EqualsAnything("bogus")))
    _assert_names(excinfo, fn_name, "backend")
    assert "'bogus'" in str(excinfo.value)
    o_np, _ = _call(fn_name, pos, dict(backend=np.str_("xla")))
    o_py, _ = _call(fn_name, pos, dict(backend="xla"))
    np.testing.assert_array_equal(np.asarray(o_np), np.asarray(o_py))


def test_option_check_returns_a_plain_str():
    from gdn2_jax.validation import check_option
    for value in (np.str_("xla"), _EqualsAnything("xla"), "xla"):
        got = check_option("f", "backend", value, ("auto", "xla"))
        assert type(got) is str and got == "xla"


_STATIC_HINT = ("it must be known when the function is traced: under jax.jit pass it as a static argument, "
                "static_argnums / static_argnames")


@pytest.mark.parametrize("transform", ["jit", "vmap", "grad"])
def test_traced_static_arguments_get_the_static_argument_hint(transform):
    """A traced ``chunk_size`` (naive_chunk_gdn2) and ``scale`` name the argument and say how to pass a static
    value, and the hint names jit, vmap and grad alike (it said "under jax.jit" only; chunk_size had none)."""
    pos = _rng_inputs()
    cases = [("naive_chunk_gdn2", "chunk_size", 4, "a Python int"),
             ("chunk_gdn2", "scale", 0.5, "a number such as float(x)")]
    for fn_name, arg, value, as_what in cases:
        def f(x):
            o, _ = _call(fn_name, pos, {arg: x})
            return o.sum()
        run = {"jit": jax.jit(f), "vmap": jax.vmap(f), "grad": jax.grad(f)}[transform]
        x = (np.asarray([value] * 2) if transform == "vmap" else
             float(value) if transform == "grad" else value)
        with pytest.raises(TypeError) as excinfo:
            run(x)
        _assert_names(excinfo, fn_name, arg)
        msg = str(excinfo.value)
        assert "got a traced value" in msg and _STATIC_HINT in msg and f"as {as_what}" in msg, msg
        assert "under jax.vmap or jax.grad close over it" in msg and "hashable" in msg, msg


def test_concrete_only_checks_are_skipped_for_traced_cu_seqlens():
    # Under jit the values of cu_seqlens are unknown: the call must trace (shapes are fine), which shows the
    # value checks above are skipped, not silently applied to garbage.
    pos, kw = _varlen([0, 3, 7])
    out = jax.eval_shape(
        lambda cu: naive_recurrent_gdn2(*(pos[n] for n in "qkvgbw"), cu_seqlens=cu, output_final_state=True),
        jax.ShapeDtypeStruct((3,), np.int32),
    )
    assert out[1].shape == (2, HV, K, V)


def test_cu_seqlens_with_zero_length_sequences_is_valid():
    pos, kw = _varlen([0, 0, 3, 3, 7])
    o, ht = fused_recurrent_gdn2(*(pos[n] for n in "qkvgbw"), output_final_state=True, **kw)
    assert ht.shape == (4, HV, K, V)
    # zero-length sequences keep their (zero) initial state; the others do not
    norms = np.abs(np.asarray(ht)).sum(axis=(1, 2, 3))
    assert norms[0] == 0 and norms[2] == 0 and norms[1] > 0 and norms[3] > 0


_SUBPROCESS = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import gdn2_jax
    from jax._src import xla_bridge
    res = {"after_import": {
        "modules": sorted(m for m in ("torch", "tilelang", "jax_tvm_ffi", "tvm_ffi", "triton", "fla")
                          if m in sys.modules),
        "backends": sorted(xla_bridge._backends),
    }}
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 6, 2, 3)).astype(np.float32); k = q.copy()
    v = rng.standard_normal((1, 6, 2, 2)).astype(np.float32); w = np.full_like(v, 0.5)
    g = np.full((1, 6, 2, 3), -0.5, np.float32); b = np.full_like(g, 0.5)
    bad = {
        "cu_not_ending_at_T": dict(cu_seqlens=np.array([0, 2, 5], np.int32)),
        "g_nan": dict(g=np.where(g == g, np.nan, g).astype(np.float32)),
        "h0_fp16": dict(initial_state=np.zeros((1, 2, 3, 2), np.float16)),
        "scale_zero": dict(scale=0.0),
        "backend": dict(backend="gpu"),
    }
    errors = {}
    for fn in ("chunk_gdn2", "fused_recurrent_gdn2", "naive_recurrent_gdn2", "naive_chunk_gdn2"):
        for name, over in bad.items():
            if name == "backend" and fn.startswith("naive"):
                continue
            args = dict(q=q, k=k, v=v, g=g, b=b, w=w)
            kw = {}
            for key, val in over.items():
                (args if key in args else kw)[key] = val
            try:
                getattr(gdn2_jax, fn)(*args.values(), **kw)
                errors[fn + "/" + name] = "no error"
            except (ValueError, TypeError) as e:
                errors[fn + "/" + name] = type(e).__name__
    res["errors"] = errors
    res["after_bad_calls"] = sorted(xla_bridge._backends)
    gdn2_jax.fused_recurrent_gdn2(q, k, v, g, b, w)  # a valid call does initialise a backend
    res["after_good_call"] = sorted(xla_bridge._backends)
    print(json.dumps(res))
    """
)


def test_import_is_light_and_bad_calls_touch_no_backend():
    out = subprocess.run([sys.executable, "-c", _SUBPROCESS], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["after_import"]["modules"] == [], res
    assert res["after_import"]["backends"] == [], res
    assert res["errors"] and all(v in ("ValueError", "TypeError") for v in res["errors"].values()), res
    assert res["after_bad_calls"] == [], res
    assert res["after_good_call"] != [], res  # the probe can see an initialised backend


@pytest.mark.parametrize("fn_name", list(FUNCS))
def test_calls_do_not_mutate_or_donate_inputs(fn_name):
    pos = _rng_inputs()
    h0 = np.random.default_rng(3).standard_normal((B, HV, K, V)).astype(np.float32)
    copies = {n: x.copy() for n, x in pos.items()}
    h0_copy = h0.copy()
    _call(fn_name, pos, dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True))
    for n, x in pos.items():
        np.testing.assert_array_equal(x, copies[n], err_msg=n)
    np.testing.assert_array_equal(h0, h0_copy)

    # jax array inputs stay alive (nothing is donated), also under jit
    jpos = {n: jnp.asarray(x) for n, x in pos.items()}
    jh0 = jnp.asarray(h0)
    f = jax.jit(lambda p, s: _call(fn_name, p, dict(initial_state=s, output_final_state=True)))
    f(jpos, jh0)
    assert not any(x.is_deleted() for x in jpos.values()) and not jh0.is_deleted()
    np.testing.assert_array_equal(np.asarray(jh0), h0_copy)



@pytest.mark.parametrize("fn_name", list(FUNCS))
def test_numpy_float64_inputs_without_x64(fn_name):
    """numpy's default float64 arrays (and a numpy initial_state with packed sequences) work without x64:
    math in float32, float32 results, no dtype-truncation warnings, same values as float32 inputs."""
    assert not jax.config.jax_enable_x64
    pos = {n: x.astype(np.float64) for n, x in _rng_inputs(B=1, T=7).items()}
    h0 = np.random.default_rng(5).standard_normal((2, HV, K, V))
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
              cu_seqlens=np.array([0, 3, 7]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o, ht = _call(fn_name, pos, kw)
    assert o.dtype == np.float32 and ht.dtype == np.float32
    o32, ht32 = _call(fn_name, {n: x.astype(np.float32) for n, x in pos.items()},
                      dict(kw, initial_state=h0.astype(np.float32)))
    np.testing.assert_allclose(np.asarray(o), np.asarray(o32), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ht), np.asarray(ht32), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("serving", ["inplace", "pool"])
def test_numpy_float64_state_in_place_without_x64(serving):
    """A numpy float64 state reused in place (``inplace_final_state``, or a state pool) without x64: the state
    JAX holds is float32, and so is the returned one, with no dtype-truncation warning from inside the call."""
    assert not jax.config.jax_enable_x64
    pos = _rng_inputs(B=2, T=3)
    h0 = np.random.default_rng(6).standard_normal((2, HV, K, V))  # float64
    kw = (dict(inplace_final_state=True) if serving == "inplace"
          else dict(ssm_state_indices=np.array([1, 0], np.int32)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o, ht = fused_recurrent_gdn2(*(pos[n] for n in "qkvgbw"), initial_state=h0, backend="xla", **kw)
    assert o.dtype == np.float32 and ht.dtype == np.float32 and ht.shape == h0.shape
    o32, ht32 = fused_recurrent_gdn2(*(pos[n] for n in "qkvgbw"), initial_state=h0.astype(np.float32),
                                     backend="xla", **kw)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o32))
    np.testing.assert_array_equal(np.asarray(ht), np.asarray(ht32))


# --------------------------------------------------------------------------------------------------
# traced cu_seqlens cannot be checked in Python: invalid ones must give NaN, never a silent wrong answer
# --------------------------------------------------------------------------------------------------
_ALL_FNS = [(chunk_gdn2, {"backend": "xla"}), (fused_recurrent_gdn2, {"backend": "xla"}),
            (naive_chunk_gdn2, {}), (naive_recurrent_gdn2, {})]


def _packed_inputs(seed, T):
    """float32 (q, k, v, g, b, w) for B = 1, H = HV = 2, K = V = 4."""
    x = make_inputs(seed, 1, T, 2, 2, 4, 4)
    return tuple(x[n] for n in "qkvgbw")


@pytest.mark.parametrize("fn,kw", _ALL_FNS, ids=lambda x: getattr(x, "__name__", ""))
def test_traced_invalid_cu_seqlens_poison_outputs(fn, kw):
    x = _packed_inputs(11, 8)
    call = jax.jit(lambda cu: fn(*x, cu_seqlens=cu, output_final_state=True, **kw))
    o, ht = call(jnp.asarray([0, 3, 8], jnp.int32))  # valid: finite, equal to the eager (checked) call
    o_ref, ht_ref = fn(*x, cu_seqlens=jnp.asarray([0, 3, 8], jnp.int32), output_final_state=True, **kw)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ht), np.asarray(ht_ref), rtol=1e-5, atol=1e-6)
    # same length as the valid one, so the same compiled function sees them
    for bad in ([0, 4, 7], [1, 4, 8], [0, 6, 4], [0, -3, 8], [0, 4, 100]):
        o, ht = call(jnp.asarray(bad, jnp.int32))
        assert np.isnan(np.asarray(o)).all(), bad
        assert np.isnan(np.asarray(ht)).all(), bad


@pytest.mark.parametrize("fn,kw", _ALL_FNS, ids=lambda x: getattr(x, "__name__", ""))
def test_traced_invalid_cu_seqlens_poison_gradients(fn, kw):
    """Gradients through outputs of invalid traced cu_seqlens are NaN too, never silently zero."""
    q, k, v, g, b, w = _packed_inputs(12, 8)

    def loss(q, v, cu):
        o, ht = fn(q, k, v, g, b, w, cu_seqlens=cu, output_final_state=True, **kw)
        return jnp.sum(o ** 2) + jnp.sum(ht)

    vg = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    val, (dq, dv) = vg(q, v, jnp.asarray([0, 3, 8], jnp.int32))
    assert np.isfinite(float(val)) and np.isfinite(np.asarray(dq)).all() and np.abs(np.asarray(dv)).sum() > 0
    val, (dq, dv) = vg(q, v, jnp.asarray([0, 6, 4], jnp.int32))
    assert np.isnan(float(val))
    assert np.isnan(np.asarray(dq)).all() and np.isnan(np.asarray(dv)).all()


def test_l2norm_refuses_non_arrays_non_floats_and_scalars():
    from gdn2_jax import l2norm

    for good in (jnp.asarray([3.0, 4.0]), np.asarray([3.0, 4.0], np.float32)):
        np.testing.assert_allclose(np.asarray(l2norm(good)), [0.6, 0.8], rtol=1e-6)
    for bad in ([3.0, 4.0], (3.0, 4.0), [[3.0, 4.0]], 5.0, "x", None,  # not arrays, as the ops' q, k, ... must be
                jax.ShapeDtypeStruct((2,), jnp.float32)):
        with pytest.raises(TypeError, match=r"^l2norm: `x` must be a jax or numpy array, got " + type(bad).__name__):
            l2norm(bad)
    for bad in (jnp.asarray([3, 4]), jnp.asarray([3 + 4j]), jnp.asarray([True, False]), np.asarray([3, 4]),
                jnp.asarray([3.0, 4.0], jnp.float8_e4m3fn), np.asarray([3.0, 4.0], dtype=object)):
        with pytest.raises(TypeError, match=r"^l2norm: `x` must be a float16, bfloat16, float32 or float64 array, "
                                            r"got dtype " + str(bad.dtype)):  # (the dtype given, not a converted one)
            l2norm(bad)
    for bad in (jnp.asarray(1.0), np.float32(1.0), np.asarray(1.0)):
        with pytest.raises(ValueError, match=r"^l2norm: `x` must have at least one axis"):
            l2norm(bad)


@pytest.mark.parametrize("fn,kw", _ALL_FNS, ids=lambda x: getattr(x, "__name__", ""))
def test_numpy_cu_seqlens_under_jit(fn, kw):
    """numpy offsets closed over by a jitted function are constants: same result as eager, no tracer error."""
    q, k, v, g, b, w = _packed_inputs(13, 9)
    cu = np.array([0, 4, 4, 9])
    o_ref, ht_ref = fn(q, k, v, g, b, w, cu_seqlens=cu, output_final_state=True, **kw)
    o, ht = jax.jit(lambda q: fn(q, k, v, g, b, w, cu_seqlens=cu, output_final_state=True, **kw))(q)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ht), np.asarray(ht_ref), rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(ht[1]).max()) == 0.0  # the empty sequence keeps the zero initial state

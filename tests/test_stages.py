"""Stage-by-stage tests of the chunk form (``gdn2_jax.xla``: cumsum, chunk_intra, wy_fast, chunk_delta_h, chunk_o).

* CPU, float64: every stage's hand-written backward equals ``jax.vjp`` of its forward, at random primal points
  taken from a real chunk (g down to -60 mixed inside the chunk, b in [0, 2]) and random cotangents; the
  composed one-chunk VJP (``chunk.chunk_bwd_one``) equals autodiff of ``chunk.chunk_fwd_one``; and the composed
  forward equals an independent fp64 token loop (numpy, written here) on one chunk.
* GPU (``cuda``): the intra-chunk launch of ``kernels/chunk_fwd.py`` against its xla twin ``xla.intra_stage``
  (scratch buffers Aqk, Y, U, QG, KG, GAM), and the state/output launch fed with the twin's scratch against
  ``state_fwd`` + ``o_fwd``.

Metric: RMS(x - ref) / RMS(ref) (``_oracle.rms_ratio``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _oracle import rms_ratio

from gdn2_jax.xla.chunk import chunk_bwd_one, chunk_fwd_one
from gdn2_jax.xla.chunk_delta_h import state_bwd, state_bwd_recurrent, state_fwd
from gdn2_jax.xla.chunk_intra import intra_bwd, intra_fwd, solve_bwd, solve_fwd
from gdn2_jax.xla.chunk_o import o_bwd, o_fwd
from kernels.build import SMEM_EPILOGUE_OPTIONS, WARP_TILE_OPTIONS
from gdn2_jax.xla.common import masks
from gdn2_jax.xla.cumsum import SUB, Gates, SubGates, chunk_gates, chunk_local_cumsum_bwd
from gdn2_jax.xla.wy_fast import WY, wy_bwd, wy_fwd

TOL = 1e-10
BATCH = (2, 3)  # (sequences, value heads): the leading "..." dims of every stage
K, V = 16, 8
SCALE = K ** -0.5
# per-channel decay levels mixed inside every chunk ("swept"), and a mild decay where every factor stays > 1e-5
G_LEVELS = np.array([0.0, -1e-3, -0.1, -1.0, -6.0, -20.0, -60.0])
G_PROBS = np.array([0.1, 0.2, 0.3, 0.2, 0.1, 0.05, 0.05])


# ------------------------------------------------------------------------------------------------ inputs
def chunk_inputs(seed, C=64, gdist="swept"):
    """One chunk of fp64 numpy inputs ``[*BATCH, C, D]``: q, k unit-norm; v = 0.5 N(0,1); b ~ U(0, 2);
    w ~ U(0, 1); S0 ~ N(0, 1); g per channel from G_LEVELS (swept, -60 included) or U(-0.3, 0) (mild)."""
    rng = np.random.default_rng(seed)
    sh = BATCH + (C,)
    q = rng.standard_normal(sh + (K,))
    k = rng.standard_normal(sh + (K,))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    if gdist == "swept":
        g = G_LEVELS[rng.choice(len(G_LEVELS), size=sh + (K,), p=G_PROBS)] * rng.uniform(0.5, 1.0, sh + (K,))
        assert (g < -50).any() and (g == 0).any()
    else:
        g = -rng.uniform(0.0, 0.3, sh + (K,))
    return dict(q=q, k=k, v=0.5 * rng.standard_normal(sh + (V,)), g=g, b=rng.uniform(0.0, 2.0, sh + (K,)),
                w=rng.uniform(0.0, 1.0, sh + (V,)), S0=rng.standard_normal(BATCH + (K, V)))


def cotangent(rng, like, mask=None):
    ct = rng.standard_normal(np.shape(like))
    return ct if mask is None else ct * np.asarray(mask, np.float64)


def gates_from_G(G):
    """Every decay factor of a chunk as a function of the cumulative decay G (the variable the intra and WY
    backwards differentiate by). The pairwise exponent is masked before ``exp`` (never exp of a positive)."""
    C = G.shape[-2]
    incl = masks(C)[0][:, :, None]
    D = G[..., :, None, :] - G[..., None, :, :]
    Gam = jnp.exp(jnp.where(incl, D, 0.0)) * incl.astype(G.dtype)
    return Gates(G=G, gam=jnp.exp(G), gamC=jnp.exp(G[..., -1, :]), tail=jnp.exp(G[..., -1:, :] - G), Gam=Gam)


def close(x, ref, tol=TOL, what=""):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    assert x.shape == ref.shape, (what, x.shape, ref.shape)
    assert np.all(np.isfinite(x)), f"{what}: non-finite values"
    assert np.any(ref != 0), f"{what}: the reference is identically zero (the check would be vacuous)"
    r = rms_ratio(x, ref)
    assert r <= tol, (what, r)


def token_loop(q, k, v, g, b, w, S0, scale):
    """Independent fp64 token loop over the C rows of one chunk (``[..., C, D]``). Returns (o, S_end)."""
    S = np.array(S0, np.float64)
    o = np.zeros(q.shape[:-1] + (v.shape[-1],))
    for t in range(q.shape[-2]):
        S = np.exp(g[..., t, :])[..., :, None] * S
        u = w[..., t, :] * v[..., t, :] - np.einsum("...k,...kv->...v", b[..., t, :] * k[..., t, :], S)
        S = S + k[..., t, :, None] * u[..., None, :]
        o[..., t, :] = scale * np.einsum("...k,...kv->...v", q[..., t, :], S)
    return o, S


# ------------------------------------------------------------------------------------------- cumsum
@pytest.mark.parametrize("gdist", ["swept", "mild"])
def test_cumsum_forward_factors_and_reverse_cumsum_is_vjp(x64, gdist):
    x = chunk_inputs(1, gdist=gdist)
    g = jnp.asarray(x["g"])
    gates = chunk_gates(g)
    # forward: each factor from an independent numpy construction
    G = np.cumsum(x["g"], axis=-2)
    C = G.shape[-2]
    incl = np.tril(np.ones((C, C), bool))[:, :, None]
    D = np.where(incl, G[..., :, None, :] - G[..., None, :, :], -np.inf)
    close(gates.G, G, 1e-13, "G")
    close(gates.gam, np.exp(G), 1e-13, "gam")
    close(gates.gamC, np.exp(G[..., -1, :]), 1e-13, "gamC")
    close(gates.tail, np.exp(G[..., -1:, :] - G), 1e-12, "tail")
    close(gates.Gam, np.exp(D), 1e-12, "Gam")
    assert np.all(np.asarray(gates.Gam)[..., ~np.tril(np.ones((C, C), bool)), :] == 0)  # exactly 0 above
    assert np.all(np.isfinite(np.asarray(gates.Gam)))

    rng = np.random.default_rng(2)
    dG = cotangent(rng, G)
    _, vjp = jax.vjp(lambda g: chunk_gates(g).G, g)
    close(chunk_local_cumsum_bwd(jnp.asarray(dG)), vjp(jnp.asarray(dG))[0], what="dg")
    # reverse cumsum by hand: dg_t = sum_{r >= t} dG_r
    close(chunk_local_cumsum_bwd(jnp.asarray(dG)), np.flip(np.cumsum(np.flip(dG, -2), -2), -2), 1e-13, "dg np")

    # every factor, differentiated through the segment sums of chunk_gates, is the function of G that the
    # later stages' backwards assume (gates_from_G), chained through the reverse cumsum
    cts = Gates(*(jnp.asarray(cotangent(rng, f)) for f in gates))
    _, vjp_g = jax.vjp(chunk_gates, g)
    _, vjp_G = jax.vjp(gates_from_G, jnp.asarray(G))
    close(vjp_g(cts)[0], chunk_local_cumsum_bwd(vjp_G(cts)[0]), what="dg via every factor")


@pytest.mark.parametrize("gdist,C", [("swept", 64), ("mild", 64), ("swept", 32)])
def test_factored_gates_equal_dense(x64, gdist, C):
    """``chunk_gates(g, factored=True)``: the sub-chunk factors reproduce every dense Gam entry (lead_r * back[i]_s
    below the diagonal blocks, ``diag`` on them), are exactly 0 where masked and finite (g down to -60), and the
    other factors equal the dense path's; a chunk that is not a multiple of SUB rows falls back to the dense form."""
    x = chunk_inputs(3, C=C, gdist=gdist)
    g = jnp.asarray(x["g"])
    dense, fac = chunk_gates(g), chunk_gates(g, factored=True)
    assert isinstance(fac.Gam, SubGates) and not isinstance(dense.Gam, SubGates)
    for name in ("G", "gam", "gamC", "tail"):
        close(getattr(fac, name), getattr(dense, name), 1e-13, name)
    sg, Gam = fac.Gam, np.asarray(dense.Gam)
    NS = C // SUB
    rebuilt = np.zeros_like(Gam)
    for i in range(NS):
        rows = slice(i * SUB, (i + 1) * SUB)
        lead, back = np.asarray(sg.lead)[..., rows, None, :], np.asarray(sg.back)[..., i, None, :, :]
        rebuilt[..., rows, :i * SUB, :] = (lead * back)[..., :i * SUB, :]
        rebuilt[..., rows, rows, :] = np.asarray(sg.diag)[..., i, :, :, :]
        assert np.all(np.asarray(sg.back)[..., i, i * SUB:, :] == 0)  # exactly 0 from sub-chunk i on
    close(rebuilt, Gam, 1e-12, "Gam from the sub-chunk factors")
    assert np.all(np.asarray(sg.diag)[..., ~np.tril(np.ones((SUB, SUB), bool)), :] == 0)  # exactly 0 above
    assert all(np.all(np.isfinite(np.asarray(f))) for f in sg)
    assert not isinstance(chunk_gates(g[..., :24, :], factored=True).Gam, SubGates)


@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("gdist", ["swept", "mild"])
def test_intra_factored_equals_dense(x64, gdist, levels):
    """intra_fwd / intra_bwd over the factored gates (16-row sub-chunks; with ``levels=2`` their diagonal blocks
    factored again into 4-row groups) give the dense results (every score and gradient)."""
    x = chunk_inputs(4, gdist=gdist)
    q, k, b = (jnp.asarray(x[n]) for n in "qkb")
    g = jnp.asarray(x["g"])
    dense, fac = chunk_gates(g), chunk_gates(g, factored=True, levels=levels)
    assert isinstance(fac.Gam.diag, SubGates) == (levels == 2)
    assert all(np.all(np.isfinite(np.asarray(f))) for f in jax.tree_util.tree_leaves(fac.Gam))
    for a, r, name in zip(intra_fwd(q, k, b, fac, SCALE), intra_fwd(q, k, b, dense, SCALE), ("Aqk", "T")):
        close(a, r, 1e-12, name)
    rng = np.random.default_rng(5)
    incl, strict = (np.asarray(m, np.float64) for m in masks(64))
    dAqk, dT = (jnp.asarray(cotangent(rng, np.zeros(BATCH + (64, 64)) + 1, m)) for m in (incl, strict))
    for a, r, name in zip(intra_bwd(q, k, b, fac, dAqk, dT, SCALE), intra_bwd(q, k, b, dense, dAqk, dT, SCALE),
                          ("dq", "dk", "db", "dG")):
        close(a, r, 1e-12, name)


# -------------------------------------------------------------------------------------- chunk_intra
@pytest.mark.parametrize("gdist", ["swept", "mild"])
def test_intra_bwd_is_vjp_of_intra_fwd(x64, gdist):
    x = chunk_inputs(3, gdist=gdist)
    q, k, b = (jnp.asarray(x[n]) for n in "qkb")
    G = jnp.cumsum(jnp.asarray(x["g"]), axis=-2)
    C = G.shape[-2]
    incl, strict = masks(C)
    rng = np.random.default_rng(4)
    dAqk = jnp.asarray(cotangent(rng, np.zeros(BATCH + (C, C)), incl))
    dT = jnp.asarray(cotangent(rng, np.zeros(BATCH + (C, C)), strict))

    def f(q, k, b, G):
        return intra_fwd(q, k, b, gates_from_G(G), SCALE)

    (Aqk, T), vjp = jax.vjp(f, q, k, b, G)
    # forward: lower (with diagonal) / strictly lower, and the diagonal of Aqk is scale * q_r . k_r
    assert np.all(np.asarray(Aqk)[..., ~np.asarray(incl)] == 0) and np.all(np.asarray(T)[..., ~np.asarray(strict)] == 0)
    close(np.diagonal(np.asarray(Aqk), axis1=-2, axis2=-1), SCALE * np.sum(x["q"] * x["k"], -1), 1e-13, "diag Aqk")
    ref = vjp((dAqk, dT))
    got = intra_bwd(q, k, b, gates_from_G(G), dAqk, dT, SCALE)
    for name, a, r in zip(("dq", "dk", "db", "dG"), got, ref):
        close(a, r, what=name)


@pytest.mark.parametrize("C", [64, 24])
def test_solve_bwd_is_vjp_of_solve_fwd(x64, C):
    x = chunk_inputs(5, C=C)
    gates = chunk_gates(jnp.asarray(x["g"]))
    _, T = intra_fwd(jnp.asarray(x["q"]), jnp.asarray(x["k"]), jnp.asarray(x["b"]), gates, SCALE)
    A, vjp = jax.vjp(solve_fwd, T)
    eye = np.eye(C)
    close(np.asarray(A) @ (eye + np.asarray(T)), np.broadcast_to(eye, A.shape), 1e-12, "A (I + T) = I")
    close(A, np.linalg.inv(eye + np.asarray(T)), 1e-12, "A vs numpy inverse")
    rng = np.random.default_rng(6)
    dA = jnp.asarray(cotangent(rng, A))  # a full cotangent: the upper part must not leak into dT
    dT = solve_bwd(A, dA)
    close(dT, vjp(dA)[0], what="dT")
    assert np.all(np.asarray(dT)[..., ~np.tril(np.ones((C, C), bool), -1)] == 0)


# ------------------------------------------------------------------------------------------ wy_fast
@pytest.mark.parametrize("gdist", ["swept", "mild"])
def test_wy_bwd_is_vjp_of_wy_fwd(x64, gdist):
    x = chunk_inputs(7, gdist=gdist)
    q, k, v, b, w = (jnp.asarray(x[n]) for n in "qkvbw")
    G = jnp.cumsum(jnp.asarray(x["g"]), axis=-2)
    _, T = intra_fwd(q, k, b, gates_from_G(G), SCALE)
    A = solve_fwd(T)

    def f(A, q, k, v, b, w, G):
        wy = wy_fwd(A, q, k, v, b, w, gates_from_G(G), SCALE)
        return wy.Y, wy.U, wy.QG, wy.KG

    (Y, U, QG, KG), vjp = jax.vjp(f, A, q, k, v, b, w, G)
    gates = gates_from_G(G)
    close(QG, SCALE * np.exp(np.asarray(G)) * x["q"], 1e-13, "QG")
    close(KG, np.exp(np.asarray(G)[..., -1:, :] - np.asarray(G)) * x["k"], 1e-13, "KG")
    close(Y, np.asarray(A) @ (np.exp(np.asarray(G)) * x["b"] * x["k"]), 1e-13, "Y")
    close(U, np.asarray(A) @ (x["w"] * x["v"]), 1e-13, "U")
    rng = np.random.default_rng(8)
    cts = [jnp.asarray(cotangent(rng, a)) for a in (Y, U, QG, KG)]
    ref = vjp(tuple(cts))  # (dA, dq, dk, dv, db, dw, dG)
    wy = wy_fwd(A, q, k, v, b, w, gates, SCALE)
    assert isinstance(wy, WY)
    dq, dk, dv, db, dw, dG, dA = wy_bwd(A, k, v, b, w, gates, wy, *cts, SCALE)
    for name, a, r in zip(("dA", "dq", "dk", "dv", "db", "dw", "dG"), (dA, dq, dk, dv, db, dw, dG), ref):
        close(a, r, what=name)


# ------------------------------------------------------------------------------------ chunk_delta_h
def _stage_point(seed, gdist="swept"):
    """Y, U, KG, QG, Aqk, G_C, S0 of a real chunk (the primal point of the state and output stages)."""
    x = chunk_inputs(seed, gdist=gdist)
    a = {n: jnp.asarray(x[n]) for n in x}
    gates = chunk_gates(a["g"])
    Aqk, T = intra_fwd(a["q"], a["k"], a["b"], gates, SCALE)
    wy = wy_fwd(solve_fwd(T), a["q"], a["k"], a["v"], a["b"], a["w"], gates, SCALE)
    return dict(Y=wy.Y, U=wy.U, KG=wy.KG, QG=wy.QG, Aqk=Aqk, GC=gates.G[..., -1, :], S0=a["S0"])


@pytest.mark.parametrize("gdist", ["swept", "mild"])
def test_state_bwd_is_vjp_of_state_fwd(x64, gdist):
    p = _stage_point(9, gdist)

    def f(Y, U, KG, GC, S0):
        return state_fwd(Y, U, KG, jnp.exp(GC), S0)

    (R, S_next), vjp = jax.vjp(f, p["Y"], p["U"], p["KG"], p["GC"], p["S0"])
    Yn, Un, KGn, S0n = (np.asarray(p[n]) for n in ("Y", "U", "KG", "S0"))
    close(R, Un - Yn @ S0n, 1e-13, "R")
    close(S_next, np.exp(np.asarray(p["GC"]))[..., :, None] * S0n + np.swapaxes(KGn, -1, -2) @ np.asarray(R),
          1e-13, "S_next")
    rng = np.random.default_rng(10)
    dR_o, dS_end, dS0_o = (jnp.asarray(cotangent(rng, a)) for a in (R, S_next, S_next))
    dY_r, dU_r, dKG_r, dGC_r, dS0_r = vjp((dR_o, dS_end))
    dS0, dY, dU, dKG, dG_C = state_bwd(p["Y"], p["KG"], jnp.exp(p["GC"]), p["S0"], R, dR_o, dS0_o, dS_end)
    close(dS0, dS0_r + dS0_o, what="dS0 (+ the output's share dS0_o)")
    for name, a, r in (("dY", dY, dY_r), ("dU", dU, dU_r), ("dKG", dKG, dKG_r), ("dG_C", dG_C, dGC_r)):
        close(a, r, what=name)


# ------------------------------------------------------------------------------------------ chunk_o
def test_o_bwd_is_vjp_of_o_fwd(x64):
    p = _stage_point(11)
    R, _ = state_fwd(p["Y"], p["U"], p["KG"], jnp.exp(p["GC"]), p["S0"])
    C = R.shape[-2]
    incl = masks(C)[0].astype(R.dtype)

    def f(QG, S0, Aqk, R):  # Aqk can only hold its lower triangle with diagonal
        return o_fwd(QG, S0, Aqk * incl, R)

    O, vjp = jax.vjp(f, p["QG"], p["S0"], p["Aqk"], R)
    close(O, np.asarray(p["QG"]) @ np.asarray(p["S0"]) + np.asarray(p["Aqk"]) @ np.asarray(R), 1e-13, "O")
    dO = jnp.asarray(cotangent(np.random.default_rng(12), O))
    got = o_bwd(p["QG"], p["S0"], p["Aqk"], R, dO)
    for name, a, r in zip(("dQG", "dS0_o", "dAqk", "dR_o"), got, vjp(dO)):
        close(a, r, what=name)
    assert np.all(np.asarray(got[2])[..., ~np.tril(np.ones((C, C), bool))] == 0)


# ------------------------------------------------------------------------------------ composed chunk
@pytest.mark.parametrize("gdist,C", [("swept", 64), ("mild", 64), ("swept", 40)])
def test_chunk_bwd_one_is_vjp_of_chunk_fwd_one(x64, gdist, C):
    x = chunk_inputs(13, C=C, gdist=gdist)
    args = [jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "b", "w", "S0")]
    (O, S_next), vjp = jax.vjp(lambda *a: chunk_fwd_one(*a, SCALE), *args)
    rng = np.random.default_rng(14)
    dO, dS_end = jnp.asarray(cotangent(rng, O)), jnp.asarray(cotangent(rng, S_next))
    ref = vjp((dO, dS_end))
    (dq, dk, dv, dg, db, dw), dS0 = chunk_bwd_one(*args, dO, dS_end, SCALE)
    for name, a, r in zip(("dq", "dk", "dv", "dg", "db", "dw", "dS0"), (dq, dk, dv, dg, db, dw, dS0), ref):
        close(a, r, what=name)


@pytest.mark.parametrize("gdist,C", [("swept", 64), ("mild", 64), ("mild", 17)])
def test_chunk_fwd_one_equals_token_loop(x64, gdist, C):
    x = chunk_inputs(15, C=C, gdist=gdist)
    O, S_next = chunk_fwd_one(*(jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "b", "w", "S0")), SCALE)
    o_ref, S_ref = token_loop(*(x[n] for n in ("q", "k", "v", "g", "b", "w", "S0")), SCALE)
    assert O.dtype == jnp.float64
    close(O, o_ref, what="O")
    close(S_next, S_ref, what="S_next")


# ============================================================================================ GPU
def _bf16(a):
    import ml_dtypes

    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16)


def _spread_residual(aqkl):
    """``AqkL [..., T, HV, 16]`` (tokens counted from a chunk start; ``kernels._common.AQKL_WIDTH``) as the
    ``[..., T, HV, 64]`` residual it stands for: row r of a chunk holds it at columns 16 (r // 16) + c, zero
    elsewhere (the off-diagonal blocks carry no residual)."""
    aqkl = np.asarray(aqkl)
    blk = (np.arange(aqkl.shape[-3]) % 64) // 16
    out = np.zeros(aqkl.shape[:-1] + (64,), aqkl.dtype)
    for b in range(4):
        out[..., blk == b, :, 16 * b:16 * b + 16] = aqkl[..., blk == b, :, :]
    return out


def _residual_blocks(full):
    """The inverse of :func:`_spread_residual`: each row's diagonal 16 x 16 block of ``[..., T, HV, 64]``."""
    full = np.asarray(full)
    blk = (np.arange(full.shape[-3]) % 64) // 16
    out = np.zeros(full.shape[:-1] + (16,), full.dtype)
    for b in range(4):
        out[..., blk == b, :, :] = full[..., blk == b, :, 16 * b:16 * b + 16]
    return out


def _gpu_gates(rng, shape, gdist):
    """fp32 log-decays [B, T, HV, K]. ``swept``: per channel from G_LEVELS (down to -60; the intra kernel's exact
    diagonal path); ``spec``: U(-5, -0.1) (spec §11; mostly its TF32 fast path); ``mixed``: U(-0.3, 0) with one
    channel block of 32 strong (-60) in every other chunk, so fast and exact slices meet in one launch."""
    if gdist == "swept":
        return G_LEVELS[rng.choice(len(G_LEVELS), size=shape, p=G_PROBS)] * rng.uniform(0.5, 1.0, shape)
    if gdist == "spec":
        return rng.uniform(-5.0, -0.1, shape)
    g = -rng.uniform(0.0, 0.3, shape)
    strong = (np.arange(shape[1]) // 64) % 2 == 1
    g[:, strong, :, 32:64] = -60.0 * rng.uniform(0.5, 1.0, g[:, strong, :, 32:64].shape)
    return g


def _gpu_inputs(seed, B, T, H, HV, K_, V_, l2, gdist="swept"):
    """bf16 q, k, v, b, w and fp32 g (numpy, :func:`_gpu_gates`), b in [0, 2]."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, H, K_))
    k = rng.standard_normal((B, T, H, K_))
    if l2:  # unnormalised: the kernel normalises
        q *= rng.uniform(0.5, 3.0, (B, T, H, 1))
        k *= rng.uniform(0.5, 3.0, (B, T, H, 1))
    else:
        q /= np.linalg.norm(q, axis=-1, keepdims=True)
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g = _gpu_gates(rng, (B, T, HV, K_), gdist)
    g[..., :2] = 0.0
    return dict(q=_bf16(q), k=_bf16(k), v=_bf16(0.5 * rng.standard_normal((B, T, HV, V_))),
                g=g.astype(np.float32), b=_bf16(rng.uniform(0.0, 2.0, (B, T, HV, K_))),
                w=_bf16(rng.uniform(0.0, 1.0, (B, T, HV, V_))),
                h0=rng.standard_normal((B, HV, K_, V_)).astype(np.float32))


def _torch(a):
    import torch

    if a.dtype.name == "bfloat16":
        return torch.from_numpy(np.asarray(a, np.float32)).to("cuda", torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a)).to("cuda")


def _np(t):
    import torch

    return t.float().cpu().numpy() if t.dtype == torch.bfloat16 else t.cpu().numpy()


def _gpu_rms(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(x)), "non-finite values (unwritten / NaN-poisoned elements?)"
    return rms_ratio(x, ref)


GPU_CASES = [  # B, T, H, HV, K, V, l2norm  (T not a multiple of 64; GVA HV = 2H)
    (2, 100, 2, 4, 64, 64, False),
    (1, 150, 1, 2, 128, 128, True),
    (2, 37, 2, 4, 128, 64, True),
    (1, 130, 2, 4, 64, 128, False),
]


@pytest.mark.cuda
@pytest.mark.parametrize("gdist", ["swept", "spec", "mixed"])
@pytest.mark.parametrize("B,T,H,HV,K_,V_,l2", GPU_CASES)
def test_gpu_intra_launch_and_state_launch_vs_xla_twins(B, T, H, HV, K_, V_, l2, gdist):
    import torch

    from gdn2_jax import xla
    from gdn2_jax.xla import layout
    from kernels import _compile, registry, torch_api

    x = _gpu_inputs(100 + T + K_, B, T, H, HV, K_, V_, l2, gdist)
    scale = K_ ** -0.5
    cfg = registry.config(H=H, HV=HV, K=K_, V=V_, dtype="bfloat16", g_dtype="float32", scale=scale,
                          use_initial_state=True, output_final_state=True, varlen=False, use_qk_l2norm=l2)
    pipe = registry.get("chunk_gdn2").pipeline(**cfg)
    assert [la.name for la in pipe.launches] == ["gdn2_chunk_intra", "gdn2_chunk_state_o"]
    t = {n: _torch(a) for n, a in x.items()}
    res = torch_api.run_pipeline(pipe, t, return_scratch=True)
    torch.cuda.synchronize()

    # ---- launch 1 vs xla.intra_stage (float32 math, on the CPU, on the same bf16 inputs). The scratch is
    # token-major [B, T, ...]: rows past T in the last chunk do not exist in either ----
    with jax.default_device(jax.devices("cpu")[0]):
        twin = {n: np.asarray(a) for n, a in xla.intra_stage(
            *(jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "b", "w")), scale=scale,
            use_qk_l2norm_in_kernel=l2).items()}
    assert twin["Aqk"].dtype == np.float32
    NT = -(-T // 64)
    assert twin["GAM"].shape == (B, NT, HV, K_) and twin["Aqk"].shape == (B, T, HV, 64)
    for name in ("Aqk", "Y", "U", "QG", "KG"):
        got = _np(res[name])
        assert got.shape == twin[name].shape, name
        r = _gpu_rms(got, twin[name])
        assert r <= 1e-2, (name, r)
    # Aqk holds the lower triangle of each chunk only (row r of a chunk: columns s <= r)
    r_in = np.arange(T) % 64
    upper = np.arange(64)[None, :] > r_in[:, None]  # [T, 64]
    assert np.all(_np(res["Aqk"]).transpose(0, 2, 1, 3)[:, :, upper] == 0)
    gam = _np(res["GAM"])
    assert gam.shape == twin["GAM"].shape
    assert _gpu_rms(gam, twin["GAM"]) <= 1e-5, _gpu_rms(gam, twin["GAM"])

    # ---- launch 2 alone, fed the twin's scratch (bf16, GAM fp32) vs state_fwd + o_fwd on those values ----
    feed = {n: _bf16(twin[n]) for n in ("Aqk", "Y", "U", "QG", "KG")}
    feed["GAM"] = twin["GAM"].astype(np.float32)
    la = pipe.launches[1]
    if "AqkL" in la.args:  # aqk_split (the default): the bf16 rounding residual of Aqk's diagonal blocks
        feed["AqkL"] = _residual_blocks(_bf16(twin["Aqk"] - feed["Aqk"].astype(np.float32)))
    bufs = {n: _torch(a) for n, a in feed.items()}
    bufs["h0"] = t["h0"]
    shapes = pipe.buffer_shapes({n: tuple(a.shape) for n, a in t.items()})
    for b_ in pipe.outputs:  # NaN-poisoned outputs: an unwritten element fails
        bufs[b_.name] = torch.full(shapes[b_.name], float("nan"), dtype=getattr(torch, b_.dtype), device="cuda")
    arch = _compile.device_arch(0)
    _compile.get_function(la, arch)(*[bufs[a] for a in la.args])
    torch.cuda.synchronize()

    with jax.default_device(jax.devices("cpu")[0]), jax.enable_x64(True):
        f64 = {n: jnp.asarray(np.asarray(a, np.float64)) for n, a in feed.items()}
        ch = {n: layout.dense_to_chunks(f64[n], 64) for n in ("Y", "U", "QG", "KG")}
        aqkl = _spread_residual(np.asarray(feed["AqkL"], np.float64)) if "AqkL" in feed else 0.0
        Aqk = layout.dense_to_chunks(f64["Aqk"] + aqkl, 64)  # [NC, B, HV, C, 64]
        gamC = jnp.moveaxis(f64["GAM"], 1, 0)  # [NC, B, HV, K]
        S = jnp.asarray(x["h0"], jnp.float64)
        outs = []
        for c in range(NT):
            R, S_next = state_fwd(ch["Y"][c], ch["U"][c], ch["KG"][c], gamC[c], S)
            outs.append(o_fwd(ch["QG"][c], S, Aqk[c], R))
            S = S_next
        o_ref = np.asarray(layout.dense_from_chunks(jnp.stack(outs), T))
        ht_ref = np.asarray(S)
    r_o, r_h = _gpu_rms(_np(bufs["o"]), o_ref), _gpu_rms(_np(bufs["ht"]), ht_ref)
    assert r_o <= 5e-3 and r_h <= 5e-3, (r_o, r_h)


@pytest.mark.cuda
@pytest.mark.parametrize("gdist", ["spec", "mixed", "swept"])
def test_gpu_intra_fast_diagonal_path_matches_exact_path(gdist):
    """Launch 1 with TF32 diagonal blocks where the decay range allows (the default) against the same launch with
    every diagonal block summed exactly in fp32 (``exact_diag=True``), on identical inputs: the scratch agrees to
    TF32 precision (identical where every slice took the exact path), and two runs of each are bit-identical."""
    import torch

    from kernels import registry, torch_api

    B, T, H, HV, K_, V_ = 2, 300, 2, 4, 128, 128
    x = _gpu_inputs(7, B, T, H, HV, K_, V_, False, gdist)
    cfg = registry.config(H=H, HV=HV, K=K_, V=V_, dtype="bfloat16", g_dtype="float32", scale=K_ ** -0.5,
                          use_initial_state=True, output_final_state=True, varlen=False, use_qk_l2norm=False)
    t = {n: _torch(a) for n, a in x.items()}
    runs = {}
    for exact in (False, True):
        pipe = registry.get("chunk_gdn2").pipeline(**cfg, exact_diag=exact)
        r1 = torch_api.run_pipeline(pipe, t, return_scratch=True)
        r2 = torch_api.run_pipeline(pipe, t, return_scratch=True)
        torch.cuda.synchronize()
        for n in ("Aqk", "Y", "U", "o", "ht"):
            assert torch.equal(r1[n], r2[n]), (exact, n)
        runs[exact] = {n: _np(r1[n]) for n in ("Aqk", "Y", "U", "o", "ht")}
    for n, ref in runs[True].items():
        r = _gpu_rms(runs[False][n], ref)
        if gdist == "swept":  # every slice has a -60 channel: both runs take the exact path
            assert r == 0.0, (n, r)
        else:
            assert 0.0 < r <= 2e-3 if n in ("Aqk", "Y", "U") else r <= 2e-3, (n, r)


_PREFETCH_CASES = [  # varlen cu_seqlens or None, B, T, H, HV, K, V, l2norm, dtype, g dtype, save_states, gates
    (None, 2, 300, 2, 4, 128, 128, False, "bfloat16", "float32", False, "spec"),
    ([0, 0, 70, 200, 201], 1, 201, 2, 4, 64, 128, True, "bfloat16", "float32", True, "mixed"),
    (None, 1, 1, 1, 1, 128, 64, False, "float16", "bfloat16", False, "swept"),
    (None, 3, 100, 2, 2, 64, 64, True, "bfloat16", "bfloat16", True, "swept"),
    ([0, 64, 64, 129], 1, 129, 1, 2, 128, 128, False, "float16", "float32", False, "spec"),
]


def test_prefetch_cases_are_prebuilt_by_the_tests_preset():
    """``kernels/build.py``'s ``_PREFETCH_CFGS`` (what the ``tests`` preset compiles ahead of time for the prefetch
    and ``intra_ftz`` GPU tests) lists the configurations of :data:`_PREFETCH_CASES`, in order."""
    from kernels.build import _PREFETCH_CFGS

    assert [(cu is not None, H, HV, K_, V_, l2, dt, gd, save)
            for cu, B, T, H, HV, K_, V_, l2, dt, gd, save, gdist in _PREFETCH_CASES] == list(_PREFETCH_CFGS)


def _case_config(cu, H, HV, K_, V_, l2, dtype, g_dtype):
    """The ``registry.config`` of a GPU case (packed when ``cu`` is given; initial and final state on)."""
    from kernels import registry

    return registry.config(H=H, HV=HV, K=K_, V=V_, dtype=dtype, g_dtype=g_dtype, scale=K_ ** -0.5,
                           use_initial_state=True, output_final_state=True, varlen=cu is not None, use_qk_l2norm=l2)


def test_session24_gpu_tests_are_prebuilt_by_the_tests_preset():
    """Every launch that the GPU tests of ``smem_epilogue`` on the other launches, ``intra_unroll``, the
    two-warpgroup state pass, ``g_first`` (its launches without it), ``state_async`` and the grids' head order
    (``test_gpu_heads_first_bit_identical``) build is in the ``tests``
    preset, so the device compiles it ahead of time in parallel rather than inside the test."""
    from kernels import build, registry
    from kernels.build import _BV_CASES, _HEADS_FIRST_CASES

    op = registry.get("chunk_gdn2")
    have = {(la.name, la.key, la.pass_configs)
            for la in build.plan_launches(build.preset("tests"), ("chunk_gdn2",), "sm_90a")}
    need = []
    for case, opts in [(0, dict(o, smem_epilogue=e)) for o in SMEM_EPILOGUE_OPTIONS for e in (False, True)] + [
            (c, dict(intra_unroll=u)) for c in (0, 1) for u in (False, True)] + [
            (c, dict(g_first=False)) for c in range(len(_PREFETCH_CASES))]:
        cu, _, _, H, HV, K_, V_, l2, dtype, g_dtype, save, _ = _PREFETCH_CASES[case]
        need.append(op.pipeline(**_case_config(cu, H, HV, K_, V_, l2, dtype, g_dtype), save_states=save,
                                **opts).launches[0])
    for varlen, H, HV, K_, V_, l2, dtype, g_dtype in _BV_CASES:
        cfg = _case_config([0] if varlen else None, H, HV, K_, V_, l2, dtype, g_dtype)
        need += [la for opts in ({}, dict(block_v=V_, state_threads=256)) for la in op.pipeline(**cfg, **opts).launches]
        need += [la for o in ({}, dict(block_v=V_, state_threads=256), dict(save_states=True))
                 for la in op.pipeline(**cfg, state_async=False, **o).launches]  # (test_gpu_state_async_bit_identical)
        need += list(op.pipeline(**cfg, save_states=True).launches)
    cfg4 = _case_config(None, 4, 4, 128, 128, False, "bfloat16", "float32")  # (its reruns of a long sequence)
    need += [la for o in ({}, dict(block_v=128, state_threads=256), dict(save_states=True)) for a in (False, True)
             for la in op.pipeline(**cfg4, state_async=a, **o).launches]
    for varlen, H, HV, K_, V_, l2, dtype, g_dtype in _HEADS_FIRST_CASES:  # (test_gpu_heads_first_bit_identical)
        cfg = _case_config([0] if varlen else None, H, HV, K_, V_, l2, dtype, g_dtype)
        need += [la for o in ({}, dict(block_v=V_, state_threads=256), dict(save_states=True)) for h in (False, True)
                 for la in op.pipeline(**cfg, intra_heads_first=h, state_heads_first=h, **o).launches]
        need += list(op.pipeline(**cfg).launches)  # (launch 1's order alone: the default)
    missing = [la.key for la in need if (la.name, la.key, la.pass_configs) not in have]
    assert len(need) == 31 + 4 * 8 + 6 * 2 + 5 * 14 and not missing, missing


def _prefetch_case(seed, cu, B, T, H, HV, K_, V_, l2, dtype, g_dtype, gdist):
    """A :data:`_PREFETCH_CASES` case on the GPU: its ``registry.config`` and torch inputs q, k, v, g, b, w (and
    ``cu_seqlens`` when packed) in the case's dtypes (no initial state: the intra launch does not read it)."""
    import torch

    x = _gpu_inputs(seed, B, T, H, HV, K_, V_, l2, gdist)
    cfg = _case_config(cu, H, HV, K_, V_, l2, dtype, g_dtype)
    t = {n: _torch(x[n]).to(getattr(torch, dtype)) for n in ("q", "k", "v", "b", "w")}
    t["g"] = _torch(x["g"]).to(getattr(torch, g_dtype))
    if cu is not None:
        t["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device="cuda")
    return cfg, t


def _assert_intra_scratch_bit_identical(cfg, t, save, option, key, **fixed):
    """Launch 1 with pipeline option ``option`` off, on, on again (its launch key names it as ``key`` when on;
    the other pipeline options ``fixed`` in all three), on
    the torch inputs ``t``, every scratch buffer filled with the same sentinel beforehand (so unwritten elements
    agree too): on equals off bit for bit, and the two runs with it on are bit-identical; the launch wrote every
    token row of Y and U (none is all sentinel), all finite. (A store past a chunk's valid rows would land in a row
    that another block writes, or past the buffer, so it need not show here: the row masks are checked on the
    generated CUDA, ``tests/test_tilelang_cpu.py::test_forward_intra_prefetch_masks_every_global_access_itself``.)"""
    import torch

    from kernels import _compile, registry

    arch = _compile.device_arch(0)
    got = []
    for on in (False, True, True):
        pipe = registry.get("chunk_gdn2").pipeline(**cfg, save_states=save, **fixed, **{option: on})
        la = pipe.launches[0]
        assert la.name == "gdn2_chunk_intra" and ((key, True) in la.key) == on
        shapes = pipe.buffer_shapes({n: tuple(a.shape) for n, a in t.items()})
        dts = {b.name: b.dtype for b in pipe.scratch}
        bufs = dict(t)
        for n in la.args:
            if n not in bufs:
                bufs[n] = torch.full(shapes[n], 7.25, dtype=getattr(torch, dts[n]), device="cuda")
        _compile.get_function(la, arch)(*[bufs[a] for a in la.args])
        torch.cuda.synchronize()
        got.append({n: bufs[n] for n in la.args if n not in t})
    assert sorted(got[0]) == sorted(got[1])
    for n in got[0]:
        a, b, c = (g[n].view(torch.int16 if g[n].element_size() == 2 else torch.int32) for g in got)
        assert torch.equal(a, b), (n, int((a != b).sum()))
        assert torch.equal(b, c), n
    for n in ("Y", "U"):  # (every token row belongs to a chunk: cu_seqlens ends at T)
        x = got[1][n]
        assert not bool((x == 7.25).all(dim=-1).any()), (n, int((x == 7.25).all(dim=-1).sum()))
        assert bool(torch.isfinite(x.float()).all()), n


@pytest.mark.cuda
@pytest.mark.parametrize("cu,B,T,H,HV,K_,V_,l2,dtype,g_dtype,save,gdist", _PREFETCH_CASES)
def test_gpu_intra_prefetch_bit_identical_to_default(cu, B, T, H, HV, K_, V_, l2, dtype, g_dtype, save, gdist):
    """Launch 1 with ``intra_prefetch`` (inputs by predicated cp.async one slice ahead, no TileLang bounds checks)
    does the arithmetic of the launch without it (both with separate slice passes, ``fused_slice=False``, which
    the launch without prefetch always has): every scratch buffer it writes is bit-identical to that launch's, on
    identical inputs, with the same sentinel in every buffer beforehand (so unwritten elements agree too, and a
    write past a chunk's valid rows would show), over dense and packed sequences (an empty one, one of a single
    token, a chunk-aligned one), GVA, the in-kernel L2 norm, K / V of 64 and 128, fp16, bf16 g, T = 1 and the
    training forward's ``Akk``; two runs of the prefetch launch are bit-identical."""
    cfg, t = _prefetch_case(41 + T, cu, B, T, H, HV, K_, V_, l2, dtype, g_dtype, gdist)
    _assert_intra_scratch_bit_identical(cfg, t, save, "intra_prefetch", "prefetch", fused_slice=False)


@pytest.mark.cuda
@pytest.mark.parametrize("cu,B,T,H,HV,K_,V_,l2,dtype,g_dtype,save,gdist", _PREFETCH_CASES)
def test_gpu_intra_fused_slice_bit_identical_to_default(cu, B, T, H, HV, K_, V_, l2, dtype, g_dtype, save, gdist):
    """Launch 1 with ``fused_slice`` (the default: each channel slice's element-wise work in one pass over
    thread-owned rows, G in registers) does the arithmetic of the launch without it (separate passes over shared
    tiles; both with the anchored products by ``T.gemm``, ``warp_tiles=False``): every scratch buffer it writes
    is bit-identical to that launch's on the prefetch test's cases (packed sequences with an empty and a one-token
    sequence, GVA, the in-kernel L2 norm, K / V of 64 and 128, fp16, bf16 g, T = 1, the training forward's ``Akk``,
    fast and exact slices), with the same sentinel in every buffer beforehand; two runs of it are bit-identical."""
    cfg, t = _prefetch_case(53 + T, cu, B, T, H, HV, K_, V_, l2, dtype, g_dtype, gdist)
    # (warp_tiles=False on both sides: fused_slice alone)
    _assert_intra_scratch_bit_identical(cfg, t, save, "fused_slice", "fused_slice",
                                        warp_tiles=False)


@pytest.mark.cuda
@pytest.mark.parametrize("cu,B,T,H,HV,K_,V_,l2,dtype,g_dtype,save,gdist", _PREFETCH_CASES)
def test_gpu_intra_warp_tiles_bit_identical_to_default(cu, B, T, H, HV, K_, V_, l2, dtype, g_dtype, save, gdist):
    """Launch 1 with ``warp_tiles`` (the default: the four anchored products as hand-written TF32 ``mma.sync``
    tiles, one 32-row column tile per warp) does the arithmetic of the launch without it (``T.gemm`` over all eight
    warps): every scratch buffer it writes is bit-identical to that launch's on the prefetch test's cases (packed
    sequences with an empty and a one-token sequence, GVA, the in-kernel L2 norm, K / V of 64 and 128, fp16,
    bf16 g, T = 1, the training forward's ``Akk``, fast and exact slices), with the same sentinel in every buffer
    beforehand; two runs of it are bit-identical."""
    cfg, t = _prefetch_case(67 + T, cu, B, T, H, HV, K_, V_, l2, dtype, g_dtype, gdist)
    _assert_intra_scratch_bit_identical(cfg, t, save, "warp_tiles", "warp_tiles")


@pytest.mark.cuda
@pytest.mark.parametrize("cu,B,T,H,HV,K_,V_,l2,dtype,g_dtype,save,gdist", _PREFETCH_CASES)
def test_gpu_intra_smem_epilogue_bit_identical_to_default(cu, B, T, H, HV, K_, V_, l2, dtype, g_dtype, save, gdist):
    """Launch 1 with ``smem_epilogue`` (the default: Y and U rounded into shared memory, then stored as 16-byte
    pieces of whole rows) writes what the launch storing them from the accumulators writes: every scratch buffer
    bit-identical on the prefetch test's cases (packed sequences with an empty and a one-token sequence, so chunks
    with fewer valid rows; GVA, K / V of 64 and 128, fp16, T = 1, the training forward), with the same sentinel in
    every buffer beforehand; two runs bit-identical."""
    cfg, t = _prefetch_case(79 + T, cu, B, T, H, HV, K_, V_, l2, dtype, g_dtype, gdist)
    _assert_intra_scratch_bit_identical(cfg, t, save, "smem_epilogue", "smem_epilogue")


@pytest.mark.cuda
@pytest.mark.parametrize("cu,B,T,H,HV,K_,V_,l2,dtype,g_dtype,save,gdist", _PREFETCH_CASES)
def test_gpu_intra_g_first_bit_identical_to_default(cu, B, T, H, HV, K_, V_, l2, dtype, g_dtype, save, gdist):
    """Launch 1 with ``g_first`` (the default: a slice's g and b waited for at its start, its q and k after the
    cumulative sum) writes what the launch waiting for all of a slice's tiles at once writes: every scratch buffer
    bit-identical on the prefetch test's cases (packed sequences with an empty and a one-token sequence, GVA, the
    in-kernel L2 norm, which rescales q and k in their buffers, K / V of 64 and 128, so two and four slices, fp16,
    bf16 g, T = 1, the training forward), with the same sentinel in every buffer beforehand; two runs
    bit-identical. (A read racing its copy need not show on a run; the order of the waits, copies and reads is
    checked on the generated CUDA: ``tests/test_tilelang_cpu.py::test_forward_intra_g_first_key_and_wait_order``.)"""
    cfg, t = _prefetch_case(103 + T, cu, B, T, H, HV, K_, V_, l2, dtype, g_dtype, gdist)
    _assert_intra_scratch_bit_identical(cfg, t, save, "g_first", "g_first")


@pytest.mark.cuda
@pytest.mark.parametrize("opts", SMEM_EPILOGUE_OPTIONS, ids=lambda o: "+".join(f"{k}={v}" for k, v in o.items()))
def test_gpu_intra_smem_epilogue_bit_identical_other_launches(opts):
    """``smem_epilogue`` on the launch-1 variants whose epilogue code differs from the default's: without the
    cp.async prefetch (so without the fused slice pass; U's residual product from ``ZsL``), with the Neumann-series
    solve, and with 128 threads (one warpgroup: a 64 x 128 WGMMA tile a product); every scratch buffer bit-identical
    to the same launch storing Y / U from the accumulators, on the first prefetch case (B2 T300 H2 HV4)."""
    cu, B, T, H, HV, K_, V_, l2, dtype, g_dtype, save, gdist = _PREFETCH_CASES[0]
    cfg, t = _prefetch_case(89 + T, cu, B, T, H, HV, K_, V_, l2, dtype, g_dtype, gdist)
    _assert_intra_scratch_bit_identical(cfg, t, save, "smem_epilogue", "smem_epilogue", **opts)


@pytest.mark.cuda
@pytest.mark.parametrize("case", [0, 1])
def test_gpu_intra_unroll_bit_identical(case):
    """``intra_unroll`` (experimental: the channel-slice loop unrolled, for per-slice profiles) does the default's
    arithmetic: every scratch buffer bit-identical, on the first two prefetch cases (K = 128 and, packed with the
    L2 norm and the training forward, K = 64: four and two slices)."""
    cu, B, T, H, HV, K_, V_, l2, dtype, g_dtype, save, gdist = _PREFETCH_CASES[case]
    cfg, t = _prefetch_case(97 + T, cu, B, T, H, HV, K_, V_, l2, dtype, g_dtype, gdist)
    _assert_intra_scratch_bit_identical(cfg, t, save, "intra_unroll", "unroll_slices")


@pytest.mark.cuda
@pytest.mark.parametrize("opts", WARP_TILE_OPTIONS, ids=lambda o: "+".join(o))
def test_gpu_intra_warp_tiles_bit_identical_with_precision_options(opts):
    """``warp_tiles`` against ``T.gemm`` with the launch-1 options that change the products' operands or their
    assembly: ``tf32_round`` + ``exact_self``, ``exact_diag`` (every slice on the exact path) and the Neumann-series
    solve; every scratch buffer bit-identical, on the first prefetch case (B2 T300 H2 HV4, fast and exact
    slices)."""
    cu, B, T, H, HV, K_, V_, l2, dtype, g_dtype, save, gdist = _PREFETCH_CASES[0]
    cfg, t = _prefetch_case(71 + T, cu, B, T, H, HV, K_, V_, l2, dtype, g_dtype, gdist)
    _assert_intra_scratch_bit_identical(cfg, t, save, "warp_tiles", "warp_tiles", **opts)


@pytest.mark.cuda
@pytest.mark.parametrize("cu,B,T,H,HV,K_,V_,l2,dtype,g_dtype,save,gdist", _PREFETCH_CASES)
def test_gpu_intra_ftz_changes_only_subnormal_terms(cu, B, T, H, HV, K_, V_, l2, dtype, g_dtype, save, gdist):
    """``intra_ftz`` (launch 1 compiled with ``nvcc -ftz=true``, the default) against the same pipeline without
    it, on the prefetch test's cases (packed sequences, GVA, the in-kernel L2 norm, fp16, bf16 g, T = 1, the
    training forward): two runs with it are bit-identical, and every scratch buffer and output agrees with the
    launch without it to within 2^-60 (8.7e-19). The bound: a flushed value is below 2^-126 in magnitude, an
    anchored partner is at most 2^50 times an input of magnitude at most 2^2 here, and a product sums at most
    2^7 channels, so a changed entry moves by less than 2^-67 (measured, session 21, H100: 1.3e-26 in Aqk on the
    benchmark's accuracy inputs; on this test's cases every difference was within 1e-30, its bound then). The
    per-chunk-slot buffers ``GAM`` and ``h`` are left out for packed sequences, whose unused slots are never
    written."""
    import torch

    from kernels import registry, torch_api

    cfg, t = _prefetch_case(43 + T, cu, B, T, H, HV, K_, V_, l2, dtype, g_dtype, gdist)
    N = B if cu is None else len(cu) - 1
    t["h0"] = _torch(np.random.default_rng(T).standard_normal((N, HV, K_, V_)).astype(np.float32))
    op = registry.get("chunk_gdn2")
    runs = [torch_api.run_pipeline(op.pipeline(**cfg, save_states=save, intra_ftz=f), t, return_scratch=True)
            for f in (False, True, True)]
    torch.cuda.synchronize()
    assert ("ftz", True) in op.pipeline(**cfg, save_states=save).launches[0].key  # (the default is on)
    assert sorted(runs[0]) == sorted(runs[1]) and "o" in runs[0] and "Aqk" in runs[0]
    # (packed sequences leave chunk slots past a sequence's chunks unwritten in the per-slot buffers)
    per_slot = {"GAM", "h"} if cu is not None else set()
    for n, a in runs[0].items():
        if n in per_slot:
            continue
        b = runs[1][n]
        assert torch.equal(b, runs[2][n]), n
        assert bool(torch.isfinite(a.float()).all()), n
        d = (a.double() - b.double()).abs()
        assert float(d.max()) <= 2.0 ** -60, (n, float(d.max()), int((a != b).sum()))


@pytest.mark.cuda
@pytest.mark.parametrize("cu,B,T,H,HV,K_,V_,l2,dtype,g_dtype,save,gdist", _PREFETCH_CASES)
def test_gpu_blocked_solve_vs_neumann_series(cu, B, T, H, HV, K_, V_, l2, dtype, g_dtype, save, gdist):
    """``blocked_solve`` (the default: ``(I + T)^-1`` blockwise, fp32 16 x 16 blocks and two 32^3 TF32 products)
    against the Neumann series' four 64^3 TF32 products, on the prefetch test's cases (packed sequences with an
    empty one, GVA, the in-kernel L2 norm, K / V of 64 and 128, fp16, bf16 g, T = 1, the training forward's
    ``Akk``): two runs of the blocked launch are bit-identical; every scratch buffer and output agrees with the
    series' to within 1e-2 RMS ratio (the slice loop is shared, so Aqk, QG, KG and GAM are bit-identical); and for
    dense inputs Y and U are no further from the fp64 xla twin (the same bf16 inputs, in float64) than the
    series' are (at most 2% further, plus 1e-6)."""
    import torch

    from gdn2_jax import xla
    from kernels import registry, torch_api

    cfg, t = _prefetch_case(47 + T, cu, B, T, H, HV, K_, V_, l2, dtype, g_dtype, gdist)
    N = B if cu is None else len(cu) - 1
    t["h0"] = _torch(np.random.default_rng(T + 1).standard_normal((N, HV, K_, V_)).astype(np.float32))
    op = registry.get("chunk_gdn2")
    assert ("blocked_solve", True) in op.pipeline(**cfg, save_states=save).launches[0].key  # (the default)
    runs = [torch_api.run_pipeline(op.pipeline(**cfg, save_states=save, blocked_solve=bs), t, return_scratch=True)
            for bs in (False, True, True)]
    torch.cuda.synchronize()
    series, blocked = runs[0], runs[1]
    assert sorted(series) == sorted(blocked) and "Y" in blocked and ("Akk" in blocked) == save
    per_slot = {"GAM", "h"} if cu is not None else set()  # (unused chunk slots of packed sequences: unwritten)
    for n, a in blocked.items():
        if n in per_slot:
            continue
        assert torch.equal(a, runs[2][n]), n
        if n in ("Aqk", "AqkL", "QG", "KG", "GAM", "QGL"):
            assert torch.equal(a, series[n]), n
        else:
            r = _gpu_rms(_np(a), _np(series[n]))
            assert r <= 1e-2, (n, r)
    if cu is None:
        with jax.default_device(jax.devices("cpu")[0]), jax.enable_x64(True):
            twin = xla.intra_stage(*(jnp.asarray(_np(t[n]), jnp.float64) for n in ("q", "k", "v", "g", "b", "w")),
                                   scale=K_ ** -0.5, use_qk_l2norm_in_kernel=l2)
            twin = {n: np.asarray(twin[n]) for n in ("Y", "U")}
        for n in ("Y", "U"):
            rb, rs = _gpu_rms(_np(blocked[n]), twin[n]), _gpu_rms(_np(series[n]), twin[n])
            assert rb <= 1.02 * rs + 1e-6, (n, rb, rs)


def _used_slots(cu):
    """The chunk slots that packed sequences ``cu`` (offsets, a list) use in the per-slot buffers (``h``, ``GAM``):
    sequence n's chunks from slot ``n + cu[n] // CHUNK``, as ``kernels.chunk_fwd.seq_span`` lays them. The other
    slots (past a sequence's chunks, or an empty sequence's) are never written."""
    from kernels.chunk_fwd import CHUNK

    return [n + s // CHUNK + c for n, (s, e) in enumerate(zip(cu[:-1], cu[1:])) for c in range(-(-(e - s) // CHUNK))]


def _assert_runs_bit_identical(runs, used, label):
    """Two ``torch_api.run_pipeline`` results hold the same outputs, o and ht among them, each finite in the first
    run and equal bit for bit; ``h`` only on the chunk slots ``used`` (``_used_slots``; None: every slot), the
    other slots are never written (torch.empty's garbage). ``label`` goes into the assertion messages."""
    import torch

    assert set(runs[0]) == set(runs[1]) and {"o", "ht"} <= set(runs[0]), (sorted(runs[0]), sorted(runs[1]))
    for n in runs[0]:
        a, b = runs[0][n], runs[1][n]
        if n == "h" and used is not None:
            a, b = a[:, used], b[:, used]
        assert bool(torch.isfinite(a.float()).all()), (label, n)
        assert torch.equal(a, b), (label, n, float((a.float() - b.float()).abs().max()))


def _bv_case(seed, case):
    """A ``kernels/build.py`` ``_BV_CASES`` case (or ``_HEADS_FIRST_CASES``' fifth, ``case`` 4) on the GPU: its config
    and torch inputs with a random initial state (packed: B1 T201 with an empty and a one-token sequence; dense: B2
    T150), and V."""
    from kernels.build import _HEADS_FIRST_CASES

    varlen, H, HV, K_, V_, l2, dtype, g_dtype = _HEADS_FIRST_CASES[case]
    cu = [0, 0, 70, 200, 201] if varlen else None
    B, T = (1, 201) if varlen else (2, 150)
    cfg, t = _prefetch_case(seed, cu, B, T, H, HV, K_, V_, l2, dtype, g_dtype, "spec")
    N = B if cu is None else len(cu) - 1
    t["h0"] = _torch(np.random.default_rng(case).standard_normal((N, HV, K_, V_)).astype(np.float32))
    return cfg, t, V_


def _assert_public_call_takes(B, opts, monkeypatch):
    """The public torch ``chunk_gdn2`` at ``B`` sequences x 32 heads (K = V = 128) runs the pipeline with the state
    pass ``opts`` (``kernels.chunk_fwd.inference_options``), and its o and final state equal the default pipeline's
    (V-blocks of 32) bit for bit."""
    import torch

    from kernels import registry, torch_api

    op = registry.get("chunk_gdn2")
    assert op.options_for_call(N=B, HV=32, V=128) == opts
    cfg, t = _prefetch_case(5, None, B, 100, 32, 32, 128, 128, False, "bfloat16", "float32", "spec")
    t["h0"] = _torch(np.random.default_rng(3).standard_normal((B, 32, 128, 128)).astype(np.float32))
    ran, run = [], torch_api.run_pipeline
    monkeypatch.setattr(torch_api, "run_pipeline", lambda pipe, *a, **k: ran.append(pipe) or run(pipe, *a, **k))
    o, ht = torch_api.chunk_gdn2(t["q"], t["k"], t["v"], t["g"], t["b"], t["w"], initial_state=t["h0"],
                                 output_final_state=True)
    assert len(ran) == 1 and ran[0].launches[1].key == op.pipeline(**cfg, **opts).launches[1].key
    ref = run(op.pipeline(**cfg), t)
    torch.cuda.synchronize()
    assert ("BV", 32) in op.pipeline(**cfg).launches[1].key
    assert torch.equal(o, ref["o"]) and torch.equal(ht, ref["ht"])


@pytest.mark.cuda
@pytest.mark.parametrize("case", range(4))
def test_gpu_state_block_v64_bit_identical(case, monkeypatch):
    """The state pass with V-blocks of 64 (what ``kernels.chunk_fwd.inference_options`` picks at some sequences x
    heads counts between whole waves, e.g. 192) gives o and the final state bit-identical to the default V-blocks:
    its products sum over K and over a chunk's rows, never over V (``kernels/build.py``'s ``_BV_CASES``: dense bf16
    GVA, packed sequences with an empty and a one-token one, K = 64 and the in-kernel L2 norm, fp16 with bf16 g,
    K = V = 64). And
    (case 0) the public torch call at B = 6, H = 32 (192 heads: between whole waves of the wide pass) runs it and
    equals the default's bit for bit."""
    import torch

    from kernels import registry, torch_api

    cfg, t, _ = _bv_case(7 + case, case)
    op = registry.get("chunk_gdn2")
    runs = [torch_api.run_pipeline(op.pipeline(**cfg, **opt), t) for opt in ({}, {"block_v": 64})]
    torch.cuda.synchronize()
    assert ("BV", 64) in op.pipeline(**cfg, block_v=64).launches[1].key
    for n in ("o", "ht"):
        assert bool(torch.isfinite(runs[0][n].float()).all()), n
        assert torch.equal(runs[0][n], runs[1][n]), (n, float((runs[0][n].float() - runs[1][n].float()).abs().max()))
    if case == 0:
        _assert_public_call_takes(6, {"block_v": 64}, monkeypatch)


@pytest.mark.cuda
@pytest.mark.parametrize("case", range(4))
def test_gpu_state_two_warpgroups_bit_identical(case, monkeypatch):
    """The state pass with two warpgroups and one V-block per head (``state_threads=256``, ``block_v=V``) gives o
    and the final state bit-identical to the default launch on ``_BV_CASES`` (its products sum over K and a chunk's
    rows, as before; dense GVA, packed sequences with an empty and a one-token one, the in-kernel L2 norm, fp16 with
    bf16 g, K = V = 64). And (case 0) the public torch call at B = 8, H = 32 runs that launch
    (``kernels.chunk_fwd.inference_options``) and equals the default's (V-blocks of 32) bit for bit."""
    import torch

    from kernels import registry, torch_api
    from kernels.chunk_fwd import STATE_WIDE_OPTIONS

    cfg, t, V_ = _bv_case(11 + case, case)
    op = registry.get("chunk_gdn2")
    two = op.pipeline(**cfg, block_v=V_, state_threads=256)
    assert ("threads", 256) in two.launches[1].key and ("BV", V_) in two.launches[1].key
    runs = [torch_api.run_pipeline(pipe, t) for pipe in (op.pipeline(**cfg), two)]
    torch.cuda.synchronize()
    for n in ("o", "ht"):
        assert bool(torch.isfinite(runs[0][n].float()).all()), n
        assert torch.equal(runs[0][n], runs[1][n]), (n, float((runs[0][n].float() - runs[1][n].float()).abs().max()))
    if case == 0:  # the public call at 8 sequences x 32 heads (K = V = 128) takes this launch
        assert STATE_WIDE_OPTIONS == {"block_v": 128, "state_threads": 256}
        _assert_public_call_takes(8, STATE_WIDE_OPTIONS, monkeypatch)


@pytest.mark.cuda
@pytest.mark.parametrize("case", range(4))
def test_gpu_state_async_bit_identical(case):
    """The state pass with its products issued asynchronously (``state_async``, the default: ``T.wgmma_gemm`` with
    one ``T.wait_wgmma`` per group, each loaded tile's slot released only after the wait for its product) gives o,
    the final state and, in the training forward (``save_states``), the per-chunk states ``h`` and ``v_new``
    bit-identical to the synchronous launch (``state_async=False``): the same products summed in the same order.
    ``_BV_CASES`` (dense GVA, packed sequences with an empty and a one-token one, the in-kernel L2 norm, fp16 with
    bf16 g, K = V = 64), with the default V-blocks and with two warpgroups; then 3 runs of a 128-chunk sequence (B1
    T8192 H4) with the default V-blocks, with two warpgroups (the batched shapes' launch) and in the training forward,
    where a slot refilled while its product still read it would show."""
    import torch

    from kernels import defaults, registry, torch_api

    cfg, t, V_ = _bv_case(23 + case, case)
    used = _used_slots(t["cu_seqlens"].tolist()) if "cu_seqlens" in t else None  # (h's written chunk slots)
    op = registry.get("chunk_gdn2")
    pairs = [({"state_async": False}, {}), ({"block_v": V_, "state_threads": 256, "state_async": False},
                                             {"block_v": V_, "state_threads": 256}),
             ({"save_states": True, "state_async": False}, {"save_states": True})]
    assert defaults.FORWARD["state_async"]  # (the default launches are the asynchronous ones)
    for base, opts in pairs:
        assert ("async_mma", True) in op.pipeline(**cfg, **opts).launches[1].key
        assert ("async_mma", True) not in op.pipeline(**cfg, **base).launches[1].key
        runs = [torch_api.run_pipeline(op.pipeline(**cfg, **o), t) for o in (base, opts)]
        torch.cuda.synchronize()
        _assert_runs_bit_identical(runs, used, base)
        if base.get("save_states"):
            assert {"h", "v_new"} <= set(runs[0])
    if case == 0:  # (every output of each launch; dense, so every chunk slot of h is written)
        cfg, t = _prefetch_case(31, None, 1, 8192, 4, 4, 128, 128, False, "bfloat16", "float32", "spec")
        t["h0"] = _torch(np.random.default_rng(31).standard_normal((1, 4, 128, 128)).astype(np.float32))
        for opts in ({}, {"block_v": 128, "state_threads": 256}, {"save_states": True}):
            ref = torch_api.run_pipeline(op.pipeline(**cfg, **opts, state_async=False), t)
            for _ in range(3):
                got = torch_api.run_pipeline(op.pipeline(**cfg, **opts), t)
                torch.cuda.synchronize()
                assert set(got) == set(ref), (opts, sorted(got), sorted(ref))
                for n in ref:
                    assert torch.equal(got[n], ref[n]), (opts, n)


@pytest.mark.cuda
@pytest.mark.parametrize("case", range(5))
def test_gpu_heads_first_bit_identical(case):
    """The launches' grids with the value head fastest (``intra_heads_first``, the default; ``state_heads_first``,
    the default of the two-warpgroup pass) give every output bit-identical to the grids of chunk slots x heads
    (both off): o and the final state with the default V-blocks (launch 1's order alone, then both, the state
    pass's several V-blocks per head included), with two warpgroups, and ``h`` / ``v_new`` in the training forward
    with both. ``kernels.build._HEADS_FIRST_CASES``: ``_BV_CASES`` (dense GVA, packed sequences with an empty and a
    one-token one, the in-kernel L2 norm, fp16 with bf16 g, K = V = 64) and HV = 3 (not a power of two); the head
    of block ``i`` is ``i % HV``, so GVA (``HV > H``) checks the mapping of value heads to q / k heads too."""
    import torch

    from kernels import defaults, registry, torch_api

    cfg, t, V_ = _bv_case(51 + case, case)
    used = _used_slots(t["cu_seqlens"].tolist()) if "cu_seqlens" in t else None  # (h's written chunk slots)
    op = registry.get("chunk_gdn2")
    assert defaults.FORWARD["intra_heads_first"]
    rows = {"intra_heads_first": False, "state_heads_first": False}
    for base in ({}, {"state_heads_first": True}, {"block_v": V_, "state_threads": 256},
                 {"save_states": True, "state_heads_first": True}):
        on = op.pipeline(**cfg, **base).launches
        assert ("heads_first", True) in on[0].key
        assert (("heads_first", True) in on[1].key) == ("state_threads" in base or "state_heads_first" in base)
        runs = [torch_api.run_pipeline(op.pipeline(**cfg, **dict(base, **rows)), t),
                torch_api.run_pipeline(op.pipeline(**cfg, **base), t)]
        torch.cuda.synchronize()
        _assert_runs_bit_identical(runs, used, base)


@pytest.mark.cuda
def test_gpu_vmap_chunk_takes_the_folded_batch_launch():
    """``jax.vmap`` of the jitted public ``chunk_gdn2`` over 8 problems of one sequence (H = 32, K = V = 128) runs as
    one call of 8 sequences, which takes the two-warpgroup state pass (``inference_options``); its o and final
    state equal the 8 problems called one by one (V-blocks of 32) and one B = 8 call, bit for bit."""
    import re

    import gdn2_jax
    from kernels import _compile, registry
    from kernels.chunk_fwd import STATE_WIDE_OPTIONS

    M, T, H, D = 8, 100, 32, 128
    xs = [_gpu_inputs(60 + i, 1, T, H, H, D, D, False, "spec") for i in range(M)]
    x = {n: jnp.asarray(np.stack([np.asarray(a[n], np.float32) for a in xs]),
                        jnp.float32 if n in ("g", "h0") else jnp.bfloat16)
         for n in ("q", "k", "v", "g", "b", "w", "h0")}

    def f(q, k, v, g, b, w, h0):
        return gdn2_jax.chunk_gdn2(q, k, v, g, b, w, initial_state=h0, output_final_state=True, backend="tilelang")

    args = [x[n] for n in ("q", "k", "v", "g", "b", "w", "h0")]
    vf = jax.jit(jax.vmap(f))
    cfg = registry.config(H=H, HV=H, K=D, V=D, dtype="bfloat16", g_dtype="float32", scale=D ** -0.5,
                          use_initial_state=True, output_final_state=True, varlen=False, use_qk_l2norm=False)
    wide = registry.get("chunk_gdn2").pipeline(**cfg, **STATE_WIDE_OPTIONS).launches[1]
    targets = re.findall(r"custom_call @(\w+)\(", vf.lower(*args).as_text())
    assert any(t.startswith(_compile.target_name(wide, _compile.device_arch(0))) for t in targets), targets
    ov, hv = vf(*args)
    one = [jax.jit(f)(*(a[i] for a in args)) for i in range(M)]
    ob, hb = jax.jit(f)(*(a[:, 0] for a in args[:6]), args[6][:, 0])
    assert bool(jnp.isfinite(ov.astype(jnp.float32)).all())
    assert bool(jnp.array_equal(ov, jnp.stack([o for o, _ in one])))
    assert bool(jnp.array_equal(hv, jnp.stack([h for _, h in one])))
    assert bool(jnp.array_equal(ov[:, 0], ob)) and bool(jnp.array_equal(hv[:, 0], hb))


@pytest.mark.cuda
@pytest.mark.parametrize("varlen", [False, True])
def test_gpu_intra_aqk_split_residual_vs_twin(varlen):
    """With ``aqk_split`` (the default) launch 1 also stores the bf16 rounding residual of Aqk's diagonal 16 x 16
    blocks (``AqkL [B, T, HV, 16]``): Aqk itself is unchanged (bit-identical to the launch without it), and on the
    diagonal blocks Aqk + AqkL is closer to the xla twin's fp32 scores than Aqk alone (a residual stored at the
    wrong columns or rows would not be). Dense T = 200, and packed sequences of 0, 70 and 130 tokens (whose chunks
    start at each sequence's start: the twin runs per sequence)."""
    import torch

    from gdn2_jax import xla
    from kernels import registry, torch_api

    H, HV, K_, V_ = 2, 4, 128, 128
    cu, (B, T, N), x, cfg = _packed_case(11, varlen, H, HV, K_, V_)
    t = {n: _torch(a) for n, a in x.items()}
    if varlen:
        t["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device="cuda")
    base = torch_api.run_pipeline(registry.get("chunk_gdn2").pipeline(**cfg, aqk_split=False), t,
                                  return_scratch=True)
    split = torch_api.run_pipeline(registry.get("chunk_gdn2").pipeline(**cfg), t, return_scratch=True)
    torch.cuda.synchronize()
    assert torch.equal(base["Aqk"], split["Aqk"])
    assert tuple(split["AqkL"].shape) == (B, T, HV, 16)
    his, twins, lows = [], [], []
    for s0, s1 in (zip(cu[:-1], cu[1:]) if varlen else [(0, T)]):
        if s1 == s0:
            continue
        with jax.default_device(jax.devices("cpu")[0]):
            twin = np.asarray(xla.intra_stage(*(jnp.asarray(x[n][:, s0:s1]) for n in ("q", "k", "v", "g", "b", "w")),
                                              scale=K_ ** -0.5)["Aqk"])
        twins.append(_residual_blocks(twin))
        his.append(_residual_blocks(_np(split["Aqk"][:, s0:s1]).astype(np.float64)))
        lows.append(_np(split["AqkL"][:, s0:s1]))
    hi, twin, low = (np.concatenate(a, axis=1) for a in (his, twins, lows))
    r_hi = _gpu_rms(hi, twin)
    r_sum = _gpu_rms(hi + low, twin)
    assert r_sum < 0.7 * r_hi, (r_sum, r_hi)


@pytest.mark.cuda
@pytest.mark.parametrize("seed", [0, 1])
def test_gpu_z_split_brings_o_and_state_closer_to_fp64(seed):
    """``z_split`` (session 16, the default since 17: U = A Z_hi + A Z_lo, Z = w v exact) against the same pipeline
    without it, both against the fp64 token loop on the same quantised inputs (the benchmark's accuracy case, spec
    distribution, B1 T512 H4): o and the final state must both get closer to fp64, and launch 1 with ``z_split``
    must give the same bits with and without ``intra_prefetch`` (its promise); the training forward's
    ``qg_split`` (QGL stored for the backward) leaves every other output and scratch buffer bit-identical."""
    import torch

    from benchmarks import bench_lib as L
    from kernels import registry, torch_api

    B, T, H, D = 1, 512, 4, 128
    x = L.torch_inputs(B, T, H, H, seed=seed, g_scale=1.0)
    L.torch_sync()
    ref_o, ref_s = L.oracle_np(*(L.tnp(x[n]) for n in L.ARGS), L.tnp(x["h0"]), D ** -0.5)
    cfg = registry.config(H=H, HV=H, K=D, V=D, dtype="bfloat16", g_dtype="float32", scale=D ** -0.5,
                          use_initial_state=True, output_final_state=True, varlen=False, use_qk_l2norm=False)
    op = registry.get("chunk_gdn2")
    err, runs = {}, {}
    for zs, pre in ((False, True), (True, True), (True, False)):
        runs[zs, pre] = torch_api.run_pipeline(op.pipeline(**cfg, z_split=zs, intra_prefetch=pre), x,
                                               return_scratch=True)
    for zs in (False, True):
        err[zs] = (L.rms(L.tnp(runs[zs, True]["o"]), ref_o), L.rms(L.tnp(runs[zs, True]["ht"]), ref_s))
    assert err[True][0] < err[False][0] and err[True][1] < err[False][1], err
    for n, a in runs[True, True].items():  # (dense T = 512: every element of every buffer is written)
        assert torch.equal(a, runs[True, False][n]), n
    tr = {qs: torch_api.run_pipeline(op.pipeline(**cfg, save_states=True, qg_split=qs), x, return_scratch=True)
          for qs in (False, True)}
    torch.cuda.synchronize()
    assert "QGL" in tr[True] and "QGL" not in tr[False]
    for n, a in tr[False].items():
        assert torch.equal(a, tr[True][n]), n
    qg, qgl = (tr[True][n].double() for n in ("QG", "QGL"))
    assert bool((qgl.abs() <= qg.abs() * 2.0 ** -8).all())  # a rounding residual: at most half a bf16 ulp


def _dstate_twin(Aqk, Y, QG, KG, gam, do, dht):
    """fp64 reverse dS pass of one sequence (token-major [L, HV, .] arrays, gam [nc, HV, K]): the xla stages
    ``chunk_o.o_bwd`` (dR_o = Aqk^T dO, dS0_o = QG^T dO) and ``chunk_delta_h.state_bwd_recurrent`` per chunk, last
    to first. Rows past L are zero. Returns (dh [nc, HV, K, V], dv [L, HV, V], dh0 [HV, K, V])."""
    from gdn2_jax.xla import layout

    L = do.shape[0]
    nc = gam.shape[0]
    with jax.default_device(jax.devices("cpu")[0]), jax.enable_x64(True):
        ch = {n: layout.dense_to_chunks(jnp.asarray(np.asarray(a, np.float64))[None], 64)[:, 0]
              for n, a in (("Aqk", Aqk), ("Y", Y), ("QG", QG), ("KG", KG), ("do", do))}  # [nc, HV, C, .]
        dS = jnp.asarray(np.asarray(dht, np.float64))
        dh, dR = [None] * nc, [None] * nc
        for c in reversed(range(nc)):
            dh[c] = dS
            _, dS0_o, _, dR_o = o_bwd(ch["QG"][c], jnp.zeros_like(dS), ch["Aqk"][c], ch["do"][c], ch["do"][c])
            dS, dR[c] = state_bwd_recurrent(ch["Y"][c], ch["KG"][c], jnp.asarray(gam[c], jnp.float64), dR_o, dS0_o,
                                            dS)
        dv = np.asarray(layout.dense_from_chunks(jnp.stack(dR)[:, None], L)[0])
        return np.asarray(jnp.stack(dh)), dv, np.asarray(dS)


_DSTATE_OPTS = ({}, {"split_ds": True}, {"split_ds": True, "split_dr": True}, {"split_ds": True, "qg_split": True})


@pytest.mark.cuda
@pytest.mark.parametrize("varlen,opts", [(v, o) for o in _DSTATE_OPTS for v in (False, True)])
def test_gpu_dstate_launch_vs_xla_twin(varlen, opts):
    """``gdn2_chunk_dstate`` (the reverse state-gradient pass), fed the training forward's own scratch (Aqk + AqkL,
    Y, QG, KG, GAM and, with ``qg_split``, QG's rounding residual QGL) and random dO / dht, against the fp64 twin
    on the same values (QG + QGL with ``qg_split``): every chunk's end-state gradient ``dh``, ``dv`` (= dR) and
    ``dh0``; NaN-poisoned outputs; bit-identical reruns. Dense T = 200 (a partial last chunk) and packed sequences
    of 0, 70, 130 tokens; the options off, ``split_ds`` (dS as 16-bit value plus residual), with ``split_dr`` (dR
    too: session 15's default) and with ``qg_split`` (the training backward's default since session 17). With
    ``qg_split`` dh and dh0 must be within 1e-3 of the twin fed QG + QGL (measured on the H200, session 17: dh0
    5.3e-4 dense, 6.3e-4 for the 130-token sequence; the CPU emulation's ~1e-4 left out rounding points of the
    state pass) and dh0 nearer to it than to the twin fed QG alone (at most 0.95 times as far), which QGL's product
    corrects: a kernel that ignored QGL would sit nearer the QG-only twin. (Session 17's "half as far" failed on the
    GPU: 0.67 and 0.91 of the distance; the kernel's other rounding is of the size of QG's.)"""
    import torch

    from kernels import registry, torch_api
    from kernels.chunk_bwd import chunk_dstate_pipeline

    H, HV, K_, V_ = 2, 4, 128, 128
    cu, (B, T, N), x, cfg = _packed_case(21, varlen, H, HV, K_, V_)
    qgs = bool(opts.get("qg_split"))
    t, fwd = _training_forward(registry.get("chunk_gdn2"), dict(cfg, qg_split=qgs), x, cu)
    rng = np.random.default_rng(23)
    do = _bf16(rng.standard_normal((B, T, HV, V_)))
    dht = rng.standard_normal((N, HV, K_, V_)).astype(np.float32)
    pipe = chunk_dstate_pipeline(HV=HV, K=K_, V=V_, dtype="bfloat16", use_dht=True, varlen=varlen, **opts)
    scn = ("Aqk", "AqkL", "Y", "QG", "KG", "GAM") + (("QGL",) if qgs else ())
    assert ("QGL" in pipe.inputs) == qgs
    ins = {n: fwd[n] for n in scn}
    ins.update(do=_torch(do), dht=_torch(dht))
    if varlen:
        ins["cu_seqlens"] = t["cu_seqlens"]
    shapes = pipe.buffer_shapes({n: tuple(a.shape) for n, a in ins.items()})

    def run():
        out = {b.name: torch.full(shapes[b.name], float("nan"), device="cuda") for b in pipe.outputs}
        return torch_api.run_pipeline(pipe, ins, out=out)

    r1, r2 = run(), run()
    torch.cuda.synchronize()
    for n in ("dh", "dv", "dh0"):  # (chunk slots no sequence uses stay NaN, in both runs)
        torch.testing.assert_close(r1[n], r2[n], rtol=0, atol=0, equal_nan=True, msg=n)
    got = {n: _np(r1[n]) for n in ("dh", "dv", "dh0")}
    sc = {n: _np(fwd[n]) for n in scn}
    qg = sc["QG"].astype(np.float64) + (sc["QGL"] if qgs else 0.0)
    starts = cu[:-1] if varlen else [0] * N
    lens = np.diff(cu) if varlen else [T] * N
    for n_ in range(N):
        bb, s0, L = (0 if varlen else n_), starts[n_], lens[n_]
        nc = -(-L // 64)
        slot0 = n_ + s0 // 64 if varlen else 0
        if L == 0:  # an empty sequence: dh0 is its dht
            np.testing.assert_array_equal(got["dh0"][n_], dht[n_])
            continue
        tk = slice(s0, s0 + L)
        aqk = sc["Aqk"][bb, tk].astype(np.float64) + _spread_residual(sc["AqkL"][bb, tk])  # (rows from s0)
        dh, dv, dh0 = _dstate_twin(aqk, sc["Y"][bb, tk], qg[bb, tk], sc["KG"][bb, tk],
                                   sc["GAM"][bb, slot0:slot0 + nc], np.asarray(do[bb, tk], np.float32), dht[n_])
        if qgs:  # the twin without QGL's product: the kernel must be nearer the twin with it
            _, _, dh0_q = _dstate_twin(aqk, sc["Y"][bb, tk], sc["QG"][bb, tk], sc["KG"][bb, tk],
                                       sc["GAM"][bb, slot0:slot0 + nc], np.asarray(do[bb, tk], np.float32), dht[n_])
        for name, a, ref in (("dh", got["dh"][bb, slot0:slot0 + nc], dh), ("dv", got["dv"][bb, tk], dv),
                             ("dh0", got["dh0"][n_], dh0)):
            r = _gpu_rms(a, ref)
            assert r <= (1e-3 if qgs and name != "dv" else 1e-2), (n_, name, r)
            if qgs and name == "dh0":  # (mid-sequence dh: both ~4e-5 here, session 17; QG's rounding is in dh0)
                r_q = _gpu_rms(a, dh0_q)  # (session 18, H100: r / r_q = 0.67 dense, 0.91 for the 70-token sequence)
                assert r <= 0.95 * r_q, (n_, name, r, "vs the twin without QGL:", r_q)


@pytest.mark.cuda
@pytest.mark.parametrize("varlen", [False, True])
def test_gpu_tf32_rounded_states_and_dr(varlen):
    """``wy_tf32_round="dy"`` / ``"dy_min"``'s producers (sessions 18-19): the training forward with
    ``tf32_states`` stores every chunk start state ``h`` and the solve ``Akk`` as TF32 values (the low 13 mantissa
    bits zero) and the reverse state pass with ``tf32_dr`` stores dR (``dv_new``) so; without the options some of
    those bits are set (the stores are not rounded). The rounded values are each within half a TF32 ulp of the
    unrounded run's (same inputs, same arithmetic before the store): ``_common.tf32_nearest``'s arithmetic
    rounding survives ``ptxas`` (session 18's first form compiled to the identity). Dense T = 200 and packed 0 /
    70 / 130 tokens."""
    import torch

    from kernels import registry, torch_api
    from kernels.chunk_bwd import training_forward_options

    H, HV, K_, V_ = 2, 4, 128, 128
    cu, (B, T, N), x, cfg = _packed_case(41, varlen, H, HV, K_, V_)
    op = registry.get("chunk_gdn2")
    do = _torch(_bf16(np.random.default_rng(43).standard_normal((B, T, HV, V_))))
    got = {}
    mode = "dy_min"  # (the producers are the same for "dy")
    for m in (False, mode):
        bwd = op.backward_pipeline(**cfg, wy_tf32_round=m)
        t, fwd = _training_forward(op, dict(cfg, **training_forward_options(bwd)), x, cu)
        ins = {n: (fwd[n] if n in fwd else t[n]) for n in bwd.inputs if n not in ("do", "dht")}
        ins.update(do=do, dht=torch.zeros_like(fwd["ht"]))
        r = torch_api.run_pipeline(bwd, ins, return_scratch=True)
        torch.cuda.synchronize()
        used = _used_slots(cu) if varlen else slice(None)
        got[m] = dict(h=fwd["h"][:, used], Akk=fwd["Akk"], dR=r["dv_new"])
    for n in ("h", "Akk", "dR"):
        on, off = got[mode][n], got[False][n]
        assert torch.isfinite(on).all() and on.numel() > 0, n
        assert ((on.view(torch.int32) & 0x1FFF) == 0).all(), n
        assert ((off.view(torch.int32) & 0x1FFF) != 0).any(), n
        ulp = torch.ldexp(torch.ones_like(off), torch.frexp(off).exponent - 11)  # (TF32: 11 significant bits)
        assert ((on - off).abs() <= 0.5 * ulp).all(), n


def _packed_case(seed, varlen, H, HV, K_, V_, gdist="spec", dtype="bfloat16", g_dtype="float32", l2=False):
    """The case of the GPU backward-stage tests: dense B2 T200, or packed sequences of 0, 70 and 130 tokens
    (``cu``); inputs ``_gpu_inputs(seed, ..., gdist)`` (float32 / bf16-valued numpy) with a random fp32 initial
    state (seed + 1); the registry configuration with h0 and ht on. Returns ``cu, (B, T, N), x, cfg``."""
    from kernels import registry

    cu = [0, 0, 70, 200] if varlen else None
    B, T, N = (1, 200, 3) if varlen else (2, 200, 2)
    x = _gpu_inputs(seed, B, T, H, HV, K_, V_, False, gdist)
    x["h0"] = np.random.default_rng(seed + 1).standard_normal((N, HV, K_, V_)).astype(np.float32)
    cfg = registry.config(H=H, HV=HV, K=K_, V=V_, dtype=dtype, g_dtype=g_dtype, scale=K_ ** -0.5,
                          use_initial_state=True, output_final_state=True, varlen=varlen, use_qk_l2norm=l2)
    return cu, (B, T, N), x, cfg


def _training_forward(op, cfg, x, cu):
    """The inputs ``x`` (numpy) as CUDA tensors (with ``cu_seqlens`` when ``cu`` is given) and the training
    forward's outputs with its scratch (what the backward pipeline reads)."""
    import torch

    from kernels import torch_api

    t = {n: _torch(a) for n, a in x.items()}
    if cu is not None:
        t["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device="cuda")
    return t, torch_api.run_pipeline(op.pipeline(**cfg, save_states=True), t, return_scratch=True)


_CAST_CASES = [  # (H, HV, K, V, dtype, g_dtype, l2, varlen): the configurations of kernels/build.py's `casts`
    (2, 2, 128, 128, "bfloat16", "float32", False, False), (2, 4, 128, 128, "bfloat16", "float32", False, True),
    (2, 2, 64, 128, "bfloat16", "bfloat16", True, False), (1, 1, 128, 64, "float16", "float32", False, False)]


@pytest.mark.cuda
@pytest.mark.parametrize("H,HV,K_,V_,dtype,g_dtype,l2,varlen", _CAST_CASES)
def test_gpu_cast_grads_bit_identical_to_casting_fp32(H, HV, K_, V_, dtype, g_dtype, l2, varlen):
    """``cast_grads`` (the default): the backward launches store the gradients they finish in their inputs'
    dtypes, and each is bit for bit the fp32 gradient of ``cast_grads=False`` cast with torch's round to nearest
    (what jnp's ``astype`` did after the kernels). Which ones are cast: dv, dw, db always; dg when g is 16-bit;
    dq, dk unless GVA (HV > H) or the in-kernel l2 norm leaves a jnp step (then both runs give the same fp32
    values). Into NaN-poisoned outputs (every element written); dense T = 200 and packed 0 / 70 / 130 tokens."""
    import torch

    from kernels import registry, torch_api

    cu, (B, T, N), x, cfg = _packed_case(41, varlen, H, HV, K_, V_, "swept", dtype, g_dtype, l2)
    if dtype == "float16":
        x.update({n: np.asarray(x[n], np.float32).astype(np.float16) for n in "qkvbw"})
    if g_dtype == "bfloat16":
        x["g"] = _bf16(x["g"])
    op = registry.get("chunk_gdn2")
    t, fwd = _training_forward(op, cfg, x, cu)
    rng = np.random.default_rng(43)
    do = torch.from_numpy(rng.standard_normal((B, T, HV, V_)).astype(np.float32)).to("cuda", t["v"].dtype)
    dht = torch.from_numpy(rng.standard_normal((N, HV, K_, V_)).astype(np.float32)).to("cuda")
    got = {}
    for cast in (True, False):
        pipe = op.backward_pipeline(**cfg, cast_grads=cast)
        ins = {n: (fwd[n] if n in fwd else t[n]) for n in pipe.inputs if n not in ("do", "dht")}
        ins.update(do=do, dht=dht)
        shapes = pipe.buffer_shapes({n: tuple(a.shape) for n, a in ins.items()})
        out = {b.name: torch.full(shapes[b.name], float("nan"), device="cuda", dtype=torch_api._torch_dtype(b.dtype))
               for b in pipe.outputs}
        got[cast] = torch_api.run_pipeline(pipe, ins, out=out)
    torch.cuda.synchronize()
    qk = HV == H and not l2
    want = dict(dq=dtype if qk else "float32", dk=dtype if qk else "float32", db=dtype, dv=dtype, dw=dtype,
                dg=g_dtype, dh0="float32")
    for n, dt in want.items():
        a, b = got[True][n], got[False][n]
        assert a.dtype == torch_api._torch_dtype(dt) and b.dtype == torch.float32, (n, a.dtype, b.dtype)
        assert torch.isfinite(a).all(), n
        torch.testing.assert_close(a, b.to(a.dtype), rtol=0, atol=0, msg=n)


_BWD_VARIANTS = ({}, {"cast_grads": False}, {"intra_v2": False}, {"intra_v2": False, "reg_diag": True}, {"intra_tc": True}, {"intra_fast_diag": True},
                 {"intra_tc": True, "intra_fast_diag": True},
                 {"wy_load": "async", "wy_threads": 512},
                 {"wy_load": "async", "wy_threads": 256},
                 {"wy_load": "tma", "wy_threads": 256}, {"wy_load": "sync", "wy_threads": 256},
                 {"wy_load": "sync", "wy_threads": 512},
                 {"wy_load": "sync", "wy_tf32_round": True}, {"wy_tf32_round": "dy"}, {"wy_tf32_round": "dy_min"},
                 {"split_ds": False, "split_dr": False},
                 {"split_dr": False},
                 {"qg_split": True, "split_dr": False}, {"z_split": True, "qg_split": True, "split_dr": False})


@pytest.mark.cuda
@pytest.mark.parametrize("varlen,gdist,opts", [(v, g, o) for o in _BWD_VARIANTS
                                               for v, g in ((False, "spec"), (True, "swept"))])
def test_gpu_local_bwd_launches_vs_xla_twin(varlen, gdist, opts):
    """The chunk-parallel backward launches (``gdn2_chunk_bwd_wy`` + ``gdn2_chunk_bwd_intra``, after the reverse
    state pass, ``kernels/chunk_bwd.py``), fed the training forward's own scratch and states, against their xla twin
    ``xla.chunk.chunk_backward_from_states`` (fp32 jnp on the CPU) on the same h, v_new, dh and dR: the six
    gradients (dq, dk summed over the GVA groups here) by RMS ratio; NaN-poisoned outputs (every element written);
    bit-identical reruns. Dense T = 200 (a partial last chunk; gates of the spec distribution) and packed
    sequences of 0, 70, 130 tokens (gates swept down to -60, mixed within a chunk); the default launches and the
    options of ``chunk_bwd_pipeline`` (intra version 1 with and without ``reg_diag``, version 2 with
    ``intra_tc`` and / or ``intra_fast_diag``; the WY launch's ``wy_load`` pipelines and ``wy_tf32_round`` (True,
    ``"dy"``, ``"dy_min"``); ``split_ds``, ``split_dr``, ``qg_split`` and the training forward's ``z_split``)."""
    import torch

    from gdn2_jax.xla import chunk as xc
    from kernels import registry, torch_api
    from kernels.chunk_bwd import training_forward_options

    H, HV, K_, V_ = 2, 4, 128, 128
    cu, (B, T, N), x, cfg = _packed_case(31, varlen, H, HV, K_, V_, gdist)
    op = registry.get("chunk_gdn2")
    pipe = op.backward_pipeline(**cfg, **opts)
    # (the training forward with the variant's forward options; QGL when the variant's state pass reads it, h
    # rounded to TF32 when its WY launch expects that)
    fwd_opts = dict({n: opts[n] for n in ("z_split",) if n in opts}, **training_forward_options(pipe))
    t, fwd = _training_forward(op, dict(cfg, **fwd_opts), x, cu)
    rng = np.random.default_rng(33)
    do = _bf16(rng.standard_normal((B, T, HV, V_)))
    assert [la.name for la in pipe.launches] == ["gdn2_chunk_dstate", "gdn2_chunk_bwd_wy", "gdn2_chunk_bwd_intra"]
    ins = {n: (fwd[n] if n in fwd else t[n]) for n in pipe.inputs if n not in ("do", "dht")}
    ins.update(do=_torch(do), dht=_torch(rng.standard_normal((N, HV, K_, V_)).astype(np.float32)))
    shapes = pipe.buffer_shapes({n: tuple(a.shape) for n, a in ins.items()})

    def run():
        out = {b.name: torch.full(shapes[b.name], float("nan"), device="cuda", dtype=torch_api._torch_dtype(b.dtype))
               for b in pipe.outputs}
        return torch_api.run_pipeline(pipe, ins, out=out, return_scratch=True)

    r1, r2 = run(), run()
    torch.cuda.synchronize()
    names = ("dq", "dk", "dv", "dg", "db", "dw", "dh0")
    for n in names:
        torch.testing.assert_close(r1[n], r2[n], rtol=0, atol=0, msg=n)
    got = {n: _np(r1[n]) for n in names}
    for n in ("dq", "dk"):  # value head j read q/k head j // 2
        got[n] = got[n].reshape(B, T, H, 2, K_).sum(axis=3)
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        ref = xc.chunk_backward_from_states(
            K_ ** -0.5, HV // H, False, *(jnp.asarray(np.asarray(x[n], np.float32)) for n in "qkvgbw"),
            None if cu is None else jnp.asarray(cu, jnp.int32), *(jnp.asarray(_np(a)) for a in (
                fwd["h"], fwd["v_new"], r1["dh"], r1["dv_new"])), jnp.asarray(np.asarray(do, np.float32)))
    for name, a, r in zip(names, (got[n] for n in names), ref):
        e = _gpu_rms(a, np.asarray(r))
        assert e <= 5e-3, (name, e)

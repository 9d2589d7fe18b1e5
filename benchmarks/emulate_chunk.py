"""CPU emulation of the chunk-prefill kernels' rounding (``kernels/chunk_fwd.py``), to predict accuracy changes
before spending GPU time. A development probe, not a test: the real kernels are measured on the GPU.

    python -m benchmarks.emulate_chunk [--seeds 0,1,2,3] [--T 512] [--H 4] [--ablations]
    python -m benchmarks.emulate_chunk --dstate [--seeds 0,1,2]     # dh0 of the reverse state pass

It recomputes launch 1 and launch 2 in numpy with every rounding point of the kernels: bf16 inputs and scratch
(Aqk, Y, U, QG, KG), fp32 cumulative decay (base 2), TF32 operands of the anchored products and of the Neumann
series of the solve, bf16 tensor-core products with fp32 accumulation, the per-slice choice between the fast
(TF32 diagonal blocks, anchor at row 8 of each sub-chunk) and the exact (fp32 diagonal sums) paths. TF32 operands
are either truncated (what ``mma.sync`` does with raw fp32 bits, as TileLang's ``T.gemm`` feeds them) or rounded
to nearest first. Products are accumulated in float64 (the fp32 accumulation error, ~1e-7, is below what is
compared). Inputs: spec §15's accuracy distribution on the CPU (not the GPU generator's values, so figures
differ from the benchmark's by the seed-to-seed spread); oracle: ``bench_lib.oracle_np`` (fp64 token loop).

Prints, per variant, the RMS ratio vs fp64 of o and the final state, per seed and on average. ``--ablations`` adds
variants that keep one scratch buffer in fp32, or split the state into bf16 hi + lo parts in the state kernel's
products, to show which rounding points carry the error.
"""

from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np

C, BC, DC = 64, 16, 32
LOG2E = 1.4426950408889634
HALF_RANGE = 50.0


def bf16(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def tf32(x, mode):
    """fp32 -> the value a TF32 tensor core uses: ``trunc`` (low 13 mantissa bits dropped) or ``rn``
    (round to nearest, ties away: add half an ulp of TF32, then truncate)."""
    u = np.asarray(x, np.float32).view(np.uint32)
    if mode == "rn":
        u = u + np.uint32(0x1000)
    return (u & np.uint32(0xFFFFE000)).view(np.float32)


def inputs(seed, B, T, H, K=128, V=128):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, H, K))
    k = rng.standard_normal((B, T, H, K))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    return dict(q=bf16(q), k=bf16(k), v=bf16(0.5 * rng.standard_normal((B, T, H, V))),
                g=rng.uniform(-5.0, -0.1, (B, T, H, K)).astype(np.float32),
                b=bf16(rng.uniform(0, 1, (B, T, H, K))), w=bf16(rng.uniform(0, 1, (B, T, H, V))),
                h0=rng.standard_normal((B, H, K, V)).astype(np.float32))


def intra(q, k, g, b, v, w, scale, *, diag, mode, exact_self=False, aqk_split=False, keep32=(), z_split=False,
          qg_split=False, solve="neumann"):
    """Launch 1 for one chunk of one head (rows [C, K]); returns Aqk, Y, U, QG, KG (bf16 values) and GAM.
    ``solve``: ``"neumann"`` (A = (I - N + N^2 - N^3) D, four TF32 products) or ``"blocked"`` (``blocked_solve``:
    the 16 x 16 off-diagonal blocks of the two 32 x 32 diagonal blocks in fp32, the lower 32 x 32 block as two
    TF32 products).
    ``z_split``: U from the exact w v (its bf16 rounding plus residual, two products); ``qg_split``: QG returned
    as bf16 plus its bf16 rounding residual (the training forward's QGL, summed here). ``aqk_split``: Aqk returned
    as bf16 plus its bf16 rounding residual (``AqkL``; ``"diag"``: of its diagonal 16 x 16 blocks only, session
    28's candidate)."""
    K = q.shape[-1]
    G = np.zeros((C, K), np.float32)
    for d0 in range(0, K, DC):  # the kernel's cumulative sum is per slice, in fp32
        G[:, d0:d0 + DC] = np.cumsum((g[:, d0:d0 + DC] * np.float32(LOG2E)).astype(np.float32), axis=0,
                                     dtype=np.float32)
    bk = (b * k).astype(np.float32)
    Qk = np.zeros((C, C))
    Tm = np.zeros((C, C))
    for d0 in range(0, K, DC):
        sl = slice(d0, d0 + DC)
        Gs = G[:, sl]
        fast = diag == "tf32" and all(
            np.max(np.abs(Gs[n:n + BC] - Gs[n + 8])) <= HALF_RANGE for n in range(0, C, BC))
        for ib in range(C // BC):
            n = ib * BC
            a = n + 8 if fast else n
            rows = slice(n, n + BC)
            fq = np.exp2(Gs[rows] - Gs[a]).astype(np.float32)
            QE = np.concatenate([scale * q[rows, sl] * fq, bk[rows, sl] * fq]).astype(np.float32)
            ncol = n + BC
            Kc = k[:ncol, sl] * np.exp2(np.minimum(Gs[a] - Gs[:ncol], 0.0)).astype(np.float32)
            if fast:
                Kc[n:ncol] = k[n:ncol, sl] * np.exp2(Gs[a] - Gs[n:ncol])
            else:
                Kc[n:ncol] = 0.0
            acc = tf32(QE, mode).astype(np.float64) @ tf32(Kc.astype(np.float32), mode).astype(np.float64).T
            Qk[rows, :ncol] += acc[:BC]
            Tm[rows, :ncol] += acc[BC:]
            if not fast:  # exact fp32 diagonal block
                e = np.exp2(np.minimum(Gs[rows][:, None, :] - Gs[rows][None, :, :], 0.0))
                Qk[rows, n:ncol] += scale * np.einsum("rd,sd,rsd->rs", q[rows, sl], k[rows, sl], e)
                Tm[rows, n:ncol] += np.einsum("rd,sd,rsd->rs", bk[rows, sl], k[rows, sl], e)
    r = np.arange(C)
    Qk = np.where(r[:, None] >= r[None, :], Qk, 0.0).astype(np.float32)
    Tm = np.where(r[:, None] > r[None, :], Tm, 0.0).astype(np.float32)
    if exact_self:
        Qk[r, r] = scale * np.sum(q.astype(np.float64) * k, axis=-1)
    # (I + T)^-1: diagonal blocks exact (fp32 forward substitution), then (I - N + N^2 - N^3) D in TF32
    D = np.zeros((C, C), np.float32)
    for n in range(0, C, BC):
        blk = slice(n, n + BC)
        D[blk, blk] = np.linalg.inv(np.eye(BC) + Tm[blk, blk].astype(np.float64)).astype(np.float32)
    blockr = r // BC
    Toff = np.where(blockr[:, None] > blockr[None, :], Tm, 0.0).astype(np.float32)

    def mm(x, y):
        return (tf32(x, mode).astype(np.float64) @ tf32(y, mode).astype(np.float64)).astype(np.float32)

    # with tf32_round the kernel stores N and N^2 rounded (they are products' operands), N^3 as computed
    rnd = (lambda x: tf32(x, "rn")) if mode == "rn" else (lambda x: x)
    if solve == "blocked":
        def mm32(x, y):  # fp32 SIMT products (accumulated exactly here)
            return (x.astype(np.float64) @ y.astype(np.float64)).astype(np.float32)

        X = D.copy()
        for p in range(0, C, 2 * BC):  # X_(i+1, i) = -D_(i+1) (T_(i+1, i) D_i), i = 0, 2
            rr, cc = slice(p + BC, p + 2 * BC), slice(p, p + BC)
            X[rr, cc] = -mm32(D[rr, rr], mm32(Tm[rr, cc], D[cc, cc]))
        # (the kernel's tf32_round would also store D and the level-1 blocks rounded: not emulated here)
        H2 = C // 2  # lower half: -X_BB (T_BA X_AA), TF32 operands (the kernel's P is fp32 in shared memory)
        X[H2:, :H2] = -mm(X[H2:, H2:], mm(Tm[H2:, :H2], X[:H2, :H2]))
        A = bf16(X)
    else:
        N1 = rnd(mm(D, Toff))
        N2 = rnd(mm(N1, N1))
        N3 = mm(N1, N2)
        M = (np.eye(C, dtype=np.float32) - N1 + N2 - N3).astype(np.float32)
        A = bf16(mm(M, D))
    Ebs = bf16(bk * np.exp2(G))
    Zs = (w * v).astype(np.float32) if z_split else bf16(w * v)  # (exact: two 8-bit significands)

    def st(name, val):  # scratch store: bf16 unless the ablation keeps it in fp32
        return np.asarray(val, np.float32) if name in keep32 else bf16(val)

    Y = st("Y", A.astype(np.float64) @ Ebs)
    U = st("U", A.astype(np.float64) @ Zs)
    QG = st("QG", scale * q * np.exp2(G))
    if qg_split:
        qg32 = (scale * q * np.exp2(G)).astype(np.float32)
        QG = QG.astype(np.float64) + bf16(qg32 - QG)
    KG = st("KG", k * np.exp2(G[-1] - G))
    Aqk = st("Aqk", Qk)
    if aqk_split:  # bf16 + its bf16 rounding residual (everywhere; "diag": diagonal blocks), two products
        blocks = aqk_split != "diag" or (np.arange(C)[:, None] // BC == np.arange(C)[None, :] // BC)
        Aqk = Aqk + np.where(blocks, bf16(Qk - Aqk), 0)
    return Aqk, Y, U, QG, KG, np.exp2(G[-1]).astype(np.float32)


def forward(x, scale, *, split_state=False, r32=False, **kw):
    """Both launches for dense inputs (T a multiple of 64, H == HV); returns (o, final state) as float64."""
    B, T, H, K = x["q"].shape
    V = x["v"].shape[-1]
    o = np.zeros((B, T, H, V))
    S_out = np.zeros((B, H, K, V))
    for bb in range(B):
        for h in range(H):
            S = x["h0"][bb, h].astype(np.float32)
            for c0 in range(0, T, C):
                t = slice(c0, c0 + C)
                Aqk, Y, U, QG, KG, GAM = intra(*(x[n][bb, t, h] for n in ("q", "k", "g", "b", "v", "w")), scale,
                                               **kw)
                Sb = bf16(S).astype(np.float64)
                if split_state:  # S as bf16 hi + bf16 lo in the products with the state (two bf16 products)
                    Sb = Sb + bf16(S - Sb).astype(np.float64)
                R = U - Y.astype(np.float64) @ Sb
                R = R.astype(np.float32).astype(np.float64) if r32 else bf16(R).astype(np.float64)
                O = QG.astype(np.float64) @ Sb + Aqk.astype(np.float64) @ R
                o[bb, t, h] = bf16(O)
                S = (S * GAM[:, None] + KG.astype(np.float64).T @ R).astype(np.float32)
            S_out[bb, h] = S
    return o, S_out


VARIANTS = {
    "v4 (exact diag, trunc)": dict(diag="exact", mode="trunc"),
    "v5 (tf32 diag, trunc)": dict(diag="tf32", mode="trunc"),
    "v5 + exact_self (trunc)": dict(diag="tf32", mode="trunc", exact_self=True),
    "v4 arithmetic, rn": dict(diag="exact", mode="rn"),
    "v5 arithmetic, rn": dict(diag="tf32", mode="rn"),
    "v5 + exact_self, rn": dict(diag="tf32", mode="rn", exact_self=True),
    "v5 + aqk_split (trunc)": dict(diag="tf32", mode="trunc", aqk_split=True),
    "v5 + all three options": dict(diag="tf32", mode="rn", exact_self=True, aqk_split=True),
    "v5 + aqk_split + z_split": dict(diag="tf32", mode="trunc", aqk_split=True, z_split=True),
    "+ blocked_solve (session 22)": dict(diag="tf32", mode="trunc", aqk_split=True, z_split=True, solve="blocked"),
    "  AqkL: diagonal blocks only": dict(diag="tf32", mode="trunc", aqk_split="diag", z_split=True,
                                         solve="blocked"),
}
ABLATIONS = {  # on top of "v5 + exact_self, rn": which rounding points carry the error
    "+ Aqk fp32": dict(keep32=("Aqk",)),
    "+ QG fp32": dict(keep32=("QG",)),
    "+ KG fp32": dict(keep32=("KG",)),
    "+ Y, U fp32": dict(keep32=("Y", "U")),
    "+ state split hi/lo": dict(split_state=True),
    "+ state split, Aqk fp32": dict(split_state=True, keep32=("Aqk",)),
    "+ R fp32": dict(r32=True),
    "+ Aqk, KG fp32": dict(keep32=("Aqk", "KG")),
    "+ Aqk, KG fp32, R fp32": dict(keep32=("Aqk", "KG"), r32=True),
}


def _split(x):
    hi = bf16(x).astype(np.float64)
    return hi + bf16(x - hi)


def dstate(x, do, dht, scale, *, split_ds=True, split_dr=True, **kw):
    """The reverse state pass (``kernels/chunk_bwd.py::_dstate_prim``) over the emulated forward scratch, dense
    inputs; returns dh0 [B, H, K, V]. dS and dR enter their products as bf16 (plus residuals with ``split_ds`` /
    ``split_dr``), the products accumulate exactly (float64 here)."""
    B, T, H, K = x["q"].shape
    out = np.zeros((B, H, K, do.shape[-1]))
    for bb in range(B):
        for h in range(H):
            dS = dht[bb, h].astype(np.float64)
            scr = [intra(*(x[n][bb, c0:c0 + C, h] for n in ("q", "k", "g", "b", "v", "w")), scale, **kw)
                   for c0 in range(0, T, C)]
            for ci in reversed(range(len(scr))):
                Aqk, Y, _, QG, KG, GAM = scr[ci]
                dO = do[bb, ci * C:(ci + 1) * C, h].astype(np.float64)
                Sb = _split(dS) if split_ds else bf16(dS).astype(np.float64)
                dR = (KG.astype(np.float64) @ Sb + Aqk.astype(np.float64).T @ dO).astype(np.float32)
                dRb = _split(dR) if split_dr else bf16(dR).astype(np.float64)
                dS = dS * GAM[:, None] + QG.astype(np.float64).T @ dO - Y.astype(np.float64).T @ dRb
            out[bb, h] = dS
    return out


DSTATE_VARIANTS = {  # forward intra options + state-pass options
    "session 15 default (split_ds = dS and dR)": dict(diag="tf32", mode="trunc", aqk_split=True),
    "dS split only": dict(diag="tf32", mode="trunc", aqk_split=True, split_dr=False),
    "qg_split, dS split (candidate)": dict(diag="tf32", mode="trunc", aqk_split=True, split_dr=False, qg_split=True),
    "qg_split + z_split, dS split": dict(diag="tf32", mode="trunc", aqk_split=True, split_dr=False, qg_split=True,
                                         z_split=True),
}


def main_dstate(seeds, T, H):
    """dh0's RMS ratio vs the fp64 gradient (``bench_lib.oracle_grads_fp64``) per :data:`DSTATE_VARIANTS`."""
    from benchmarks.bench_lib import oracle_grads_fp64, rms

    scale = 128 ** -0.5
    for seed in seeds:
        x = inputs(seed, 1, T, H)
        rng = np.random.default_rng(seed + 1000)
        do = bf16(rng.standard_normal((1, T, H, 128)))
        dht = rng.standard_normal((1, H, 128, 128)).astype(np.float32)
        ref = oracle_grads_fp64(x, do, dht, scale)["dh0"]
        for name, kw in DSTATE_VARIANTS.items():
            print(f"seed {seed} {name:44s} dh0 {rms(dstate(x, do, dht, scale, **kw), ref):.4e}", flush=True)


def main(argv=None):
    from benchmarks.bench_lib import oracle_np, rms

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2,3")
    ap.add_argument("--T", type=int, default=512)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--ablations", action="store_true")
    ap.add_argument("--dstate", action="store_true", help="dh0 of the reverse state pass instead (T 256, H 2 "
                    "unless given)")
    a = ap.parse_args(argv)
    if a.dstate:
        return main_dstate([int(s) for s in a.seeds.split(",")], a.T if a.T != 512 else 256, a.H if a.H != 4 else 2)
    scale = 128 ** -0.5
    variants = dict(VARIANTS)
    if a.ablations:
        base = VARIANTS["v5 + exact_self, rn"]
        variants.update({name: {**base, **kw} for name, kw in ABLATIONS.items()})
    res = {name: [] for name in variants}
    for seed in (int(s) for s in a.seeds.split(",")):
        x = inputs(seed, 1, a.T, a.H)
        ref_o, ref_s = oracle_np(*(x[n] for n in ("q", "k", "v", "g", "b", "w")), x["h0"], scale)
        for name, kw in variants.items():
            o, s = forward(x, scale, **kw)
            res[name].append((rms(o, ref_o), rms(s, ref_s)))
            print(f"seed {seed} {name:28s} o {res[name][-1][0]:.4e}  state {res[name][-1][1]:.4e}", flush=True)
    print("mean over seeds:")
    for name, v in res.items():
        print(f"  {name:28s} o {np.mean([t[0] for t in v]):.4e}  state {np.mean([t[1] for t in v]):.4e}")


if __name__ == "__main__":
    main()

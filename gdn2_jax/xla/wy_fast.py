"""Stage 3 of the chunk form: the WY auxiliaries and the gate-aware WY backward.

FLA ``fla/ops/gdn2/wy_fast.py`` (``recompute_w_u_fwd_gdn2``) and the WY part of
``chunk_gdn2_bwd_wy_dqkg_fused`` (``chunk_bwd.py``). Per chunk, with ``A = (I + T)^-1`` and the gates of stage 1::

    Ebar = gam * b * k,   Z = w * v                  (the two right-hand sides)
    Y = A Ebar            (FLA buffer ``w``; not the write gate)
    U = A Z               (FLA ``u``)
    QG = scale * gam * q  (FLA ``qg``),   KG = tail * k = exp(G_C - G) * k   (FLA ``kg``)

Backward, from the cotangents dY, dU, dQG, dKG (the state and output stages produce them)::

    dZ = A^T dU,   dEbar = A^T dY,   dA = dU Z^T + dY Ebar^T     (the gates live inside these products)
    dv = dZ * w,   dw = dZ * v,   db = dEbar gam k,   dk = dEbar gam b + tail dKG,   dq = scale gam dQG
    dG_r = Ebar_r dEbar_r + QG_r dQG_r - KG_r dKG_r,   dG_C += sum_r KG_r dKG_r  (through gam, tail)

Kernel twin: ``kernels/chunk_fwd.py`` launch 1 stores ``Y, U, QG, KG`` (input dtype, token-major ``[B, T, HV, ·]``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax

from .common import ein
from .cumsum import Gates

__all__ = ["WY", "wy_fwd", "wy_bwd"]


class WY(NamedTuple):
    """WY auxiliaries of one chunk (compute dtype)."""

    Ebar: jax.Array  # [..., C, K] gam * b * k
    Z: jax.Array     # [..., C, V] w * v
    Y: jax.Array     # [..., C, K] A Ebar
    U: jax.Array     # [..., C, V] A Z
    QG: jax.Array    # [..., C, K] scale * gam * q
    KG: jax.Array    # [..., C, K] tail * k


def wy_fwd(A, q, k, v, b, w, gates: Gates, scale: float) -> WY:
    """Forward of the stage: A ``[..., C, C]`` from the solve; q, k, b ``[..., C, K]``; v, w ``[..., C, V]``."""
    Ebar = gates.gam * b * k
    Z = w * v
    return WY(Ebar=Ebar, Z=Z, Y=ein("...rs,...sk->...rk", A, Ebar), U=ein("...rs,...sv->...rv", A, Z),
              QG=scale * gates.gam * q, KG=gates.tail * k)


def wy_bwd(A, k, v, b, w, gates: Gates, wy: WY, dY, dU, dQG, dKG, scale: float):
    """Backward of :func:`wy_fwd`. Cotangents dY, dQG, dKG ``[..., C, K]`` and dU ``[..., C, V]``.

    Returns ``(dq, dk, dv, db, dw, dG, dA)``: the WY share of the gradients w.r.t. q, k, v, b, w, the cumulative
    decay G ``[..., C, K]`` (the last row carries the G_C terms of ``tail``) and dA ``[..., C, C]`` (for
    ``chunk_intra.solve_bwd``).
    """
    dZ = ein("...rs,...rv->...sv", A, dU)       # A^T dU
    dEbar = ein("...rs,...rk->...sk", A, dY)    # A^T dY
    dA = ein("...rv,...sv->...rs", dU, wy.Z) + ein("...rk,...sk->...rs", dY, wy.Ebar)
    dk_tail = gates.tail * dKG
    dq = scale * gates.gam * dQG
    dk = dEbar * gates.gam * b + dk_tail
    db = dEbar * gates.gam * k
    dG = wy.Ebar * dEbar + wy.QG * dQG - k * dk_tail
    dG = dG.at[..., -1, :].add((k * dk_tail).sum(axis=-2))
    return dq, dk, dZ * w, db, dZ * v, dG, dA

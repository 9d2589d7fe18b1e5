"""Stage 4 of the chunk form: state passing across chunks (FLA ``chunk_gated_delta_rule_fwd_h`` / ``_bwd_dhu``).

Per chunk with start state ``S0`` ``[..., K, V]``::

    R      = U - Y S0                          (FLA ``v_new``: row r is the u_t of the token recurrence)
    S_next = Diag(gamC) S0 + KG^T R

Backward, from the end-state cotangent dS_end, the output's share dR_o of dR and its share dS0_o of dS0::

    dR  = dR_o + KG dS_end
    dS0 = Diag(gamC) dS_end + dS0_o - Y^T dR          (becomes dS_end of the previous chunk; dh0 for the first)
    dU  = dR,   dY = -dR S0^T,   dKG = R dS_end^T,   dG_C += gamC * rowsum(dS_end * S0)

Kernel twin: ``kernels/chunk_fwd.py`` launch 2 (``gdn2_chunk_state_o``), which keeps the fp32 state in registers
(per-chunk states never reach HBM) and fuses the output stage (``chunk_o``).
"""

from __future__ import annotations

import jax.numpy as jnp

from .common import ein

__all__ = ["state_fwd", "state_bwd", "state_bwd_recurrent", "state_bwd_parallel"]


def state_fwd(Y, U, KG, gamC, S0):
    """One chunk: Y, KG ``[..., C, K]``, U ``[..., C, V]``, gamC ``[..., K]``, S0 ``[..., K, V]``.

    Returns ``(R [..., C, V], S_next [..., K, V])`` in the compute dtype.
    """
    R = U - ein("...rk,...kv->...rv", Y, S0)
    S_next = gamC[..., :, None] * S0 + ein("...rk,...rv->...kv", KG, R)
    return R, S_next


def state_bwd_recurrent(Y, KG, gamC, dR_o, dS0_o, dS_end):
    """The sequential part of :func:`state_bwd` (FLA ``chunk_gated_delta_rule_bwd_dhu``): ``(dS0, dR)``.

    Only this needs the previous (later) chunk's result; everything else of the backward is chunk-parallel given
    the start states S0, R and the per-chunk dS_end (:func:`state_bwd_parallel`).
    """
    dR = dR_o + ein("...rk,...kv->...rv", KG, dS_end)
    dS0 = gamC[..., :, None] * dS_end + dS0_o - ein("...rk,...rv->...kv", Y, dR)
    return dS0, dR


def state_bwd_parallel(gamC, S0, R, dR, dS_end):
    """The chunk-parallel part of :func:`state_bwd`: ``(dY, dKG, dG_C)`` from the chunk's S0, R, dR and dS_end."""
    dY = -ein("...rv,...kv->...rk", dR, S0)
    dKG = ein("...rv,...kv->...rk", R, dS_end)
    dG_C = gamC * jnp.sum(dS_end * S0, axis=-1)
    return dY, dKG, dG_C


def state_bwd(Y, KG, gamC, S0, R, dR_o, dS0_o, dS_end):
    """Backward of :func:`state_fwd` for one chunk (shapes as there; dS_end, dS0_o ``[..., K, V]``, dR_o like R).

    Returns ``(dS0, dY, dU, dKG, dG_C)`` with dG_C ``[..., K]`` the gradient w.r.t. the chunk's last cumulative
    decay through gamC.
    """
    dS0, dR = state_bwd_recurrent(Y, KG, gamC, dR_o, dS0_o, dS_end)
    dY, dKG, dG_C = state_bwd_parallel(gamC, S0, R, dR, dS_end)
    return dS0, dY, dR, dKG, dG_C

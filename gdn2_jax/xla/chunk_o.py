"""Stage 5 of the chunk form: the output (FLA ``chunk_gla_fwd_o_gk``; backward ``chunk_kda_bwd_dAv`` + the
inter-chunk dq of ``chunk_gdn2_bwd_wy_dqkg_fused``).

Per chunk::

    O = QG S0 + Aqk R

Backward, from dO ``[..., C, V]``::

    dQG = dO S0^T,   dS0_o = QG^T dO,   dAqk = tril(dO R^T) (s <= r),   dR_o = Aqk^T dO

Kernel twin: the output of ``kernels/chunk_fwd.py`` launch 2 (``gdn2_chunk_state_o``, fused with the state pass).
"""

from __future__ import annotations

from .common import ein, masks

__all__ = ["o_fwd", "o_bwd", "o_bwd_local"]


def o_fwd(QG, S0, Aqk, R):
    """QG ``[..., C, K]``, S0 ``[..., K, V]``, Aqk ``[..., C, C]``, R ``[..., C, V]`` -> O ``[..., C, V]``."""
    return ein("...rk,...kv->...rv", QG, S0) + ein("...rs,...sv->...rv", Aqk, R)


def o_bwd(QG, S0, Aqk, R, dO):
    """Backward of :func:`o_fwd`: returns ``(dQG [..., C, K], dS0_o [..., K, V], dAqk [..., C, C], dR_o [..., C, V])``;
    dAqk is masked to the lower triangle with its diagonal (the entries Aqk can have)."""
    dQG, dAqk = o_bwd_local(S0, R, dO)
    dS0_o = ein("...rk,...rv->...kv", QG, dO)
    dR_o = ein("...rs,...rv->...sv", Aqk, dO)
    return dQG, dS0_o, dAqk, dR_o


def o_bwd_local(S0, R, dO):
    """The shares of :func:`o_bwd` that need the chunk's start state and R (the rest are the reverse state pass's):
    ``(dQG [..., C, K], dAqk [..., C, C])``, dAqk masked to the lower triangle with its diagonal."""
    incl = masks(R.shape[-2])[0].astype(R.dtype)
    return ein("...rv,...kv->...rk", dO, S0), ein("...rv,...sv->...rs", dO, R) * incl

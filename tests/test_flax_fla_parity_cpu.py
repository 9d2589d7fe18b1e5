"""CPU parity: flax_layers.GatedDeltaNet2 vs FLA's torch GatedDeltaNet2 layer (flash-linear-attention 0.6.0)
with FLA's GPU-only kernels replaced by torch references, so the *layer semantics* (projections, short
convolutions and their cache, gates, GVA broadcast, gated RMSNorm, dispatch, unpadding, cache handling) are
compared without a GPU and without TF32 rounding.

Replaced (``monkeypatch`` on the names FLA's code looks up), each written from the corresponding FLA kernel:

* ``fla.layers.gdn2.chunk_gdn2`` / ``fused_recurrent_gdn2`` -> FLA's own token loop
  ``fla.ops.gdn2.naive.naive_recurrent_gdn2`` (float32), after the in-kernel q/k L2 norm
  ``x / sqrt(sum(x^2) + 1e-6)`` (``fla.modules.l2norm.l2norm_fwd`` / the fused recurrent kernel), per
  ``cu_seqlens`` segment;
* ``fla.modules.causal_conv1d.ops.causal_conv1d`` (prefill) and ``causal_conv1d_update`` (single-token step,
  in place on the cache) -> depthwise ``torch.nn.functional.conv1d`` over [cached window, x], window layout
  ``[N, D, W]`` newest last, bias, SiLU;
* ``fla.modules.norm.fused_norm_gate.rms_norm_gated`` -> ``x * rsqrt(mean(x^2) + eps) * weight * act(g)``.

Needs torch and FLA's layers importable (``fla-core`` + ``flash-linear-attention`` 0.6.0, which import triton
and transformers even on a CPU); skipped otherwise — CI does not install them. Tolerance: float32 RMS ratio
<= 1e-5 (measured ~1e-7 .. 1e-6).
"""

from __future__ import annotations

import importlib.util
import os

import pytest


def _fla_layers_installed() -> bool:
    """Look for FLA's layers (and triton, transformers) without importing anything: a half-successful
    ``import fla.layers`` would leave ``fla`` in sys.modules for every test module collected after this one."""
    spec = importlib.util.find_spec("fla")
    if spec is None or any(importlib.util.find_spec(m) is None for m in ("triton", "transformers", "einops")):
        return False
    return any(os.path.isdir(os.path.join(p, "layers")) for p in spec.submodule_search_locations or ())


if not _fla_layers_installed():
    pytest.skip("FLA's layers (flash-linear-attention 0.6.0 with triton and transformers) are not installed",
                allow_module_level=True)
torch = pytest.importorskip("torch")
try:
    import fla.layers.gdn2 as fla_gdn2_layer
    import fla.modules.causal_conv1d.ops as fla_conv_ops
    import fla.modules.norm.fused_norm_gate as fla_norm_ops
    from fla.models.utils import Cache
    from fla.ops.gdn2.naive import naive_recurrent_gdn2 as fla_naive_recurrent_gdn2
except Exception as e:  # ImportError without triton/transformers; triton may raise others on odd hosts
    pytest.skip(f"FLA's layers are not importable here ({type(e).__name__}: {e})", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402

from _fla_parity import left_padded_prefill, make_pair, prefill_and_decode  # noqa: E402

TOL = 1e-5
HIDDEN, HEAD_DIM, NUM_HEADS = 64, 16, 2


# ------------------------------------------------------------------------------------------------------
# torch references for FLA's Triton pieces
# ------------------------------------------------------------------------------------------------------
def _segments(cu_seqlens):
    if cu_seqlens is None:
        return None
    cu = [int(c) for c in cu_seqlens.tolist()]
    return list(zip(cu[:-1], cu[1:]))


def ref_gdn2(q, k, v, g, b, w, scale=None, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, cu_seqlens=None, calls=None, op_name=None, **kwargs):
    """FLA's chunk_gdn2 / fused_recurrent_gdn2 semantics through FLA's naive token loop."""
    assert not kwargs, f"unexpected arguments {sorted(kwargs)}"
    if calls is not None:
        calls.append((op_name, q.shape[1]))
    if use_qk_l2norm_in_kernel:
        q, k = (x / torch.sqrt((x.float() ** 2).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    segs = _segments(cu_seqlens)
    if segs is None:
        return fla_naive_recurrent_gdn2(q, k, v, g, b, w, scale=scale, initial_state=initial_state,
                                        output_final_state=output_final_state)
    outs, states = [], []
    for n, (s, e) in enumerate(segs):
        h0 = None if initial_state is None else initial_state[n:n + 1]
        o, h = fla_naive_recurrent_gdn2(*(x[:, s:e] for x in (q, k, v, g, b, w)), scale=scale, initial_state=h0,
                                        output_final_state=True)
        outs.append(o)
        states.append(h)
    return torch.cat(outs, 1), (torch.cat(states, 0) if output_final_state else None)


def _conv_one(x, weight, bias, prev, activation):
    """x [L, D], weight [D, W], prev [D, W] inputs before x (newest last) -> (y [L, D] f32, window [D, W])."""
    D, W = weight.shape
    full = torch.cat([prev.float(), x.float().T], dim=1)  # [D, W + L]
    y = F.conv1d(full[None], weight.float()[:, None, :], bias=None if bias is None else bias.float(), groups=D)
    y = y[0, :, 1:].T  # output i of the valid conv covers inputs i .. i+W-1 of `full`: token t is output t + 1
    if activation in ("silu", "swish"):
        y = F.silu(y)
    return y, full[:, -W:]


def ref_causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
                      activation=None, backend=None, cu_seqlens=None, chunk_indices=None, **kwargs):
    """FLA's causal_conv1d: x [B, T, D] (B == 1 with cu_seqlens), initial/final state [N, D, W]."""
    assert residual is None
    B, T, D = x.shape
    W = weight.shape[1]
    segs = _segments(cu_seqlens) or [(None, None)] * B
    ys, finals = [], []
    for n, (s, e) in enumerate(segs):
        xs = x[n] if s is None else x[0, s:e]
        prev = x.new_zeros(D, W, dtype=torch.float32) if initial_state is None else initial_state[n]
        y, window = _conv_one(xs, weight, bias, prev, activation)
        ys.append(y.to(x.dtype))
        finals.append(window.to(x.dtype))
    y = torch.stack(ys) if cu_seqlens is None else torch.cat(ys)[None]
    return y, (torch.stack(finals) if output_final_state else None)


def ref_causal_conv1d_update(x, cache, residual=None, weight=None, bias=None, activation=None):
    """FLA's single-token step: one token per sequence ([N, 1, D] or [1, N, D]); updates ``cache`` in place."""
    assert residual is None
    shape = x.shape
    xs = x.reshape(-1, x.shape[-1])  # [N, D]
    ys = []
    for n in range(xs.shape[0]):
        y, window = _conv_one(xs[n:n + 1], weight, bias, cache[n], activation)
        cache[n].copy_(window)
        ys.append(y[0])
    return torch.stack(ys).to(x.dtype).view(shape), cache


def ref_rms_norm_gated(x, g, weight, bias, activation="swish", residual=None, prenorm=False,
                       residual_in_fp32=False, eps=1e-6):
    """FLA's gated RMSNorm over the last axis: ``x * rsqrt(mean(x^2) + eps) * weight * act(g)``, float32 math."""
    assert residual is None and not prenorm and bias is None
    xf, gf = x.float(), g.float()
    y = xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + eps) * weight.float()
    y = y * (torch.sigmoid(gf) if activation == "sigmoid" else F.silu(gf))
    return y.to(x.dtype)


@pytest.fixture
def fla_cpu(monkeypatch):
    """Patch FLA's GPU-only pieces with the references above; yields the list of GDN-2 op calls (name, T)."""
    calls = []
    for name in ("chunk_gdn2", "fused_recurrent_gdn2"):
        monkeypatch.setattr(fla_gdn2_layer, name,
                            lambda *a, _n=name, **kw: ref_gdn2(*a, calls=calls, op_name=_n, **kw))
    monkeypatch.setattr(fla_conv_ops, "causal_conv1d", ref_causal_conv1d)
    monkeypatch.setattr(fla_conv_ops, "causal_conv1d_update", ref_causal_conv1d_update)
    monkeypatch.setattr(fla_norm_ops, "rms_norm_gated", ref_rms_norm_gated)
    yield calls


def _pair(**kw):
    return make_pair(torch, fla_gdn2_layer.GatedDeltaNet2, "float32", device="cpu", hidden=HIDDEN,
                     head_dim=HEAD_DIM, num_heads=NUM_HEADS, **kw)


@pytest.mark.parametrize("T,op", [(100, "chunk_gdn2"), (40, "fused_recurrent_gdn2")])
@pytest.mark.parametrize("num_v_heads", [NUM_HEADS, 2 * NUM_HEADS], ids=["HV=H", "GVA HV=2H"])
def test_prefill_and_decode_match_fla_layer_on_cpu(fla_cpu, T, op, num_v_heads):
    ours, fla, tdt = _pair(num_v_heads=num_v_heads)
    prefill_and_decode(torch, Cache, ours, fla, tdt, device="cpu", T=T, steps=4, tol=TOL)
    # FLA's dispatch: the prefill took `op`, every decode step the fused recurrent one
    assert fla_cpu == [(op, T)] + [("fused_recurrent_gdn2", 1)] * 4, fla_cpu


def test_left_padded_prefill_and_cache_conversion_match_fla_layer_on_cpu(fla_cpu):
    ours, fla, _ = _pair(num_v_heads=2 * NUM_HEADS, seed=3)
    left_padded_prefill(torch, Cache, ours, fla, device="cpu", tol=TOL)
    assert [c[0] for c in fla_cpu] == ["chunk_gdn2", "fused_recurrent_gdn2"], fla_cpu

"""GPU parity: flax_layers.GatedDeltaNet2 vs FLA's torch GatedDeltaNet2 (flash-linear-attention 0.6.0).

Same weights (moved with flax_layers.convert) and inputs give the same outputs and the same cache
(recurrent state and conv windows) after a prefill and after several decode steps. FLA's layer runs only on
CUDA (Triton), so this needs an NVIDIA GPU, torch with CUDA and the fla packages (on the GPU host:
``source .gpu/env.sh``). Tolerances (RMS ratio): float32 <= 1e-4, bfloat16 <= 1e-2.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flax_layers import (GatedDeltaNet2, cache_from_fla, cache_to_fla, fla_layer_kwargs, load_fla_state_dict,
                         to_fla_state_dict)

pytestmark = pytest.mark.cuda


def _torch_fla():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device (FLA's layer needs one)")
    pytest.importorskip("einops")
    try:
        from fla.layers.gdn2 import GatedDeltaNet2 as FLAGatedDeltaNet2
        from fla.models.utils import Cache
    except ImportError as e:  # pragma: no cover - depends on the GPU host
        pytest.skip(f"flash-linear-attention layers not importable: {e}")
    return torch, FLAGatedDeltaNet2, Cache


def ratio(ref, x):
    ref = np.asarray(ref, np.float64)
    x = np.asarray(x, np.float64)
    return float(np.sqrt(np.mean((ref - x) ** 2)) / np.sqrt(np.mean(ref ** 2)))


def _pair(dtype_name, *, num_v_heads, seed=0, hidden=256, head_dim=64, num_heads=2):
    """Our layer and FLA's, holding the same random weights (representable in the dtype)."""
    torch, FLA, _ = _torch_fla()
    jdt = jnp.dtype(dtype_name)
    ours = GatedDeltaNet2(hidden, head_dim=head_dim, num_heads=num_heads, num_v_heads=num_v_heads,
                          gate_activation="sigmoid", dtype=jdt, param_dtype=jdt, deterministic=True,
                          rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    sd = to_fla_state_dict(ours, dtype=np.float32)
    for key, val in sd.items():  # O(1) activations everywhere (the NVlabs init makes the output tiny)
        if key.endswith("weight") and val.ndim == 2:
            sd[key] = (rng.standard_normal(val.shape) / math.sqrt(val.shape[1])).astype(np.float32)
        elif key in ("g_proj.1.bias", "o_norm.weight"):
            sd[key] = rng.uniform(0.5, 1.5, val.shape).astype(np.float32)
    sd = {k: np.asarray(jnp.asarray(v, jdt).astype(jnp.float32)) for k, v in sd.items()}  # round to dtype
    load_fla_state_dict(ours, sd)
    tdt = dict(float32=torch.float32, bfloat16=torch.bfloat16)[dtype_name]
    fla = FLA(**fla_layer_kwargs(ours), layer_idx=0)
    fla.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()})
    fla = fla.to(device="cuda", dtype=tdt).eval()
    return ours, fla, torch, tdt


def _fla_cache_np(cache):
    state = cache[0]
    return {"recurrent_state": state["recurrent_state"].float().cpu().numpy(),
            "conv_state": tuple(c.float().cpu().numpy() for c in state["conv_state"])}


def _assert_cache(ref_fla, ours, tol):
    got = cache_to_fla(ours)
    assert ratio(ref_fla["recurrent_state"], got["recurrent_state"]) <= tol
    for a, b in zip(ref_fla["conv_state"], got["conv_state"]):
        assert ratio(a, np.asarray(b, np.float32)) <= tol


# One shape throughout (H = 2, HV = 4: grouped value heads), so FLA's Triton kernels are compiled and autotuned
# once per dtype; the first call of each still takes tens of seconds on a fresh machine.
HV = 4


@pytest.mark.parametrize("dtype_name,tol", [("float32", 1e-4), ("bfloat16", 1e-2)])
def test_prefill_and_decode_match_fla(dtype_name, tol):
    ours, fla, torch, tdt = _pair(dtype_name, num_v_heads=HV)
    _, _, Cache = _torch_fla()
    B, T, steps = 2, 100, 4  # T > 64: FLA and ours both take the chunk path for the prefill
    x = np.random.default_rng(1).standard_normal((B, T + steps, ours.hidden_size)).astype(np.float32)
    x = np.asarray(jnp.asarray(x, ours.dtype).astype(jnp.float32))
    xt = torch.from_numpy(x).to(device="cuda", dtype=tdt)
    with jax.default_matmul_precision("highest"):
        prefill = nnx.jit(lambda m, x: m(x))
        step = nnx.jit(lambda m, x, c: m(x, cache=c), donate_argnums=2)
        y, cache = prefill(ours, jnp.asarray(x[:, :T], ours.dtype))
        with torch.no_grad():
            fcache = Cache()
            fy, _, fcache = fla(xt[:, :T], past_key_values=fcache, use_cache=True)
        assert ratio(fy.float().cpu().numpy(), y) <= tol
        _assert_cache(_fla_cache_np(fcache), cache, tol)
        for t in range(T, T + steps):
            y, cache = step(ours, jnp.asarray(x[:, t:t + 1], ours.dtype), cache)
            with torch.no_grad():
                fy, _, fcache = fla(xt[:, t:t + 1], past_key_values=fcache, use_cache=True)
            assert ratio(fy.float().cpu().numpy(), y) <= tol, t
        _assert_cache(_fla_cache_np(fcache), cache, tol)


def test_left_padded_prefill_and_cache_conversion_match_fla():
    """FLA unpads via attention_mask; ours keeps padded positions out of the state and conv windows."""
    ours, fla, torch, tdt = _pair("float32", num_v_heads=HV, seed=3)
    _, _, Cache = _torch_fla()
    B, T = 2, 80
    x = np.random.default_rng(4).standard_normal((B, T, ours.hidden_size)).astype(np.float32)
    mask = np.ones((B, T), bool)
    mask[1, :13] = False  # left padding
    with jax.default_matmul_precision("highest"):
        y, cache = ours(jnp.asarray(x), attention_mask=jnp.asarray(mask))
        with torch.no_grad():
            fcache = Cache()
            fy, _, fcache = fla(torch.from_numpy(x).cuda(), attention_mask=torch.from_numpy(mask).cuda(),
                                past_key_values=fcache, use_cache=True)
        fy = fy.float().cpu().numpy()
        assert ratio(fy[mask], np.asarray(y)[mask]) <= 1e-4
        ref = _fla_cache_np(fcache)
        _assert_cache(ref, cache, 1e-4)
        # continue our layer from FLA's cache (converted) and FLA from its own: same next output
        x1 = np.random.default_rng(5).standard_normal((B, 1, ours.hidden_size)).astype(np.float32)
        y1, _ = ours(jnp.asarray(x1), cache=cache_from_fla(ref))
        with torch.no_grad():
            fy1, _, _ = fla(torch.from_numpy(x1).cuda(), past_key_values=fcache, use_cache=True)
        assert ratio(fy1.float().cpu().numpy(), y1) <= 1e-4

"""Shared pieces of the FLA layer parity tests (``test_flax_fla_parity.py`` on the GPU,
``test_flax_fla_parity_cpu.py`` on the CPU): the layer pair with the same weights, and the prefill/decode and
padded-prefill comparisons, which report every measured RMS ratio by name.

FLA = flash-linear-attention 0.6.0, ``fla/layers/gdn2.py`` (``GatedDeltaNet2``) with its cache
``fla.models.utils.Cache``. Importing this module needs neither torch nor fla; the callers import them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from _oracle import rms_ratio
from flax_layers import (GatedDeltaNet2, cache_from_fla, cache_to_fla, fla_layer_kwargs, load_fla_state_dict,
                         to_fla_state_dict)


def ratio(ref, x):
    """RMS(x - ref) / RMS(ref), in float64 (``ref`` first, as FLA is the reference here)."""
    return rms_ratio(x, ref)


def check(name, r, tol, note=""):
    """Assert one measured ratio, naming the quantity (so a cut-off log still says what failed)."""
    assert r <= tol, f"{name}: RMS ratio {r:.3e} > {tol:.0e}" + (f" ({note})" if note else "")


def make_pair(torch, fla_cls, dtype_name, *, device, num_v_heads, seed=0, hidden=256, head_dim=64, num_heads=2):
    """Our layer and FLA's (on ``device``), holding the same random weights (representable in the dtype).

    Returns ``(ours, fla, torch_dtype)``. Weights are O(1)-activation random (the NVlabs init makes the output
    tiny), with a norm scale and a gate bias away from their init.
    """
    jdt = jnp.dtype(dtype_name)
    ours = GatedDeltaNet2(hidden, head_dim=head_dim, num_heads=num_heads, num_v_heads=num_v_heads,
                          gate_activation="sigmoid", dtype=jdt, param_dtype=jdt, deterministic=True,
                          rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    sd = to_fla_state_dict(ours, dtype=np.float32)
    for key, val in sd.items():
        if key.endswith("weight") and val.ndim == 2:
            sd[key] = (rng.standard_normal(val.shape) / math.sqrt(val.shape[1])).astype(np.float32)
        elif key in ("g_proj.1.bias", "o_norm.weight"):
            sd[key] = rng.uniform(0.5, 1.5, val.shape).astype(np.float32)
    sd = {k: np.asarray(jnp.asarray(v, jdt).astype(jnp.float32)) for k, v in sd.items()}  # round to dtype
    load_fla_state_dict(ours, sd)
    tdt = dict(float32=torch.float32, bfloat16=torch.bfloat16)[dtype_name]
    fla = fla_cls(**fla_layer_kwargs(ours), layer_idx=0)
    fla.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in sd.items()})
    fla = fla.to(device=device, dtype=tdt).eval()
    return ours, fla, tdt


def fla_cache_np(cache):
    """FLA's layer-0 cache as numpy float32 ``{"recurrent_state", "conv_state": (q, k, v)}``."""
    state = cache[0]
    return {"recurrent_state": state["recurrent_state"].float().cpu().numpy(),
            "conv_state": tuple(c.float().cpu().numpy() for c in state["conv_state"])}


def check_cache(where, ref_fla, ours, tol, note=""):
    got = cache_to_fla(ours)
    check(f"{where} recurrent_state", ratio(ref_fla["recurrent_state"], got["recurrent_state"]), tol, note)
    for name, a, b in zip("qkv", ref_fla["conv_state"], got["conv_state"]):
        check(f"{where} {name}_conv state", ratio(a, np.asarray(b, np.float32)), tol, note)


def prefill_and_decode(torch, cache_cls, ours, fla, tdt, *, device, T, steps, tol, B=2, seed=1, note=""):
    """Prefill T tokens, then ``steps`` single-token decode steps, in both layers; compare outputs and caches.

    Our prefill/decode are ``nnx.jit``-compiled (cache donated between steps) under
    ``jax.default_matmul_precision("highest")``. FLA runs under ``torch.no_grad()`` (inference dispatch: its
    layer takes ``fused_recurrent`` for ``T <= 64``, else ``chunk``).
    """
    x = np.random.default_rng(seed).standard_normal((B, T + steps, ours.hidden_size)).astype(np.float32)
    x = np.array(jnp.asarray(x, ours.dtype).astype(jnp.float32))  # rounded to the dtype; a writable copy
    xt = torch.from_numpy(x).to(device=device, dtype=tdt)
    with jax.default_matmul_precision("highest"):
        prefill = nnx.jit(lambda m, x: m(x))
        step = nnx.jit(lambda m, x, c: m(x, cache=c), donate_argnums=2)
        y, cache = prefill(ours, jnp.asarray(x[:, :T], ours.dtype))
        with torch.no_grad():
            fcache = cache_cls()
            fy, _, fcache = fla(xt[:, :T], past_key_values=fcache, use_cache=True)
        check(f"prefill (T={T}) output", ratio(fy.float().cpu().numpy(), y), tol, note)
        check_cache(f"prefill (T={T})", fla_cache_np(fcache), cache, tol, note)
        for t in range(T, T + steps):
            y, cache = step(ours, jnp.asarray(x[:, t:t + 1], ours.dtype), cache)
            with torch.no_grad():
                fy, _, fcache = fla(xt[:, t:t + 1], past_key_values=fcache, use_cache=True)
            check(f"decode step {t - T + 1} (T={T}) output", ratio(fy.float().cpu().numpy(), y), tol, note)
        check_cache(f"after {steps} decode steps (T={T})", fla_cache_np(fcache), cache, tol, note)


def left_padded_prefill(torch, cache_cls, ours, fla, *, device, tol, B=2, T=80, pad=13, note=""):
    """Float32. FLA unpads via ``attention_mask``; ours keeps padded positions out of the state and conv windows.
    Then our layer continues from FLA's cache (converted) and FLA from its own: same next output. Ours runs
    ``nnx.jit``-compiled (one compile per call instead of op-by-op dispatch)."""
    x = np.random.default_rng(4).standard_normal((B, T, ours.hidden_size)).astype(np.float32)
    mask = np.ones((B, T), bool)
    mask[1, :pad] = False  # left padding
    with jax.default_matmul_precision("highest"):
        y, cache = nnx.jit(lambda m, x, mask: m(x, attention_mask=mask))(ours, jnp.asarray(x), jnp.asarray(mask))
        with torch.no_grad():
            fcache = cache_cls()
            fy, _, fcache = fla(torch.from_numpy(x).to(device), attention_mask=torch.from_numpy(mask).to(device),
                                past_key_values=fcache, use_cache=True)
        fy = fy.float().cpu().numpy()
        check("left-padded prefill output (real tokens)", ratio(fy[mask], np.asarray(y)[mask]), tol, note)
        ref = fla_cache_np(fcache)
        check_cache("left-padded prefill", ref, cache, tol, note)
        x1 = np.random.default_rng(5).standard_normal((B, 1, ours.hidden_size)).astype(np.float32)
        y1, _ = nnx.jit(lambda m, x, c: m(x, cache=c))(ours, jnp.asarray(x1), cache_from_fla(ref))
        with torch.no_grad():
            fy1, _, _ = fla(torch.from_numpy(x1).to(device), past_key_values=fcache, use_cache=True)
        check("decode step from converted FLA cache, output", ratio(fy1.float().cpu().numpy(), y1), tol, note)

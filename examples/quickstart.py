"""gdn2-jax quickstart (runs on a CPU-only machine in well under a minute).

1. prefill a prompt with ``chunk_gdn2`` and keep its final state,
2. decode the next tokens one at a time with ``fused_recurrent_gdn2`` from that state,
   and check the result equals one long call over prompt + new tokens,
3. take a gradient through ``chunk_gdn2`` with ``jax.grad``.
"""

import time

import jax
import jax.numpy as jnp

from gdn2_jax import chunk_gdn2, fused_recurrent_gdn2

t_start = time.perf_counter()
B, T_PROMPT, T_NEW = 2, 100, 6  # batch, prompt length, tokens to decode
H, HV, K, V = 2, 4, 64, 64  # 2 query/key heads shared by 4 value heads (grouped value heads)
T = T_PROMPT + T_NEW

keys = jax.random.split(jax.random.PRNGKey(0), 6)
q = jax.random.normal(keys[0], (B, T, H, K))
k = jax.random.normal(keys[1], (B, T, H, K))
v = jax.random.normal(keys[2], (B, T, HV, V))
g = -jax.nn.softplus(jax.random.normal(keys[3], (B, T, HV, K)))  # natural-log decay (<= 0): exp(g) in (0, 1)
b = jax.nn.sigmoid(jax.random.normal(keys[4], (B, T, HV, K)))  # erase gate, per key channel
w = jax.nn.sigmoid(jax.random.normal(keys[5], (B, T, HV, V)))  # write gate, per value channel
opts = dict(use_qk_l2norm_in_kernel=True)  # L2-normalise q and k inside the op, as the GDN-2 layer does

# One long call over all T tokens (what decoding must reproduce).
o_full, state_full = chunk_gdn2(q, k, v, g, b, w, output_final_state=True, **opts)

# 1. Prefill: the prompt only; keep the final state [B, HV, K, V] (float32).
prompt = [x[:, :T_PROMPT] for x in (q, k, v, g, b, w)]
o_prompt, state = chunk_gdn2(*prompt, output_final_state=True, **opts)
print(f"prefill: o {o_prompt.shape} {o_prompt.dtype}, state {state.shape} {state.dtype}")


# 2. Decode token by token from the state (jit once, reuse for every step).
@jax.jit
def decode_step(state, q_t, k_t, v_t, g_t, b_t, w_t):
    return fused_recurrent_gdn2(q_t, k_t, v_t, g_t, b_t, w_t, initial_state=state, output_final_state=True,
                                **opts)


outs = [o_prompt]
for t in range(T_PROMPT, T):
    o_t, state = decode_step(state, *(x[:, t:t + 1] for x in (q, k, v, g, b, w)))
    outs.append(o_t)
o_decoded = jnp.concatenate(outs, axis=1)
diff_o = float(jnp.max(jnp.abs(o_decoded - o_full)))
diff_s = float(jnp.max(jnp.abs(state - state_full)))
print(f"decode {T_NEW} tokens: max |o - o_one_call| = {diff_o:.2e}, max |state - state_one_call| = {diff_s:.2e}")
assert diff_o < 1e-4 and diff_s < 1e-4, "prefill + decode does not match the single call"


# 3. A gradient: d(sum o^2)/d(q, k, v, g, b, w) through chunk_gdn2 (hand-written chunk-level VJP).
def loss(q, k, v, g, b, w):
    o, _ = chunk_gdn2(q, k, v, g, b, w, **opts)
    return jnp.sum(o.astype(jnp.float32) ** 2)


grads = jax.jit(jax.grad(loss, argnums=tuple(range(6))))(q, k, v, g, b, w)
for name, gr in zip("qkvgbw", grads):
    assert bool(jnp.all(jnp.isfinite(gr))), name
print("grad norms: " + ", ".join(f"d{n} {float(jnp.linalg.norm(gr)):.3e}" for n, gr in zip("qkvgbw", grads)))
print(f"done in {time.perf_counter() - t_start:.1f} s on {jax.devices()[0].platform}")

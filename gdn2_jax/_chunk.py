"""Chunked WY form (C = 64) in jnp: naive_chunk_gdn2 and the custom_vjp xla backend of chunk_gdn2.

PLACEHOLDER: until the chunk implementation lands, chunk_forward_xla falls back to the token loop.
"""

from __future__ import annotations

from .reference import recurrent_forward


def chunk_forward_xla(q, k, v, g, b, w, dims, initial_state, cu_seqlens, output_final_state,
                      use_qk_l2norm_in_kernel):
    return recurrent_forward(q, k, v, g, b, w, dims, initial_state, cu_seqlens,
                             output_final_state, use_qk_l2norm_in_kernel)


def naive_chunk_gdn2(*args, **kwargs):
    raise NotImplementedError("naive_chunk_gdn2 is not implemented yet")

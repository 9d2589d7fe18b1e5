"""The xla backend: pure-jnp GDN-2, split into the stages of FLA's ``fla/ops/gdn2`` (and of our kernels).

Each stage is one file with its forward and backward side by side; each is the xla twin (the oracle in the GPU
tests) of the kernel stage that computes the same quantities:

==================  ==============================================  ============================================
file                stage (forward / backward)                      kernel twin (``kernels/``)
==================  ==============================================  ============================================
``cumsum.py``       gate cumsum / reverse cumsum of dg              ``chunk_fwd.py`` launch 1 (cumsum part, GAM)
``chunk_intra.py``  Aqk, T, (I+T)^-1 / intra-chunk gradients        ``chunk_fwd.py`` launch 1 (Aqk)
``wy_fast.py``      WY auxiliaries Y, U, QG, KG / WY backward       ``chunk_fwd.py`` launch 1 (Y, U, QG, KG)
``chunk_delta_h.py``state passing / state backward (dh)             ``chunk_fwd.py`` launch 2 (state)
``chunk_o.py``      output / dAqk, dv-partial, inter-chunk dq       ``chunk_fwd.py`` launch 2 (o)
``chunk.py``        the stages composed: scan + custom_vjp          the whole ``chunk_gdn2`` pipeline
``recurrent.py``    the token loop (ground truth)                   ``recurrent_fwd.py``
``layout.py``       token-major <-> chunk-major (dense, varlen)     (chunk slots of ``chunk_fwd.py``)
==================  ==============================================  ============================================

Tests: ``tests/test_stages.py`` checks every stage's backward against autodiff of its forward (CPU) and every
kernel stage against its xla twin (GPU, marked ``cuda``).
"""

from .chunk import CHUNK_SIZE, chunk_forward, intra_stage, naive_chunk_forward
from .common import l2norm, sequence_ids
from .recurrent import recurrent_forward

__all__ = ["CHUNK_SIZE", "chunk_forward", "naive_chunk_forward", "intra_stage", "recurrent_forward", "l2norm",
           "sequence_ids"]

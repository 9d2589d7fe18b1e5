"""The xla backend of ``chunk_gdn2`` and the ``naive_chunk_gdn2`` reference: the five stages composed.

Per chunk (forward, then the hand-written VJP of spec §7.2 in FLA's kernel order)::

    forward   cumsum.chunk_gates -> chunk_intra.intra_fwd, solve_fwd -> wy_fast.wy_fwd
              -> chunk_delta_h.state_fwd -> chunk_o.o_fwd
    backward  chunk_o.o_bwd -> chunk_delta_h.state_bwd -> wy_fast.wy_bwd -> chunk_intra.solve_bwd, intra_bwd
              -> cumsum.chunk_local_cumsum_bwd

Everything runs on chunk-major arrays ``[NC, B, HV, C, D]`` (``layout``). :func:`chunk_forward` splits the work
as FLA's kernels do: the stages that are local to a chunk run for all chunks at once (in batches of chunks), and
only the state recurrences are a ``lax.scan`` over the NC chunks (two products per step; forward: the start
states S0, FLA's ``h``; backward: the reverse dS pass, FLA's ``dh``). It is a ``jax.custom_vjp`` whose residuals
are the inputs only: O(T/C) states, never per-token states. :func:`naive_chunk_forward` is a whole-chunk scan
(:func:`chunk_fwd_one` per step) differentiated by plain autodiff (each chunk rematerialised).

No factor ``exp(-G)`` is ever formed (``cumsum``), so g down to -60 per token gives finite outputs and gradients.
:func:`intra_stage` is the xla twin of the kernels' intra-chunk launch (GPU tests compare them stage by stage).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels._common import CHUNK

from . import layout
from .chunk_delta_h import state_bwd_parallel, state_bwd_recurrent, state_fwd
from .chunk_intra import intra_bwd, intra_fwd, solve_bwd, solve_fwd
from .chunk_o import o_bwd, o_bwd_local, o_fwd
from .common import prepare_qk
from .cumsum import SUB, chunk_gates, chunk_local_cumsum_bwd
from .wy_fast import wy_bwd, wy_fwd

__all__ = ["CHUNK_SIZE", "chunk_forward", "naive_chunk_forward", "chunk_fwd_one", "chunk_bwd_one", "intra_stage",
           "chunk_backward_from_states"]

CHUNK_SIZE = CHUNK


# --------------------------------------------------------------------------------------------------
# One chunk
# --------------------------------------------------------------------------------------------------
# Pairwise decays of the intra stage in FLA's sub-chunk factored form (``cumsum.SubGates``: matmuls plus 16 x 16
# diagonal blocks) instead of a dense [C, C, K] factor. Equal to rounding (tests/test_stages.py); on since session 6
# (GPU training step 1.7-2.1x faster than dense, docs/performance-notes.md).
_FACTORED_INTRA = True
# Levels of that factorisation (``cumsum.sub_gates``): 1 = 16-row sub-chunks with exact 16 x 16 diagonal blocks; 2 =
# those blocks factored again into 4-row groups (experimental, session 6: equal to rounding on the CPU, not yet
# measured on a GPU).
_FACTORED_LEVELS = 1


def _stages_fwd(q, k, v, g, b, w, scale):
    """Stages 1-3 of one chunk (everything that does not depend on the start state)."""
    gates = chunk_gates(g, factored=_FACTORED_INTRA, levels=_FACTORED_LEVELS)
    Aqk, T = intra_fwd(q, k, b, gates, scale)
    A = solve_fwd(T)
    return gates, Aqk, A, wy_fwd(A, q, k, v, b, w, gates, scale)


def chunk_fwd_one(q, k, v, g, b, w, S0, scale):
    """One chunk forward: q, k, g, b ``[..., C, K]``, v, w ``[..., C, V]``, S0 ``[..., K, V]`` (compute dtype).

    Returns ``(O [..., C, V], S_next [..., K, V])``.
    """
    gates, Aqk, _, wy = _stages_fwd(q, k, v, g, b, w, scale)
    R, S_next = state_fwd(wy.Y, wy.U, wy.KG, gates.gamC, S0)
    return o_fwd(wy.QG, S0, Aqk, R), S_next


def _bwd_local(q, k, v, g, b, w, S0, R, dR, dS_end, dQG, dAqk, scale):
    """Everything of the chunk VJP that is local to the chunk once the two state passes ran: recomputes stages
    1-3, then the state stage's parallel part, the WY, solve and intra backward and the reverse cumsum of dG.
    ``R`` is the chunk's ``U - Y S0``, ``dR`` its full cotangent, ``dQG``/``dAqk`` the output stage's shares.
    Returns ``(dq, dk, dv, dg, db, dw)``."""
    gates, _, A, wy = _stages_fwd(q, k, v, g, b, w, scale)
    dY, dKG, dG_C = state_bwd_parallel(gates.gamC, S0, R, dR, dS_end)
    dq_w, dk_w, dv, db_w, dw, dG_w, dA = wy_bwd(A, k, v, b, w, gates, wy, dY, dR, dQG, dKG, scale)
    dq_i, dk_i, db_i, dG_i = intra_bwd(q, k, b, gates, dAqk, solve_bwd(A, dA), scale)
    dG = (dG_w + dG_i).at[..., -1, :].add(dG_C)
    return dq_w + dq_i, dk_w + dk_i, dv, chunk_local_cumsum_bwd(dG), db_w + db_i, dw


def chunk_bwd_one(q, k, v, g, b, w, S0, dO, dS_end, scale):
    """Chunk-level VJP of spec §7.2 for one chunk (shapes as :func:`chunk_fwd_one`; dO like O, dS_end like S0).

    Recomputes the chunk's forward (FLA's recomputation policy), then runs the stages in reverse.
    Returns ``((dq, dk, dv, dg, db, dw), dS0)``.
    """
    gates, Aqk, _, wy = _stages_fwd(q, k, v, g, b, w, scale)
    R, _ = state_fwd(wy.Y, wy.U, wy.KG, gates.gamC, S0)
    dQG, dS0_o, dAqk, dR_o = o_bwd(wy.QG, S0, Aqk, R, dO)
    dS0, dR = state_bwd_recurrent(wy.Y, wy.KG, gates.gamC, dR_o, dS0_o, dS_end)
    return _bwd_local(q, k, v, g, b, w, S0, R, dR, dS_end, dQG, dAqk, scale), dS0


# --------------------------------------------------------------------------------------------------
# Scan over chunks (chunk-major layout [NC, B, HV, C, D]; seq/reset [NC, B])
# --------------------------------------------------------------------------------------------------
def _start_state(h0, sq, rs, S):
    return jnp.where(rs[:, None, None, None], h0[sq], S)


def _scan_forward(scale, q, k, v, g, b, w, h0, seq, reset, *, remat=False):
    """Forward over all chunks, one whole chunk per scan step (the plain-autodiff path of ``naive_chunk_gdn2``).
    Returns (O [NC,B,HV,C,V], S_end [NC,B,HV,K,V])."""
    def body(S, xs):
        qc, kc, vc, gc, bc, wc, sq, rs = xs
        O, S_next = chunk_fwd_one(qc, kc, vc, gc, bc, wc, _start_state(h0, sq, rs, S), scale)
        return S_next, (O, S_next)

    if remat:
        body = jax.checkpoint(body)
    NC, B, HV, _, K = q.shape
    S_init = jnp.zeros((B, HV, K, v.shape[-1]), h0.dtype)
    _, ys = lax.scan(body, S_init, (q, k, v, g, b, w, seq, reset))
    return ys


# Bytes of one decay-weighted temporary of the intra stage ([C, C, K] dense; a quarter of that factored) allowed per
# batch of (chunk, sequence, head) problems in the chunk-parallel parts (lax.map batches); one batch holds all of
# them when they fit. Several such temporaries are alive at once, so the peak is a few times this.
_BATCH_BYTES = 1 << 30


def _chunk_map(f, xs):
    """``f`` over the chunk-major arrays ``xs`` (each ``[NC, B, HV, ...]``), one (chunk, sequence, head) problem per
    row: the three leading axes are flattened to ``rows`` and mapped in batches (``lax.map``, which vmaps ``f`` over
    each batch) sized by :data:`_BATCH_BYTES`; the stages take any leading dims. Results are reshaped back to
    ``[NC, B, HV, ...]``."""
    NC, B, HV, C, K = xs[0].shape
    n = NC * B * HV
    # (factored: the [C/16, C, K] factors and the temporaries around them; a quarter of the dense row keeps the
    # batches at ~2k problems for fp32, which the GPU still fills, instead of all of them at once)
    pair = C * C * K * jnp.dtype(xs[0].dtype).itemsize // (4 if _FACTORED_INTRA and C % SUB == 0 else 1)
    rows = int(max(1, min(n, _BATCH_BYTES // pair)))
    flat = tuple(x.reshape((n,) + x.shape[3:]) for x in xs)
    out = f(flat) if rows == n else lax.map(f, flat, batch_size=rows)
    return jax.tree_util.tree_map(lambda y: y.reshape((NC, B, HV) + y.shape[1:]), out)


def _state_pass(scale, q, k, v, g, b, w, h0, seq, reset):
    """Stages 1-3 chunk-parallel, then the sequential state pass (two products per chunk).

    Returns ``(QG, Aqk, Y, KG, gamC, S0s, R, S_end)``, chunk-major: the chunk start states S0s (= FLA's ``h``),
    R = U - Y S0 and the end states."""
    def pre(x):
        gates, Aqk, _, wy = _stages_fwd(*x, scale)
        return wy.QG, Aqk, wy.Y, wy.U, wy.KG, gates.gamC

    QG, Aqk, Y, U, KG, gamC = _chunk_map(pre, (q, k, v, g, b, w))

    def body(S, xs):
        Yc, Uc, KGc, gc, sq, rs = xs
        S0 = _start_state(h0, sq, rs, S)
        R, S_next = state_fwd(Yc, Uc, KGc, gc, S0)
        return S_next, (S0, R, S_next)

    NC, B, HV, _, K = q.shape
    _, (S0s, R, S_end) = lax.scan(body, jnp.zeros((B, HV, K, v.shape[-1]), h0.dtype), (Y, U, KG, gamC, seq, reset))
    return QG, Aqk, Y, KG, gamC, S0s, R, S_end


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunk_core(scale, q, k, v, g, b, w, h0, seq, reset):
    QG, Aqk, _, _, _, S0s, R, S_end = _state_pass(scale, q, k, v, g, b, w, h0, seq, reset)
    return o_fwd(QG, S0s, Aqk, R), S_end


def _chunk_core_fwd(scale, q, k, v, g, b, w, h0, seq, reset):
    out = _chunk_core(scale, q, k, v, g, b, w, h0, seq, reset)
    # Residuals: the (chunk-major) inputs only; states are recomputed in the backward.
    return out, (q, k, v, g, b, w, h0, seq, reset)


def _chunk_core_bwd(scale, res, cts):
    """The VJP in FLA's split: chunk-parallel stages around the two sequential state passes.

    1. stages 1-3 per chunk and the forward state pass (:func:`_state_pass`): S0, R;
    2. (parallel) the output stage's backward: dQG, dS0_o, dAqk, dR_o;
    3. (sequential, reverse) the dS pass (FLA's ``dh``): dS_end per chunk, dR, and dh0;
    4. (parallel) everything else (:func:`_bwd_local`), stages 1-3 recomputed.
    Only O(T/C) states are kept (S0, dS_end: one [K, V] each per chunk); no per-token state is ever formed.
    """
    q, k, v, g, b, w, h0, seq, reset = res
    dO, dS_end_all = cts
    S0s, R, dR, dS_end, dh0_chunks = _state_passes_with_grads(scale, q, k, v, g, b, w, h0, seq, reset, dO,
                                                              dS_end_all)
    grads = _local_grads(scale, (q, k, v, g, b, w), S0s, R, dR, dS_end, dO)
    dh0 = jnp.zeros_like(h0).at[seq.reshape(-1)].add(dh0_chunks.reshape((-1,) + h0.shape[1:]))
    return (*grads, dh0, None, None)


def _state_passes_with_grads(scale, q, k, v, g, b, w, h0, seq, reset, dO, dS_end_all):
    """Steps 1-3 of :func:`_chunk_core_bwd` (what the kernels compute on the GPU: ``kernels/chunk_fwd.py`` with
    ``save_states`` and ``kernels/chunk_bwd.py``): the start states S0, R, its gradient dR, every chunk's
    end-state gradient dS_end and the start-state gradients of the chunks that start from h0."""
    QG, Aqk, Y, KG, gamC, S0s, R, _ = _state_pass(scale, q, k, v, g, b, w, h0, seq, reset)
    _, dS0_o, _, dR_o = o_bwd(QG, S0s, Aqk, R, dO)
    # Chunk c's end-state gradient is the next chunk's dS0 unless the next chunk restarts from h0 (sequence
    # boundary), plus any cotangent on S_end[c] itself (final states).
    reset_next = jnp.concatenate([reset[1:], jnp.ones_like(reset[:1])], axis=0)

    def body(dS_next, xs):
        Yc, KGc, gc, dRo, dS0o, dSc, rn, rs = xs
        dS_end = jnp.where(rn[:, None, None, None], jnp.zeros_like(dS_next), dS_next) + dSc
        dS0, dR = state_bwd_recurrent(Yc, KGc, gc, dRo, dS0o, dS_end)
        return dS0, (dS_end, dR, jnp.where(rs[:, None, None, None], dS0, jnp.zeros_like(dS0)))

    _, (dS_end, dR, dh0_chunks) = lax.scan(body, jnp.zeros(S0s.shape[1:], S0s.dtype),
                                           (Y, KG, gamC, dR_o, dS0_o, dS_end_all, reset_next, reset), reverse=True)
    return S0s, R, dR, dS_end, dh0_chunks


def _local_grads(scale, xs, S0s, R, dR, dS_end, dO):
    """Step 4 of :func:`_chunk_core_bwd`, all chunks at once: the output stage's local shares and
    :func:`_bwd_local` (chunk-major inputs ``xs = (q, k, v, g, b, w)``); returns ``(dq, dk, dv, dg, db, dw)``."""
    dQG, dAqk = o_bwd_local(S0s, R, dO)
    return _chunk_map(lambda x: _bwd_local(*x, scale), (*xs, S0s, R, dR, dS_end, dQG, dAqk))


_chunk_core.defvjp(_chunk_core_fwd, _chunk_core_bwd)


def _naive_core(scale, q, k, v, g, b, w, h0, seq, reset):
    return _scan_forward(scale, q, k, v, g, b, w, h0, seq, reset, remat=True)


# --------------------------------------------------------------------------------------------------
# Token-major entry points (the implementations behind the public ops)
# --------------------------------------------------------------------------------------------------
def _to_chunks(cdt, group, use_qk_l2norm_in_kernel, q, k, v, g, b, w, plan, C: int):
    """L2 norm + GVA repeat of q, k, then all six inputs in the compute dtype ``cdt``, chunk-major (dense, or by
    the varlen ``plan``). Normalised in the compute dtype: no rounding of q / k back to a 16-bit input dtype."""
    q, k = prepare_qk(jnp.asarray(q).astype(cdt), jnp.asarray(k).astype(cdt), group, use_qk_l2norm_in_kernel)
    xs = [jnp.asarray(x).astype(cdt) for x in (q, k, v, g, b, w)]
    return [layout.to_chunks(x, plan, C) for x in xs]


def _chunked(core, p, q, k, v, g, b, w, initial_state, cu_seqlens, C: int, poison=None):
    """L2 norm + GVA repeat (plain autodiff), layout to chunks, ``core``, layout back; outputs times ``poison``."""
    dims = p.dims
    cdt = dims.compute_dtype
    out_dtype = jax.dtypes.canonicalize_dtype(q.dtype)  # numpy float64 without x64 -> float32
    h0 = (jnp.zeros((dims.N, dims.HV, dims.K, dims.V), cdt) if initial_state is None
          else jnp.asarray(initial_state).astype(cdt))
    plan = None if cu_seqlens is None else layout.varlen_plan(cu_seqlens, dims.T, C)
    xs = _to_chunks(cdt, dims.group, p.use_qk_l2norm_in_kernel, q, k, v, g, b, w, plan, C)
    if plan is None:
        NC = xs[0].shape[0]
        seq = jnp.broadcast_to(jnp.arange(dims.B, dtype=jnp.int32)[None], (NC, dims.B))
        reset = jnp.broadcast_to((jnp.arange(NC) == 0)[:, None], (NC, dims.B))
        o, S_end = core(dims.scale, *xs, h0, seq, reset)
        o = layout.dense_from_chunks(o, dims.T)
        final = S_end[-1]
    else:
        o, S_end = core(dims.scale, *xs, h0, plan.seq[:, None], plan.reset[:, None])
        o = layout.varlen_from_chunks(o, plan)
        final = jnp.where(plan.has[:, None, None, None], S_end[plan.last, 0], h0)
    if poison is not None:
        o, final = o * poison.astype(o.dtype), final * poison.astype(final.dtype)
    return o.astype(out_dtype), (final if p.output_final_state else None)


def chunk_forward(p, q, k, v, g, b, w, initial_state, cu_seqlens, poison=None):
    """xla backend of ``chunk_gdn2`` for a validated call ``p`` (``gdn2_jax.validation.Problem``): the chunk scan
    (C = 64) with the hand-written §7.2 VJP. Returns ``(o [B, T, HV, V] in q's dtype, final state or None)``,
    multiplied by ``poison`` (a float32 scalar 1 / NaN, ``validation.run_poisoned``) when given."""
    return _chunked(_chunk_core, p, q, k, v, g, b, w, initial_state, cu_seqlens, CHUNK_SIZE, poison)


def naive_chunk_forward(p, q, k, v, g, b, w, initial_state, cu_seqlens, poison=None):
    """``naive_chunk_gdn2`` for a validated call: the same chunk forward differentiated by plain autodiff, with
    ``chunk_size`` from ``p.options`` (clamped to T: a longer chunk is only zero padding)."""
    C = min(int(dict(p.options)["chunk_size"]), max(p.dims.T, 1))
    return _chunked(_naive_core, p, q, k, v, g, b, w, initial_state, cu_seqlens, C, poison)


def chunk_backward_from_states(scale, group, use_qk_l2norm_in_kernel, q, k, v, g, b, w, cu_seqlens, h, v_new, dh,
                               dv_new, do):
    """The chunk-parallel rest of the ``chunk_gdn2`` backward once the kernels ran both state passes
    (``backend="tilelang"``: ``kernels/chunk_fwd.py`` with ``save_states``, ``kernels/chunk_bwd.py``).

    Inputs as the op takes them (q, k ``[B, T, H, K]``; v, w ``[B, T, HV, V]``; g, b ``[B, T, HV, K]``;
    ``cu_seqlens [N + 1]`` or None, then B == 1), the kernels' chunk start states ``h`` and end-state gradients
    ``dh`` ``[B, NT, HV, K, V]`` (chunk slots, ``kernels.chunk_fwd.num_chunk_slots``), R = ``v_new`` and its full
    gradient ``dv_new`` ``[B, T, HV, V]``, and ``do`` ``[B, T, HV, V]``. Runs the output stage's local shares
    (``chunk_o.o_bwd_local``) and :func:`_bwd_local` (stages 1-3 recomputed, FLA's policy) for all chunks, then the
    transposes of the layout, GVA repeat and L2 norm (:func:`_to_chunks`, by ``jax.vjp``). Returns
    ``(dq, dk, dv, dg, db, dw)`` in the inputs' dtypes (math in float32, float64 for float64 inputs). The same
    formulas as :func:`_chunk_core_bwd`; only S0, R, dR and dS_end come from kernels.
    """
    C = CHUNK_SIZE
    cdt = jnp.promote_types(q.dtype, jnp.float32)
    plan = None if cu_seqlens is None else layout.varlen_plan(cu_seqlens, q.shape[1], C)
    xs, pull = jax.vjp(lambda *a: tuple(_to_chunks(cdt, group, use_qk_l2norm_in_kernel, *a, plan, C)),
                       q, k, v, g, b, w)
    S0s, dS_end = (layout.slots_to_chunks(x, plan) for x in (h, dh))
    R, dR, dO = (layout.to_chunks(x.astype(cdt), plan, C) for x in (v_new, dv_new, do))
    return pull(tuple(_local_grads(scale, xs, S0s, R, dR, dS_end, dO)))


def intra_stage(q, k, v, g, b, w, *, scale: float, use_qk_l2norm_in_kernel: bool = False):
    """xla twin of the intra-chunk kernel launch (``kernels/chunk_fwd.py``, ``gdn2_chunk_intra``) for dense input.

    q, k ``[B, T, H, K]``; v, w ``[B, T, HV, V]``; g, b ``[B, T, HV, K]`` (any float dtype; math in float32, float64
    under x64 for float64 inputs). Returns a dict of the kernel's scratch buffers in its layouts:
    ``Aqk [B, T, HV, 64]``, ``Y, QG, KG [B, T, HV, K]``, ``U [B, T, HV, V]`` (token-major) and
    ``GAM [B, NT, HV, K]`` (NT = ceil(T / 64)), in the compute dtype.
    """
    B, T, H, K = q.shape
    HV = v.shape[2]
    cdt = jnp.promote_types(jnp.result_type(q, k, v, g, b, w), jnp.float32)
    q, k = prepare_qk(q, k, HV // H, use_qk_l2norm_in_kernel)
    xs = [layout.dense_to_chunks(jnp.asarray(x).astype(cdt), CHUNK_SIZE) for x in (q, k, v, g, b, w)]
    gates, Aqk, _, wy = _stages_fwd(*xs, scale)
    tok = functools.partial(layout.dense_from_chunks, T=T)
    return dict(Aqk=tok(Aqk), Y=tok(wy.Y), U=tok(wy.U), QG=tok(wy.QG), KG=tok(wy.KG),
                GAM=jnp.moveaxis(gates.gamC, 0, 1))

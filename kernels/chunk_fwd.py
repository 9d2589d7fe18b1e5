"""Chunked prefill forward of GDN-2 (chunk C = 64) as two TileLang kernels.

Math (spec §5, Gated DeltaNet-2, arXiv:2605.22791 eqs. 18-25; FLA ``fla/ops/gdn2``). Per chunk of C = 64 rows
with within-chunk cumulative log-decay ``G_r = sum_{i<=r} g_i`` (fp32, base 2 internally)::

    Aqk_rs = scale * sum_d q_rd k_sd exp(G_rd - G_sd)              s <= r
    T_rs   =         sum_d b_rd k_rd k_sd exp(G_rd - G_sd)         s <  r
    A = (I + T)^-1,  Y = A (b*k*exp(G)),  U = A (w*v)
    R = U - Y S0,    O = scale (q*exp(G)) S0 + Aqk R,    S1 = exp(G_C) * S0 + (k*exp(G_C - G))^T R

Launch 1 ``gdn2_chunk_intra`` (one block per chunk slot and value head, fully parallel, the head fastest in
the grid with ``intra_heads_first``, the default since session 32; 256 threads, two blocks per SM,
the channel axis walked in slices of 32, each slice's inputs fetched by cp.async while the previous one is
computed: ``intra_prefetch``, the default since session 12) computes the cumulative decay, ``Aqk`` and ``T``,
the solve, and stores ``Aqk``, ``Y``, ``U``, ``QG = scale*q*exp(G)``, ``KG = k*exp(G_C - G)``
(input dtype) and ``GAM = exp(G_C)`` (fp32). Exponents are bounded where they are evaluated:

* the 16x16 blocks of Aqk / T use TF32 tensor-core products anchored at a row a of the row sub-chunk [n, n+16):
  ``(q_r exp(G_r - G_a)) . (k_s exp(G_a - G_s))``. Per channel slice, when every ``|G_r - G_(n+8)|`` within every
  sub-chunk is at most 50 (base 2; 69 nats over 16 tokens) the anchor is a = n + 8 and the diagonal blocks are
  products too (all factors in 2^[-50, 50]); otherwise a = n for the off-diagonal blocks (exponents <= 0) and
  the diagonal blocks are exact fp32 sums over channels (a thread owns one column s and a group of rows,
  ``exp(min(G_r - G_s, 0))`` per element). ``exact_diag=True`` forces the second path everywhere;
* ``(I+T)^-1``: the four diagonal 16x16 blocks by fp32 forward substitution (D), then (``blocked_solve``, the
  default since session 22) the 16x16 blocks below them inside each 32x32 diagonal block in fp32 and the lower
  32x32 block as two 32^3 TF32 products; without it ``A = (I - N + N^2 - N^3) D`` with ``N = D T_off``
  (strictly block-lower, N^4 = 0), four 64^3 TF32 products.

Launch 2 ``gdn2_chunk_state_o`` (one block per sequence, V-block and value head; the head fastest in the grid
with ``state_heads_first``, the two-warpgroup pass's default) walks the chunks of one sequence with
the state slice ``S[K, BV]`` in fp32 registers and writes the output of every chunk (FLA's h and o kernels fused:
per-chunk states never reach HBM, except with ``save_states``, the training forward, which also writes each
chunk's start state ``h`` and ``v_new``), then the final state.

GVA: value head j reads q/k head j // (HV/H) inside launch 1 (never materialised). Varlen: chunks are aligned
to each sequence start; chunk slot of (sequence n, chunk j) is ``n + cu[n] // 64 + j`` (< T // 64 + N), found by
launch 1 with a binary search over ``cu_seqlens`` on the device. Token offsets are int64. Never imports jax.

Precision (bf16 inputs, fp64 oracle, spec §11 inputs B1 T512 H4, H200, v5): o RMS ratio 3.28e-3, final state
2.45e-3; FLA 0.6.0 on the same inputs 3.21e-3 / 2.44e-3 (v4, every diagonal block exact: 3.19e-3 / 2.45e-3). See
docs/performance-notes.md, session 4.
"""

from . import defaults, registry
from ._common import (AQKL_WIDTH, CHUNK, L2NORM_EPS, LOG2E, TF32_DY, drop_params, product_residual,
                      residual_blocks_macro, rounding_residual, segment_scan_macros, tf32_nearest, tf32_operand)
from ._pipeline import Buf, Launch, Pipeline

__all__ = ["STATE_CHOICE_OPTIONS", "STATE_WIDE_OPTIONS", "chunk_fwd_pipeline", "inference_options", "num_chunk_slots"]

SUB = 16
assert AQKL_WIDTH == SUB  # (launch 1 stores AqkL by its row sub-chunks)
# a slice's diagonal 16x16 blocks use TF32 products (anchored at each sub-chunk's row 8) when every base-2 log-decay
# within a sub-chunk lies within this distance of that row's (69 nats over 16 tokens); else exact fp32 sums
DIAG_HALF_RANGE = 50.0
_VERSION = 5  # bump when the generated code changes in a way the source hash would not see


#: The state pass (launch 2) of an inference call: one V-block of 128 per head and two consumer warpgroups
#: (``STATE_WIDE_OPTIONS``), V-blocks of 64, or V-blocks of 32, chosen per call by sequences x value heads
#: (``inference_options``). Each option runs one block per SM (209, 169 and 149 KiB of shared memory at
#: K = V = 128), so the launch runs in waves of ``STATE_RULE_SMS`` blocks, and wider V-blocks read each head's Y,
#: QG, KG and Aqk fewer times (at V-blocks of 32 the launch is L2-bound: 89.7% L2 throughput, ncu, session 21).
#: ``_STATE_CHOICES``: (options, blocks per head, µs per block and chunk with every SM busy), from H100 do_bench times
#: at B4 T4096 H32 (session 25, call A): 0.298 ms for the wide pass's one wave of 64-chunk blocks, 0.334 for V-blocks
#: of 64 (two waves), 0.392 for 32 (four). The rule takes the option with the fewest waves x that time, so that a
#: partly filled last wave is counted whole (with fewer blocks in flight a block runs faster, down to 3.8, 2.4 and
#: 1.0 µs per chunk in calls A and D: the model overcounts a partial wave). Measured where it chooses the wide pass:
#: -7 to -11% against V-blocks of 64 at 128, 256 and 512 heads (H100, session 25); between whole waves (133-198,
#: 265-330, 397-462 heads) it takes the narrower blocks by the model only (not measured there). Below
#: ``STATE_WIDE_MIN_HEADS`` heads the factory default stays (V-blocks of 32, or 16 below 32 value heads; the wider
#: options are 2.6-3.9x slower at 16-32 heads, session 25; V-blocks of 64 cost 1.6-2.5x at 32-64 blocks, session
#: 21), and so it does for packed sequences (``varlen``): their lengths are not known when the call is traced, and
#: one long sequence sets the launch's time, its heads' work on 1, 2 or 4 blocks per head (B1 T32768 H32: the wide
#: pass 2.6x, V-blocks of 64 1.6x the default's time, session 25 call A).
STATE_WIDE_MIN_HEADS = 128
#: The factory options of the wide state pass.
STATE_WIDE_OPTIONS = {"block_v": 128, "state_threads": 256}
#: SMs the rule assumes (H100 and H200 SXM; an H100 PCIe has 114).
STATE_RULE_SMS = 132
_STATE_CHOICES = ((STATE_WIDE_OPTIONS, 1, 0.298e3 / 64), ({"block_v": 64}, 2, 0.334e3 / 128),
                  ({"block_v": 32}, 4, 0.392e3 / 256))
#: The options ``inference_options`` can return besides none (what ``kernels.build``'s serving preset builds).
STATE_CHOICE_OPTIONS = tuple(c[0] for c in _STATE_CHOICES)


def inference_options(*, N: int, HV: int, V: int, varlen: bool = False) -> dict:
    """Factory options of :func:`chunk_fwd_pipeline` for one inference call with ``N`` sequences (``HV`` value heads
    of dim ``V``; ``varlen``: packed sequences), which the runners add to ``registry.config``
    (``registry.KernelOp.options_for_call``): for V = 128, equal-length sequences and ``N * HV >=
    STATE_WIDE_MIN_HEADS``, the state-pass option of ``_STATE_CHOICES`` with the least modelled time (waves of
    ``STATE_RULE_SMS`` blocks x time per block; ties go to the wider V-block): ``STATE_WIDE_OPTIONS`` at 128-132,
    199-264, 331-396 and from 463 heads, ``{"block_v": 64}`` at 166-198, 265-330 and 397-462, ``{"block_v": 32}`` at
    133-165; otherwise none (the factory's default). The training forward keeps the default (its state pass also
    writes the per-chunk states the backward reads). Changes no result: launch 2's products sum over K and over a
    chunk's rows, never over V, so the V-block width and the warpgroup split only move work between blocks and
    warps (bit-identical, ``tests/test_stages.py``)."""
    heads = N * HV
    if V != 128 or varlen or heads < STATE_WIDE_MIN_HEADS:
        return {}
    opts, _, _ = min(_STATE_CHOICES, key=lambda c: -(-heads * c[1] // STATE_RULE_SMS) * c[2])
    return dict(opts)


def num_chunk_slots(T: int, N: int, varlen: bool) -> int:
    """Chunk slots per batch row: ceil(T/64) dense, T // 64 + N (an upper bound) varlen."""
    return T // CHUNK + N if varlen else -(-T // CHUNK)


def seq_span(n, cu_seqlens, Tn, varlen: bool):
    """Where sequence ``n`` lives, for the kernels that walk one sequence's chunks in order (inside a prim_func):
    ``(batch row, first token (int64), length, first chunk slot)``. Varlen: row 0 of the packed batch, tokens
    ``cu_seqlens[n] ..``, slots from ``n + cu_seqlens[n] // 64`` (``num_chunk_slots``); dense: row n, all Tn tokens."""
    import tilelang.language as T

    if varlen:
        return 0, T.cast(cu_seqlens[n], "int64"), cu_seqlens[n + 1] - cu_seqlens[n], n + cu_seqlens[n] // CHUNK
    return n, T.int64(0), Tn, 0


def locate_chunk(bx, cu_seqlens, Tn, NT, NP1, loc, t0, varlen: bool):
    """Where the chunk of block ``bx`` (one block per chunk slot, ``bx`` in [0, NT * B)) lives, for the kernels that
    take one chunk per block (inside a prim_func, as a ``T.macro``): fills ``loc`` (int32 local ``[4]``) with
    ``(scratch, batch row, chunk slot, valid rows)`` and ``t0`` (int64 local ``[1]``) with the chunk's first token.
    Varlen: a binary search over ``cu_seqlens`` finds the sequence n with ``n + cu[n] // 64 <= bx`` (slots as
    ``num_chunk_slots``); a slot past its sequence's chunks gets ``valid == 0``, and so does every slot whose rows
    would fall outside ``[0, Tn)`` (invalid traced ``cu_seqlens``: not ending at Tn, negative or decreasing)."""
    import tilelang.language as T

    C = CHUNK

    @T.macro
    def body(bx, cu_seqlens, loc, t0):
        if varlen:
            loc[0] = 0
            loc[1] = NP1 - 2
            for _it in T.serial(32):
                if loc[0] < loc[1]:
                    if (loc[0] + loc[1] + 1) // 2 + cu_seqlens[(loc[0] + loc[1] + 1) // 2] // C <= bx:
                        loc[0] = (loc[0] + loc[1] + 1) // 2
                    else:
                        loc[1] = (loc[0] + loc[1] + 1) // 2 - 1
            loc[1] = 0
            loc[2] = bx
            t0[0] = T.cast(cu_seqlens[loc[0]], "int64") + T.cast(bx - loc[0] - cu_seqlens[loc[0]] // C, "int64") * C
            # clamped to [0, C] and to the packed batch's Tn tokens, in int64 before the cast: invalid traced
            # cu_seqlens (poisoned to NaN later) then never move a load or store past the buffers of the kernels
            # compiled without TileLang's bounds checks
            loc[3] = T.cast(T.max(T.min(T.min(T.cast(cu_seqlens[loc[0] + 1], "int64"), T.cast(Tn, "int64"))
                                        - t0[0], T.int64(C)), T.int64(0)), "int32")
            if t0[0] < 0:
                loc[3] = 0
        else:
            loc[1] = bx // NT
            loc[2] = bx % NT
            t0[0] = T.cast(bx % NT, "int64") * C
            loc[3] = T.min(Tn - (bx % NT) * C, C)

    return body(bx, cu_seqlens, loc, t0)


def _signature(*, H, HV, K, V, dtype, g_dtype, varlen):
    """Buffer types of both launches (every optional buffer included; ``drop_params`` removes unused ones).

    Dense: batch B = number of sequences N. Varlen: B == 1, N = NP1 - 1 sequences (``cu_seqlens`` int32 [NP1]).
    """
    import tilelang.language as T

    C = CHUNK
    B = T.dynamic("B")
    Tn = T.dynamic("T")
    NT = T.dynamic("NT")
    NP1 = T.dynamic("NP1")
    N = T.dynamic("N") if varlen else B
    f32 = "float32"
    sig = dict(
        q=T.Tensor((B, Tn, H, K), dtype), k=T.Tensor((B, Tn, H, K), dtype), v=T.Tensor((B, Tn, HV, V), dtype),
        g=T.Tensor((B, Tn, HV, K), g_dtype), b=T.Tensor((B, Tn, HV, K), dtype), w=T.Tensor((B, Tn, HV, V), dtype),
        h0=T.Tensor((N, HV, K, V), f32), cu_seqlens=T.Tensor((NP1,), "int32"),
        Aqk=T.Tensor((B, Tn, HV, C), dtype), AqkL=T.Tensor((B, Tn, HV, AQKL_WIDTH), dtype),
        Y=T.Tensor((B, Tn, HV, K), dtype), U=T.Tensor((B, Tn, HV, V), dtype),
        QG=T.Tensor((B, Tn, HV, K), dtype), KG=T.Tensor((B, Tn, HV, K), dtype), GAM=T.Tensor((B, NT, HV, K), f32),
        QGL=T.Tensor((B, Tn, HV, K), dtype), Akk=T.Tensor((B, Tn, HV, C), f32),
        o=T.Tensor((B, Tn, HV, V), dtype), ht=T.Tensor((N, HV, K, V), f32),
        h=T.Tensor((B, NT, HV, K, V), f32), v_new=T.Tensor((B, Tn, HV, V), f32),
    )
    return sig, dict(B=B, T=Tn, NT=NT, NP1=NP1, N=N)


# ----------------------------------------------------------------------------------------------------------------
# launch 1: intra-chunk (cumsum, Aqk, T, solve, WY auxiliaries)
# ----------------------------------------------------------------------------------------------------------------
def _intra_prim(*, H, HV, K, V, dtype, g_dtype, scale, varlen, l2norm, threads, min_blocks, exact_diag,
                exact_self=False, tf32_round=False, aqk_split=False, save_a=False, prefetch=False, z_split=False,
                qg_split=False, tf32_a=False, ftz=False, blocked_solve=False, fused_slice=False, warp_tiles=False,
                smem_epilogue=False, unroll_slices=False, g_first=False, heads_first=False):
    """Launch 1 (one block per chunk slot and value head): ``threads`` threads, hint ``min_blocks`` per SM.

    The channel (d) axis is walked in slices of DC = 32 so that shared memory (87 KB for K = V = 128, 110 KB with
    ``prefetch``) and registers allow two 256-thread blocks per SM. Per slice: load g, q, k (optionally L2-normalised), b*k; the
    within-chunk cumulative sum of the slice (segment prefix, then segment offsets); store QG, KG, GAM for the slice
    and keep ``b*k*exp(G)`` (input dtype) for the Y product; decide the slice's path (``__syncthreads_or`` over
    its decay ranges, block-uniform); accumulate the 16x16 blocks of Aqk and T as anchored TF32 products (one
    register accumulator per row sub-chunk; the diagonal blocks included on the fast path) or, on the exact path,
    the diagonal blocks as fp32 sums (thread = block, column s, group of rows). Then: store Aqk; invert the diagonal 16x16 blocks of I + T
    by forward substitution; the rest of ``A`` blockwise (``blocked_solve``, below) or as
    ``(I - N + N^2 - N^3) D`` with TF32 products; ``Y = A (b k exp(G))`` and
    ``U = A (w v)`` with bf16/fp16 tensor-core products.

    ``prefetch`` (the same arithmetic, bit-identical results): every input tile reaches shared memory by predicated
    ``cp.async`` (16-byte copies; rows past the chunk's valid ones are zero-filled, never read), one slice ahead:
    q and k of slice dc + 1 in the second of two buffers while slice dc is computed, its g and b as soon as slice
    dc's are consumed (converted at the slice's start), and w, v right after the slice loop, so that the solve
    hides their latency. (Every product is rounded where the launch without it rounds it: g * log2(e) is stored
    before the cumulative sum, so no fused multiply-add can change a bit.) At K = V = 128 with the default options
    (ptxas, sm_90a): 110 KB of shared memory instead of 87 (still two blocks per SM), 128 registers and no spills
    (92 bytes spilled without it; ``exact_self`` with ``tf32_round`` still spills 112). Compiled without TileLang's bounds
    checks (``tl.disable_safe_memory_legalize``): every global access is masked by the kernel itself (checked on
    the generated CUDA by ``tests/test_tilelang_cpu.py::test_forward_intra_prefetch_masks_every_global_access_itself``).

    ``blocked_solve`` (256 threads only): ``(I + T)^-1`` as a blocked lower-triangular inverse instead of the
    Neumann series: the 16 x 16 diagonal blocks by forward substitution (as without it), then the 16 x 16 block
    below the diagonal inside each of the two 32 x 32 diagonal blocks, ``X_(i+1,i) = -D_(i+1) (T_(i+1,i) D_i)``,
    as fp32 products (thread = two entries), then the lower 32 x 32 block ``-X_BB (T_BA X_AA)`` as two TF32
    ``T.gemm`` (32 x 32 x 32): 81,920 multiply-adds instead of the four dense 64^3 products' 1,048,576 (13x
    fewer), and fp32 where the series used TF32. (With ``tf32_round`` the two diagonal 32 x 32 blocks of the
    inverse are stored rounded to nearest TF32: they are operands.)

    ``fused_slice`` (the default; needs ``prefetch`` and 256 threads; the same arithmetic, bit-identical results):
    the slice's element-wise work in one pass over rows that each thread owns (segment ``tx // 32`` of 8 rows,
    channel ``tx % 32``): g and b go to registers, the cumulative sum runs in registers (the segment totals exchanged
    through shared memory, as before), and QG, KG, Ebs, the row's QE operands and its Kc operands are formed from
    one read of each input, instead of separate passes that each re-read G, q, k and b*k from shared memory.
    Gc is still stored (anchors, G at the chunk's last row, the exact diagonal sums), b*k only for slices that
    take the exact path.

    ``warp_tiles`` (the default; needs ``fused_slice``; the same arithmetic, bit-identical results): the four
    anchored products as hand-written TF32 ``mma.sync`` (m16n8k8) tiles instead of ``T.gemm``, each warp owning whole 32-row column
    tiles of one product (warp: sub-chunk, first column, 8-column tiles: 0: (0, 0, 2), 1: (1, 0, 4),
    2 / 3: (2, 0 / 24, 3), 4 / 5: (3, 0 / 32, 4); warps 6 and 7 have none), so that each operand element is read
    from shared memory once or twice per slice instead of two to four times (``T.gemm`` spreads each product over
    all eight warps in 16 x 8 or 16 x 16 tiles), and only the columns a product needs (``T.gemm`` computes Aqk's
    first sub-chunk 32 columns wide and the third 64). QE / Kc are plain row-major tiles padded to 36 floats a row
    (``ldmatrix`` rows conflict-free; QE of sub-chunk i in ``QEa[i]``, Kc_i in rows ``KOFF[i]`` onwards of ``Kca``),
    each Kc holding only the rows its product reads; the per-row pass stores a row's QE into its sub-chunk's tile
    by index, and each Kc_i after the row loop under one warp-uniform branch (the rows' sub-chunk ``tx // 64``
    before i or equal to it), not one comparison and branch per row and sub-chunk. Each output element
    sees the same m16n8k8 operations in the same order as under ``T.gemm`` (k-steps of 8 channels in order,
    slice after slice). The accumulators are stored to Aqk / T by their owners; with ``blocked_solve`` Aqk's tile is
    padded to 72 floats a row (the owners' stores are 8-way bank conflicts at 64, as the Neumann solve keeps it).

    ``smem_epilogue`` (the default; the same values, bit-identical results): Y and U leave through shared memory.
    Their accumulators are rounded into Ebs and Zs (``stmatrix``; their products have read them), and each
    thread stores 16-byte pieces of whole rows. Stored from the WGMMA accumulators directly, every 4-byte store
    covered 8 rows x 16 bytes (half of each 32-byte sector) and recomputed its 64-bit address (about 23
    instructions a store, 16 stores of Y and 16 of U a thread; the region of the products and these stores held
    54.9 M of v9's 350.7 M instructions at B4 T4096 H32).

    ``g_first`` (needs ``fused_slice``; the same arithmetic, bit-identical results): each slice's g and b travel in
    a ``cp.async`` group of their own, ahead of its q and k, and the slice's start waits for them only; q and k are
    waited for after the cumulative sum and each thread's share of the fast-path test, just before that test's
    block-wide ``__syncthreads_or``, which makes them visible (the anchors that follow depend on its result, and
    every row is copied by other threads than the ones that read it, so the wait cannot move past that barrier).
    Slice dc + 1's q and k go out after its g and b (both once slice dc's g and b are in registers), so the groups
    complete in that order. The cumulative sum of the block's first slice, which nothing else in the block
    overlaps, then runs while its q and k are still arriving.

    ``unroll_slices`` (experimental, off; the same arithmetic): the channel-slice loop marked ``#pragma unroll``, so
    that nvcc makes one copy of its body per slice, with the slice index and buffer parity constants, and a per-SASS
    profile tells the slices' waits apart (bench configuration, nvcc -ftz=true, every nvdisasm instruction: 11,280
    instead of 4,784; each copy 2,180-2,280 against the loop body's 2,235, so hardly fewer executed).

    ``ftz`` changes nothing here: the pipeline compiles the launch with ``nvcc -ftz=true`` (see ``intra_ftz`` of
    ``chunk_fwd_pipeline``); it is a parameter so that it enters the launch's key.
    """
    import tilelang.language as T

    # (what chunk_fwd_pipeline checks for its callers; the warp roles and row segments below assume all of it)
    assert not fused_slice or (prefetch and threads == 256), "fused_slice needs prefetch and 256 threads"
    assert not warp_tiles or fused_slice, "warp_tiles needs fused_slice"
    assert not g_first or fused_slice, "g_first needs fused_slice"
    assert not blocked_solve or threads == 256, "blocked_solve needs 256 threads"
    C, BC = CHUNK, SUB
    NB = C // BC
    TH = threads
    grp = HV // H
    acc = "float32"
    DC = 32                     # channel slice
    NDC = K // DC
    RG = TH // (NB * BC)
    RPG = BC // RG
    NSEG = TH // DC
    SEG = C // NSEG
    segment_offset, slice_cumsum = segment_scan_macros(SEG, NSEG, DC)
    PADB = 8                    # row padding of SIMT-read tiles against bank conflicts (16 bytes)
    PADF = 4
    scale = float(scale)
    force_exact = 1 if exact_diag else 0

    def tfr(x):  # TF32 operands rounded to nearest with ``tf32_round``, else truncated by the tensor core
        return tf32_operand(x, tf32_round)

    def qkel(buf, cur, r, d):  # element (r, d) of q / k slice buffer ``cur`` (two buffers with ``prefetch``)
        return buf[cur, r, d] if prefetch else buf[r, d]

    def anchor(Gc, ib, d, fast):  # G_a of row sub-chunk ib: row ib*BC + 8 on a fast slice, else row ib*BC
        return T.if_then_else(fast != 0, Gc[ib * BC + 8, d], Gc[ib * BC, d])

    def kc_operand(ib, rows, s, kf, Gs, a, a8, fast):
        # row s (of ``rows``) of sub-chunk ib's Kc operand, k_s = kf and G_s = Gs: k_s 2^min(G_a - G_s, 0) for
        # columns before the sub-chunk (a: its anchor), and on a fast slice k_s 2^(G_(n+8) - G_s) inside its
        # diagonal block (a8: G_(n+8)); zero past it (rows of Kc0 / Kc2 beyond their blocks)
        diag = T.exp2(a8 - Gs)
        if (ib + 1) * BC < rows:
            diag = T.if_then_else(s < (ib + 1) * BC, diag, 0.0)
        if ib == 0:
            return tfr(T.if_then_else(fast != 0, T.if_then_else(s < BC, kf * T.exp2(a8 - Gs), 0.0), 0.0))
        return tfr(kf * T.if_then_else(s < ib * BC, T.exp2(T.min(a - Gs, 0.0)), T.if_then_else(fast != 0, diag, 0.0)))

    def staged(buf, slot, r, c):  # element of a staging buffer: [slot, r, c] of a two-buffer one (slot >= 0)
        return buf[r, c] if isinstance(slot, int) and slot < 0 else buf[slot, r, c]

    EW16, EWG = 8, (4 if g_dtype == "float32" else 8)  # elements per 16-byte copy: 16-bit tiles, g

    @T.macro
    def cp_rows(dst, slot, src, bb, t0, hh, c0, valid, tx, width, ew):
        # rows [0, C) x columns [c0, c0 + width) of src [B, T, heads, :] into dst: one 16-byte cp.async per
        # (thread, step); rows >= valid zero-filled (the source is never read there)
        for j in T.unroll(C * width // ew // TH):
            T.ptx_cp_async(
                T.access_ptr(staged(dst, slot, (tx + j * TH) // (width // ew), (tx + j * TH) % (width // ew) * ew),
                             "w", ew),
                T.access_ptr(src[bb, t0 + (tx + j * TH) // (width // ew), hh, c0 + (tx + j * TH) % (width // ew) * ew],
                             "r", ew),
                ew, predicate=(tx + j * TH) // (width // ew) < valid)

    sig, dims = _signature(H=H, HV=HV, K=K, V=V, dtype=dtype, g_dtype=g_dtype, varlen=varlen)
    B, Tn, NT, NP1 = dims["B"], dims["T"], dims["NT"], dims["NP1"]

    @T.macro
    def anchored(QE0, QE1, QE2, QE3, Kc0, Kc1, Kc2, Kc3, Acc0, Acc1, Acc2, Acc3, Gc, qc, kc, bkc, fast, cur):
        # rows [n, n+BC) of q (x scale) and b*k (n = ib*BC) against columns s < n + BC, as TF32 products anchored
        # at row a of the sub-chunk: (x_r 2^(G_r-G_a)) . (k_s 2^(G_a-G_s)). Exact path (fast == 0): a = n, only the
        # off-diagonal columns s < n (both exponents <= 0; the diagonal block is summed exactly below). Fast path:
        # a = n + 8 and the diagonal block too: every |G_r - G_a| <= DIAG_HALF_RANGE in the sub-chunk, so all
        # factors lie in 2^[-50, 50] (no overflow, no flush for |x| in 2^[-76, 78]). Entries above the diagonal can
        # be large (even inf) but are never read (anchored_store selects, never multiplies).
        # (G_a is selected between two rows at constant indices, not read at row n + 8 * fast: TileLang's barrier
        # planner cannot bound an index that depends on a runtime value, and put a __syncthreads() between every
        # two of the stores below. Row r of q and row r of b*k share their exponential.)
        for r, d in T.Parallel(BC, DC):
            e0 = T.exp2(Gc[r, d] - anchor(Gc, 0, d, fast))
            QE0[r, d] = tfr(scale * T.cast(qkel(qc, cur, r, d), acc) * e0)
            QE0[BC + r, d] = tfr(bkc[r, d] * e0)
            e1 = T.exp2(Gc[BC + r, d] - anchor(Gc, 1, d, fast))
            QE1[r, d] = tfr(scale * T.cast(qkel(qc, cur, BC + r, d), acc) * e1)
            QE1[BC + r, d] = tfr(bkc[BC + r, d] * e1)
            e2 = T.exp2(Gc[2 * BC + r, d] - anchor(Gc, 2, d, fast))
            QE2[r, d] = tfr(scale * T.cast(qkel(qc, cur, 2 * BC + r, d), acc) * e2)
            QE2[BC + r, d] = tfr(bkc[2 * BC + r, d] * e2)
            e3 = T.exp2(Gc[3 * BC + r, d] - anchor(Gc, 3, d, fast))
            QE3[r, d] = tfr(scale * T.cast(qkel(qc, cur, 3 * BC + r, d), acc) * e3)
            QE3[BC + r, d] = tfr(bkc[3 * BC + r, d] * e3)
        for s_, d in T.Parallel(C, DC):
            Kc3[s_, d] = kc_operand(3, C, s_, T.cast(qkel(kc, cur, s_, d), acc), Gc[s_, d], anchor(Gc, 3, d, fast),
                                    Gc[3 * BC + 8, d], fast)
            Kc2[s_, d] = kc_operand(2, C, s_, T.cast(qkel(kc, cur, s_, d), acc), Gc[s_, d], anchor(Gc, 2, d, fast),
                                    Gc[2 * BC + 8, d], fast)
        for s_, d in T.Parallel(2 * BC, DC):  # (rows of their own: a masked store past a tile's rows costs a barrier)
            Kc1[s_, d] = kc_operand(1, 2 * BC, s_, T.cast(qkel(kc, cur, s_, d), acc), Gc[s_, d],
                                    anchor(Gc, 1, d, fast), Gc[BC + 8, d], fast)
            Kc0[s_, d] = kc_operand(0, 2 * BC, s_, T.cast(qkel(kc, cur, s_, d), acc), Gc[s_, d],
                                    anchor(Gc, 0, d, fast), Gc[8, d], fast)
        T.gemm(QE0, Kc0, Acc0, transpose_B=True)
        T.gemm(QE1, Kc1, Acc1, transpose_B=True)
        T.gemm(QE2, Kc2, Acc2, transpose_B=True)
        T.gemm(QE3, Kc3, Acc3, transpose_B=True)

    @T.macro
    def send_qk(qc, kc, q, k, dc, cur, bb, t0, hq, valid, tx):
        # (prefetch) slice dc + 1's q and k into the other buffers, one copy group
        cp_rows(qc, 1 - cur, q, bb, t0, hq, (dc + 1) * DC, valid, tx, DC, EW16)
        cp_rows(kc, 1 - cur, k, bb, t0, hq, (dc + 1) * DC, valid, tx, DC, EW16)
        T.ptx_commit_group()

    @T.macro
    def slice_arrived(qc, kc, q, k, dc, cur, bb, t0, hq, valid, tx):
        # (prefetch) wait for slice dc's tiles, then send slice dc + 1's q and k into the other buffers
        T.ptx_wait_group(0)
        T.sync_threads()
        if dc + 1 < NDC:
            send_qk(qc, kc, q, k, dc, cur, bb, t0, hq, valid, tx)

    @T.macro
    def qe_store(QE0, QE1, QE2, QE3, ib, r, d, xq, xb):
        # row r of sub-chunk ib's QE operand: q (x scale) in row r, b*k in row BC + r (ib warp-uniform)
        if ib == 0:
            QE0[r, d] = xq
            QE0[BC + r, d] = xb
        elif ib == 1:
            QE1[r, d] = xq
            QE1[BC + r, d] = xb
        elif ib == 2:
            QE2[r, d] = xq
            QE2[BC + r, d] = xb
        else:
            QE3[r, d] = xq
            QE3[BC + r, d] = xb

    @T.macro
    def anchored_store(ib, Acc, Qk, Tm):
        # columns < ib*BC: off-diagonal block; [ib*BC, ib*BC + BC): the diagonal block (lower / strictly lower)
        for r, c in T.Parallel(2 * BC, (ib + 1) * BC):
            if r < BC:
                Qk[ib * BC + r, c] = T.if_then_else(c - ib * BC <= r, Acc[r, c], 0.0)
            else:
                Tm[ib * BC + r - BC, c] = T.if_then_else(c - ib * BC < r - BC, Acc[r, c], 0.0)

    @T.macro
    def next_operand(Nf, dst):  # a product's result stored as the next product's operand (rounded: tf32_round)
        if tf32_round:
            for r, c in T.Parallel(C, C):
                dst[r, c] = tfr(Nf[r, c])
        else:
            T.copy(Nf, dst)

    @T.macro
    def neumann_inverse(Tm, Ds, Ns, N2s, Nf, As, Akk, bb, t0, hv, valid):
        # A = (I - N + N^2 - N^3) D with N = D L (L: T below the diagonal blocks, so N^4 = 0), four dense TF32
        # products; D (the diagonal blocks' inverses) is in Ds
        for r, c in T.Parallel(C, C):
            Tm[r, c] = tfr(T.if_then_else(c // BC < r // BC, Tm[r, c], 0.0))
        T.gemm(Ds, Tm, Nf, clear_accum=True)
        next_operand(Nf, Ns)
        T.gemm(Ns, Ns, Nf, clear_accum=True)
        next_operand(Nf, N2s)
        T.gemm(Ns, N2s, Nf, clear_accum=True)
        for r, c in T.Parallel(C, C):
            N2s[r, c] = tfr(T.if_then_else(r == c, 1.0, 0.0) - Ns[r, c] + N2s[r, c] - Nf[r, c])
        T.gemm(N2s, Ds, Nf, clear_accum=True)
        T.copy(Nf, As)
        if save_a:  # A = (I + T)^-1 in fp32 for the backward (training forward; TF32 with tf32_a)
            for r, c in T.Parallel(C, C):
                if r < valid:
                    Akk[bb, t0 + r, hv, c] = tf32_nearest(Nf[r, c]) if tf32_a else Nf[r, c]

    @T.macro
    def blocked_inverse(Tm, Ds, Mt, Ps, Pf, xl, tx):
        # X = (I + T)^-1 in Ds, whose diagonal 16 x 16 blocks D_i are already there (zeros elsewhere).
        # Level 1, i = 0, 2: X_(i+1,i) = -D_(i+1) (T_(i+1,i) D_i), fp32 (thread: pair p = tx // 128, row
        # r = (tx % 128) // 8 of the block, columns tx % 8 and tx % 8 + 8)
        for j in T.unroll(2):
            xl[j] = 0.0
        for kk in T.unroll(BC):
            for j in T.unroll(2):
                xl[j] = xl[j] + Tm[(tx // 128) * 2 * BC + BC + (tx % 128) // 8, (tx // 128) * 2 * BC + kk] * Ds[
                    (tx // 128) * 2 * BC + kk, (tx // 128) * 2 * BC + tx % 8 + 8 * j]
        for j in T.unroll(2):
            Mt[tx // 128, (tx % 128) // 8, tx % 8 + 8 * j] = xl[j]
        for j in T.unroll(2):
            xl[j] = 0.0
        for kk in T.unroll(BC):
            for j in T.unroll(2):
                xl[j] = xl[j] + Ds[(tx // 128) * 2 * BC + BC + (tx % 128) // 8, (tx // 128) * 2 * BC + BC + kk] * Mt[
                    tx // 128, kk, tx % 8 + 8 * j]
        for j in T.unroll(2):
            Ds[(tx // 128) * 2 * BC + BC + (tx % 128) // 8, (tx // 128) * 2 * BC + tx % 8 + 8 * j] = tfr(-xl[j])
        # level 2: X_BA = -X_BB (T_BA X_AA) (32 x 32 blocks; two TF32 products of 8 warps, 16 x 8 tiles each)
        if tf32_round:
            for r, c in T.Parallel(C // 2, C // 2):
                Tm[C // 2 + r, c] = tfr(Tm[C // 2 + r, c])
        T.gemm(Tm[C // 2:C, 0:C // 2], Ds[0:C // 2, 0:C // 2], Pf, clear_accum=True)
        for r, c in T.Parallel(C // 2, C // 2):
            Ps[r, c] = tfr(Pf[r, c])
        T.gemm(Ds[C // 2:C, C // 2:C], Ps, Pf, clear_accum=True)
        for r, c in T.Parallel(C // 2, C // 2):
            Ds[C // 2 + r, c] = -Pf[r, c]

    # (warp_tiles) warp w < 6: (sub-chunk, first column, number of 8-column tiles) of its anchored product tile
    WTILES = ((0, 0, 2), (1, 0, 4), (2, 0, 3), (2, 24, 3), (3, 0, 4), (3, 32, 4))
    MMA_TF32 = ("tl::mma_sync<tl::DataType::kTensorFloat32, tl::DataType::kTensorFloat32, tl::DataType::kFloat32, "
                "16, 8, 8, false, true>")

    KOFF = [BC * i * (i + 1) // 2 for i in range(NB + 1)]  # (warp_tiles) first row of Kc_i in Kca

    @T.macro
    def warp_tile(QEa, Kca, ib, n0, nn, wacc, afr, bfr, lane):
        # this warp's tile of QE Kc^T: rows [0, 32) (q rows, then b*k rows) x columns [n0, n0 + 8 nn), TF32 m16n8k8
        # per k-step of 8 channels. ldmatrix of fp32 as 8 x (4 fp32) matrices: A (m16 tile mi) rows mi*16 + 0..15,
        # registers a0..a3 = (g, t), (g+8, t), (g, t+4), (g+8, t+4); B (8-column tile j: Kc rows n0 + 8j + 0..7)
        # registers b0, b1 = (g, t), (g, t+4), two tiles per x4 (g = lane // 4, t = lane % 4)
        for ki in T.unroll(DC // 8):
            for mi in T.unroll(2):
                T.call_extern("handle", "tl::ptx_ldmatrix_x4",
                              T.address_of(QEa[ib, mi * BC + lane % 8 + lane // 8 % 2 * 8, ki * 8 + lane // 16 * 4]),
                              T.address_of(afr[mi * 4]))
            for nj in T.unroll(nn // 2):
                T.call_extern("handle", "tl::ptx_ldmatrix_x4",
                              T.address_of(Kca[KOFF[ib] + n0 + nj * 16 + lane % 8 + lane // 16 * 8,
                                               ki * 8 + lane // 8 % 2 * 4]),
                              T.address_of(bfr[nj * 4]))
            if nn % 2 == 1:
                T.call_extern("handle", "tl::ptx_ldmatrix_x2",
                              T.address_of(Kca[KOFF[ib] + n0 + (nn - 1) * 8 + lane % 8, ki * 8 + lane // 8 % 2 * 4]),
                              T.address_of(bfr[(nn - 1) * 2]))
            for mi in T.unroll(2):
                for nj in T.unroll(nn):
                    T.call_extern("handle", MMA_TF32, T.address_of(wacc[(mi * nn + nj) * 4]),
                                  T.address_of(afr[mi * 4]), T.address_of(bfr[nj * 2]))

    def kc_value(case, k, x):  # a Kc operand's value from k_s and x = G_a - G_s: before, inside (fast), or zero
        if case == "before":  # rows before the sub-chunk: the decay clamped at 1
            return k * T.exp2(T.min(x, 0.0))
        if case == "fast":  # rows inside it on a fast slice: the diagonal block anchored at G_(n+8)
            return k * T.exp2(x)
        return k * T.float32(0.0)  # (exact slice: the diagonal block is summed in fp32 elsewhere; rows of zeros)

    @T.macro
    def kc_loop(Kca, ib, kl, gl, a, case, tx):  # this thread's eight rows of Kc_ib, all of one case
        for i in T.unroll(SEG):
            Kca[KOFF[ib] + (tx // DC) * SEG + i, tx % DC] = tfr(kc_value(case, kl[i], a - gl[i]))

    @T.macro
    def kc_rows(Kca, ib, kl, gl, a, fast, tx):
        # (warp_tiles) this thread's rows (tx // 32) * 8 + i of sub-chunk ib's Kc operand, k_s = kl[i], G_s = gl[i],
        # a = the sub-chunk's anchor: kc_operand's values, with the row's place known per warp (its sub-chunk
        # tx // 64 is before ib, or ib itself) instead of compared row by row. The cases are branches around whole
        # row loops (the conditions are warp- or block-uniform): as one select per row, nvcc branched around each
        # row's exponential and re-evaluated the condition there (4 of the row's 7 instructions, session 25)
        if ib > 0 and tx // (2 * DC) < ib:  # (Kc_0 holds rows < 16 only: the diagonal block)
            kc_loop(Kca, ib, kl, gl, a, "before", tx)
        elif fast != 0:
            kc_loop(Kca, ib, kl, gl, a, "fast", tx)
        else:
            kc_loop(Kca, ib, kl, gl, a, "zero", tx)

    @T.macro
    def warp_store(ib, n0, nn, wacc, Qk, Tm, lane):
        # the owner's accumulators (c0..c3 of tile (mi, j) = rows g, g, g+8, g+8 x columns 2t, 2t+1, 2t, 2t+1) into
        # Aqk's rows (mi = 0: lower triangle of the diagonal block) and T's (mi = 1: strictly lower)
        for nj in T.unroll(nn):
            for e in T.unroll(4):
                Qk[ib * BC + lane // 4 + e // 2 * 8, n0 + nj * 8 + lane % 4 * 2 + e % 2] = T.if_then_else(
                    n0 + nj * 8 + lane % 4 * 2 + e % 2 - ib * BC <= lane // 4 + e // 2 * 8, wacc[nj * 4 + e], 0.0)
                Tm[ib * BC + lane // 4 + e // 2 * 8, n0 + nj * 8 + lane % 4 * 2 + e % 2] = T.if_then_else(
                    n0 + nj * 8 + lane % 4 * 2 + e % 2 - ib * BC < lane // 4 + e // 2 * 8, wacc[(nn + nj) * 4 + e],
                    0.0)

    @T.macro
    def warp_role(w, store, QEa, Kca, wacc, afr, bfr, Qk, Tm, lane):
        # warp w's part of the anchored products (store False) or of their assembly into Aqk / T (store True)
        if store:
            warp_store(WTILES[w][0], WTILES[w][1], WTILES[w][2], wacc, Qk, Tm, lane)
        else:
            warp_tile(QEa, Kca, WTILES[w][0], WTILES[w][1], WTILES[w][2], wacc, afr, bfr, lane)

    @T.macro
    def by_warp_role(store, QEa, Kca, wacc, afr, bfr, Qk, Tm, tx):
        # (warp_tiles) each of warps 0..5 its role of WTILES (a warp-uniform branch; warps 6 and 7 have none)
        if tx // 32 == 0:
            warp_role(0, store, QEa, Kca, wacc, afr, bfr, Qk, Tm, tx % 32)
        elif tx // 32 == 1:
            warp_role(1, store, QEa, Kca, wacc, afr, bfr, Qk, Tm, tx % 32)
        elif tx // 32 == 2:
            warp_role(2, store, QEa, Kca, wacc, afr, bfr, Qk, Tm, tx % 32)
        elif tx // 32 == 3:
            warp_role(3, store, QEa, Kca, wacc, afr, bfr, Qk, Tm, tx % 32)
        elif tx // 32 == 4:
            warp_role(4, store, QEa, Kca, wacc, afr, bfr, Qk, Tm, tx % 32)
        elif tx // 32 == 5:
            warp_role(5, store, QEa, Kca, wacc, afr, bfr, Qk, Tm, tx % 32)

    @T.prim_func
    def main(q: sig["q"], k: sig["k"], v: sig["v"], g: sig["g"], b: sig["b"], w: sig["w"],
             cu_seqlens: sig["cu_seqlens"], Aqk: sig["Aqk"], AqkL: sig["AqkL"], Y: sig["Y"], U: sig["U"],
             QG: sig["QG"], KG: sig["KG"], GAM: sig["GAM"], QGL: sig["QGL"], Akk: sig["Akk"]):
        # (heads_first: one grid axis with the value head fastest, so that the blocks launched together read and
        # write whole token rows of the [B, T, HV, D] tensors rather than one head's slice of many rows)
        with T.Kernel(*((HV * NT * B,) if heads_first else (NT * B, HV)), threads=TH) as ids:
            bx, hv = (ids // HV, ids % HV) if heads_first else ids
            if min_blocks > 1:
                T.annotate_min_blocks_per_sm(min_blocks)
            tx = T.get_thread_binding()
            hq = hv // grp

            # (buffers of one shape allocated together, in the order the shared-memory layout was measured with)
            Gc = T.alloc_shared((C, DC + PADF), acc)
            if prefetch:  # q, k slices in two buffers each; g, b, w staged as loaded (v staged in Zs)
                qc, kc = (T.alloc_shared((2, C, DC + PADB), dtype) for _ in range(2))
                gS = T.alloc_shared((C, DC), g_dtype)
                bS = T.alloc_shared((C, DC), dtype)
                wS = T.alloc_shared((C, V), dtype)
            else:
                qc, kc = (T.alloc_shared((C, DC + PADB), dtype) for _ in range(2))
            bkc = T.alloc_shared((C, DC + PADF), acc)
            tot = T.alloc_shared((NSEG, DC), acc)
            nq, nk = (T.alloc_shared((C,), acc) for _ in range(2))
            # Kc0 rows >= 16 and Kc2 rows >= 48 are zero: 8 warps need 32- / 64-wide products
            if warp_tiles:  # plain rows padded to 36 floats: QE of sub-chunk i in QEa[i]; Kc_i in rows
                # [KOFF[i], KOFF[i] + (i + 1) * 16) of Kca (only the rows its product reads)
                QEa = T.alloc_shared((NB, 2 * BC, DC + PADF), acc)
                Kca = T.alloc_shared((KOFF[NB], DC + PADF), acc)
                wacc = T.alloc_local((32,), acc)  # (this warp's tile: at most 2 x 4 m16n8 accumulators)
                afr = T.alloc_local((8,), "uint32")
                bfr = T.alloc_local((8,), "uint32")
                kl = T.alloc_local((SEG,), acc)  # (the thread's k of its rows, for the Kc stores)
            else:
                QE0, QE1, QE2, QE3, Kc0, Kc1 = (T.alloc_shared((2 * BC, DC), acc) for _ in range(6))
                Kc2, Kc3 = (T.alloc_shared((4 * BC, DC), acc) for _ in range(2))
                Acc0, Acc1 = (T.alloc_fragment((2 * BC, 2 * BC), acc) for _ in range(2))
                Acc2, Acc3 = (T.alloc_fragment((2 * BC, 4 * BC), acc) for _ in range(2))
            Ebs = T.alloc_shared((C, K), dtype)
            if blocked_solve:  # Ds holds the inverse X; Mt the level-1 partial products, Pf / Ps the 32^3 ones
                if warp_tiles:  # (Aqk's tile padded: see warp_store)
                    Qk = T.alloc_shared((C, C + PADB), acc)
                    Tm, Ds = (T.alloc_shared((C, C), acc) for _ in range(2))
                else:
                    Qk, Tm, Ds = (T.alloc_shared((C, C), acc) for _ in range(3))
                Mt = T.alloc_shared((2, BC, BC), acc)
                Ps = T.alloc_shared((C // 2, C // 2), acc)
                Pf = T.alloc_fragment((C // 2, C // 2), acc)
                xl = T.alloc_local((2,), acc)
            else:
                Qk, Tm, Ds, Ns, N2s = (T.alloc_shared((C, C), acc) for _ in range(5))
                Nf = T.alloc_fragment((C, C), acc)
            As = T.alloc_shared((C, C), dtype)
            Zs = T.alloc_shared((C, V), dtype)
            if z_split and not prefetch:  # (with prefetch, w's staging tile takes the residual of w v)
                ZsL = T.alloc_shared((C, V), dtype)
            Yf = T.alloc_fragment((C, K), acc)
            Uf = T.alloc_fragment((C, V), acc)
            aq, at = (T.alloc_local((RPG,), acc) for _ in range(2))
            xc = T.alloc_local((BC,), acc)
            csum, kkv, gmv = (T.alloc_var(acc) for _ in range(3))
            if exact_self:
                sdot = T.alloc_var(acc)
            if fused_slice:  # a thread's rows of the slice: G, b; the four anchors G_a; its sub-chunk's, G_(C-1)
                gl, bl = (T.alloc_local((SEG,), acc) for _ in range(2))
                anc = T.alloc_local((NB,), acc)
                ar, glast = (T.alloc_var(acc) for _ in range(2))
            fast = T.alloc_var("int32")
            # block-uniform coordinates computed once (as expressions they were re-derived at every access)
            loc = T.alloc_local((4,), "int32")
            t0a = T.alloc_local((1,), "int64")
            locate_chunk(bx, cu_seqlens, Tn, NT, NP1, loc, t0a, varlen)
            bb, slot, valid, t0 = loc[1], loc[2], loc[3], t0a[0]

            if valid > 0:
                if l2norm:
                    # 1 / ||x|| per row for q (threads 0..63) and k (threads 64..127)
                    if tx < 2 * C:
                        csum = 0.0
                        for d in T.serial(K):
                            if tx < C:
                                if tx < valid:
                                    csum = csum + T.cast(q[bb, t0 + tx, hq, d], acc) * T.cast(q[bb, t0 + tx, hq, d], acc)
                            else:
                                if tx - C < valid:
                                    csum = csum + T.cast(k[bb, t0 + tx - C, hq, d], acc) * T.cast(
                                        k[bb, t0 + tx - C, hq, d], acc)
                        if tx < C:
                            nq[tx] = T.rsqrt(csum + L2NORM_EPS)
                        else:
                            nk[tx - C] = T.rsqrt(csum + L2NORM_EPS)
                if exact_self:
                    sdot = 0.0
                if warp_tiles:
                    for i in T.unroll(32):
                        wacc[i] = 0.0
                else:
                    T.clear(Acc0)
                    T.clear(Acc1)
                    T.clear(Acc2)
                    T.clear(Acc3)
                for i in T.unroll(RPG):
                    aq[i] = 0.0
                    at[i] = 0.0
                if prefetch:
                    cp_rows(gS, -1, g, bb, t0, hv, 0, valid, tx, DC, EWG)
                    cp_rows(bS, -1, b, bb, t0, hv, 0, valid, tx, DC, EW16)
                    if g_first:  # (g and b in a copy group of their own, ahead of q and k)
                        T.ptx_commit_group()
                    cp_rows(qc, 0, q, bb, t0, hq, 0, valid, tx, DC, EW16)
                    cp_rows(kc, 0, k, bb, t0, hq, 0, valid, tx, DC, EW16)
                    T.ptx_commit_group()
                for dc in (T.unroll(NDC) if unroll_slices else T.serial(NDC)):
                    cur = dc % 2 if prefetch else 0
                    if not fused_slice:
                        if prefetch:
                            # ---- slice dc has arrived (rows >= valid zero-filled); slice dc + 1's q, k go out ----
                            slice_arrived(qc, kc, q, k, dc, cur, bb, t0, hq, valid, tx)
                            for r, d in T.Parallel(C, DC):
                                Gc[r, d] = T.cast(gS[r, d], acc) * LOG2E  # (stored before the sum, as below)
                                if l2norm:
                                    qc[cur, r, d] = T.cast(T.cast(qc[cur, r, d], acc) * nq[r], dtype)
                                    kc[cur, r, d] = T.cast(T.cast(kc[cur, r, d], acc) * nk[r], dtype)
                                bkc[r, d] = T.cast(bS[r, d], acc) * T.cast(kc[cur, r, d], acc)
                            # every thread's reads of gS / bS above are done before the copies overwrite them
                            # (stated here, not left to TileLang's barrier insertion)
                            T.sync_threads()
                            if dc + 1 < NDC:  # slice dc's g and b are consumed: slice dc + 1's go out
                                cp_rows(gS, -1, g, bb, t0, hv, (dc + 1) * DC, valid, tx, DC, EWG)
                                cp_rows(bS, -1, b, bb, t0, hv, (dc + 1) * DC, valid, tx, DC, EW16)
                                T.ptx_commit_group()
                        else:
                            # ---- load the channel slice (rows >= valid are zero) ----
                            for r, d in T.Parallel(C, DC):
                                Gc[r, d] = T.if_then_else(
                                    r < valid, T.cast(g[bb, t0 + r, hv, dc * DC + d], acc), 0.0) * LOG2E
                                if l2norm:
                                    qc[r, d] = T.if_then_else(
                                        r < valid, T.cast(T.cast(q[bb, t0 + r, hq, dc * DC + d], acc) * nq[r], dtype),
                                        T.cast(0, dtype))
                                    kc[r, d] = T.if_then_else(
                                        r < valid, T.cast(T.cast(k[bb, t0 + r, hq, dc * DC + d], acc) * nk[r], dtype),
                                        T.cast(0, dtype))
                                    bkc[r, d] = T.if_then_else(
                                        r < valid, T.cast(b[bb, t0 + r, hv, dc * DC + d], acc) * T.cast(T.cast(
                                            T.cast(k[bb, t0 + r, hq, dc * DC + d], acc) * nk[r], dtype), acc), 0.0)
                                else:
                                    qc[r, d] = T.if_then_else(r < valid, q[bb, t0 + r, hq, dc * DC + d], T.cast(0, dtype))
                                    kc[r, d] = T.if_then_else(r < valid, k[bb, t0 + r, hq, dc * DC + d], T.cast(0, dtype))
                                    bkc[r, d] = T.if_then_else(
                                        r < valid, T.cast(b[bb, t0 + r, hv, dc * DC + d], acc) * T.cast(
                                            k[bb, t0 + r, hq, dc * DC + d], acc), 0.0)
                        # ---- cumulative sum of the slice: segment prefix, then segment offsets ----
                        slice_cumsum(Gc, tot, csum, tx)
                        # ---- per-slice outputs: QG, KG, GAM, and b*k*exp(G) for Y (one exp2(G) for Ebs and QG) ----
                        for r, d in T.Parallel(C, DC):
                            eg = T.exp2(Gc[r, d])
                            Ebs[r, dc * DC + d] = T.cast(bkc[r, d] * eg, dtype)
                            if r < valid:
                                QG[bb, t0 + r, hv, dc * DC + d] = T.cast(scale * T.cast(qkel(qc, cur, r, d), acc) * eg, dtype)
                                if qg_split:  # its rounding residual (training forward, for the reverse state pass)
                                    QGL[bb, t0 + r, hv, dc * DC + d] = rounding_residual(
                                        scale * T.cast(qkel(qc, cur, r, d), acc) * eg, dtype)
                                KG[bb, t0 + r, hv, dc * DC + d] = T.cast(
                                    T.cast(qkel(kc, cur, r, d), acc) * T.exp2(Gc[C - 1, d] - Gc[r, d]), dtype)
                        for d in T.Parallel(DC):
                            GAM[bb, slot, hv, dc * DC + d] = T.exp2(Gc[C - 1, d])
                        # ---- fast path for this slice: every |G_r - G_(n+8)| <= DIAG_HALF_RANGE in every sub-chunk ----
                        csum = 0.0
                        if tx < NB * DC:
                            for r in T.serial(BC):
                                csum = T.max(csum, T.abs(Gc[(tx // DC) * BC + r, tx % DC]
                                                         - Gc[(tx // DC) * BC + 8, tx % DC]))
                        fast = 1 - T.syncthreads_or(T.if_then_else(csum > DIAG_HALF_RANGE, 1, 0) + force_exact)
                        if exact_self:  # q_r . k_r of the slice in fp32 (the undecayed self term; thread = row)
                            if tx < C:
                                for dd in T.unroll(DC):
                                    sdot = sdot + T.cast(qkel(qc, cur, tx, dd), acc) * T.cast(
                                        qkel(kc, cur, tx, dd), acc)
                        # ---- anchored TF32 products: off-diagonal blocks, and the diagonal blocks when fast ----
                        anchored(QE0, QE1, QE2, QE3, Kc0, Kc1, Kc2, Kc3, Acc0, Acc1, Acc2, Acc3, Gc, qc, kc, bkc, fast, cur)
                    else:
                        # ---- slice dc has arrived; slice dc + 1's q, k go out. Thread (segment sg = tx // DC,
                        # channel d = tx % DC) owns rows sg * SEG + i, i < SEG, of the slice: g and b to registers ----
                        if g_first:  # (only g and b waited for here; q and k before the row pass reads them)
                            T.ptx_wait_group(1)
                            T.sync_threads()
                        else:
                            slice_arrived(qc, kc, q, k, dc, cur, bb, t0, hq, valid, tx)
                        for i in T.unroll(SEG):  # (g * log2(e) rounded on its own, as the default launch
                            # stores it before its sum: __fmul_rn is never contracted into the sum's additions)
                            gl[i] = T.call_extern(acc, "__fmul_rn", T.cast(gS[(tx // DC) * SEG + i, tx % DC], acc),
                                                  LOG2E)
                            bl[i] = T.cast(bS[(tx // DC) * SEG + i, tx % DC], acc)
                        T.sync_threads()  # (the staging tiles of g and b are read: slice dc + 1's go out)
                        if dc + 1 < NDC:
                            cp_rows(gS, -1, g, bb, t0, hv, (dc + 1) * DC, valid, tx, DC, EWG)
                            cp_rows(bS, -1, b, bb, t0, hv, (dc + 1) * DC, valid, tx, DC, EW16)
                            T.ptx_commit_group()
                            if g_first:  # (slice dc - 1's q / k buffers are free since the barrier above)
                                send_qk(qc, kc, q, k, dc, cur, bb, t0, hq, valid, tx)
                        # ---- cumulative sum in registers: segment prefix, then the segment offsets ----
                        csum = 0.0
                        for i in T.unroll(SEG):
                            csum = csum + gl[i]
                            gl[i] = csum
                        tot[tx // DC, tx % DC] = csum
                        T.sync_threads()
                        segment_offset(tot, csum, tx)
                        for i in T.unroll(SEG):
                            gl[i] = gl[i] + csum
                            Gc[(tx // DC) * SEG + i, tx % DC] = gl[i]
                        T.sync_threads()
                        glast = Gc[C - 1, tx % DC]
                        if tx < DC:
                            GAM[bb, slot, hv, dc * DC + tx] = T.exp2(glast)
                        # ---- fast path: every |G_r - G_(n+8)| <= DIAG_HALF_RANGE in every sub-chunk ----
                        csum = 0.0
                        for i in T.unroll(SEG):
                            csum = T.max(csum, T.abs(gl[i] - Gc[(tx // (2 * DC)) * BC + 8, tx % DC]))
                        if g_first:  # slice dc's q and k have arrived (the barrier below makes them visible;
                            # other threads copied them): slice dc + 1's two groups may still be in flight
                            if dc + 1 < NDC:
                                T.ptx_wait_group(2)
                            else:
                                T.ptx_wait_group(0)
                        fast = 1 - T.syncthreads_or(T.if_then_else(csum > DIAG_HALF_RANGE, 1, 0) + force_exact)
                        for ib in T.unroll(NB):  # the anchors G_a of the four sub-chunks (block-uniform choice)
                            anc[ib] = anchor(Gc, ib, tx % DC, fast)
                        ar = anchor(Gc, tx // (2 * DC), tx % DC, fast)  # (this thread's sub-chunk's, in a register)
                        # ---- per owned row: QG, KG, Ebs, the row's QE operands and its Kc operands ----
                        for i in T.unroll(SEG):
                            if l2norm:
                                qc[cur, (tx // DC) * SEG + i, tx % DC] = T.cast(T.cast(
                                    qc[cur, (tx // DC) * SEG + i, tx % DC], acc) * nq[(tx // DC) * SEG + i], dtype)
                                kc[cur, (tx // DC) * SEG + i, tx % DC] = T.cast(T.cast(
                                    kc[cur, (tx // DC) * SEG + i, tx % DC], acc) * nk[(tx // DC) * SEG + i], dtype)
                            qf = T.cast(qc[cur, (tx // DC) * SEG + i, tx % DC], acc)
                            kf = T.cast(kc[cur, (tx // DC) * SEG + i, tx % DC], acc)
                            bk = bl[i] * kf
                            if fast == 0:  # (the exact diagonal sums read b*k)
                                bkc[(tx // DC) * SEG + i, tx % DC] = bk
                            eg = T.exp2(gl[i])
                            Ebs[(tx // DC) * SEG + i, dc * DC + tx % DC] = T.cast(bk * eg, dtype)
                            if (tx // DC) * SEG + i < valid:
                                QG[bb, t0 + (tx // DC) * SEG + i, hv, dc * DC + tx % DC] = T.cast(scale * qf * eg, dtype)
                                if qg_split:
                                    QGL[bb, t0 + (tx // DC) * SEG + i, hv, dc * DC + tx % DC] = product_residual(
                                        scale * qf, eg, dtype)
                                KG[bb, t0 + (tx // DC) * SEG + i, hv, dc * DC + tx % DC] = T.cast(
                                    kf * T.exp2(glast - gl[i]), dtype)
                            er = T.exp2(gl[i] - ar)
                            if warp_tiles:  # (the row's sub-chunk tx // 64 indexes QEa)
                                kl[i] = kf
                                QEa[tx // (2 * DC), (tx // DC) % 2 * SEG + i, tx % DC] = tfr(scale * qf * er)
                                QEa[tx // (2 * DC), BC + (tx // DC) % 2 * SEG + i, tx % DC] = tfr(bk * er)
                            else:
                                qe_store(QE0, QE1, QE2, QE3, tx // (2 * DC), (tx // DC) % 2 * SEG + i, tx % DC,
                                         tfr(scale * qf * er), tfr(bk * er))
                            # (anc[ib] is G_(n+8) on a fast slice, the only case that reads the diagonal term)
                            if not warp_tiles:
                                Kc3[(tx // DC) * SEG + i, tx % DC] = kc_operand(
                                    3, C, (tx // DC) * SEG + i, kf, gl[i], anc[3], anc[3], fast)
                                Kc2[(tx // DC) * SEG + i, tx % DC] = kc_operand(
                                    2, C, (tx // DC) * SEG + i, kf, gl[i], anc[2], anc[2], fast)
                                if tx < 2 * BC // SEG * DC:  # (rows < 32: Kc1, Kc0)
                                    Kc1[(tx // DC) * SEG + i, tx % DC] = kc_operand(
                                        1, 2 * BC, (tx // DC) * SEG + i, kf, gl[i], anc[1], anc[1], fast)
                                    Kc0[(tx // DC) * SEG + i, tx % DC] = kc_operand(
                                        0, 2 * BC, (tx // DC) * SEG + i, kf, gl[i], anc[0], anc[0], fast)
                        if warp_tiles:  # (Kc_ib's rows < (ib + 1) * 16: one warp-uniform branch per sub-chunk)
                            kc_rows(Kca, 3, kl, gl, anc[3], fast, tx)
                            if tx < 3 * BC // SEG * DC:
                                kc_rows(Kca, 2, kl, gl, anc[2], fast, tx)
                            if tx < 2 * BC // SEG * DC:
                                kc_rows(Kca, 1, kl, gl, anc[1], fast, tx)
                            if tx < BC // SEG * DC:
                                kc_rows(Kca, 0, kl, gl, anc[0], fast, tx)
                        if exact_self:  # q_r . k_r of the slice in fp32 (the undecayed self term; thread = row)
                            if tx < C:
                                for dd in T.unroll(DC):
                                    sdot = sdot + T.cast(qkel(qc, cur, tx, dd), acc) * T.cast(
                                        qkel(kc, cur, tx, dd), acc)
                        if warp_tiles:
                            T.sync_threads()  # (the slice's QE / Kc are stored)
                            by_warp_role(False, QEa, Kca, wacc, afr, bfr, Qk, Tm, tx)
                        else:
                            T.gemm(QE0, Kc0, Acc0, transpose_B=True)
                            T.gemm(QE1, Kc1, Acc1, transpose_B=True)
                            T.gemm(QE2, Kc2, Acc2, transpose_B=True)
                            T.gemm(QE3, Kc3, Acc3, transpose_B=True)
                    # ---- otherwise exact diagonal blocks: thread = (block, column s, group of rows) ----
                    if fast == 0:
                        if (tx % (BC * RG)) // BC * RPG + RPG - 1 >= tx % BC:
                            for dd in T.unroll(DC):
                                kkv = T.cast(qkel(kc, cur, (tx // (BC * RG)) * BC + tx % BC, dd), acc)
                                for i in T.unroll(RPG):
                                    gmv = kkv * T.exp2(T.min(
                                        Gc[(tx // (BC * RG)) * BC + (tx % (BC * RG)) // BC * RPG + i, dd]
                                        - Gc[(tx // (BC * RG)) * BC + tx % BC, dd], 0.0))
                                    aq[i] = aq[i] + T.cast(qkel(
                                        qc, cur, (tx // (BC * RG)) * BC + (tx % (BC * RG)) // BC * RPG + i, dd),
                                        acc) * gmv
                                    at[i] = at[i] + bkc[(tx // (BC * RG)) * BC + (tx % (BC * RG)) // BC * RPG + i,
                                                        dd] * gmv

                if prefetch:  # w and v (into Zs) for U, hidden by the solve
                    T.sync_threads()  # the last slice's reads of the buffers wS / Zs share memory with are done
                    cp_rows(wS, -1, w, bb, t0, hv, 0, valid, tx, V, EW16)
                    cp_rows(Zs, -1, v, bb, t0, hv, 0, valid, tx, V, EW16)
                    T.ptx_commit_group()
                # ---- assemble Aqk and T ----
                for r, c in T.Parallel(C, C):
                    if c // BC > r // BC:
                        Qk[r, c] = 0.0
                        Tm[r, c] = 0.0
                if warp_tiles:
                    by_warp_role(True, QEa, Kca, wacc, afr, bfr, Qk, Tm, tx)
                else:
                    anchored_store(0, Acc0, Qk, Tm)
                    anchored_store(1, Acc1, Qk, Tm)
                    anchored_store(2, Acc2, Qk, Tm)
                    anchored_store(3, Acc3, Qk, Tm)
                for i in T.unroll(RPG):  # exact diagonal-block sums of the slices that were not fast (else zero)
                    Qk[(tx // (BC * RG)) * BC + (tx % (BC * RG)) // BC * RPG + i, (tx // (BC * RG)) * BC + tx % BC] = \
                        Qk[(tx // (BC * RG)) * BC + (tx % (BC * RG)) // BC * RPG + i, (tx // (BC * RG)) * BC + tx % BC] \
                        + T.if_then_else((tx % (BC * RG)) // BC * RPG + i >= tx % BC, aq[i] * scale, 0.0)
                    Tm[(tx // (BC * RG)) * BC + (tx % (BC * RG)) // BC * RPG + i, (tx // (BC * RG)) * BC + tx % BC] = \
                        Tm[(tx // (BC * RG)) * BC + (tx % (BC * RG)) // BC * RPG + i, (tx // (BC * RG)) * BC + tx % BC] \
                        + T.if_then_else((tx % (BC * RG)) // BC * RPG + i > tx % BC, at[i], 0.0)
                if exact_self:  # the diagonal of Aqk from the exact fp32 self terms (replaces the TF32 / SIMT value)
                    T.sync_threads()
                    if tx < C:
                        Qk[tx, tx] = sdot * scale
                for r, c in T.Parallel(C, C):
                    if r < valid:
                        Aqk[bb, t0 + r, hv, c] = T.cast(Qk[r, c], dtype)
                if aqk_split:  # the diagonal blocks' rounding residual: there Aqk + AqkL carries 16 mantissa bits
                    for r, c in T.Parallel(C, AQKL_WIDTH):
                        if r < valid:
                            AqkL[bb, t0 + r, hv, c] = rounding_residual(Qk[r, (r // BC) * BC + c], dtype)

                # ---- (I + T)^-1 ----
                if tx < C:
                    for i in T.unroll(BC):
                        xc[i] = T.if_then_else(i == tx % BC, 1.0, 0.0)
                        for j in T.unroll(BC):
                            if j < i:
                                xc[i] = xc[i] - Tm[(tx // BC) * BC + i, (tx // BC) * BC + j] * xc[j]
                    for r in T.unroll(C):
                        Ds[r, tx] = tfr(T.if_then_else(r // BC == tx // BC, xc[r % BC], 0.0))
                if blocked_solve:
                    blocked_inverse(Tm, Ds, Mt, Ps, Pf, xl, tx)
                    T.copy(Ds, As)
                    if save_a:
                        for r, c in T.Parallel(C, C):
                            if r < valid:
                                Akk[bb, t0 + r, hv, c] = tf32_nearest(Ds[r, c]) if tf32_a else Ds[r, c]
                else:
                    neumann_inverse(Tm, Ds, Ns, N2s, Nf, As, Akk, bb, t0, hv, valid)

                # ---- WY auxiliaries ----
                if prefetch:
                    T.ptx_wait_group(0)
                    T.sync_threads()
                if z_split:
                    # Z = w v is exact in fp32 (two 8- or 11-bit significands) and, for bf16, exact as its 16-bit
                    # rounding plus that rounding's residual (fp16: but where the residual falls below fp16's
                    # normal range): U = A Z_hi + A Z_lo (Uf holds Z until its products clear it)
                    for r, e in T.Parallel(C, V):
                        if prefetch:
                            Uf[r, e] = T.cast(wS[r, e], acc) * T.cast(Zs[r, e], acc)
                        else:
                            Uf[r, e] = T.if_then_else(
                                r < valid, T.cast(w[bb, t0 + r, hv, e], acc) * T.cast(v[bb, t0 + r, hv, e], acc), 0.0)
                    for r, e in T.Parallel(C, V):
                        Zs[r, e] = T.cast(Uf[r, e], dtype)
                        if prefetch:
                            wS[r, e] = rounding_residual(Uf[r, e], dtype)
                        else:
                            ZsL[r, e] = rounding_residual(Uf[r, e], dtype)
                elif prefetch:
                    for r, e in T.Parallel(C, V):
                        Zs[r, e] = T.cast(T.cast(wS[r, e], acc) * T.cast(Zs[r, e], acc), dtype)
                else:
                    for r, e in T.Parallel(C, V):
                        Zs[r, e] = T.cast(T.if_then_else(
                            r < valid, T.cast(w[bb, t0 + r, hv, e], acc) * T.cast(v[bb, t0 + r, hv, e], acc), 0.0),
                            dtype)
                T.gemm(As, Ebs, Yf, clear_accum=True)
                T.gemm(As, Zs, Uf, clear_accum=True)
                if z_split:
                    if prefetch:
                        T.gemm(As, wS, Uf)
                    else:
                        T.gemm(As, ZsL, Uf)
                if smem_epilogue:  # Y, U rounded into Ebs, Zs (their products are done), then stored by rows
                    # (the barriers come from TileLang's planner: one after both warpgroups' products have read Ebs /
                    # Zs, one before the rows are read back; tests/test_tilelang_cpu.py checks them in the CUDA)
                    T.copy(Yf, Ebs)
                    T.copy(Uf, Zs)
                for r, d in T.Parallel(C, K):
                    if r < valid:
                        Y[bb, t0 + r, hv, d] = Ebs[r, d] if smem_epilogue else T.cast(Yf[r, d], dtype)
                for r, e in T.Parallel(C, V):
                    if r < valid:
                        U[bb, t0 + r, hv, e] = Zs[r, e] if smem_epilogue else T.cast(Uf[r, e], dtype)

    keep = {"q", "k", "v", "g", "b", "w", "Aqk", "Y", "U", "QG", "KG", "GAM"} | ({"cu_seqlens"} if varlen else set())
    keep |= {"AqkL"} if aqk_split else set()
    keep |= {"Akk"} if save_a else set()
    keep |= {"QGL"} if qg_split else set()
    return drop_params(main, keep)


# ----------------------------------------------------------------------------------------------------------------
# launch 2: sequential state passing + output
# ----------------------------------------------------------------------------------------------------------------
def _state_prim(*, HV, K, V, BV, dtype, use_h0, store_ht, varlen, stages, aqk_split=False, save_states=False,
                tf32_h=False, threads=128, async_mma=False, heads_first=False):
    import tilelang.language as T

    C = CHUNK
    acc = "float32"
    NVB = V // BV
    spread_residual = residual_blocks_macro()

    # q, k, g, b, w only fix the type signature's shared dims; launch 2 never takes them
    sig, dims = _signature(H=1, HV=HV, K=K, V=V, dtype=dtype, g_dtype=acc, varlen=varlen)
    B, Tn, NP1 = dims["B"], dims["T"], dims["NP1"]
    NSEQ = NP1 - 1 if varlen else B

    @T.prim_func
    def main(Aqk: sig["Aqk"], AqkL: sig["AqkL"], Y: sig["Y"], U: sig["U"], QG: sig["QG"], KG: sig["KG"],
             GAM: sig["GAM"], h0: sig["h0"], cu_seqlens: sig["cu_seqlens"], o: sig["o"], ht: sig["ht"],
             h: sig["h"], v_new: sig["v_new"]):
        with T.Kernel(*((HV * NSEQ * NVB,) if heads_first else (NSEQ * NVB, HV)), threads=threads) as ids:
            bx, hv = (ids // HV, ids % HV) if heads_first else ids  # (heads_first: as in launch 1)
            n = bx // NVB
            v0 = (bx % NVB) * BV
            S = T.alloc_fragment((K, BV), acc)
            Ys, Qs, Ks = (T.alloc_shared((C, K), dtype) for _ in range(3))
            As = T.alloc_shared((C, C), dtype)
            if aqk_split:  # (AqkL's tile, and the residual product's operand it is spread into)
                AsLc = T.alloc_shared((C, AQKL_WIDTH), dtype)
                AsL = T.alloc_shared((C, C), dtype)
            Us = T.alloc_shared((C, BV), dtype)
            gs = T.alloc_shared((K,), acc)
            Sb = T.alloc_shared((K, BV), dtype)
            Rb = T.alloc_shared((C, BV), dtype)
            Rf, Of = (T.alloc_fragment((C, BV), acc) for _ in range(2))
            if async_mma:  # (a read of each loaded tile after the wait for its product: see below)
                keep = T.alloc_local((4,), dtype)

            bb, bos, ln, sbase = seq_span(n, cu_seqlens, Tn, varlen)

            if use_h0:
                for i, j in T.Parallel(K, BV):
                    S[i, j] = h0[n, hv, i, v0 + j]
            else:
                T.clear(S)

            for j in T.Pipelined(T.ceildiv(ln, C), num_stages=stages):
                T.copy(Y[bb, bos + j * C:bos + j * C + C, hv, :], Ys)
                T.copy(QG[bb, bos + j * C:bos + j * C + C, hv, :], Qs)
                T.copy(KG[bb, bos + j * C:bos + j * C + C, hv, :], Ks)
                T.copy(Aqk[bb, bos + j * C:bos + j * C + C, hv, :], As)
                if aqk_split:
                    T.copy(AqkL[bb, bos + j * C:bos + j * C + C, hv, :], AsLc)
                T.copy(U[bb, bos + j * C:bos + j * C + C, hv, v0:v0 + BV], Us)
                T.copy(GAM[bb, sbase + j, hv, :], gs)
                if save_states:  # the chunk's start state (FLA ``h``), fp32 (rounded to TF32 with tf32_h)
                    for i, e in T.Parallel(K, BV):
                        h[bb, sbase + j, hv, i, v0 + e] = tf32_nearest(S[i, e]) if tf32_h else S[i, e]
                T.copy(S, Sb)
                if async_mma:  # both products of Sb in flight at once; R's is waited for, o's runs on
                    T.wgmma_gemm(Ys, Sb, Rf, clear_accum=True)
                    T.wgmma_gemm(Qs, Sb, Of, clear_accum=True)
                    T.wait_wgmma(1)
                    keep[0] = Ys[0, 0]  # (the pipeline releases a tile's slot after its last read: after the wait)
                else:
                    T.gemm(Ys, Sb, Rf, clear_accum=True)
                    T.gemm(Qs, Sb, Of, clear_accum=True)
                if save_states:  # R = U - Y S0 (FLA ``v_new``), fp32, the sequence's rows only
                    for r, e in T.Parallel(C, BV):
                        if j * C + r < ln:
                            v_new[bb, bos + j * C + r, hv, v0 + e] = T.cast(Us[r, e], acc) - Rf[r, e]
                for r, e in T.Parallel(C, BV):
                    Rb[r, e] = T.if_then_else(j * C + r < ln, T.cast(T.cast(Us[r, e], acc) - Rf[r, e], dtype),
                                              T.cast(0, dtype))
                if async_mma:  # the three products of R issued together, one wait: the same sums in the same order
                    if aqk_split:
                        spread_residual(AsL, AsLc, j == 0)
                    for i, e in T.Parallel(K, BV):
                        S[i, e] = S[i, e] * gs[i]
                    T.wgmma_gemm(As, Rb, Of)
                    if aqk_split:
                        T.wgmma_gemm(AsL, Rb, Of)
                    T.wgmma_gemm(Ks, Rb, S, transpose_A=True)
                    T.wait_wgmma(0)
                    keep[1] = Qs[0, 0]
                    keep[2] = As[0, 0]
                    keep[3] = Ks[0, 0]
                else:
                    T.gemm(As, Rb, Of)
                    if aqk_split:
                        spread_residual(AsL, AsLc, j == 0)
                        T.gemm(AsL, Rb, Of)
                    for i, e in T.Parallel(K, BV):
                        S[i, e] = S[i, e] * gs[i]
                    T.gemm(Ks, Rb, S, transpose_A=True)
                for r, e in T.Parallel(C, BV):
                    if j * C + r < ln:
                        o[bb, bos + j * C + r, hv, v0 + e] = T.cast(Of[r, e], dtype)

            if store_ht:
                for i, e in T.Parallel(K, BV):
                    ht[n, hv, i, v0 + e] = S[i, e]

    keep = {"Aqk", "Y", "U", "QG", "KG", "GAM", "o"} | ({"AqkL"} if aqk_split else set())
    keep |= {"h0"} if use_h0 else set()
    keep |= {"ht"} if store_ht else set()
    keep |= {"h", "v_new"} if save_states else set()
    keep |= {"cu_seqlens"} if varlen else set()
    return drop_params(main, keep)


# ----------------------------------------------------------------------------------------------------------------
# pipeline factory
# ----------------------------------------------------------------------------------------------------------------
def sizes_fn(varlen: bool, first: str = "q"):
    """A pipeline's ``sizes``: B and T from input ``first`` ``[B, T, ...]``, N, NT (``num_chunk_slots``)."""
    def sizes(shapes):
        B, Tn = int(shapes[first][0]), int(shapes[first][1])
        N = int(shapes["cu_seqlens"][0]) - 1 if varlen else B
        return {"B": B, "T": Tn, "N": N, "NT": num_chunk_slots(Tn, N, varlen)}

    return sizes


def _forward_default(fn: str, name: str, value, needs: tuple[bool, str] | None = None):
    """Option ``name`` of ``fn``: ``value``, or ``kernels.defaults.FORWARD[name]`` when None; ``ValueError`` unless
    a bool, naming the defaults table when the bad value came from there. ``needs = (met, what)``: an option that
    only exists where ``met`` (the launch it changes): off there when None, ``ValueError`` "``name``=True needs
    ``what``" when True."""
    met, what = needs if needs is not None else (True, "")
    if value is None and not met:
        return False
    origin = ""
    if value is None:
        value, origin = defaults.FORWARD[name], " (from kernels.defaults.FORWARD)"
    if not isinstance(value, bool):
        raise ValueError(f"{fn}: {name} must be a bool, got {value!r}{origin}")
    if value and not met:
        raise ValueError(f"{fn}: {name}=True needs {what}")
    return value


def chunk_fwd_pipeline(*, H: int, HV: int, K: int, V: int, dtype: str, g_dtype: str, scale: float,
                       use_initial_state: bool, output_final_state: bool, varlen: bool, use_qk_l2norm: bool,
                       block_v: int | None = None, stages: int = 2, intra_threads: int = 256,
                       intra_min_blocks: int = 2, exact_diag: bool = False, exact_self: bool = False,
                       tf32_round: bool = False, aqk_split: bool = True, save_states: bool = False,
                       intra_prefetch: bool | None = None, z_split: bool | None = None,
                       qg_split: bool | None = None, tf32_states: bool | None = None,
                       intra_ftz: bool | None = None, blocked_solve: bool | None = None,
                       fused_slice: bool | None = None, warp_tiles: bool | None = None,
                       smem_epilogue: bool | None = None, intra_unroll: bool = False,
                       g_first: bool | None = None, state_threads: int = 128,
                       state_async: bool | None = None, intra_heads_first: bool | None = None,
                       state_heads_first: bool | None = None) -> Pipeline:
    """Pipeline of the chunked GDN-2 prefill forward (two launches, see the module docstring).

    Inputs ``q,k [B,T,H,K]``, ``v,w [B,T,HV,V]`` (``dtype``: bfloat16 | float16), ``g [B,T,HV,K]`` (``g_dtype``:
    float32 | bfloat16, natural-log decay), ``b [B,T,HV,K]`` (``dtype``), ``h0 [N,HV,K,V]`` fp32 when
    ``use_initial_state``, ``cu_seqlens [N+1]`` int32 when ``varlen`` (then B == 1). Outputs ``o [B,T,HV,V]``
    (``dtype``) and, with ``output_final_state``, ``ht [N,HV,K,V]`` fp32. K, V in {64, 128}; HV a multiple of H.
    Scratch (input dtype unless noted): ``Aqk [B,T,HV,64]`` (and ``AqkL [B,T,HV,16]``), ``Y``, ``QG``,
    ``KG [B,T,HV,K]``, ``U [B,T,HV,V]``, ``GAM [B,NT,HV,K]`` fp32. Tuning knobs: ``block_v`` (V-block of the
    state kernel; default 16 for HV < 32, else 32), ``stages`` (its software-pipeline depth), ``intra_threads``
    (threads of the intra-chunk kernel: 128 or 256), ``intra_min_blocks`` (its blocks-per-SM hint, which caps
    registers) and ``exact_diag`` (every diagonal block summed exactly in fp32, never as TF32 products: the
    arithmetic before kernel v5, for comparisons) and
    ``exact_self`` (experimental: the diagonal of Aqk, the undecayed self terms q_r . k_r, summed in fp32) and
    ``tf32_round`` (experimental: TF32 operands rounded to nearest instead of truncated by the tensor core) and
    ``aqk_split`` (default on since session 5: Aqk stored as bf16 + the bf16 rounding residual of its diagonal
    16 x 16 blocks, ``AqkL [B,T,HV,16]`` (row r of a chunk: the residual of Aqk[r, 16 (r // 16) + c], c < 16; the
    whole residual ``[B,T,HV,64]`` until session 28), used as a second product in launch 2; o's RMS ratio vs fp64
    on the spec case 2.56e-3 with the whole residual and 2.99e-3 without (H100, session 28), 2.544e-3 with the
    diagonal blocks' residual alone against 2.542e-3 with the whole (CPU emulation, seeds 0-2); off reproduces
    kernel v5).
    ``intra_prefetch`` (default from ``kernels.defaults.FORWARD``): launch 1 loads its input tiles by predicated
    ``cp.async`` one channel slice ahead, without TileLang's bounds checks (the same arithmetic: bit-identical
    results; see ``_intra_prim``).
    ``z_split`` (default from ``kernels.defaults.FORWARD``): launch 1 forms ``U = A (w v)`` as two 16-bit
    tensor-core products, ``A Z_hi + A Z_lo``, where ``Z_hi`` is ``w v`` rounded to the input dtype and ``Z_lo``
    its rounding residual: ``w v`` of two 16-bit inputs is exact in fp32 and, for bf16, in that pair (fp16: up to
    residuals below fp16's normal range, 2^-14), so U no longer carries the rounding of its right-hand side, which
    (I + T)^-1 amplifies (FLA rounds it: spec §6 2c). Changes the results (o and the final state closer to fp64 in
    the CPU emulation; ``docs/performance-notes.md``, session 16).
    ``qg_split`` (training forward only; default: on when ``save_states`` and
    ``kernels.defaults.BACKWARD["qg_split"]``): launch 1 also stores ``QGL``, the rounding residual of QG in the
    input dtype, for the reverse state pass (``kernels.chunk_bwd.chunk_dstate_pipeline``); the forward's results
    are unchanged.
    ``tf32_states`` (training forward only; default: on when ``save_states`` and
    ``kernels.defaults.BACKWARD["wy_tf32_round"]`` is ``"dy"`` or ``"dy_min"``): ``h`` and ``Akk`` are stored
    rounded to nearest TF32 (``_common.tf32_nearest``), the precision at which the backward's WY launch reads
    them (its ``tf32_round="dy"`` / ``"dy_min"``); the forward's results are unchanged.
    ``intra_ftz`` (default from ``kernels.defaults.FORWARD``): launch 1 is compiled with ``nvcc -ftz=true``, so that
    each ``exp2`` is one ``MUFU.EX2`` instead of four instructions (the range test and the two scalings that keep
    results below 2^-126 subnormal), and fp32 subnormals (below 2^-126, 1.2e-38) are flushed to zero in its
    arithmetic. Only terms that pass through a subnormal change: QG, KG, QGL, GAM and b*k*exp(G) lose values
    below 2^-126, and a flushed factor or product can meet an anchored partner of at most 2^50
    (``DIAG_HALF_RANGE``) times an input, so an entry of Aqk or T moves by less than
    2^-76 max(|x_r|, |k_s|, |x_r| |k_s|) per channel (and Y, U, o through them). Measured (session 21, H100, seven
    cases including the benchmark's accuracy inputs): o and the final state bit-identical, the largest change in
    Aqk 1.3e-26 (``docs/performance-notes.md``).
    ``blocked_solve`` (default from ``kernels.defaults.FORWARD``): launch 1 inverts ``I + T`` blockwise (the
    16 x 16 blocks below the diagonal of each 32 x 32 diagonal block as fp32 products, then the lower 32 x 32 block
    as two 32^3 TF32 products) instead of the Neumann series' four dense 64^3 TF32 products (see ``_intra_prim``).
    Changes the results by the products' roundings (CPU emulation, spec case, seeds 0-2: o 2.5420e-3 ->
    2.5423e-3 vs fp64, final state 1.6883e-3 -> 1.6884e-3; ``benchmarks/emulate_chunk.py --seeds 0,1,2``). The
    default applies to the 256-thread launch; with ``intra_threads=128`` it is off (True there: ValueError).
    ``fused_slice`` (default from ``kernels.defaults.FORWARD`` where ``intra_prefetch`` and ``intra_threads=256``,
    else off; True there: ValueError): launch 1 does each channel slice's element-wise work in one pass over
    thread-owned rows with G in registers (see ``_intra_prim``); the same arithmetic, bit-identical results.
    ``warp_tiles`` (default from ``kernels.defaults.FORWARD`` where ``fused_slice``, else off; True there:
    ValueError): launch 1's four anchored products as hand-written TF32 ``mma.sync`` tiles, one 32-row column tile
    per warp (see ``_intra_prim``); bit-identical results.
    ``smem_epilogue`` (default from ``kernels.defaults.FORWARD``): launch 1 stores Y and U through shared memory
    in 16-byte pieces of whole rows instead of from its tensor-core accumulators (see ``_intra_prim``);
    bit-identical results.
    ``intra_unroll`` (experimental, off): launch 1's channel-slice loop unrolled (see ``unroll_slices`` of
    ``_intra_prim``); the same arithmetic.
    ``g_first`` (default from ``kernels.defaults.FORWARD`` where ``fused_slice``, else off; True there:
    ValueError): launch 1 waits at each channel slice's start for its g and b only, and for its q and k after the
    cumulative sum (see ``_intra_prim``); bit-identical results.
    ``state_threads`` (128, the default, or 256): launch 2's compute threads (TileLang adds its TMA producer
    warpgroup to either). Two warpgroups let one block take V-blocks of 128 (``block_v=128``) without spilling
    (sm_90a: 168 registers, 209 KiB of shared memory), so that Y, QG, KG and Aqk are read once per head instead of
    once per V-block; its products sum over K and a chunk's rows as before (bit-identical). Inference calls with
    many sequences x value heads choose it (``inference_options``).
    ``state_async`` (default from ``kernels.defaults.FORWARD``): launch 2 issues its products asynchronously
    (``T.wgmma_gemm``): Y S and QG S together, waiting for the first only; then Aqk R, AqkL R and KG^T R
    together, one wait. Each TMA-loaded tile is read once more after the wait for its product, because TileLang's
    pipeline releases a slot to the producer after the tile's last read in the loop body (without that read the
    release came right after the issue, before the product was done). The same products summed in the same
    order: bit-identical results.
    ``intra_heads_first`` (default from ``kernels.defaults.FORWARD``): launch 1's blocks on one grid axis with
    the value head fastest (block ``i`` takes head ``i % HV`` of chunk slot ``i // HV``) instead of a grid of
    chunk slots x heads, so that the blocks that run together read q, k, v, g, b, w and write the scratch as whole
    token rows of the ``[B, T, HV, D]`` tensors. ``state_heads_first`` (default: on for the two-warpgroup pass,
    ``state_threads=256``, off otherwise): the same for launch 2's blocks (block ``i``: head ``i % HV`` of V-block
    x sequence ``i // HV``). Each block's work is unchanged: bit-identical results.
    ``save_states`` (training forward) adds two outputs for the backward: ``h [B,NT,HV,K,V]`` fp32, each chunk's
    start state (chunk slots as ``GAM``), and ``v_new [B,T,HV,V]`` fp32, R = U - Y S0 per token (FLA's names),
    and the scratch ``Akk [B,T,HV,64]`` fp32, the solve ``A = (I + T)^-1`` of launch 1 (FLA ``Akk``).
    Raises ``ValueError`` for unsupported configurations.
    """
    fn = "chunk_fwd_pipeline"
    intra_prefetch = _forward_default(fn, "intra_prefetch", intra_prefetch)
    z_split = _forward_default(fn, "z_split", z_split)
    qg_origin = ""
    if qg_split is None:
        qg_split = bool(save_states) and defaults.BACKWARD["qg_split"]
        qg_origin = " (from kernels.defaults.BACKWARD)"
    if not isinstance(qg_split, bool):
        raise ValueError(f"{fn}: qg_split must be a bool, got {qg_split!r}{qg_origin}")
    if qg_split and not save_states:
        raise ValueError(f"{fn}: qg_split=True needs save_states=True (QGL is read by the backward only)")
    intra_ftz = _forward_default(fn, "intra_ftz", intra_ftz)
    # (blocked_solve: its thread mapping assumes 256 threads; fused_slice: what it is written for; warp_tiles: it
    # needs the fused slice pass's QE / Kc stores; g_first: the separate slice passes read q and k before the sum)
    blocked_solve = _forward_default(fn, "blocked_solve", blocked_solve,
                                     (intra_threads == 256, f"intra_threads=256, got {intra_threads}"))
    fused_slice = _forward_default(fn, "fused_slice", fused_slice, (
        intra_prefetch and intra_threads == 256,
        f"intra_prefetch=True and intra_threads=256, got {intra_prefetch} and {intra_threads}"))
    on_fused = (fused_slice, "fused_slice=True (and so intra_prefetch=True and intra_threads=256), got "
                f"fused_slice={fused_slice}")
    warp_tiles = _forward_default(fn, "warp_tiles", warp_tiles, on_fused)
    smem_epilogue = _forward_default(fn, "smem_epilogue", smem_epilogue)
    g_first = _forward_default(fn, "g_first", g_first, on_fused)
    state_async = _forward_default(fn, "state_async", state_async)
    intra_heads_first = _forward_default(fn, "intra_heads_first", intra_heads_first)
    if tf32_states is None:  # (a bool by construction)
        tf32_states = bool(save_states) and defaults.BACKWARD["wy_tf32_round"] in TF32_DY
    if not isinstance(tf32_states, bool):
        raise ValueError(f"{fn}: tf32_states must be a bool, got {tf32_states!r}")
    if tf32_states and not save_states:
        raise ValueError(f"{fn}: tf32_states=True needs save_states=True (h is stored for the backward only)")
    registry.get("chunk_gdn2").support.check(fn, H=H, HV=HV, K=K, V=V, dtype=dtype, g_dtype=g_dtype, scale=scale)
    scale = float(scale)
    BV = min(V, 16 if HV < 32 else 32) if block_v is None else int(block_v)
    if intra_threads not in (128, 256) or intra_min_blocks not in (1, 2, 3):
        raise ValueError(f"{fn}: intra_threads must be 128 or 256 and intra_min_blocks 1..3, got "
                         f"{intra_threads}, {intra_min_blocks}")
    if BV not in (16, 32, 64, 128) or V % BV != 0:
        raise ValueError(f"{fn}: block_v={BV} must be 16, 32, 64 or 128 and divide V={V}")
    if state_threads not in (128, 256) or isinstance(state_threads, bool):
        raise ValueError(f"{fn}: state_threads must be 128 or 256, got {state_threads!r}")
    if state_threads == 256 and BV < 64:  # (at 16 TileLang fails to lay out the split WGMMA tiles; 32 untested)
        raise ValueError(f"{fn}: state_threads=256 needs block_v of 64 or 128, got {BV}")
    if not isinstance(intra_unroll, bool):
        raise ValueError(f"{fn}: intra_unroll must be a bool, got {intra_unroll!r}")
    if state_heads_first is None:  # (measured faster with two warpgroups only: docs/performance-notes.md, session 32)
        state_heads_first = state_threads == 256
    if not isinstance(state_heads_first, bool):
        raise ValueError(f"{fn}: state_heads_first must be a bool, got {state_heads_first!r}")

    inputs = ("q", "k", "v", "g", "b", "w") + (("h0",) if use_initial_state else ()) + (
        ("cu_seqlens",) if varlen else ())
    scratch = (
        Buf("Aqk", ("B", "T", HV, CHUNK), dtype),
    ) + ((Buf("AqkL", ("B", "T", HV, AQKL_WIDTH), dtype),) if aqk_split else ()) + (
        Buf("Y", ("B", "T", HV, K), dtype),
        Buf("U", ("B", "T", HV, V), dtype),
        Buf("QG", ("B", "T", HV, K), dtype),
        Buf("KG", ("B", "T", HV, K), dtype),
        Buf("GAM", ("B", "NT", HV, K), "float32"),
    ) + ((Buf("QGL", ("B", "T", HV, K), dtype),) if qg_split else ()) + (
        (Buf("Akk", ("B", "T", HV, CHUNK), "float32"),) if save_states else ())
    outputs = (Buf("o", ("B", "T", HV, V), dtype),) + (
        (Buf("ht", ("N", HV, K, V), "float32"),) if output_final_state else ()) + (
        (Buf("h", ("B", "NT", HV, K, V), "float32"), Buf("v_new", ("B", "T", HV, V), "float32"))
        if save_states else ())
    sc = ("Aqk",) + (("AqkL",) if aqk_split else ()) + ("Y", "U", "QG", "KG", "GAM")

    kw1 = dict(H=H, HV=HV, K=K, V=V, dtype=dtype, g_dtype=g_dtype, scale=scale, varlen=bool(varlen),
               l2norm=bool(use_qk_l2norm))
    kw1.update(threads=int(intra_threads), min_blocks=int(intra_min_blocks), exact_diag=bool(exact_diag))
    # (precision options enter the key only when on: the kernels without them keep v5's key and code)
    kw1.update({n: True for n, on in (("exact_self", exact_self), ("tf32_round", tf32_round),
                                      ("aqk_split", aqk_split), ("save_a", save_states),
                                      ("prefetch", intra_prefetch), ("z_split", z_split),
                                      ("qg_split", qg_split), ("tf32_a", tf32_states), ("ftz", intra_ftz),
                                      ("blocked_solve", blocked_solve), ("fused_slice", fused_slice),
                                      ("warp_tiles", warp_tiles), ("smem_epilogue", smem_epilogue),
                                      ("unroll_slices", intra_unroll), ("g_first", g_first),
                                      ("heads_first", intra_heads_first)) if on})
    intra = Launch(
        name="gdn2_chunk_intra",
        key=("gdn2_chunk_intra", _VERSION) + tuple(sorted(kw1.items())),
        build=lambda: _intra_prim(**kw1),
        pass_configs=((("tl.disable_safe_memory_legalize", True),) if intra_prefetch else ())
        + ((("tl.device_compile_flags", ("-ftz=true",)),) if intra_ftz else ()),
        args=("q", "k", "v", "g", "b", "w") + (("cu_seqlens",) if varlen else ()) + sc
        + (("QGL",) if qg_split else ()) + (("Akk",) if save_states else ()),
    )
    kw2 = dict(HV=HV, K=K, V=V, BV=BV, dtype=dtype, use_h0=bool(use_initial_state),
               store_ht=bool(output_final_state), varlen=bool(varlen), stages=int(stages))
    kw2.update({n: True for n, on in (("aqk_split", aqk_split), ("save_states", save_states),
                                      ("tf32_h", tf32_states)) if on})
    if state_threads != 128:  # (the key of the 128-thread launch stays as it was)
        kw2["threads"] = int(state_threads)
    if state_async:
        kw2["async_mma"] = True
    if state_heads_first:
        kw2["heads_first"] = True
    state = Launch(
        name="gdn2_chunk_state_o",
        key=("gdn2_chunk_state_o", _VERSION) + tuple(sorted(kw2.items())),
        build=lambda: _state_prim(**kw2),
        args=sc + (("h0",) if use_initial_state else ()) + (("cu_seqlens",) if varlen else ())
        + tuple(b.name for b in outputs),
    )
    return Pipeline(inputs=inputs, scratch=scratch, outputs=outputs, launches=(intra, state),
                    sizes=sizes_fn(varlen))

"""Default options of the chunk kernels (``kernels.chunk_fwd.chunk_fwd_pipeline``,
``kernels.chunk_bwd.chunk_bwd_pipeline``; never imports jax).

Kept out of the kernels' source digest (``kernels/_compile.py`` hashes the file that builds a launch and the
shared ``_common*`` / ``_pipeline`` / ``_compile`` modules, not this one) on purpose: every option's value is part
of its launch's key, so changing a default here selects other kernels, already compiled and measured under their
own keys, instead of changing the code of all of them. ``docs/performance-notes.md`` gives the measurements
behind each choice.
"""

from __future__ import annotations

__all__ = ["BACKWARD", "FORWARD"]

#: ``intra_prefetch``: the forward intra launch loads its input tiles by predicated cp.async one channel slice
#: ahead, without TileLang's bounds checks (bit-identical results; ``chunk_fwd_pipeline``): 1.11 ms instead of
#: 1.53 at B4 T4096 H32 (do_bench, session 12; the training forward's launch 1.14 instead of 1.57).
#: ``z_split``: launch 1 forms U = A (w v) from ``w v`` as its 16-bit rounding plus residual (exact), two products.
#: CPU emulation (session 16, spec case B1 T512 H4, 4 seeds): o 2.90e-3 -> 2.55e-3, final state 2.23e-3 ->
#: 1.68e-3 vs fp64 (FLA rounds ``w v``). On since session 17 (GPU tests and timing: ``docs/performance-notes.md``).
#: ``intra_ftz``: launch 1 compiled with ``nvcc -ftz=true`` (one ``MUFU.EX2`` per exp2 instead of four instructions;
#: fp32 subnormals flushed; ``chunk_fwd_pipeline``). Session 21 (``docs/performance-notes.md``).
#: ``blocked_solve``: launch 1 inverts I + T blockwise (fp32 16 x 16 blocks, two 32^3 TF32 products) instead of
#: the Neumann series' four 64^3 TF32 products. Session 22 (``docs/performance-notes.md``).
#: ``fused_slice``: launch 1 does each channel slice's element-wise work in one pass over thread-owned rows
#: (bit-identical results). ``warp_tiles``: its four anchored products as hand-written TF32 ``mma.sync`` tiles,
#: one 32-row column tile per warp, instead of ``T.gemm`` over all eight warps (bit-identical results). Session 23
#: (``docs/performance-notes.md``). ``smem_epilogue``: Y and U leave through shared memory as 16-byte pieces of
#: whole rows, not as 4-byte stores from the tensor-core accumulators (bit-identical results). Session 24.
#: ``g_first``: each channel slice waits for its g and b first and for its q and k after the cumulative sum
#: (bit-identical results). Session 26 (``docs/performance-notes.md``).
#: ``state_async``: launch 2 (the state pass) issues its products asynchronously (``T.wgmma_gemm``), Y S and QG S
#: together and then Aqk R, AqkL R and KG^T R together, one ``T.wait_wgmma`` per group, and releases each loaded
#: tile's pipeline slot only after that wait (bit-identical results). Session 30, measured in session 31
#: (``docs/performance-notes.md``): 17-21% off the B = 1 shapes' latency-bound state pass on an H100, the
#: two-warpgroup pass of the batched shapes unchanged.
#: ``intra_heads_first``: launch 1's grid walks the value heads first, so that the blocks that run together read
#: and write whole token rows (bit-identical results). Session 32 (``docs/performance-notes.md``; call H for H = 32,
#: call G for H = 16): the intra launch 5.3-7.0% faster at the batched H = 32 shapes and 3.8-4.4% at H = 16 on an
#: H100 (B16 T1024 H32: 0.682 -> 0.645 ms).
FORWARD = dict(intra_prefetch=True, z_split=True, intra_ftz=True, blocked_solve=True, fused_slice=True,
               warp_tiles=True, smem_epilogue=True, g_first=True, state_async=True, intra_heads_first=True)

#: ``split_ds``: the reverse state pass feeds dS to the KG dS product as a 16-bit value plus its rounding residual
#: (db 3.29e-3 instead of 3.87e-3 vs fp64 on the benchmark's gradient case, seed 77; session 10, when the option
#: also split dR). ``split_dr``: the same for dR in the Y^T dR product (session 10's other half of ``split_ds``,
#: on: the measured kernels; the CPU emulation of session 16 shows it moves neither dh nor dh0). ``qg_split``: the
#: training forward stores QG's rounding residual and the reverse state pass uses it; in the CPU emulation QG's
#: rounding is nearly all of dh0's error (B1 T256 H2, 3 seeds: 1.5-2.1e-3 -> 1.0-2.5e-4 with ``split_dr`` off, the
#: same product count). Since session 17 the defaults are session 16's candidate, ``z_split`` + ``qg_split`` +
#: ``split_dr=False`` (``tests/test_gradient_audit_gpu.py``; the session-15 kernels: ``z_split=False``,
#: ``qg_split=False``, ``split_dr=True``, ``benchmarks/profile_chunk.py``'s variant ``s15``).
#: ``intra_v2``: the intra-chunk launch's version 2 (3.51 ms instead of 10.43 at B4 T4096 H32, do_bench, session 10;
#: 2.99 ms with TileLang's bounds checks off, session 11).
#: ``wy_load`` / ``wy_threads`` / ``wy_tf32_round``: how the WY launch loads its V-block tiles, its block size
#: and TF32 operand rounding (see ``chunk_bwd_pipeline``). The two-stage cp.async pipeline over 512 threads:
#: 2.72 ms at B4 T4096 H32 (synchronous loads, 256 threads: 4.02; cp.async, 256: 2.96; TMA, warp-specialised, 256:
#: 3.71; synchronous, 512: 3.56; session 10). ``wy_tf32_round="dy_min"`` (the default since session 19): the
#: operands of db's chain (dY = -dR S0^T, dEbar = A^T dY) rounded to nearest TF32 instead of truncated by the
#: tensor core, S0, dR and A stored rounded by their producers (``_common.tf32_nearest``), dY by the WY launch:
#: H200, audit seeds 77 / 1-5: db on seed 4 2.33e-3 instead of 3.16e-3 (FLA 2.52e-3), every gradient below FLA's
#: on all six, for +0.006-0.025 ms per training step (0.1-0.6%). ``"dy"`` also rounds the operands behind dT: no
#: better overall (db on seed 4 2.37e-3). False: truncation (sessions 10-18, profile_chunk's ``wy_trunc``).
#: ``intra_tc``: version 2's off-diagonal blocks as TF32 tensor-core products (4.29 ms instead of 2.99 at B4 T4096
#: H32, session 11: two blocks of 4 warps per SM). ``intra_fast_diag``: its diagonal blocks anchored at their
#: middle rows where the decay allows (3.07 ms instead of 2.99, session 11). Both stay off.
#: ``cast_grads``: the WY and intra launches store the gradients they finish in their inputs' dtypes (bit-identical
#: to casting the fp32 outputs in jnp, without that pass over memory; sessions 14-15).
BACKWARD = dict(split_ds=True, split_dr=False, qg_split=True, intra_v2=True, intra_tc=False, intra_fast_diag=False,
                wy_load="async", wy_threads=512, wy_tf32_round="dy_min", cast_grads=True)

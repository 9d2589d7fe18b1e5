"""GPU parity: flax_layers.GatedDeltaNet2 vs FLA's torch GatedDeltaNet2 (flash-linear-attention 0.6.0).

Same weights (moved with flax_layers.convert) and inputs give the same outputs and the same cache
(recurrent state and conv windows) after a prefill and after several decode steps. FLA's layer runs only on
CUDA (Triton), so this needs an NVIDIA GPU, torch with CUDA and the fla packages (on the GPU host:
``source .gpu/env.sh``). Tolerances (RMS ratio): float32 <= 1e-4, bfloat16 <= 1e-2. Every assertion names the
quantity and the measured ratio. ``test_flax_fla_parity_cpu.py`` checks the same layer semantics on a CPU.

**TF32 in FLA's float32 kernels.** FLA's chunk kernels (``fla/ops/gdn2/chunk_intra.py``, ``fla/ops/common/
chunk_delta_h.py``, ``chunk_o``, ...) call ``tl.dot`` without ``input_precision``, so float32 products use
Triton's default, TF32 (10-bit mantissa) on sm_80+; the blockwise triangular solve in ``chunk_intra.py``
asks for TF32 explicitly (``SOLVE_TRIL_DOT_PRECISION = 'tf32'`` when ``IS_TF32_SUPPORTED``). The fused
recurrent kernel (FLA's decode path, and prefills of <= 64 tokens) has no dots. Measured on a CPU, running
FLA's own chunk kernels in Triton's interpreter with TF32 operand rounding emulated, at this test's shape
(prefill output / prefill state / decode outputs): all TF32 (FLA's default) 4.1e-4 / 3.9e-4 / 3.3e-4..3.9e-4
(round-to-nearest) and 6.0e-4 / 1.1e-3 / 5.6e-4..7.0e-4 (truncation); with ``TRITON_F32_DEFAULT=ieee`` but the
solve still TF32, 3.7e-5 / 5.3e-5 / <= 5.7e-5 (nearest) and 9.4e-5 / 1.4e-4 / <= 1.5e-4 (truncation); all
IEEE ~6e-7 (the CPU test's figures). The float32 comparison therefore only means something against FLA with
IEEE float32 dots, which the ``fla_ieee_fp32_dots`` fixture arranges:

* ``TRITON_F32_DEFAULT=ieee`` (Triton's switch for ``tl.dot`` calls without ``input_precision``; part of the
  on-disk kernel cache key, set for this module only);
* ``fla.ops.gdn2.chunk_intra.SOLVE_TRIL_DOT_PRECISION = "ieee"`` (FLA has no switch for it). Triton refuses to
  run a kernel whose globals changed after it compiled, so this is left in place for the rest of the process,
  and is skipped (the failure messages then say so) when those kernels already compiled in this process;
* ``torch.backends.cuda.matmul.allow_tf32 = False`` (torch's default; FLA's Linear layers run on cuBLAS).

**No autotuning of FLA's kernels here.** Triton's autotuner compiles and times every config of every FLA kernel
for each new shape; with IEEE float32 dots that took over 400 s on an H200 (the H200 run of 2026-12-02 timed out in
the first case). The ``fla_first_valid_config`` fixture makes each FLA autotuner take the first of its (pruned)
configs that compiles and runs, without timing anything and without writing Triton's on-disk autotune cache (so
the benchmark's FLA timings are never affected). A config choice changes FLA's speed, not its arithmetic beyond
float32 reassociation (~1e-7), far below these tolerances.

Triton's in-process kernel cache ignores the environment: FLA float32 kernels compiled earlier in the same
process (by another test) keep their TF32 dots. Run this module in its own pytest process if in doubt.
"""

from __future__ import annotations

import os

import pytest

from _fla_parity import left_padded_prefill, make_pair, prefill_and_decode

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


def _jit_functions(module):
    """Triton JITFunctions defined in ``module`` (unwrapping autotune/heuristics wrappers)."""
    from triton.runtime.jit import JITFunction

    for obj in list(vars(module).values()):
        for _ in range(8):
            if obj is None or isinstance(obj, JITFunction):
                break
            obj = getattr(obj, "fn", None)
        if isinstance(obj, JITFunction) and obj.__globals__ is vars(module):
            yield obj


@pytest.fixture(scope="module")
def fla_first_valid_config():
    """Each Triton autotuner (FLA's kernels) runs the first config that compiles and works, untimed and uncached."""
    from triton.runtime.autotuner import Autotuner

    orig_run, orig_bench = Autotuner.run, Autotuner._bench
    inf = float("inf")

    def run(self, *args, **kwargs):
        self._gdn2_found = False
        self.cache_results = False  # never persist this choice into Triton's on-disk autotune cache
        return orig_run(self, *args, **kwargs)

    def bench(self, *args, config, **meta):
        if getattr(self, "_gdn2_found", False):
            return [inf, inf, inf]
        r = orig_bench(self, *args, config=config, **meta)
        self._gdn2_found = r[0] != inf
        return [0.0, 0.0, 0.0] if self._gdn2_found else r

    def once(fn, quantiles=None, **kw):  # run the config once instead of timing it
        fn()
        return [0.0, 0.0, 0.0]

    mp = pytest.MonkeyPatch()
    mp.setattr(Autotuner, "run", run)
    mp.setattr(Autotuner, "_bench", bench)
    mp.setattr(Autotuner, "do_bench", property(lambda self: once))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def fla_ieee_fp32_dots(fla_first_valid_config):
    """Make FLA's float32 GDN-2 kernels use IEEE float32 dots (see the module docstring). Yields a note for
    failure messages describing what was set."""
    torch, _, _ = _torch_fla()
    import triton.language as tl
    from fla.ops.gdn2 import chunk_intra

    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_F32_DEFAULT", "ieee")
    mp.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    note = "FLA with TRITON_F32_DEFAULT=ieee"
    if chunk_intra.SOLVE_TRIL_DOT_PRECISION == "ieee":
        note += ", chunk_intra solve ieee"
    elif any(f.hash is not None for f in _jit_functions(chunk_intra)):
        note += ("; chunk_intra's solve kept TF32 (its kernels compiled earlier in this process; "
                 "rerun this module alone)")
    else:  # not restored: Triton would refuse to run the kernels compiled with it (see the module docstring)
        chunk_intra.SOLVE_TRIL_DOT_PRECISION = tl.constexpr("ieee")
        note += ", chunk_intra solve ieee (left so for this process)"
    assert os.environ["TRITON_F32_DEFAULT"] == "ieee"
    yield note
    mp.undo()


# One shape throughout (H = 2, HV = 4: grouped value heads), so FLA's Triton kernels are compiled and autotuned
# once per dtype; the first call of each still takes tens of seconds on a fresh machine.
HV = 4


@pytest.mark.parametrize("dtype_name,tol", [("float32", 1e-4), ("bfloat16", 1e-2)])
def test_prefill_and_decode_match_fla(fla_ieee_fp32_dots, dtype_name, tol):
    torch, FLA, Cache = _torch_fla()
    ours, fla, tdt = make_pair(torch, FLA, dtype_name, device="cuda", num_v_heads=HV)
    # T > 64: FLA and ours both take the chunk path for the prefill; decode steps take the fused recurrent one
    prefill_and_decode(torch, Cache, ours, fla, tdt, device="cuda", T=100, steps=4, tol=tol,
                       note=fla_ieee_fp32_dots)


def test_left_padded_prefill_and_cache_conversion_match_fla(fla_ieee_fp32_dots):
    """FLA unpads via attention_mask; ours keeps padded positions out of the state and conv windows."""
    torch, FLA, Cache = _torch_fla()
    ours, fla, _ = make_pair(torch, FLA, "float32", device="cuda", num_v_heads=HV, seed=3)
    left_padded_prefill(torch, Cache, ours, fla, device="cuda", tol=1e-4, note=fla_ieee_fp32_dots)

"""The one table of GDN-2 ops that have TileLang kernels (never imports jax, torch or tilelang).

Each :class:`KernelOp` is declared once, here, with

* its **pipeline factory** (``"module:function"`` in ``kernels/``; it returns a :class:`~kernels._pipeline.Pipeline`
  for one static configuration, see :func:`config`),
* its **support rule** (:class:`Support`: input dtypes, gate dtypes, head dims), and
* its **xla fallback** (``"module:function"`` in ``gdn2_jax``: the pure-jnp implementation the JAX API uses where
  the kernels cannot run; named as a string so that this package stays free of jax).

Every runner iterates this table: ``kernels/build.py`` (ahead-of-time compiles), ``kernels/torch_api.py`` (torch
tensors), ``gdn2_jax._tilelang`` (XLA FFI custom calls) and the tests.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
from typing import Callable

from ._pipeline import Pipeline

__all__ = ["Support", "KernelOp", "OPS", "get", "config", "resolve"]


@dataclasses.dataclass(frozen=True)
class Support:
    """What a kernel pipeline accepts. Dtypes by name (``"bfloat16"``, ...)."""

    dtypes: tuple = ("bfloat16", "float16")    # q, and k, v, b, w in q's dtype
    g_dtypes: tuple = ("float32", "bfloat16")  # the decay g
    K: tuple = (64, 128)                       # key head dims
    V: tuple = (64, 128)                       # value head dims
    state_dtype: str = "float32"               # initial / final state

    def problem(self, *, dtypes: dict, g_dtype: str, K: int, V: int, state_dtype: str | None = None):
        """The first unsupported input as an exception naming its argument (``TypeError`` for a dtype,
        ``ValueError`` for a head dim), or None when the kernels take these inputs.

        ``dtypes`` maps ``q`` (first) and the arrays that must share its dtype (``k, v, b, w``) to dtype names.
        """
        names = iter(dtypes.items())
        _, dt = next(names)
        if dt not in self.dtypes:
            return TypeError(f"needs `q` in {' or '.join(self.dtypes)}, got {dt}")
        for name, x in names:
            if x != dt:
                return TypeError(f"needs `{name}` in q's dtype {dt}, got {x}")
        if g_dtype not in self.g_dtypes:
            return TypeError(f"needs `g` in {' or '.join(self.g_dtypes)}, got {g_dtype}")
        if state_dtype is not None and state_dtype != self.state_dtype:
            return TypeError(f"needs `initial_state` in {self.state_dtype}, got {state_dtype}")
        if K not in self.K:
            return ValueError(f"supports key head dim K in {self.K} (from `q`), got K={K}")
        if V not in self.V:
            return ValueError(f"supports value head dim V in {self.V} (from `v`), got V={V}")
        return None

    def check(self, fn: str, *, H: int, HV: int, K: int, V: int, dtype: str, g_dtype: str, scale: float) -> None:
        """Raise ``ValueError`` (prefixed with ``fn``) unless a pipeline factory can build this configuration."""
        err = self.problem(dtypes={"q": dtype}, g_dtype=g_dtype, K=K, V=V)
        if err is None and (H < 1 or HV < H or HV % H):
            err = ValueError(f"HV={HV} must be a positive multiple of H={H}")
        if err is None and not math.isfinite(float(scale)):
            err = ValueError(f"scale must be finite, got {scale}")
        if err is not None:
            raise ValueError(f"{fn}: {err}")


def resolve(path: str) -> Callable:
    """The object named by ``"package.module:attribute"`` (imported on first use)."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclasses.dataclass(frozen=True)
class KernelOp:
    """A public op (FLA's name) with TileLang kernels: factory, support rule and xla fallback."""

    name: str
    factory: str
    support: Support
    xla: str
    backward: str | None = None  # factory of the backward kernels (same config; the forward with save_states)
    call_options: str | None = None  # ``f(*, N, HV, V, varlen) -> dict``: factory options chosen per inference call

    def options_for_call(self, *, N: int, HV: int, V: int, varlen: bool = False) -> dict:
        """Factory options (a dict of keyword arguments) that the runners add to :func:`config` for the
        inference pipeline of one call: ``N`` sequences (the batch B, or ``len(cu_seqlens) - 1`` for packed
        sequences, ``varlen=True``; under ``jax.vmap`` the folded batch), ``HV`` value heads of dim ``V``. Launch
        shapes chosen from the batch, e.g. ``chunk_gdn2``'s state-pass V-block (``kernels.chunk_fwd.inference_options``);
        the training pipelines keep the defaults. ``{}`` for ops without such a rule (``call_options`` None)."""
        if not self.call_options:
            return {}
        return dict(resolve(self.call_options)(N=int(N), HV=int(HV), V=int(V), varlen=bool(varlen)))

    def pipeline(self, **cfg) -> Pipeline:
        """The pipeline for one static configuration (:func:`config` plus factory options); memoised."""
        return _pipeline(self.factory, _typed_items(cfg))

    def backward_pipeline(self, **cfg) -> Pipeline:
        """The backward kernels' pipeline for the forward configuration ``cfg``; ``KeyError`` if the op has none."""
        if self.backward is None:
            raise KeyError(f"op {self.name!r} has no backward kernels")
        return _pipeline(self.backward, _typed_items(cfg))


def _typed_items(cfg: dict) -> tuple:
    """``cfg`` as the memo key of :func:`_pipeline`: (name, type, value) sorted by name. The value's type is part
    of the key because equal values of other types hash alike (``1 == True``): without it a bad option value
    ``1`` would be answered with the memoised pipeline of ``True`` instead of the factory's ``ValueError``."""
    return tuple(sorted((n, type(v), v) for n, v in cfg.items()))


@functools.lru_cache(maxsize=512)
def _pipeline(factory: str, items: tuple) -> Pipeline:
    return resolve(factory)(**{n: v for n, _, v in items})


OPS: dict[str, KernelOp] = {op.name: op for op in (
    KernelOp("chunk_gdn2", "kernels.chunk_fwd:chunk_fwd_pipeline", Support(),
             "gdn2_jax.xla.chunk:chunk_forward", backward="kernels.chunk_bwd:chunk_bwd_pipeline",
             call_options="kernels.chunk_fwd:inference_options"),
    KernelOp("fused_recurrent_gdn2", "kernels.recurrent_fwd:fused_recurrent_fwd_pipeline",
             Support(K=(16, 32, 64, 128, 256), V=(16, 32, 64, 128, 256)),
             "gdn2_jax.xla.recurrent:recurrent_forward"),
)}


def get(name: str) -> KernelOp:
    """The registry entry of op ``name``; ``KeyError`` naming the known ops otherwise."""
    try:
        return OPS[name]
    except KeyError:
        raise KeyError(f"no TileLang kernels for op {name!r}; ops with kernels: {sorted(OPS)}") from None


def config(*, H: int, HV: int, K: int, V: int, dtype: str, g_dtype: str, scale: float, use_initial_state: bool,
           output_final_state: bool, varlen: bool, use_qk_l2norm: bool, **options) -> dict:
    """The factory keyword arguments of one static configuration, as every runner builds them.

    ``options`` are factory-specific (e.g. ``inplace_state`` or tile sizes of ``fused_recurrent_gdn2``).
    """
    return dict(H=int(H), HV=int(HV), K=int(K), V=int(V), dtype=str(dtype), g_dtype=str(g_dtype), scale=float(scale),
                use_initial_state=bool(use_initial_state), output_final_state=bool(output_final_state),
                varlen=bool(varlen), use_qk_l2norm=bool(use_qk_l2norm), **options)

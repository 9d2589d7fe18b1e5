"""Framework-neutral description of a GDN-2 op as a sequence of TileLang kernel launches.

A :class:`Pipeline` names the caller's inputs, the scratch buffers and outputs (with symbolic shapes), and
the ordered kernel :class:`Launch` es that read and write them. The runners in ``kernels/torch_api.py``
(torch tensors) and ``gdn2_jax/_ffi.py`` (XLA FFI custom calls) execute any pipeline generically.

Contract (shared by every kernel factory in ``kernels/``; see the project's kernel contract):

* Kernels are destination-passing: outputs and scratch are ordinary prim_func parameters (never ``out_idx``).
* Every element of every output is written by the kernels (tests poison outputs with NaN). Scratch is never
  zero-initialised.
* Dynamic dims (batch, T, chunks) are symbolic; head counts and head dims are static.
* GVA (HV a multiple of H) is handled inside the kernels: value head j reads q/k head j // (HV/H).
* Parameter order of every launch: the buffers it reads, then the buffers it writes (the contract's "inputs,
  scratch, outputs"). The XLA runner maps a launch onto one ``ffi_call`` as ``fn(*operands, *results)``
  (jax-tvm-ffi's ``["args", "rets"]``): the results start at the first *fresh* buffer (one no earlier launch
  produced); a launch without fresh buffers has as results the args after its last pipeline input. Results an
  earlier launch produced are passed in and aliased (``input_output_aliases``: updated in place). Pipeline inputs
  may never be results (kernels do not write their inputs).
* This module never imports jax, torch or tilelang.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

__all__ = ["Buf", "Launch", "Pipeline", "DTYPES", "resolve_shape", "launch_io"]

#: dtype names a buffer may have (numpy / torch / jax spellings agree on these names).
DTYPES = ("bfloat16", "float16", "float32", "int32")


@dataclasses.dataclass(frozen=True)
class Buf:
    """A buffer the runner allocates: an output or scratch space.

    ``shape`` holds ints or names of runtime sizes returned by :attr:`Pipeline.sizes`,
    e.g. ``("B", "T", 32, 128)``. ``dtype`` is one of :data:`DTYPES`.
    """

    name: str
    shape: tuple
    dtype: str

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"Buf {self.name!r}: dtype must be one of {DTYPES}, got {self.dtype!r}")
        for d in self.shape:
            if not isinstance(d, (int, str)):
                raise TypeError(f"Buf {self.name!r}: shape entries must be int or str, got {d!r}")


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch.

    ``key`` is hashable and holds everything that changes the generated code (name, static dims, every input
    dtype, flags, scale, block sizes), ``pass_configs`` included in effect (a launch whose pass configuration
    is an option also names that option in its key); the compile cache adds the arch, the TileLang version and
    the hash of the kernel's source files. ``build()`` returns the ``T.prim_func`` (called once per key). ``args`` are
    buffer names (pipeline inputs, scratch or outputs) in the prim_func's parameter order. ``pass_configs``:
    ``(name, value)`` pairs of TileLang pass configuration for this kernel's compile (also part of the cache key).
    """

    name: str
    key: tuple
    build: Callable[[], Any] = dataclasses.field(compare=False, hash=False, repr=False)
    args: tuple = ()
    pass_configs: tuple = ()

    def __post_init__(self):
        hash(self.key)  # must be hashable: fail early with a clear TypeError otherwise


def _no_aliases() -> dict:
    return {}


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """An op as ordered launches over caller inputs, scratch buffers and outputs.

    ``sizes(shapes)`` maps ``{input name: shape tuple}`` to the runtime sizes used in :class:`Buf` shapes
    (e.g. ``{"B":..,"T":..,"N":..,"NT":..}``). ``aliases`` maps an output name to the input it may overwrite in
    place (decode state update); runners use it for donation / ``input_output_aliases``.
    """

    inputs: tuple
    scratch: tuple
    outputs: tuple
    launches: tuple
    sizes: Callable[[Mapping[str, tuple]], dict] = dataclasses.field(compare=False, hash=False, repr=False)
    aliases: dict = dataclasses.field(default_factory=_no_aliases, compare=False, hash=False)

    def __post_init__(self):
        known = set(self.inputs)
        for buf in tuple(self.scratch) + tuple(self.outputs):
            if buf.name in known:
                raise ValueError(f"Pipeline: buffer name {buf.name!r} is used twice")
            known.add(buf.name)
        for la in self.launches:
            missing = [a for a in la.args if a not in known]
            if missing:
                raise ValueError(f"Pipeline: launch {la.name!r} names unknown buffers {missing}")
        outs = {b.name: b for b in self.outputs}
        for o, i in self.aliases.items():
            if o not in outs or i not in self.inputs:
                raise ValueError(f"Pipeline: alias {o!r} -> {i!r} must map an output to an input")

    @property
    def key(self) -> tuple:
        """Hashable identity of the whole pipeline (the launches' keys and the buffer layout)."""
        return (self.inputs, self.scratch, self.outputs, tuple(la.key for la in self.launches),
                tuple(sorted(self.aliases.items())))

    def buffer_shapes(self, input_shapes: Mapping[str, tuple]) -> dict:
        """Concrete shapes of every scratch and output buffer for the given input shapes."""
        sz = self.sizes(dict(input_shapes))
        return {b.name: resolve_shape(b, sz) for b in tuple(self.scratch) + tuple(self.outputs)}


def resolve_shape(buf: Buf, sizes: Mapping[str, int]) -> tuple:
    """``buf.shape`` with every named size replaced by its value from ``sizes``."""
    out = []
    for d in buf.shape:
        if isinstance(d, str):
            if d not in sizes:
                raise KeyError(f"Buf {buf.name!r}: size {d!r} not provided by Pipeline.sizes ({sorted(sizes)})")
            out.append(int(sizes[d]))
        else:
            out.append(int(d))
    return tuple(out)


def launch_io(pipe: Pipeline, index: int) -> tuple:
    """Split launch ``index``'s args into ``(operands, results, fresh)`` (see the parameter-order rule).

    ``fresh`` are the results no earlier launch produced (new buffers); the other results are updated in place.
    Raises ``ValueError`` when a launch would write a pipeline input or read a buffer nothing wrote yet.
    """
    produced: set = set()
    for la in pipe.launches[: index + 1]:
        first_fresh = next((i for i, a in enumerate(la.args) if a not in pipe.inputs and a not in produced), None)
        if first_fresh is None:
            split = len(la.args)
            while split > 0 and la.args[split - 1] not in pipe.inputs:
                split -= 1
        else:
            split = first_fresh
        operands, results = la.args[:split], la.args[split:]
        bad = [a for a in results if a in pipe.inputs]
        if bad:
            raise ValueError(f"Pipeline: launch {la.name!r} lists inputs {bad} after its first new output; "
                             "list the buffers a launch reads before the ones it writes")
        missing = [a for a in operands if a not in pipe.inputs and a not in produced]
        if missing:
            raise ValueError(f"Pipeline: launch {la.name!r} reads {missing} before any launch wrote them")
        fresh = tuple(a for a in results if a not in produced)
        produced.update(results)
    return operands, results, fresh

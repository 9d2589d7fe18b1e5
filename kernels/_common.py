"""Helpers shared by the TileLang kernel factories (never imports jax). Part of every kernel's cache key."""

from __future__ import annotations

__all__ = ["drop_params"]


def drop_params(func, keep):
    """Copy of the prim_func ``func`` with only the parameters whose buffer names are in ``keep``, in order.

    Lets a factory write one kernel with every optional buffer (initial state, cu_seqlens, final state) as a
    parameter and drop the ones a variant does not use; a dropped buffer must not be referenced by the body.
    """
    params = [p for p in func.params if func.buffer_map[p].name in keep]
    return type(func)(params, func.body, func.ret_type, {p: func.buffer_map[p] for p in params}, func.attrs)

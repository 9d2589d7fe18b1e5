"""Flax NNX layers built on :mod:`gdn2_jax`."""

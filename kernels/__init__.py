"""TileLang kernels for GDN-2, framework-neutral (never imports jax)."""

"""Chapter 6's setup step for JAX: ``flashbook.pallas_setup.ensure_jax`` for Exercises 1 and 4."""
import functools

from ...pallas_setup import ensure_jax as _ensure_jax

__all__ = ["ensure_jax"]

ensure_jax = functools.partial(_ensure_jax, exercises="Exercises 1 and 4")

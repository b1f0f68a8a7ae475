"""The dtype the post-training losses compute in: their inputs' widest float type, at least
float32.

Log-probs from a model arrive in float32; a float64 reference check of one's own (under
``jax.enable_x64``) passes float64, and then every term of the loss is float64 too;
bfloat16 / float16 inputs are widened to float32 (log-sigmoids and exponentials of
log-ratios lose too much in 16 bits). Inputs of mixed widths are cast to the widest, so a
float32 mask or length beside float64 log-probs needs no cast by the caller (and no
implicit promotion, which ``jax_numpy_dtype_promotion="strict"`` refuses).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["loss_dtype", "widened"]


def loss_dtype(who: str, **arrays: jax.Array | None) -> np.dtype:
    """The widest float dtype of ``arrays`` (``None`` ones skipped), at least float32.

    Raises ``ValueError`` naming ``who`` and each argument that is not a float array
    (integer log-probs are a mistake upstream, never silently cast)."""
    dtypes = {name: np.dtype(a.dtype) for name, a in arrays.items() if a is not None}
    bad = {n: str(d) for n, d in dtypes.items() if not jnp.issubdtype(d, jnp.floating)}
    if bad:
        raise ValueError(f"{who}: log-probs must be float arrays (float32 or float64), got {bad}")
    return max([np.dtype(np.float32), *dtypes.values()], key=lambda d: d.itemsize)


def widened(dtype: np.dtype, *arrays: jax.Array | None) -> tuple[jax.Array | None, ...]:
    """``arrays`` cast to ``dtype`` (``None`` kept), booleans and integers included (masks,
    lengths)."""
    return tuple(None if a is None else jnp.asarray(a).astype(dtype) for a in arrays)

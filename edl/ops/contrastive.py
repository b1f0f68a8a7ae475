"""Image-text losses of dual encoders over a ``(texts, images)`` logit matrix whose diagonal
holds the matching pairs: CLIP's symmetric softmax cross entropy and SigLIP's pairwise
sigmoid loss (transformers' ``image_text_contrastive_loss`` and ``SiglipModel``'s
``return_loss``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float

__all__ = ["clip_loss", "image_text_logits", "l2_normalize", "sigmoid_loss"]


def image_text_logits(
    text_embeds: Float[Array, "texts dim"],
    image_embeds: Float[Array, "images dim"],
    logit_scale: Float[Array, "*one"],
    logit_bias: Float[Array, "*one"] | None = None,
) -> Float[Array, "texts images"]:
    """Cosine similarities of the L2-normalised embeddings times ``exp(logit_scale)`` (plus
    ``logit_bias``: SigLIP), as ``logits_per_text``; its transpose is ``logits_per_image``.
    The embeddings are normalised as given (the dual models return them normalised)."""
    logits = text_embeds @ image_embeds.T
    logits = logits * jnp.exp(logit_scale.astype(logits.dtype)).reshape(())
    if logit_bias is not None:
        logits = logits + logit_bias.astype(logits.dtype).reshape(())
    return logits


def l2_normalize(x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
    """``x / ||x||_2`` over the last axis (no epsilon, as transformers divides)."""
    return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True))


def clip_loss(logits_per_text: Float[Array, "n n"]) -> Float[Array, ""]:
    """CLIP's loss: the mean of the text->image and image->text softmax cross entropies
    with the matching pair (the diagonal) as the target."""
    _check_square(logits_per_text)
    labels = jnp.arange(logits_per_text.shape[0], dtype=jnp.int32)
    logits = logits_per_text.astype(jnp.float32)
    per_text = optax.losses.softmax_cross_entropy_with_integer_labels(logits, labels)
    per_image = optax.losses.softmax_cross_entropy_with_integer_labels(logits.T, labels)
    return (jnp.mean(per_text) + jnp.mean(per_image)) / 2


def sigmoid_loss(logits_per_text: Float[Array, "n n"]) -> Float[Array, ""]:
    """SigLIP's loss: every (text, image) pair is a binary problem, positive on the
    diagonal; the negative log-likelihood summed over images, averaged over texts."""
    _check_square(logits_per_text)
    n = logits_per_text.shape[0]
    signs = 2 * jnp.eye(n, dtype=jnp.float32) - 1
    loglik = jax.nn.log_sigmoid(signs * logits_per_text.astype(jnp.float32))
    return jnp.mean(-jnp.sum(loglik, axis=-1))


def _check_square(logits: jax.Array) -> None:
    if logits.ndim != 2 or logits.shape[0] != logits.shape[1]:
        raise ValueError(
            f"the image-text loss pairs text i with image i: logits must be (n, n), got "
            f"{logits.shape}"
        )

"""Training losses with transformers' semantics: causal-LM cross entropy (chunked), plain cross
entropy, and the sequence-classification losses.

``causal_lm_loss`` takes the final hidden states and the output-projection weight instead of
logits: it scans over chunks of the flattened tokens with a rematerialised body, so neither the
forward pass nor the gradient ever holds the ``(batch, seq, vocab)`` float32 logits, only one
``(chunk, vocab)`` block at a time (tokens that fit one chunk skip the scan and the
recomputation). ``causal_lm_loss_from_logits`` is the plain path for
callers that already have logits (and the reference the chunked one is tested against).
``causal_lm_token_logps`` is the same chunked scan returning each position's log-probability of
its target (preference losses sum them per sequence); ``mask_without_context`` sets to
``ignore_index`` the targets whose context is padding or another packed segment.

Every loss returns ``(loss, metrics)``: a float32 scalar and a dict of scalars (the loss again,
plus accuracy / counts) ready for logging. Cross entropy is the mean over the counted targets
(HF's ``reduction="mean"``), 0.0 rather than NaN when nothing is counted; ``metrics["count"]``
lets a caller renormalise over gradient-accumulation steps as HF's ``num_items_in_batch`` does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Bool, Float, Int, Shaped

__all__ = [
    "causal_lm_loss",
    "causal_lm_loss_from_logits",
    "causal_lm_token_logps",
    "cross_entropy",
    "sequence_classification_loss",
]

Mask = Bool[Array, "batch seq"] | Int[Array, "batch seq"]


def _check_integer(name: str, what: str, x: Array) -> None:
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name}: {what} must be integer, got dtype {x.dtype}")


def _softcap(
    logits: Float[Array, "*batch vocab"], softcap: float | None
) -> Float[Array, "*batch vocab"]:
    if softcap is None:
        return logits
    if softcap <= 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    return softcap * jnp.tanh(logits / softcap)


def _token_stats(
    logits: Float[Array, "*batch vocab"],
    targets: Int[Array, "*batch"],
    valid: Bool[Array, "*batch"],
) -> tuple[Float[Array, "*batch"], Bool[Array, "*batch"]]:
    """Per-token negative log-likelihood (0 where not ``valid``) and argmax correctness."""
    safe = jnp.where(valid, targets, 0)
    # Out-of-range labels (other than the ignored ones) read NaN instead of wrapping around.
    label_logit = jnp.take_along_axis(
        logits, safe[..., None], axis=-1, wrap_negative_indices=False
    )[..., 0]
    nll = jnp.where(valid, jax.nn.logsumexp(logits, axis=-1) - label_logit, 0.0)
    correct = valid & (jnp.argmax(logits, axis=-1).astype(jnp.int32) == safe)
    return nll, correct


def _metrics(
    loss_sum: Float[Array, ""], correct: Int[Array, ""], count: Int[Array, ""]
) -> tuple[Float[Array, ""], dict[str, Array]]:
    denom = jnp.maximum(count, 1).astype(jnp.float32)  # nothing counted: 0.0, not NaN
    loss = loss_sum / denom
    return loss, {"loss": loss, "accuracy": correct.astype(jnp.float32) / denom, "count": count}


def _lm_targets(
    name: str,
    labels: Array,
    attention_mask: Array | None,
    ignore_index: int,
    shift: bool,
    token_shape: tuple[int, ...],
) -> tuple[Int[Array, "batch seq"], Bool[Array, "batch seq"]]:
    """The target of each position and whether it is counted, both ``(batch, seq)``."""
    if labels.ndim != 2 or labels.shape != token_shape:
        raise ValueError(
            f"{name}: labels must be (batch, seq) = {token_shape}, got shape {labels.shape}"
        )
    _check_integer(name, "labels", labels)
    labels = labels.astype(jnp.int32)
    valid = labels != ignore_index
    if attention_mask is not None:
        if attention_mask.shape != labels.shape:
            raise ValueError(
                f"{name}: attention_mask must be (batch, seq) = {labels.shape}, got shape "
                f"{attention_mask.shape}"
            )
        valid &= attention_mask.astype(jnp.bool_)  # a padded position is never a target
    if shift:  # position t predicts t + 1; the last position has no target
        labels = jnp.concatenate([labels[:, 1:], jnp.zeros_like(labels[:, :1])], axis=1)
        valid = jnp.concatenate([valid[:, 1:], jnp.zeros_like(valid[:, :1])], axis=1)
    return labels, valid


def cross_entropy(
    logits: Float[Array, "*batch vocab"],
    labels: Int[Array, "*batch"],
    *,
    ignore_index: int = -100,
    where: Bool[Array, "*batch"] | None = None,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """Mean cross entropy of ``logits (..., vocab)`` against integer ``labels (...)``, in float32.

    Labels equal to ``ignore_index``, and those where ``where`` is False, are not counted. Labels
    outside ``[0, vocab)`` (other than ``ignore_index``) give a NaN loss.

    Returns:
        ``(loss, {"loss", "accuracy", "count"})``: the mean over counted labels (0.0 when
        there are none), the fraction of counted labels that are the logits' argmax, and the
        int32 number of counted labels.
    """
    if logits.ndim < 1 or labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"cross_entropy: labels must have logits' leading shape {logits.shape[:-1]}, got "
            f"{labels.shape}"
        )
    _check_integer("cross_entropy", "labels", labels)
    labels = labels.astype(jnp.int32)
    valid = labels != ignore_index
    if where is not None:
        if where.shape != labels.shape:
            raise ValueError(
                f"cross_entropy: where must have labels' shape {labels.shape}, got {where.shape}"
            )
        valid &= where
    nll, correct = _token_stats(logits.astype(jnp.float32), labels, valid)
    return _metrics(
        jnp.sum(nll), jnp.sum(correct.astype(jnp.int32)), jnp.sum(valid.astype(jnp.int32))
    )


def causal_lm_loss_from_logits(
    logits: Float[Array, "batch seq vocab"],
    labels: Int[Array, "batch seq"],
    *,
    attention_mask: Mask | None = None,
    ignore_index: int = -100,
    shift: bool = True,
    softcap: float | None = None,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """``causal_lm_loss`` on already-computed logits ``(batch, seq, vocab)`` (unchunked).

    Holds the float32 logits (and, under ``jax.grad``, their cotangent) in full; prefer
    ``causal_lm_loss`` for training with a large vocabulary.
    """
    if logits.ndim != 3:
        raise ValueError(f"causal_lm_loss_from_logits: logits must be 3-d, got {logits.shape}")
    targets, valid = _lm_targets(
        "causal_lm_loss_from_logits", labels, attention_mask, ignore_index, shift, logits.shape[:2]
    )
    logits = _softcap(logits.astype(jnp.float32), softcap)
    return cross_entropy(logits, targets, ignore_index=ignore_index, where=valid)


def causal_lm_loss(
    hidden: Float[Array, "batch seq dim"],
    head: Float[Array, "vocab dim"],
    labels: Int[Array, "batch seq"],
    *,
    attention_mask: Mask | None = None,
    ignore_index: int = -100,
    shift: bool = True,
    chunk_size: int | None = None,
    softcap: float | None = None,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """Next-token cross entropy from final hidden states, chunked over tokens (HF's
    ``ForCausalLMLoss`` semantics).

    Args:
        hidden: ``(batch, seq, dim)`` final hidden states (after the final norm), any float
            dtype.
        head: ``(vocab, dim)`` output projection in torch layout: an untied ``lm_head.weight``
            or the tied embedding table. ``logits = hidden @ head.T``, accumulated in float32.
        labels: ``(batch, seq)`` token ids; usually the input ids themselves.
        attention_mask: optional ``(batch, seq)`` 0/1 or bool; a target whose own position is
            masked is not counted (as when a collator sets padded labels to ``ignore_index``).
        ignore_index: label value that is not counted.
        shift: with True, position ``t`` predicts ``labels[:, t + 1]`` and the last position
            predicts nothing; with False, ``labels`` are already aligned with ``hidden``.
        chunk_size: tokens per chunk: memory holds ``(chunk_size, vocab)`` float32 logits at a
            time. Larger than ``batch * seq`` means a single chunk. None:
            ``default_chunk_size`` of the hidden states' dtype (2048; 1024 for 16-bit floats).
        softcap: logits become ``softcap * tanh(logits / softcap)`` first (Gemma 2).

    Returns:
        ``(loss, {"loss", "accuracy", "count"})``: the float32 mean over counted targets (0.0
        when there are none), the fraction of them that are the argmax of the logits, and their
        int32 count. Gradients flow to ``hidden`` and ``head``; with more than one chunk the
        chunk logits are recomputed in the backward pass, and the head's gradient is summed
        over chunks in its dtype.
    """
    name = "causal_lm_loss"
    targets, valid = _lm_targets(
        name, labels, attention_mask, ignore_index, shift, _check_head(name, hidden, head)
    )
    x, t, v, w = _chunked(name, hidden, head, targets, valid, chunk_size, softcap)

    def chunk_stats(w, x, t, v):
        logits = jnp.einsum("cd,vd->cv", x, w, preferred_element_type=jnp.float32)
        nll, correct = _token_stats(_softcap(logits, softcap), t, v)
        return jnp.sum(nll), jnp.sum(correct.astype(jnp.int32))

    chunk_losses, chunk_correct = _map_chunks(chunk_stats, w, x, t, v)
    loss_sum, correct = jnp.sum(chunk_losses), jnp.sum(chunk_correct)
    return _metrics(loss_sum, correct, jnp.sum(valid.astype(jnp.int32)))


def causal_lm_token_logps(
    hidden: Float[Array, "batch seq dim"],
    head: Float[Array, "vocab dim"],
    labels: Int[Array, "batch seq"],
    *,
    attention_mask: Mask | None = None,
    ignore_index: int = -100,
    shift: bool = True,
    chunk_size: int | None = None,
    softcap: float | None = None,
) -> tuple[Float[Array, "batch seq"], Bool[Array, "batch seq"]]:
    """Each position's float32 log-probability of its target, chunked as ``causal_lm_loss``
    (never the full ``(batch, seq, vocab)`` logits; arguments as there).

    Returns:
        ``(logps, counted)``, both ``(batch, seq)``: with ``shift``, ``logps[:, t]`` is
        ``log p(labels[:, t + 1] | prefix)`` (log-softmax in float32, after ``softcap``), 0.0
        where ``counted`` is False (``ignore_index`` labels, masked positions, the last
        position). Gradients flow to ``hidden`` and ``head``; with more than one chunk the
        chunk logits are recomputed in the backward pass.
    """
    name = "causal_lm_token_logps"
    batch, seq = _check_head(name, hidden, head)
    targets, valid = _lm_targets(name, labels, attention_mask, ignore_index, shift, (batch, seq))
    x, t, v, w = _chunked(name, hidden, head, targets, valid, chunk_size, softcap)

    def chunk_logps(w, x, t, v):
        logits = jnp.einsum("cd,vd->cv", x, w, preferred_element_type=jnp.float32)
        nll, _ = _token_stats(_softcap(logits, softcap), t, v)
        return -nll

    logps = _map_chunks(chunk_logps, w, x, t, v)
    return logps.reshape(-1)[: batch * seq].reshape(batch, seq), valid


def mask_without_context(
    labels: Int[Array, "batch seq"],
    *,
    attention_mask: Mask | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
    ignore_index: int = -100,
) -> Int[Array, "batch seq"]:
    """``labels`` (HF-aligned, unshifted) with ``ignore_index`` where the token has no context
    to be predicted from: after a padded position (left padding), and (with ``segment_ids``)
    at the first token of each packed segment. Position 0 is never predicted anyway."""
    no_context = jnp.zeros(labels[:, 1:].shape, jnp.bool_)
    if attention_mask is not None:
        no_context |= ~attention_mask[:, :-1].astype(jnp.bool_)
    if segment_ids is not None:
        no_context |= segment_ids[:, 1:] != segment_ids[:, :-1]
    ignored = jnp.asarray(ignore_index, labels.dtype)
    return labels.at[:, 1:].set(jnp.where(no_context, ignored, labels[:, 1:]))


CHUNK_TOKENS = 2048
"""Tokens per chunk of the LM head's loss when ``chunk_size`` is None, for hidden states of
32 bits or more; 16-bit ones take half (``default_chunk_size``)."""


def default_chunk_size(dtype: DTypeLike) -> int:
    """Tokens per LM-head chunk for hidden states of ``dtype``: ``CHUNK_TOKENS``, halved for
    16-bit floats. The chunk's logits are float32 whatever the model's dtype (an honest
    log-softmax), so a bfloat16 run, which keeps its activations in half the bytes, keeps this
    float32 block at half the tokens too: ``(1024, vocab)`` float32 is the size of a
    bfloat16 block of 2048 tokens. Below 2048 tokens a step is one chunk either way."""
    return CHUNK_TOKENS // 2 if jnp.dtype(dtype).itemsize <= 2 else CHUNK_TOKENS


def _check_head(name: str, hidden: Array, head: Array) -> tuple[int, int]:
    """``(batch, seq)`` of ``hidden (batch, seq, dim)``, checked against ``head (vocab, dim)``."""
    if hidden.ndim != 3:
        raise ValueError(f"{name}: hidden must be (batch, seq, dim), got shape {hidden.shape}")
    if head.ndim != 2 or head.shape[1] != hidden.shape[2]:
        raise ValueError(
            f"{name}: head must be (vocab, dim) with hidden's dim {hidden.shape[2]}, got shape "
            f"{head.shape}"
        )
    return hidden.shape[0], hidden.shape[1]


def _chunked(
    name: str,
    hidden: Array,
    head: Array,
    targets: Array,
    valid: Array,
    chunk_size: int | None,
    softcap: float | None,
) -> tuple[Array, Array, Array, Array]:
    """The flattened tokens as ``(n_chunks, chunk, ...)`` blocks (padding never counted) and
    the head in the common dtype: ``(x, targets, valid, head)`` for a scan over chunks."""
    dtype = jnp.promote_types(hidden.dtype, head.dtype)
    if chunk_size is None:
        chunk_size = default_chunk_size(dtype)
    if chunk_size <= 0:
        raise ValueError(f"{name}: chunk_size must be positive, got {chunk_size}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"{name}: softcap must be positive, got {softcap}")
    batch, seq, dim = hidden.shape
    n = batch * seq
    chunk = max(1, min(chunk_size, n))
    n_chunks = -(-n // chunk)
    pad = n_chunks * chunk - n
    x = jnp.pad(hidden.astype(dtype).reshape(n, dim), ((0, pad), (0, 0)))
    t = jnp.pad(targets.reshape(n), (0, pad))
    v = jnp.pad(valid.reshape(n), (0, pad))
    return (
        x.reshape(n_chunks, chunk, dim),
        t.reshape(n_chunks, chunk),
        v.reshape(n_chunks, chunk),
        head.astype(dtype),
    )


def _map_chunks(fn, head: Array, x: Array, targets: Array, valid: Array):
    """``fn(head, x, targets, valid)`` on each chunk of ``_chunked``'s blocks, its outputs
    stacked over chunks. Several chunks are scanned with a rematerialised body: the backward
    pass recomputes a chunk's logits rather than keeping them all. A single chunk is called
    directly: its logits are what the chunk size lets memory hold anyway (and at the same
    point, the end of the forward pass), while the scan would run the head's product twice."""
    if x.shape[0] == 1:
        return jax.tree.map(lambda y: y[None], fn(head, x[0], targets[0], valid[0]))
    body = jax.checkpoint(fn, prevent_cse=False)
    _, out = jax.lax.scan(lambda carry, xs: (carry, body(head, *xs)), None, (x, targets, valid))
    return out


def sequence_classification_loss(
    logits: Float[Array, "batch num_labels"],
    labels: Shaped[Array, "*label_shape"],
    *,
    problem_type: str | None = None,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """HF's ``ForSequenceClassificationLoss`` on pooled ``logits (batch, num_labels)``.

    ``problem_type`` None is inferred as transformers does: ``num_labels == 1`` is
    ``"regression"``, integer labels ``"single_label_classification"``, anything else
    ``"multi_label_classification"``.

    - regression: mean squared error in float32; labels ``(batch, num_labels)``, or
      ``(batch,)`` when ``num_labels == 1``.
    - single label: mean cross entropy; integer labels ``(batch,)`` (or ``(batch, 1)``);
      labels equal to -100 are not counted, as in HF.
    - multi label: binary cross entropy with logits (stable form), mean over all elements;
      labels ``(batch, num_labels)`` in ``[0, 1]``.

    Returns:
        ``(loss, metrics)`` with ``"loss"``, ``"count"`` (int32 examples in the loss: the batch
        size, less single-label examples labelled -100) and, for the classification types,
        ``"accuracy"`` (multi label: elementwise, ``logits > 0`` against ``labels > 0.5``).
    """
    name = "sequence_classification_loss"
    if logits.ndim != 2:
        raise ValueError(f"{name}: logits must be (batch, num_labels), got {logits.shape}")
    batch, num_labels = logits.shape
    if problem_type is None:
        if num_labels == 1:
            problem_type = "regression"
        elif jnp.issubdtype(labels.dtype, jnp.integer):
            problem_type = "single_label_classification"
        else:
            problem_type = "multi_label_classification"
    logits32 = logits.astype(jnp.float32)
    count = jnp.asarray(batch, jnp.int32)

    if problem_type == "regression":
        allowed = [(batch, num_labels)] + ([(batch,)] if num_labels == 1 else [])
        if labels.shape not in allowed:
            raise ValueError(
                f"{name}: regression labels must be {' or '.join(map(str, allowed))}, got "
                f"{labels.shape}"
            )
        err = logits32 - labels.astype(jnp.float32).reshape(batch, num_labels)
        loss = jnp.mean(err * err)
        return loss, {"loss": loss, "count": count}

    if problem_type == "single_label_classification":
        if labels.shape not in ((batch,), (batch, 1)):
            raise ValueError(
                f"{name}: single-label labels must be ({batch},) for logits {logits.shape}, got "
                f"{labels.shape}"
            )
        _check_integer(name, "single-label labels", labels)
        loss, metrics = cross_entropy(logits32, labels.reshape(batch))
        return loss, {"loss": loss, "accuracy": metrics["accuracy"], "count": metrics["count"]}

    if problem_type == "multi_label_classification":
        if labels.shape != logits.shape:
            raise ValueError(
                f"{name}: multi-label labels must have logits' shape {logits.shape}, got "
                f"{labels.shape}"
            )
        y = labels.astype(jnp.float32)
        # max(x, 0) - x*y + log(1 + exp(-|x|)) == -[y log σ(x) + (1 - y) log(1 - σ(x))]
        bce = jnp.maximum(logits32, 0.0) - logits32 * y + jnp.log1p(jnp.exp(-jnp.abs(logits32)))
        loss = jnp.mean(bce)
        accuracy = jnp.mean(((logits32 > 0) == (y > 0.5)).astype(jnp.float32))
        return loss, {"loss": loss, "accuracy": accuracy, "count": count}

    raise ValueError(
        f"{name}: unknown problem_type {problem_type!r}; expected 'regression', "
        "'single_label_classification' or 'multi_label_classification'"
    )

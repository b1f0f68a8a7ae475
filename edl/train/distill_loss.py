"""Knowledge distillation's divergence: TRL's generalised Jensen-Shannon divergence between a
student's and a teacher's next-token distributions, on logits or chunked over the LM heads.

``distill_loss`` is TRL 1.16's ``GKDTrainer.generalized_jsd_loss``
(``trl/experimental/gkd/gkd_trainer.py``; the same divergence as ``DistillationTrainer``'s
chunked ``_chunked_divergence_loss``), checked against it in the tests. Per token, with
``s = log_softmax(student / T)`` and ``t = log_softmax(teacher / T)``::

    beta = 0:      KL(teacher || student) = Σ_v p_t (t - s)              (forward KL)
    beta = 1:      KL(student || teacher) = Σ_v p_s (s - t)              (reverse KL)
    otherwise:     m = log((1 - beta) p_s + beta p_t)                    (TRL's mixture)
                   beta KL(teacher || m) + (1 - beta) KL(student || m)

and the loss is the sum over counted tokens divided by their number (TRL's ``"batchmean"``
with labels: the mean over completion tokens, 0 when none). The temperature divides both
models' logits (after any soft-cap, as ``DistillationTrainer`` applies it); there is no
``T²`` factor, as in TRL.

``chunked_distill_loss`` computes the same from the final hidden states and the output
projections of both models, one ``(chunk, vocab)`` block of each at a time (scanned with a
rematerialised body, as ``edl.ops.losses.causal_lm_loss``), so neither the forward nor the
backward pass holds either model's full ``(batch, seq, vocab)`` logits. The teacher's hidden
states and head may have another width than the student's; only the vocabulary must match.
Gradients flow to the student's hidden states and head; the teacher's are stopped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from edl.ops.losses import default_chunk_size
from edl.train.loss_inputs import loss_dtype

__all__ = ["chunked_distill_loss", "distill_loss", "token_divergence"]


def _check_options(who: str, beta: float, temperature: float) -> None:
    if not 0.0 <= beta <= 1.0 or not temperature > 0:
        raise ValueError(
            f"{who}: need 0 <= beta <= 1 and temperature > 0, got beta={beta}, "
            f"temperature={temperature}"
        )


def _kl(log_p: Array, log_q: Array) -> Array:
    """``KL(p || q)`` over the last axis from log-probs (torch's ``F.kl_div(log_q, log_p,
    log_target=True)`` summed over the vocabulary)."""
    return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)


def token_divergence(
    student_logits: Float[Array, "*tokens vocab"],
    teacher_logits: Float[Array, "*tokens vocab"],
    *,
    beta: float,
    temperature: float = 1.0,
) -> Float[Array, "*tokens"]:
    """The generalised JSD of each token (module docstring), in the logits' dtype (the
    callers widen them first). ``beta`` is a Python float: 0 and 1 are TRL's special cases."""
    s = jax.nn.log_softmax(student_logits / temperature, axis=-1)
    t = jax.nn.log_softmax(teacher_logits / temperature, axis=-1)
    if beta == 0:
        return _kl(t, s)
    if beta == 1:
        return _kl(s, t)
    # TRL's mixture: logsumexp of log p_s + log(1 - beta) and log p_t + log(beta).
    m = jnp.logaddexp(s + np.log1p(-beta), t + np.log(beta))
    return beta * _kl(t, m) + (1 - beta) * _kl(s, m)


def distill_loss(
    student_logits: Float[Array, "batch seq vocab"],
    teacher_logits: Float[Array, "batch seq vocab"],
    mask: Bool[Array, "batch seq"] | Int[Array, "batch seq"],
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """TRL's ``generalized_jsd_loss`` on logits already aligned with their targets (TRL
    passes ``logits[:, :-1]`` and ``mask = labels[:, 1:] != -100``).

    Args:
        student_logits, teacher_logits: ``(batch, seq, vocab)`` (or any ``(*tokens, vocab)``
            of one shape), float32 or float64; computed in the wider, at least float32
            (``edl.train.loss_inputs``). The teacher's carry no gradient.
        mask: ``(batch, seq)`` bool or 0/1: the tokens counted (completion tokens).
        beta: 0 forward KL(teacher || student), 1 reverse KL, between: the JSD with TRL's
            mixture ``(1 - beta) p_student + beta p_teacher``.
        temperature: divides both models' logits.

    Returns:
        ``(loss, {"loss", "count"})``: the mean over counted tokens (0.0 when none) and the
        int32 number of counted tokens.
    """
    who = "distill_loss"
    _check_options(who, beta, temperature)
    if student_logits.shape != teacher_logits.shape or mask.shape != student_logits.shape[:-1]:
        raise ValueError(
            f"{who}: need student and teacher logits of one shape (*tokens, vocab) and a mask "
            f"of shape *tokens, got {student_logits.shape}, {teacher_logits.shape} and "
            f"{mask.shape}"
        )
    dtype = loss_dtype(who, student_logits=student_logits, teacher_logits=teacher_logits)
    teacher = jax.lax.stop_gradient(teacher_logits.astype(dtype))
    jsd = token_divergence(
        student_logits.astype(dtype), teacher, beta=beta, temperature=temperature
    )
    counted = jnp.asarray(mask).astype(bool)
    count = jnp.sum(counted.astype(jnp.int32))
    loss = jnp.sum(jnp.where(counted, jsd, 0.0)) / jnp.maximum(count, 1).astype(dtype)
    return loss, {"loss": loss, "count": count}


def _softcap(logits: Array, softcap: float | None) -> Array:
    return logits if softcap is None else softcap * jnp.tanh(logits / softcap)


def _blocks(x: Array, n_chunks: int, chunk: int) -> Array:
    """``x (n, ...)`` padded to ``n_chunks * chunk`` rows, cut into ``(n_chunks, chunk, ...)``."""
    pad = n_chunks * chunk - x.shape[0]
    x = jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1))
    return x.reshape(n_chunks, chunk, *x.shape[1:])


def chunked_distill_loss(
    student_hidden: Float[Array, "batch seq dim"],
    student_head: Float[Array, "vocab dim"],
    teacher_hidden: Float[Array, "batch seq teacher_dim"],
    teacher_head: Float[Array, "vocab teacher_dim"],
    mask: Bool[Array, "batch seq"],
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    student_softcap: float | None = None,
    teacher_softcap: float | None = None,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """:func:`distill_loss` of ``student_hidden @ student_head.T`` against ``teacher_hidden @
    teacher_head.T``, chunked over tokens (module docstring).

    Args:
        student_hidden, teacher_hidden: each model's final hidden states (after its final
            norm), aligned with ``mask``; widths may differ.
        student_head, teacher_head: ``(vocab, dim)`` output projections (torch layout); one
            vocabulary.
        mask: ``(batch, seq)``: the positions counted.
        chunk_size: tokens per chunk (None: ``edl.ops.losses.default_chunk_size`` of the
            student's dtype); memory holds one ``(chunk, vocab)`` block of each model's logits.
        student_softcap, teacher_softcap: each model's final logit soft-cap (Gemma 2), applied
            before the temperature.

    The logits are accumulated in float32 (float64 for float64 inputs). Returns as
    :func:`distill_loss`; gradients reach ``student_hidden`` and ``student_head`` only.
    """
    who = "chunked_distill_loss"
    _check_options(who, beta, temperature)
    batch, seq = mask.shape
    if (
        student_hidden.shape[:2] != (batch, seq)
        or teacher_hidden.shape[:2] != (batch, seq)
        or student_head.shape[1] != student_hidden.shape[-1]
        or teacher_head.shape[1] != teacher_hidden.shape[-1]
        or student_head.shape[0] != teacher_head.shape[0]
    ):
        raise ValueError(
            f"{who}: need hidden states (batch, seq, dim) = ({batch}, {seq}, ...) and heads "
            f"(vocab, dim) of one vocabulary, got student {student_hidden.shape} / "
            f"{student_head.shape}, teacher {teacher_hidden.shape} / {teacher_head.shape}"
        )
    dtype = loss_dtype(who, student_hidden=student_hidden, student_head=student_head)
    if chunk_size is None:
        chunk_size = default_chunk_size(student_hidden.dtype)
    if chunk_size <= 0:
        raise ValueError(f"{who}: chunk_size must be positive, got {chunk_size}")
    n = batch * seq
    chunk = max(1, min(chunk_size, n))
    n_chunks = -(-n // chunk)
    xs = _blocks(student_hidden.reshape(n, -1), n_chunks, chunk)
    xt = _blocks(jax.lax.stop_gradient(teacher_hidden).reshape(n, -1), n_chunks, chunk)
    on = _blocks(jnp.asarray(mask).astype(bool).reshape(n), n_chunks, chunk)
    teacher_head = jax.lax.stop_gradient(teacher_head)

    def chunk_sum(ws, wt, xs, xt, on):
        s = jnp.einsum("cd,vd->cv", xs, ws, preferred_element_type=dtype)
        t = jnp.einsum("cd,vd->cv", xt, wt, preferred_element_type=dtype)
        s, t = _softcap(s, student_softcap), _softcap(t, teacher_softcap)
        jsd = token_divergence(s, t, beta=beta, temperature=temperature)
        return jnp.sum(jnp.where(on, jsd, 0.0))

    if n_chunks == 1:  # one block: no scan, no recomputation (as edl.ops.losses)
        total = chunk_sum(student_head, teacher_head, xs[0], xt[0], on[0])
    else:
        body = jax.checkpoint(chunk_sum, prevent_cse=False)
        step = lambda carry, blk: (carry + body(student_head, teacher_head, *blk), None)
        total, _ = jax.lax.scan(step, jnp.zeros((), dtype), (xs, xt, on))
    count = jnp.sum(jnp.asarray(mask).astype(jnp.int32))
    loss = total / jnp.maximum(count, 1).astype(dtype)
    return loss, {"loss": loss, "count": count}

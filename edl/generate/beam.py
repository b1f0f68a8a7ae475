"""Beam search as a ``lax.while_loop``: Hugging Face's vectorised algorithm, step for step.

Each step takes the top ``keep = max(2, 1 + #eos) * num_beams`` continuations of all beams of a
prompt by accumulated log-probability; the best ``num_beams`` that did not just hit a
stopping condition keep running, and those among the top ``num_beams`` that did (EOS, or the
length limit) compete, length-penalised, for the ``num_beams`` finished slots. The loop stops
when no running beam can beat the worst finished one (HF's ``early_stopping`` heuristics),
or at the length limit. The KV cache rows follow their beams (reordered every step); past
Phi-3's LongRoPE original context every beam's sequence re-runs once, as in transformers.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from edl.generate import steps
from edl.generate.cache import KVCache
from edl.generate.config import GenerateOutput, GenerationConfig
from edl.generate.steps import CausalLM
from edl.ops.sampling import LogitsProcessor

__all__ = ["beam_search"]

_NEG = -1.0e9  # HF's "never choose this" score


class BeamState(eqx.Module):
    """Beam search's state after ``step`` tokens: ``beams`` running beams per prompt, with
    their tokens so far and accumulated log-probabilities (``running_scores``), the logits
    for their next token (rows ``batch * beams``) and their KV cache rows; the ``beams``
    best finished sequences per prompt (``seqs``, their lengths and length-penalised
    ``scores``; ``finished`` marks the slots filled); whether a prompt's running beams can
    still beat its worst finished one (``improvable``), and whether to ``go`` on."""

    step: Int[Array, ""]
    logits: Float[Array, "rows vocab"]
    cache: KVCache
    running: Int[Array, "batch beams max_new"]
    running_scores: Float[Array, "batch beams"]
    seqs: Int[Array, "batch beams max_new"]
    seq_len: Int[Array, "batch beams"]
    scores: Float[Array, "batch beams"]
    finished: Bool[Array, "batch beams"]
    improvable: Bool[Array, "batch 1"]
    go: Bool[Array, ""]

    @classmethod
    def start(
        cls,
        logits: Float[Array, "rows vocab"],
        cache: KVCache,
        batch: int,
        beams: int,
        max_new: int,
        pad_id: int,
    ) -> BeamState:
        """Every prompt's beams after the prefill (rows already repeated per beam): only the
        first beam is live, so the first step picks distinct continuations of one prompt."""
        empty = jnp.full((batch, beams, max_new), pad_id, jnp.int32)
        return cls(
            step=jnp.int32(0),
            logits=logits,
            cache=cache,
            running=empty,
            running_scores=jnp.zeros((batch, beams)).at[:, 1:].set(_NEG),
            seqs=empty,
            seq_len=jnp.zeros((batch, beams), jnp.int32),
            scores=jnp.full((batch, beams), _NEG),
            finished=jnp.zeros((batch, beams), jnp.bool_),
            improvable=jnp.ones((batch, 1), jnp.bool_),
            go=jnp.bool_(True),
        )


def _gather(x: jax.Array, index: jax.Array) -> jax.Array:
    """``x[b, index[b, i], ...]`` (HF's ``_gather_beams``)."""
    index = index.reshape(index.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, index, axis=1)


def _penalised(scores: jax.Array, length: jax.Array, penalty: float) -> jax.Array:
    return scores / length.astype(jnp.float32) ** penalty


def beam_search(
    model: CausalLM,
    input_ids: Int[Array, "batch seq"],
    attention_mask: Bool[Array, "batch seq"],
    key: PRNGKeyArray,
    *,
    config: GenerationConfig,
    processor: LogitsProcessor,
    max_new: int,
    unstack_layers: bool = False,
) -> GenerateOutput:
    """Beam search over ``input_ids (batch, seq)``; call it inside ``jax.jit`` (``generate``
    does). ``processor`` acts on log-probabilities, as in HF; with ``config.do_sample`` the
    ``keep`` continuations are sampled without replacement (Gumbel top-k) instead."""
    batch, beams = input_ids.shape[0], config.num_beams
    logits, cache, ids, mask = steps.start(model, input_ids, attention_mask, max_new)
    rows = jnp.repeat(jnp.arange(batch), beams)
    state = BeamState.start(
        logits[rows], cache.select_rows(rows), batch, beams, max_new, config.pad_id
    )
    decoder = steps.decoder(model, unstack_layers)
    prompt, prompt_mask = ids[rows], mask[rows]

    def body(s: BeamState) -> BeamState:
        return _step(s, decoder, prompt, prompt_mask, key, config=config, processor=processor)

    s = jax.lax.while_loop(lambda s: s.go, body, state)
    ret = config.num_return_sequences
    new = s.seqs[:, :ret].reshape(batch * ret, max_new)
    prompts = jnp.repeat(input_ids, ret, axis=0)
    return GenerateOutput(
        jnp.concatenate([prompts, new], axis=1),
        s.seq_len[:, :ret].reshape(-1),
        s.scores[:, :ret].reshape(-1),
    )


def _step(
    s: BeamState,
    decoder: CausalLM,
    prompt: Int[Array, "rows prompt"],
    prompt_mask: Bool[Array, "rows prompt"],
    key: PRNGKeyArray,
    *,
    config: GenerationConfig,
    processor: LogitsProcessor,
) -> BeamState:
    """One token for every beam: the best continuations keep running, those that stopped
    compete for the finished slots, and the cache rows follow their beams."""
    batch, beams, max_new = s.running.shape
    t = s.step
    tokens, valid = steps.history(prompt, prompt_mask, s.running.reshape(batch * beams, max_new), t)
    logp = processor(jax.nn.log_softmax(s.logits, axis=-1), tokens, valid)
    top_lp, source, token = _top_continuations(s, logp, key, config)
    top_seqs = _gather(s.running, source).at[:, :, t].set(token)
    hits = steps.is_eos(token, config.eos_ids) | (t + 1 >= max_new)

    # The best `beams` continuations that did not stop keep running.
    run_lp = top_lp + hits.astype(jnp.float32) * _NEG
    chosen = jax.lax.top_k(run_lp, beams)[1]
    running, running_scores = _gather(top_seqs, chosen), _gather(run_lp, chosen)

    seqs, seq_len, finished, scores = _merge_finished(s, top_seqs, top_lp, hits, config)

    # Cache rows follow their beams; feed each running beam's new token.
    flat_source = (jnp.arange(batch)[:, None] * beams + _gather(source, chosen)).reshape(-1)
    cache = s.cache.select_rows(flat_source)
    # Past LongRoPE's original context the beams' whole sequences re-run (``decode_or_refill``).
    flat = running.reshape(batch * beams, max_new)
    logits, cache = steps.decode_or_refill(decoder, flat[:, t], cache, prompt, prompt_mask, flat, t)

    improvable = s.improvable & _can_improve(running_scores, finished, scores, t, max_new, config)
    go = jnp.any(improvable) & ~jnp.all(hits)
    if config.early_stopping is True:
        go &= ~jnp.all(finished)
    return BeamState(
        t + 1,
        logits,
        cache,
        running,
        running_scores,
        seqs,
        seq_len,
        scores,
        finished,
        improvable,
        go,
    )


def _top_continuations(
    s: BeamState, logp: Float[Array, "rows vocab"], key: PRNGKeyArray, config: GenerationConfig
) -> tuple[Float[Array, "batch keep"], Int[Array, "batch keep"], Int[Array, "batch keep"]]:
    """The ``keep = max(2, 1 + #eos) * beams`` best continuations of each prompt's beams by
    accumulated log-probability (sampled without replacement with ``do_sample``): their
    log-probabilities, source beams and tokens."""
    batch, beams = s.running_scores.shape
    keep = max(2, 1 + len(config.eos_ids)) * beams
    vocab = logp.shape[-1]
    acc = (logp.reshape(batch, beams, vocab) + s.running_scores[:, :, None]).reshape(
        batch, beams * vocab
    )
    if config.do_sample:  # sampling without replacement from softmax(acc)
        gumbel = jax.random.gumbel(steps.fold_step(key, s.step), acc.shape)
        index = jax.lax.top_k(acc + gumbel, keep)[1]
        top_lp = jnp.take_along_axis(acc, index, axis=1)
    else:
        top_lp, index = jax.lax.top_k(acc, keep)
    return top_lp, index // vocab, (index % vocab).astype(jnp.int32)


def _merge_finished(
    s: BeamState,
    top_seqs: Int[Array, "batch keep max_new"],
    top_lp: Float[Array, "batch keep"],
    hits: Bool[Array, "batch keep"],
    config: GenerationConfig,
) -> tuple[
    Int[Array, "batch beams max_new"],
    Int[Array, "batch beams"],
    Bool[Array, "batch beams"],
    Float[Array, "batch beams"],
]:
    """Those of the top ``beams`` continuations that stopped compete, length-penalised, with
    the finished sequences for the ``beams`` finished slots: ``(seqs, seq_len, finished,
    scores)``."""
    batch, beams = s.scores.shape
    keep, t = top_lp.shape[1], s.step
    did_finish = hits & (jnp.arange(keep) < beams)[None]
    final = _penalised(top_lp, t + 1, config.length_penalty)
    if config.early_stopping is True:
        full = jnp.all(s.finished, axis=-1, keepdims=True)
        final = final + full.astype(jnp.float32) * _NEG
    final = final + (~s.improvable).astype(jnp.float32) * _NEG
    final = final + (~did_finish).astype(jnp.float32) * _NEG
    merged_scores = jnp.concatenate([s.scores, final], axis=1)
    best = jax.lax.top_k(merged_scores, beams)[1]
    seqs = _gather(jnp.concatenate([s.seqs, top_seqs], axis=1), best)
    seq_len = _gather(jnp.concatenate([s.seq_len, jnp.full((batch, keep), t + 1)], axis=1), best)
    finished = _gather(jnp.concatenate([s.finished, did_finish], axis=1), best)
    return seqs, seq_len, finished, _gather(merged_scores, best)


def _can_improve(
    running_scores: Float[Array, "batch beams"],
    finished: Bool[Array, "batch beams"],
    scores: Float[Array, "batch beams"],
    t: Int[Array, ""],
    max_new: int,
    config: GenerationConfig,
) -> Bool[Array, "batch 1"]:
    """HF's heuristic: can a prompt's best running beam still beat its worst finished one?"""
    penalty = config.length_penalty
    # "never": HF bounds the best running beam by its score at the length limit.
    never = config.early_stopping == "never" and penalty > 0.0
    best_len = jnp.int32(max_new) if never else t + 1
    best_running = _penalised(running_scores[:, :1], best_len, penalty)
    worst = jnp.where(finished, jnp.min(scores, axis=1, keepdims=True), _NEG)
    return jnp.any(best_running > worst, axis=-1, keepdims=True)

"""Beam search as a ``lax.while_loop``: Hugging Face's vectorised algorithm, step for step.

Each step takes the top ``keep = max(2, 1 + #eos) * num_beams`` continuations of all beams of a
prompt by accumulated log-probability; the best ``num_beams`` that did not just hit a
stopping condition keep running, and those among the top ``num_beams`` that did (EOS, or the
length limit) compete, length-penalised, for the ``num_beams`` finished slots. The loop stops
when no running beam can beat the worst finished one (HF's ``early_stopping`` heuristics),
or at the length limit. The KV cache rows follow their beams (reordered every step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from edl.generate import steps
from edl.generate.cache import init_cache
from edl.generate.config import GenerateOutput, GenerationConfig

__all__ = ["beam_search"]

_NEG = -1.0e9  # HF's "never choose this" score


def _gather(x: jax.Array, index: jax.Array) -> jax.Array:
    """``x[b, index[b, i], ...]`` (HF's ``_gather_beams``)."""
    index = index.reshape(index.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, index, axis=1)


def _penalised(scores: jax.Array, length: jax.Array, penalty: float) -> jax.Array:
    return scores / length.astype(jnp.float32) ** penalty


def beam_search(
    model,
    input_ids,
    attention_mask,
    key,
    *,
    config: GenerationConfig,
    processor,
    max_new: int,
    unstack_layers: bool = False,
) -> GenerateOutput:
    """Beam search over ``input_ids (batch, seq)``; call it inside ``jax.jit`` (``generate``
    does). ``processor`` acts on log-probabilities, as in HF; with ``config.do_sample`` the
    ``keep`` continuations are sampled without replacement (Gumbel top-k) instead."""
    batch, prompt_len = input_ids.shape
    beams, eos, penalty = config.num_beams, config.eos_ids, config.length_penalty
    keep = max(2, 1 + len(eos)) * beams
    ids, mask, lengths = steps.compact_prompts(input_ids, attention_mask)
    dtype = model.model.embed_tokens.weight.dtype
    cache = init_cache(model.config, batch, prompt_len + max_new, dtype)
    logits, cache = steps.prefill(model, ids, mask, lengths, cache)
    decoder = steps.decoder(model, unstack_layers)
    rows = jnp.repeat(jnp.arange(batch), beams)
    prompt, prompt_mask = ids[rows], mask[rows]
    fill = config.pad_id
    state = {
        "step": jnp.int32(0),
        "logits": logits[rows],
        "cache": cache.select_rows(rows),
        "running": jnp.full((batch, beams, max_new), fill, jnp.int32),
        "running_scores": jnp.zeros((batch, beams)).at[:, 1:].set(_NEG),
        "seqs": jnp.full((batch, beams, max_new), fill, jnp.int32),
        "seq_len": jnp.zeros((batch, beams), jnp.int32),
        "scores": jnp.full((batch, beams), _NEG),
        "finished": jnp.zeros((batch, beams), jnp.bool_),
        "improvable": jnp.ones((batch, 1), jnp.bool_),
        "go": jnp.bool_(True),
    }

    def body(s):
        t = s["step"]
        tokens, valid = steps.history(
            prompt, prompt_mask, s["running"].reshape(batch * beams, max_new), t
        )
        logp = processor(jax.nn.log_softmax(s["logits"], axis=-1), tokens, valid)
        vocab = logp.shape[-1]
        acc = (logp.reshape(batch, beams, vocab) + s["running_scores"][:, :, None]).reshape(
            batch, beams * vocab
        )
        if config.do_sample:  # sampling without replacement from softmax(acc)
            gumbel = jax.random.gumbel(steps.fold_step(key, t), acc.shape)
            index = jax.lax.top_k(acc + gumbel, keep)[1]
            top_lp = jnp.take_along_axis(acc, index, axis=1)
        else:
            top_lp, index = jax.lax.top_k(acc, keep)
        source = index // vocab
        token = (index % vocab).astype(jnp.int32)
        top_seqs = _gather(s["running"], source).at[:, :, t].set(token)
        hits = steps.is_eos(token, eos) | (t + 1 >= max_new)

        # The best `beams` continuations that did not stop keep running.
        run_lp = top_lp + hits.astype(jnp.float32) * _NEG
        chosen = jax.lax.top_k(run_lp, beams)[1]
        running, running_scores = _gather(top_seqs, chosen), _gather(run_lp, chosen)

        # Those of the top `beams` that stopped compete for the finished slots.
        did_finish = hits & (jnp.arange(keep) < beams)[None]
        final = _penalised(top_lp, t + 1, penalty)
        if config.early_stopping is True:
            full = jnp.all(s["finished"], axis=-1, keepdims=True)
            final = final + full.astype(jnp.float32) * _NEG
        final = final + (~s["improvable"]).astype(jnp.float32) * _NEG
        final = final + (~did_finish).astype(jnp.float32) * _NEG
        merged_scores = jnp.concatenate([s["scores"], final], axis=1)
        best = jax.lax.top_k(merged_scores, beams)[1]
        seqs = _gather(jnp.concatenate([s["seqs"], top_seqs], axis=1), best)
        seq_len = _gather(
            jnp.concatenate([s["seq_len"], jnp.full((batch, keep), t + 1)], axis=1), best
        )
        finished = _gather(jnp.concatenate([s["finished"], did_finish], axis=1), best)
        scores = _gather(merged_scores, best)

        # Cache rows follow their beams; feed each running beam's new token.
        flat_source = (jnp.arange(batch)[:, None] * beams + _gather(source, chosen)).reshape(-1)
        cache = s["cache"].select_rows(flat_source)
        logits, cache = steps.decode_step(decoder, running[:, :, t].reshape(-1), cache)

        # HF's heuristic: can a running beam still beat the worst finished one?
        if config.early_stopping == "never" and penalty > 0.0:
            best_len = jnp.int32(max_new)
        else:
            best_len = t + 1
        best_running = _penalised(running_scores[:, :1], best_len, penalty)
        worst = jnp.where(finished, jnp.min(scores, axis=1, keepdims=True), _NEG)
        improvable = s["improvable"] & jnp.any(best_running > worst, axis=-1, keepdims=True)
        go = jnp.any(improvable) & ~jnp.all(hits)
        if config.early_stopping is True:
            go &= ~jnp.all(finished)
        return {
            "step": t + 1, "logits": logits, "cache": cache, "running": running,
            "running_scores": running_scores, "seqs": seqs, "seq_len": seq_len,
            "scores": scores, "finished": finished, "improvable": improvable, "go": go,
        }  # fmt: skip

    s = jax.lax.while_loop(lambda s: s["go"], body, state)
    ret = config.num_return_sequences
    new = s["seqs"][:, :ret].reshape(batch * ret, max_new)
    prompts = jnp.repeat(input_ids, ret, axis=0)
    return GenerateOutput(
        jnp.concatenate([prompts, new], axis=1),
        s["seq_len"][:, :ret].reshape(-1),
        s["scores"][:, :ret].reshape(-1),
    )

"""Speculative decoding for ``generate``: draft ``k`` tokens, verify them in one target forward.

    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    out = generate(model, ids, max_new_tokens=64, speculative=spec)
    out = generate(model, ids, max_new_tokens=64, draft_model=small,
                   speculative=SpeculativeConfig(method="draft"))
    out.speculative.accepted / out.speculative.drafted      # per row

Each iteration of one compiled ``lax.while_loop``: the proposer (``edl.generate.proposers``)
drafts ``k`` tokens per row after its pending token (the last emitted, not yet in the
target's cache); the target runs once on ``[pending, draft_1..draft_k]`` through its KV cache
(writing ``k + 1`` positions); ``edl.generate.verify`` accepts a prefix of the drafts and
picks one more token; the cache's ``lengths`` are set back to the accepted prefix, which
makes the rejected positions invisible (later writes overwrite them). Rows advance by their
own ``accepted + 1`` tokens (fewer at EOS or ``max_new_tokens``), finished rows by none.

Greedy output equals ``generate`` without ``speculative`` token for token, except where
two tokens' logits are within float rounding of each other (a ``k + 1``-token forward sums
in another order than a one-token one; measured: one float32 ulp apart in an untrained
model, ``benchmarks/speculative.py``). Sampling keeps the target's distribution
(speculative sampling's rejection rule) but draws other random numbers than plain
sampling, so its tokens differ for the same key.
Processors (repetition penalty, temperature, top-k / top-p / min-p, the user's) apply at
every verified position with the history up to that position. A model with a
``steps.refill_length`` (Phi-3's LongRoPE) has its verifications cut at that length and
its sequences re-run when a row reaches it (``edl.generate.spec_refill``), its rows'
factors following their own lengths.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from edl._speculative import SpeculativeConfig
from edl.generate import spec_refill, steps
from edl.generate.config import GenerateOutput, GenerationConfig, SpeculativeStats
from edl.generate.proposers import PROPOSERS, ProposeInputs
from edl.generate.verify import emitted_tokens, greedy_verify, rejection_verify
from edl.nn.attention import KVCacheLike
from edl.ops.sampling import LogitsProcessor, greedy, sample

__all__ = ["SpeculativeConfig"]


class SpecState(eqx.Module):
    """The loop's state. Row ``b``'s tokens so far are ``seq[b, :prompt_len[b] + count[b]]``
    (compacted prompt, then ``count`` generated, the last one pending); the target's cache
    holds all but the pending token. ``proposal``: the proposer's own state."""

    it: Int[Array, ""]
    cache: KVCacheLike
    seq: Int[Array, "batch width"]
    prompt_len: Int[Array, " batch"]
    count: Int[Array, " batch"]
    done: Bool[Array, " batch"]
    proposal: Any
    stats: SpeculativeStats


def position_scores(
    processor: LogitsProcessor,
    logits: Float[Array, "batch k1 vocab"],
    seq: Int[Array, "batch width"],
    lengths: Int[Array, " batch"],
) -> Float[Array, "batch k1 vocab"]:
    """``processor`` at each verified position ``i``, seeing the tokens before it: row
    ``b``'s ``seq[b, :lengths[b] + i]`` (the drafts written after the pending token)."""
    positions = jnp.arange(seq.shape[1], dtype=jnp.int32)[None]

    def one(logit: Float[Array, "batch vocab"], i: Int[Array, ""]) -> Float[Array, "batch vocab"]:
        return processor(logit, seq, positions < (lengths + i)[:, None])

    steps_ = jnp.arange(logits.shape[1], dtype=jnp.int32)
    return jax.vmap(one, in_axes=(1, 0), out_axes=1)(logits, steps_)


def emit_count(
    emitted: Int[Array, "batch k1"],
    accepted: Int[Array, " batch"],
    room: Int[Array, " batch"],
    eos_ids: tuple[int, ...],
) -> tuple[Int[Array, " batch"], Bool[Array, " batch"]]:
    """How many of the emitted tokens a row keeps (up to its first EOS and its ``room``
    left under ``max_new_tokens``) and whether it kept an EOS."""
    pos = jnp.arange(emitted.shape[1], dtype=jnp.int32)[None]
    eos = steps.is_eos(emitted, eos_ids) & (pos <= accepted[:, None])
    first_eos = jnp.where(jnp.any(eos, axis=1), jnp.argmax(eos, axis=1) + 1, accepted + 1)
    keep = jnp.minimum(first_eos.astype(jnp.int32), room)
    return keep, jnp.any(eos & (pos < keep[:, None]), axis=1)


def _verify(model, state: SpecState, drafts, valid, q, key, num_new, *, config, processor):
    """The target's forward over the pending token and the drafts, and the verdict:
    ``(accepted, next_token, cache)``, the cache holding all ``k + 1`` new positions
    (``num_new``: ``spec_refill.chunk_tokens``, the positions that run per row)."""
    rows, k = drafts.shape
    length = state.prompt_len + state.count
    row_ids = jnp.arange(rows)[:, None]
    pending = jnp.take_along_axis(state.seq, (length - 1)[:, None], axis=1)
    tokens = jnp.concatenate([pending, drafts], axis=1)
    offsets = jnp.arange(k, dtype=jnp.int32)[None]
    seq = state.seq.at[row_ids, length[:, None] + offsets].set(drafts, mode="drop")
    live = ~state.done
    logits, cache = spec_refill.target_logits(model, tokens, seq, state.cache, num_new, live)
    scores = position_scores(processor, logits, seq, length)
    if config.do_sample:
        probs = jax.nn.softmax(scores, axis=-1)
        accepted, token = rejection_verify(probs, q, drafts, valid, key)
    else:
        accepted, token = greedy_verify(scores, drafts, valid)
    return accepted, token, cache


def _spec_step(model, state: SpecState, *, inputs, spec, config, max_new) -> SpecState:
    """One draft-and-verify iteration for every row (finished rows change nothing)."""
    proposer = PROPOSERS[spec.method]
    live = ~state.done
    length = state.prompt_len + state.count
    draft_key, verify_key = jax.random.split(jax.random.fold_in(inputs.key, state.it + 1))
    inputs = dataclasses.replace(inputs, seq=state.seq, lengths=length, key=draft_key)
    proposal, drafts, valid, q = proposer.propose(inputs, state.proposal)
    cached = state.cache.lengths
    num_new = spec_refill.chunk_tokens(model, cached, drafts.shape[1])
    if num_new is not None:  # a chunk cut at LongRoPE's original context
        valid &= jnp.arange(drafts.shape[1], dtype=jnp.int32)[None] < (num_new - 1)[:, None]
    drafts = jnp.where(valid, drafts, config.pad_id)
    accepted, token, cache = _verify(
        model,
        state,
        drafts,
        valid,
        q,
        verify_key,
        num_new,
        config=config,
        processor=inputs.processor,
    )
    emitted = emitted_tokens(drafts, accepted, token, config.pad_id)
    keep, hit_eos = emit_count(emitted, accepted, max_new - state.count, config.eos_ids)
    keep = jnp.where(live, keep, 0)
    pos = jnp.arange(emitted.shape[1], dtype=jnp.int32)[None]
    emitted = jnp.where(pos < keep[:, None], emitted, config.pad_id)
    row_ids = jnp.arange(emitted.shape[0])[:, None]
    seq = state.seq.at[row_ids, length[:, None] + pos].set(emitted, mode="drop")
    lengths = jnp.where(live, cached + 1 + accepted, cached)
    count = state.count + keep
    stats = SpeculativeStats(
        drafted=state.stats.drafted + jnp.where(live, jnp.sum(valid, axis=1, dtype=jnp.int32), 0),
        accepted=state.stats.accepted + jnp.minimum(accepted, keep),
        steps=state.stats.steps + live.astype(jnp.int32),
    )
    return SpecState(
        it=state.it + 1,
        cache=dataclasses.replace(cache, lengths=lengths),
        seq=seq,
        prompt_len=state.prompt_len,
        count=count,
        done=state.done | (live & hit_eos) | (count >= max_new),
        proposal=proposer.commit(state.proposal, proposal, cached, accepted, live),
        stats=stats,
    )


def _first_token(logits, seq, prompt_len, key, config, processor):
    """The token after the prompt, as plain decoding chooses it (its step-0 key)."""
    valid = jnp.arange(seq.shape[1], dtype=jnp.int32)[None] < prompt_len[:, None]
    scores = processor(logits, seq, valid)
    return (
        sample(scores, steps.fold_step(key, jnp.int32(0))) if config.do_sample else greedy(scores)
    )


def _start(model, draft_model, ids, mask, key, *, spec, config, processor, max_new):
    """Prefill (target and proposer) and the first token: the loop's first state."""
    room = max_new + spec.num_speculative_tokens + 1  # a verification writes k + 1 positions
    logits, cache, prompt, prompt_mask = steps.start(model, ids, mask, room)
    prompt_len = jnp.sum(prompt_mask, axis=1, dtype=jnp.int32)
    rows = ids.shape[0]
    seq = jnp.pad(prompt, ((0, 0), (0, room)), constant_values=config.pad_id)
    token = _first_token(logits, seq, prompt_len, key, config, processor)
    seq = seq.at[jnp.arange(rows), prompt_len].set(token)
    zeros = jnp.zeros((rows,), jnp.int32)
    proposal = PROPOSERS[spec.method].start(draft_model, ids, mask, room + 1)
    return SpecState(
        it=jnp.int32(0),
        cache=cache,
        seq=seq,
        prompt_len=prompt_len,
        count=zeros + 1,
        done=steps.is_eos(token, config.eos_ids) | (max_new <= 1),
        proposal=proposal,
        stats=SpeculativeStats(zeros, zeros, zeros),
    )


@functools.partial(
    jax.jit, static_argnames=("spec", "config", "processor", "max_new", "unstack_layers")
)
def generate_speculative(
    model: Any,
    draft_model: Any,
    input_ids: Int[Array, "batch seq"],
    attention_mask: Bool[Array, "batch seq"],
    key: PRNGKeyArray,
    *,
    spec: SpeculativeConfig,
    config: GenerationConfig,
    processor: LogitsProcessor,
    max_new: int,
    unstack_layers: bool = False,
) -> GenerateOutput:
    """The compiled speculative loop behind ``generate(..., speculative=spec)`` (checked
    inputs; ``input_ids`` left-padded as ``generate`` takes them). The output is laid out
    as plain ``generate``'s, with ``speculative`` set to the per-row counts."""
    if steps.refill_length(model) is not None:  # rows cross LongRoPE's limit apart
        model = steps.with_row_rope_lengths(model)
    state = _start(
        model,
        draft_model,
        input_ids,
        attention_mask,
        key,
        spec=spec,
        config=config,
        processor=processor,
        max_new=max_new,
    )
    low, high = spec.prompt_lookup_min, spec.prompt_lookup_max
    inputs = ProposeInputs(
        seq=state.seq,
        lengths=state.prompt_len + 1,
        key=key,
        draft_model=None if draft_model is None else steps.decoder(draft_model, unstack_layers),
        processor=processor,
        num_tokens=spec.num_speculative_tokens,
        do_sample=config.do_sample,
        pad_id=config.pad_id,
        ngram=(low, high),
    )
    body = functools.partial(
        _spec_step,
        steps.decoder(model, unstack_layers),
        inputs=inputs,
        spec=spec,
        config=config,
        max_new=max_new,
    )
    final = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
    pos = jnp.arange(max_new, dtype=jnp.int32)[None]
    generated = jnp.take_along_axis(final.seq, final.prompt_len[:, None] + pos, axis=1)
    generated = jnp.where(pos < final.count[:, None], generated, config.pad_id)
    return GenerateOutput(
        jnp.concatenate([input_ids, generated], axis=1),
        final.count,
        speculative=final.stats,
    )


def check_speculative(
    model: Any,
    draft_model: Any,
    spec: SpeculativeConfig | None,
    *,
    num_beams: int,
    page_size: int | None,
    images: Any,
) -> None:
    """Eager checks of ``generate``'s speculative arguments, naming what is wrong."""
    if spec is None:
        if draft_model is not None:
            raise ValueError(
                "generate: draft_model given without speculative=SpeculativeConfig(method='draft')"
            )
        return
    if not isinstance(spec, SpeculativeConfig):
        raise TypeError(f"generate: speculative must be a SpeculativeConfig, got {spec!r}")
    unsupported = {"num_beams > 1": num_beams > 1, "page_size": page_size is not None}
    unsupported["pixel_values"] = images is not None
    # Rejected drafts are taken back by rewinding lengths, which a recurrent state cannot.
    unsupported["a model with recurrent (Gated DeltaNet) layers"] = getattr(
        getattr(model, "model", None), "RECURRENT_STATE", False
    )
    for what, present in unsupported.items():
        if present:
            raise ValueError(f"generate: speculative decoding does not take {what}")
    needs = PROPOSERS[spec.method].needs_model
    if needs and draft_model is None:
        raise ValueError(f"generate: speculative method {spec.method!r} needs draft_model=")
    if not needs and draft_model is not None:
        raise ValueError(f"generate: speculative method {spec.method!r} takes no draft_model")
    if needs:
        check_draft_model(model, draft_model)


def check_draft_model(model: Any, draft_model: Any) -> None:
    """A draft model is a causal LM over the target's vocabulary (same token ids)."""
    if not isinstance(draft_model, steps.CausalLM):
        raise TypeError(
            f"generate: draft_model must be a causal LM (edl.generate.CausalLM), got "
            f"{type(draft_model).__name__}"
        )
    target, draft = model.config.vocab_size, draft_model.config.vocab_size
    if target != draft:
        raise ValueError(
            f"generate: the draft model's vocab_size {draft} differs from the target "
            f"model's {target}; a draft model must share the target's tokenizer"
        )

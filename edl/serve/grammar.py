"""Grammar-constrained decoding: structured output (``response_format``) and forced tool
calls, through llguidance.

The server turns a ``response_format`` or a forced ``tool_choice`` into an llguidance
grammar (a string: :func:`json_schema_grammar`, :func:`any_json_grammar`,
:func:`lark_grammar`), checked here so that a bad schema is a 400 before the engine sees
it, and passes it in ``SamplingParams.grammar``. The engine builds one matcher per request
(:class:`Grammars`, over the model's tokenizer), and each step:

1. the host fills the ``(rows, ceil(vocab / 32))`` int32 bitmask of every row that samples a
   token this step (:meth:`Grammars.bitmask`; rows without a grammar are all ones);
2. the device step sets every disallowed logit to ``-inf`` before sampling
   (:func:`mask_logits`, in the engine's sampler ``edl.serve.step.sample_step``, a separate
   compiled variant used only when some row of the call has a grammar: plain batches run
   the unmasked program);
3. the sampled token advances the matcher (``Grammars.advance``); when the grammar is
   complete and admits nothing more, the request finishes (``finish_reason="stop"``). The
   EOS ids are allowed only where the grammar is complete.

Why llguidance (measured 2026-11-27 on this 2-core VM; a synthetic 128,000-token vocabulary
of random 2-9 byte tokens, an object schema with string / integer / enum fields):

- install weight: llguidance is one 3.1 MB abi3 wheel with no dependencies; outlines-core
  one 2.3 MB wheel, no dependencies; xgrammar 1.3 MB but it requires torch, transformers
  and triton (about 3 GB of wheels with their CUDA libraries), which serving must not
  depend on.
- speed: llguidance builds a matcher in 0.7 ms and computes a step's mask in 5 us (median;
  the first mask of a grammar 8 ms), after a one-time 1.2 s tokenizer build; outlines-core
  compiles each schema into an index over the vocabulary in 0.6 s per schema (a request's
  latency, or a cache keyed by schema) before its per-step lookups.
- schema coverage: llguidance compiles JSON schemas lazily (Earley parser over a lexer), so
  recursion, ``anyOf`` / ``oneOf``, ``$ref``, string formats, lengths and numeric bounds
  work; outlines-core turns a schema into one regular expression (no recursive schemas).
  It also takes Lark grammars with embedded ``%json`` schemas, which forced tool calls use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from jaxtyping import Float, Int

if TYPE_CHECKING:  # the server imports this module, and no jax
    from jax import Array

__all__ = ["Grammars", "any_json_grammar", "json_schema_grammar", "lark_grammar", "mask_logits"]

# Compact JSON, as OpenAI's structured output writes it: a sampled model may otherwise
# spend its tokens on whitespace between items, which JSON allows without bound.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as e:  # the serve extra
        raise ImportError("structured output needs llguidance: pip install 'edl-jax[serve]'") from e
    return llguidance


def _checked(grammar: str, what: str) -> str:
    """``grammar`` if llguidance accepts it, else ``ValueError`` naming ``what``."""
    error = _llguidance().LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"{what} is not a grammar llguidance accepts: {error}")
    return grammar


def json_schema_grammar(schema: Mapping[str, Any], what: str = "schema") -> str:
    """The grammar of JSON values matching ``schema`` (compact separators); ``ValueError``
    naming ``what`` for a schema llguidance cannot compile."""
    if not isinstance(schema, Mapping):
        raise ValueError(f"{what} must be a JSON object, got {schema!r:.80}")
    try:
        grammar = _llguidance().LLMatcher.grammar_from_json_schema(
            dict(schema), defaults=dict(JSON_OPTIONS)
        )
    except ValueError as e:
        raise ValueError(f"{what} is not a JSON schema llguidance accepts: {e}") from e
    return _checked(grammar, what)


def any_json_grammar() -> str:
    """``response_format: {"type": "json_object"}``: any JSON object."""
    return json_schema_grammar({"type": "object"}, "json_object")


def lark_grammar(lark: str, what: str = "grammar") -> str:
    """A Lark grammar (llguidance's dialect: ``%json {schema}`` embeds a JSON schema)."""
    return _checked(_llguidance().LLMatcher.grammar_from_lark(lark), what)


def mask_logits(
    logits: Float[Array, "batch vocab"], bitmask: Int[Array, "batch words"]
) -> Float[Array, "batch vocab"]:
    """``logits`` with ``-inf`` where ``bitmask``'s bit is 0: token ``t`` is bit ``t % 32``
    of word ``t // 32`` (llguidance's layout, little-endian bits of int32 words)."""
    import jax.numpy as jnp  # here: the server imports this module, and no jax

    vocab = logits.shape[-1]
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = (bitmask[:, :, None] >> shifts[None, None, :]) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :vocab].astype(jnp.bool_)
    return jnp.where(allowed, logits, -jnp.inf)


class Grammars:
    """The engine's host side of constrained decoding over one tokenizer: a matcher per
    request, the step's bitmask, the sampled tokens fed back.

    ``tokenizer`` is an ``edl.text.HFTokenizer`` (its ``hf``, a fast transformers
    tokenizer) or a transformers fast tokenizer; ``vocab_size`` the model's (its padding
    ids are never allowed); ``eos_token_ids`` end a request where its grammar is complete.
    The llguidance tokenizer (about a second for a 128k vocabulary) is built on the first
    request that has a grammar."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._hf = getattr(tokenizer, "hf", tokenizer)
        self.vocab_size, self.eos_token_ids = vocab_size, list(eos_token_ids)
        self.words = -(-vocab_size // 32)
        self._tokenizer: Any = None

    def matcher(self, grammar: str) -> Any:
        """A fresh matcher of ``grammar``; ``ValueError`` for one llguidance refuses."""
        llg = _llguidance()
        if self._tokenizer is None:
            import llguidance.hf

            eos = self.eos_token_ids or None
            self._tokenizer = llguidance.hf.from_tokenizer(self._hf, self.vocab_size, eos)
        matcher = llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the grammar is not valid: {matcher.get_error()}")
        return matcher

    def bitmask(self, matchers: Sequence[Any], rows: int) -> np.ndarray:
        """``(rows, words)`` int32: row ``i`` allows what ``matchers[i]`` allows, every
        token where it is None (no grammar, or no token sampled this step)."""
        mask = np.full((rows, self.words), -1, np.int32)
        # One row after another: llguidance's parallel executor (a thread pool) took 10x
        # longer for 16 rows on a busy 2-core VM (2.4 ms a step against 0.25 ms).
        for i, matcher in enumerate(matchers):
            if matcher is not None:
                matcher.unsafe_compute_mask_ptr(mask[i].ctypes.data, mask.shape[1] * 4)
        return mask

    @staticmethod
    def advance(matcher: Any, token: int) -> bool:
        """Feed the sampled ``token``; True when the grammar is done (nothing but EOS may
        follow). ``RuntimeError`` if the matcher refuses it: the mask allowed it."""
        if not matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused sampled token {token}: {matcher.get_error()}")
        return matcher.is_stopped()

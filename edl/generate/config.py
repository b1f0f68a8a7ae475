"""``GenerationConfig`` (HF ``generation_config.json`` fields and defaults) and the output."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import equinox as eqx
from jaxtyping import Array, Float, Int

__all__ = ["GenerateOutput", "GenerationConfig", "SpeculativeStats"]


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """How to decode; field names and defaults as Hugging Face's ``GenerationConfig``.

    Length: ``max_new_tokens``, or ``max_length`` = padded prompt length + new tokens (HF).
    Search: greedy (default), sampling (``do_sample``: ``temperature``, ``top_k`` (HF's
    default 50), ``top_p``, ``min_p``), or beam search (``num_beams`` > 1 with
    ``length_penalty`` and ``early_stopping`` True / False / ``"never"`` as HF; with
    ``do_sample`` the beams are sampled). ``repetition_penalty`` applies to every mode.
    A row stops at any of ``eos_token_id``; later positions hold ``pad_token_id``
    (default: the first EOS id, else 0). Hashable: it is a static argument of the compiled
    decode loop.
    """

    max_new_tokens: int | None = None
    max_length: int | None = None
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = 50
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    num_beams: int = 1
    num_return_sequences: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    eos_token_id: int | Sequence[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        eos = self.eos_token_id
        if isinstance(eos, list | tuple):
            object.__setattr__(self, "eos_token_id", tuple(int(e) for e in eos) or None)
        for name in ("max_new_tokens", "max_length"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"GenerationConfig: {name} must be positive, got {value}")
        if self.num_beams < 1:
            raise ValueError(f"GenerationConfig: num_beams must be >= 1, got {self.num_beams}")
        if not 1 <= self.num_return_sequences <= self.num_beams:
            raise ValueError(
                f"GenerationConfig: num_return_sequences ({self.num_return_sequences}) must be "
                f"in [1, num_beams={self.num_beams}]"
            )
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(
                f"GenerationConfig: early_stopping must be True, False or 'never', "
                f"got {self.early_stopping!r}"
            )

    @property
    def eos_ids(self) -> tuple[int, ...]:
        eos = self.eos_token_id
        return () if eos is None else (eos,) if isinstance(eos, int) else eos

    @property
    def pad_id(self) -> int:
        """``pad_token_id``, else the first EOS id (as HF), else 0."""
        if self.pad_token_id is not None:
            return self.pad_token_id
        return self.eos_ids[0] if self.eos_ids else 0

    def new_tokens(self, prompt_len: int) -> int:
        """Tokens to generate after a (padded) prompt of ``prompt_len``; raises when the
        prompt leaves no room or no length is set."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        if self.max_length is None:
            raise ValueError("generate: set max_new_tokens or max_length")
        if self.max_length <= prompt_len:
            raise ValueError(
                f"generate: max_length {self.max_length} leaves no room after the prompt "
                f"of {prompt_len} tokens; raise it or set max_new_tokens"
            )
        return self.max_length - prompt_len

    def replace(self, **changes: Any) -> GenerationConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], **overrides: Any) -> GenerationConfig:
        """From a ``generation_config.json`` dict (unknown HF fields are ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in config.items() if k in names and v is not None}
        return cls(**{**fields, **overrides})

    @classmethod
    def of_model(cls, model: eqx.Module) -> GenerationConfig:
        """The model's own defaults: a causal LM's ``generation_config`` (its
        ``generation_config.json``, read by ``from_pretrained``), else HF's defaults."""
        pairs = getattr(model, "generation_config", ())
        return cls.from_hf({k: json.loads(v) for k, v in pairs}) if pairs else cls()


class SpeculativeStats(eqx.Module):
    """Per-row counts of a speculative ``generate``: ``drafted`` tokens proposed and verified,
    ``accepted`` of them kept in the output, target forwards (``steps``) that verified them
    (the first token, from the prefill, is in none). Acceptance rate = ``accepted /
    drafted``; tokens per target forward = ``num_new / (steps + 1)``."""

    drafted: Int[Array, " rows"]
    accepted: Int[Array, " rows"]
    steps: Int[Array, " rows"]


class GenerateOutput(eqx.Module):
    """``sequences``: the prompt as given (left padding kept) followed by ``max_new_tokens``
    generated tokens, ``pad_id`` after a row's EOS (HF's layout, without HF's trimming of
    columns that every row left empty). ``num_new``: generated tokens per row, EOS included.
    ``scores``: beam search's final (length-penalised) beam scores, else ``None``. With
    beams, rows are ``batch * num_return_sequences``, best beam first. ``speculative``:
    a speculative ``generate``'s per-row draft counts, else ``None``.

    With ``generate(..., logprobs=k)``: ``logprobs`` ``(rows, max_new_tokens)``, each
    generated token's log-prob under the model (float32 log-softmax of its raw logits, before
    any processor), and ``top_ids`` / ``top_logprobs`` ``(rows, max_new_tokens, k)``, the
    ``k`` most likely tokens at each step, most likely first; 0 after a row's EOS. Else None."""

    sequences: Int[Array, "rows total"]
    num_new: Int[Array, " rows"]
    scores: Float[Array, " rows"] | None = None
    logprobs: Float[Array, "rows new"] | None = None
    top_logprobs: Float[Array, "rows new k"] | None = None
    top_ids: Int[Array, "rows new k"] | None = None
    speculative: SpeculativeStats | None = None

"""``EdlLM``: an edl causal LM as an lm-evaluation-harness model, registered as ``"edl"``.

    lm = EdlLM(pretrained="runs/demo")                     # a model directory, as edl generate
    lm = EdlLM(model=model, tokenizer=tokenizer)           # a model in memory (no copy)
    lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"])

Requests are tokenized as lm-eval's own ``hf`` backend tokenizes them (``TemplateLM``'s
context / continuation split, the same BOS rules, truncation from the left to
``max_length``, ``loglikelihood_rolling``'s disjoint windows of ``max_length`` tokens), so on
the same model and task the scores are ``hf``'s. Log-likelihoods come from one compiled
teacher-forced forward per batch (``edl.eval.scoring``), ``generate_until`` from
``edl.generate.generate_stream`` (greedy unless the task samples), ended once every row of a
batch has hit EOS or a stop string, each text cut at its first stop string.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
    resolve_max_length,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from edl.eval.scoring import Request, score_requests
from edl.generate import GenerationConfig, generate_stream
from edl.generate.steps import CausalLM

__all__ = ["DEFAULT_MAX_LENGTH", "EdlLM"]

DEFAULT_MAX_LENGTH = 2048
"""lm-eval's default when neither the config nor the tokenizer gives a length (``hf``'s)."""

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""The generation settings a task's ``generation_kwargs`` may give besides ``do_sample``,
``until`` and ``max_gen_toks`` (``edl.generate.GenerationConfig`` fields)."""


def _batch_size(value: int | str) -> int:
    """lm-eval passes ``--batch_size`` as given (``"8"``, 8); edl needs a number."""
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"edl: batch_size must be a positive integer, got {value!r} (no 'auto': edl pads "
            "every batch to this many rows, so one size compiles once per width)"
        ) from None
    if size < 1:
        raise ValueError(f"edl: batch_size must be >= 1, got {size}")
    return size


@register_model("edl")
class EdlLM(TemplateLM):
    """An edl model and its Hugging Face tokenizer for lm-eval.

    Args:
        pretrained: a run directory, checkpoint, saved model or hub repo id, loaded as
            ``edl generate --model`` loads it (with its tokenizer files); or None with
            ``model`` and ``tokenizer``.
        model, tokenizer: a causal LM in memory and an ``edl.text.HFTokenizer`` (or a
            transformers tokenizer). The model is used as is: ``set_model`` swaps it.
        batch_size: rows per compiled call (the last batch is padded to it).
        max_length: tokens the model sees at most (default: the config's
            ``max_position_embeddings``, else the tokenizer's, else 2048, as ``hf``).
        dtype: ``"float32"`` / ``"bfloat16"`` to cast a loaded model (``"auto"`` / None:
            as stored).
        max_gen_toks: ``generate_until``'s default of new tokens (256, as ``hf``).
        add_bos_token, prefix_token_id: as ``hf``'s arguments of those names.
        seed: the PRNG seed of sampled generations.
        device, max_batch_size: accepted for lm-eval's CLI, which always passes them; jax
            places the model on its default device.
    """

    def __init__(
        self,
        pretrained: str | None = None,
        *,
        model: CausalLM | None = None,
        tokenizer: Any = None,
        batch_size: int | str = 8,
        max_length: int | None = None,
        dtype: str | None = None,
        max_gen_toks: int = 256,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        seed: int = 1234,
        device: str | None = None,
        max_batch_size: int | None = None,
    ) -> None:
        super().__init__()
        del device, max_batch_size  # lm-eval's CLI passes them to every backend
        if (pretrained is None) == (model is None):
            raise ValueError("edl: give pretrained=DIR, or model= and tokenizer=, not both")
        if pretrained is not None:
            from edl.cli.generate import load_model_and_tokenizer

            model, tokenizer = load_model_and_tokenizer(
                str(pretrained), dtype=None if dtype in (None, "auto") else dtype
            )
        self.tokenizer = getattr(tokenizer, "hf", tokenizer)  # edl's HFTokenizer wraps it
        if not hasattr(self.tokenizer, "eos_token_id"):
            raise ValueError(
                f"edl: lm-eval needs a Hugging Face tokenizer (tokenizer files beside the "
                f"model), got {type(tokenizer).__name__}"
            )
        self.model = model
        self.batch_size = _batch_size(batch_size)
        self._max_length = None if max_length is None else int(max_length)
        self._max_gen_toks = int(max_gen_toks)
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self.pretrained = pretrained
        self._key = jax.random.key(int(seed))

    def set_model(self, model: CausalLM | None) -> None:
        """Score ``model`` from now on (same structure: the compiled programs are reused);
        None drops the reference (``LMEval`` does, between evaluations)."""
        self.model = model

    # -- tokenization, as lm-eval's hf backend -------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        if self._max_length:
            return self._max_length
        return resolve_max_length(self.model.config, self.tokenizer, default=DEFAULT_MAX_LENGTH)

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs: Any
    ) -> list[int]:
        """``hf``'s encoding: the tokenizer's special tokens unless told, or the string
        already starts with the prefix token."""
        special: dict[str, bool] = {}
        if add_special_tokens is not None:
            special["add_special_tokens"] = add_special_tokens
        elif self.add_bos_token is not None:
            special["add_special_tokens"] = self.add_bos_token
        if add_special_tokens is None and has_bos_prefix(
            string, self.tokenizer.decode(self.prefix_token_id)
        ):
            special["add_special_tokens"] = False
        return self.tokenizer.encode(string, **special)

    def _prompt_encode(self, string: str) -> list[int]:
        """A ``generate_until`` context as ``hf``'s ``tok_batch_encode`` encodes it."""
        if has_bos_prefix(string, getattr(self.tokenizer, "bos_token", None)):
            return self.tokenizer.encode(string, add_special_tokens=False)
        if self.add_bos_token is not None:
            return self.tokenizer.encode(string, add_special_tokens=self.add_bos_token)
        return self.tokenizer.encode(string)

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    # -- log-likelihoods ------------------------------------------------------------------

    def _request(self, context: Sequence[int], continuation: Sequence[int]) -> Request:
        """``hf``'s input window: the last ``max_length + 1`` tokens of context +
        continuation (the last one only a target)."""
        if not context or not continuation:
            raise ValueError("edl: a loglikelihood request needs context and continuation tokens")
        if len(continuation) > self.max_length:
            raise ValueError(
                f"edl: a continuation of {len(continuation)} tokens exceeds max_length "
                f"{self.max_length}"
            )
        tokens = (list(context) + list(continuation))[-(self.max_length + 1) :]
        return Request(tuple(tokens), len(continuation))

    def _loglikelihood_tokens(
        self,
        requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
        disable_tqdm: bool = False,
        **kwargs: Any,
    ) -> list[tuple[float, bool]]:
        scored = score_requests(
            self.model,
            [self._request(context, cont) for _, context, cont in requests],
            batch_size=self.batch_size,
            max_length=self.max_length,
        )
        answers = [(s.logprob, s.is_greedy) for s in scored]
        for (key, _, _), answer in zip(requests, answers, strict=True):
            if key is not None:  # rolling windows are cached per document instead
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return answers

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood over ``hf``'s disjoint windows of ``max_length``
        tokens (the first conditioned on the prefix token), all windows batched together."""
        windows, owners = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            rolling = get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for context, continuation in map(make_disjoint_window, rolling):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows), strict=True):
            totals[owner] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # -- generation -----------------------------------------------------------------------

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Each request's continuation, cut at its first stop string (``until`` and the
        tokenizer's EOS), generated in batches of requests with the same settings."""
        groups: dict[str, list[int]] = {}
        for index, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(
                index
            )
        out: list[str | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="edl generate_until")
        for indices in groups.values():
            gen_kwargs = requests[indices[0]].args[1]
            contexts = [requests[i].args[0] for i in indices]
            for i, text in zip(indices, self._generate_group(contexts, gen_kwargs), strict=True):
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(1)
        bar.close()
        return out  # type: ignore[return-value]

    def _settings(self, gen_kwargs: Mapping[str, Any]) -> tuple[list[str], int, dict[str, Any]]:
        """``(stop strings, max new tokens, edl.generate overrides)`` of a task's
        ``generation_kwargs``; a setting edl cannot honour is refused by name."""
        kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
        eos = self.tokenizer.decode(self.eot_token_id, skip_special_tokens=False)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        max_new = int(kwargs.pop("max_gen_toks"))
        do_sample = bool(kwargs.pop("do_sample", False))
        unknown = sorted(k for k in kwargs if k not in SAMPLING_KEYS)
        if unknown:
            raise ValueError(
                f"edl: generation_kwargs {unknown} are not supported (known: do_sample, until, "
                f"max_gen_toks, {', '.join(SAMPLING_KEYS)})"
            )
        if not do_sample:
            return until, max_new, {"do_sample": False}
        return until, max_new, {"do_sample": True, **kwargs}

    def _generate_group(self, contexts: list[str], gen_kwargs: Mapping[str, Any]) -> list[str]:
        """Continuations of ``contexts`` (one setting), longest prompts first, each batch
        left-padded (and filled to ``batch_size`` rows) as ``generate`` takes it."""
        until, max_new, overrides = self._settings(gen_kwargs)
        room = self.max_length - max_new
        if room <= 0:
            raise ValueError(
                f"edl: max_gen_toks {max_new} leaves no room for a prompt in max_length "
                f"{self.max_length}"
            )
        encoded = [self._prompt_encode(c)[-room:] for c in contexts]
        order = sorted(range(len(contexts)), key=lambda i: -len(encoded[i]))
        texts: list[str] = [""] * len(contexts)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        for start in range(0, len(order), self.batch_size):
            rows = order[start : start + self.batch_size]
            prompts = [encoded[i] for i in rows]
            prompts += [prompts[-1]] * (self.batch_size - len(rows))  # one compiled size
            width = max(len(p) for p in prompts)
            ids = np.full((len(prompts), width), pad, np.int32)
            mask = np.zeros((len(prompts), width), np.int32)
            for row, p in enumerate(prompts):
                ids[row, width - len(p) :], mask[row, width - len(p) :] = p, 1
            for i, text in zip(
                rows,
                self._generate_batch(ids, mask, len(rows), until, max_new, overrides),
                strict=True,
            ):
                texts[i] = text
        return texts

    def _generate_batch(
        self,
        ids: np.ndarray,
        mask: np.ndarray,
        n_rows: int,
        until: list[str],
        max_new: int,
        overrides: Mapping[str, Any],
    ) -> list[str]:
        """The texts of the first ``n_rows`` rows of a left-padded batch ``(rows, width)``,
        each cut at its first stop string. Generation (``edl.generate.generate_stream``:
        ``generate``'s tokens, step by step) ends as soon as every row has hit an EOS or a
        stop string, not after ``max_new`` tokens: a task's answers are usually short."""
        self._key, key = jax.random.split(self._key)
        eos = set(GenerationConfig.of_model(self.model).replace(**overrides).eos_ids)
        stops = [s for s in until if s]
        new: list[list[int]] = [[] for _ in range(n_rows)]
        done = [False] * n_rows
        stream = generate_stream(
            self.model, ids, attention_mask=mask, max_new_tokens=max_new, key=key, **overrides
        )
        for tokens in stream:
            for row in range(n_rows):
                if done[row]:
                    continue
                token = int(tokens[row])
                new[row].append(token)
                text = self.tokenizer.decode(new[row], skip_special_tokens=True)
                done[row] = token in eos or any(s in text for s in stops)
            if all(done):
                stream.close()
                break
        texts = [self.tokenizer.decode(t, skip_special_tokens=True) for t in new]
        return [postprocess_generated_text(t, until, None) for t in texts]

"""Task heads on the decoder trunk: causal LM (tied or untied head, Gemma 2's final
soft-capping, the MoE router losses) and sequence classification (HF's last-non-pad
pooling), plus ``configure``, which re-runs any edl model's weights under changed run
options (never under a changed architecture).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, PRNGKeyArray

from edl.models.config import RUN_OPTIONS, DecoderConfig
from edl.models.decoder import (
    PARTITION_RULES,
    CausalLMOutput,
    DecoderModel,
    Hidden,
    Ids,
    Mask,
    Positions,
    SequenceClassifierOutput,
)
from edl.module import require_float_dtype
from edl.nn.attention import KVCacheLike
from edl.nn.layers import Linear
from edl.ops.checks import check_ids
from edl.ops.losses import (
    causal_lm_loss,
    mask_without_context,
    sequence_classification_loss,
)
from edl.ops.moe import RouterStats, load_balancing_loss, router_z_loss
from edl.ops.sharding import Rules

T = TypeVar("T")

__all__ = [
    "DecoderForCausalLM",
    "DecoderForSequenceClassification",
    "configure",
    "router_losses",
]


def _softcap(logits: jax.Array, cap: float | None) -> jax.Array:
    return logits if cap is None else cap * jnp.tanh(logits / cap)


class DecoderForCausalLM(eqx.Module):
    """Decoder + LM head; ``lm_head`` is ``None`` when tied to ``model.embed_tokens``.

    ``generation_config``: the model's ``generation_config.json`` as sorted (key, JSON)
    pairs (empty: none), static. ``edl.generate.generate`` decodes with it by default (EOS
    ids, sampling defaults), and ``save_pretrained`` writes it back.
    """

    model: DecoderModel
    lm_head: Linear | None
    generation_config: tuple[tuple[str, str], ...] = eqx.field(static=True, default=())

    trunk: ClassVar[type[DecoderModel]] = DecoderModel
    partition_rules: ClassVar[Rules] = PARTITION_RULES

    @classmethod
    def init(
        cls, config: DecoderConfig, *, key: PRNGKeyArray, dtype: DTypeLike = jnp.float32
    ) -> DecoderForCausalLM:
        """Random weights as HF initialises them; ``dtype`` must be a floating dtype."""
        dtype = require_float_dtype(dtype, f"{cls.__name__}.init: dtype")
        k_model, k_head = jax.random.split(key)
        head = None
        if not config.tie_word_embeddings:
            head = Linear.init(
                config.hidden_size,
                config.vocab_size,
                std=config.initializer_range,
                dtype=dtype,
                key=k_head,
            )
        return cls(cls.trunk.init(config, key=k_model, dtype=dtype), head)

    @property
    def config(self) -> DecoderConfig:
        return self.model.config

    @property
    def head_weight(self) -> Float[Array, "vocab dim"]:
        """The output projection ``(vocab, dim)``: ``lm_head.weight`` or the tied embedding."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def __call__(
        self,
        input_ids: Ids | None = None,
        *,
        inputs_embeds: Hidden | None = None,
        attention_mask: Mask | None = None,
        position_ids: Positions | None = None,
        segment_ids: Ids | None = None,
        output_hidden_states: bool = False,
        cache: KVCacheLike | None = None,
    ) -> CausalLMOutput:
        """Logits ``(batch, seq, vocab)`` in the activation dtype; inputs as the trunk's
        (with a ``cache``, the updated cache is returned too)."""
        out = self.model(
            input_ids,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            segment_ids=segment_ids,
            output_hidden_states=output_hidden_states,
            cache=cache,
        )
        return CausalLMOutput(
            self.lm_logits(out.last_hidden_state), out.hidden_states, out.cache, out.router_stats
        )

    def unstacked(self) -> DecoderForCausalLM:
        """The same model with its layer stacks split into tuples of layers (run unrolled,
        weights sliced once): see ``DecoderModel.unstacked``."""
        return dataclasses.replace(self, model=self.model.unstacked())

    def lm_logits(self, h: Float[Array, "*batch dim"]) -> Float[Array, "*batch vocab"]:
        """The LM head on final hidden states (generation applies it to last tokens only),
        soft-capped where the family caps (Gemma 2)."""
        logits = self.model.embed_tokens.attend(h) if self.lm_head is None else self.lm_head(h)
        return _softcap(logits, self.config.final_softcap)

    def compute_loss(
        self,
        input_ids: Ids | None = None,
        labels: Ids | None = None,
        *,
        inputs_embeds: Hidden | None = None,
        attention_mask: Mask | None = None,
        position_ids: Positions | None = None,
        segment_ids: Ids | None = None,
        chunk_size: int | None = None,
    ) -> tuple[Float[Array, ""], dict[str, Array]]:
        """Next-token cross entropy (HF semantics), without ever forming full logits.

        The inputs are ``input_ids`` or ``inputs_embeds`` ``(batch, seq, dim)`` (exactly
        one; with embeddings, ``labels`` are required). ``labels`` default to
        ``input_ids``; given ones must be -100 or in
        ``[0, vocab_size)`` (else ``ValueError``, see ``DecoderModel.embed``). Not predicted:
        ``-100`` labels, padded tokens, the token after a padded one (its context is
        padding), and (with ``segment_ids``) the first token of each packed segment. MoE
        models also report the router's ``aux_loss`` (load balancing) and ``z_loss``; as in
        transformers, the auxiliary loss times ``router_aux_loss_coef`` is added to the loss
        when ``output_router_logits`` is set, and the z-loss times ``router_z_loss_coef``
        whenever that is non-zero. ``chunk_size``: tokens per LM-head chunk
        (``edl.ops.losses.causal_lm_loss``; None: 2048, 1024 for a 16-bit model).
        Returns ``(loss, {"loss", "accuracy", "count"[, "aux_loss", "z_loss"]})``.
        """
        c = self.config
        if labels is None:
            if input_ids is None:
                raise ValueError("compute_loss: with inputs_embeds, pass labels (batch, seq)")
            labels = input_ids  # checked as input_ids
        elif c.run.check_inputs:
            labels = check_ids(labels, c.vocab_size, name="labels", ignore=-100)
        labels = mask_without_context(
            labels, attention_mask=attention_mask, segment_ids=segment_ids
        )
        out = self.model(
            input_ids,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            segment_ids=segment_ids,
        )
        loss, metrics = causal_lm_loss(
            out.last_hidden_state,
            self.head_weight,
            labels,
            attention_mask=attention_mask,
            chunk_size=chunk_size,
            softcap=c.final_softcap,
        )
        if out.router_stats is not None:
            added, router_metrics = router_losses(c, out.router_stats)
            loss = loss + added
            metrics = {**metrics, "loss": loss, **router_metrics}
        return loss, metrics


def router_losses(
    config: DecoderConfig, stats: RouterStats
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """What a MoE model's routing adds to a training loss, and its metrics: as in
    transformers, ``router_aux_loss_coef`` times the load-balancing loss when
    ``output_router_logits`` is set, plus ``router_z_loss_coef`` times the z-loss whenever
    that is non-zero. Metrics ``aux_loss`` and ``z_loss`` (unscaled). ``compute_loss`` and
    the post-training steps (``edl.train.preference_step``, ``edl.train.kto``) add it."""
    aux, z = load_balancing_loss(stats), router_z_loss(stats)
    added = jnp.zeros((), aux.dtype)
    if config.output_router_logits:
        added = added + config.router_aux_loss_coef * aux
    if config.router_z_loss_coef:
        added = added + config.router_z_loss_coef * z
    return added, {"aux_loss": aux, "z_loss": z}


class DecoderForSequenceClassification(eqx.Module):
    """Decoder + ``score`` head read at each row's last non-pad token (HF semantics)."""

    model: DecoderModel
    score: Linear

    trunk: ClassVar[type[DecoderModel]] = DecoderModel
    partition_rules: ClassVar[Rules] = PARTITION_RULES

    @classmethod
    def init(
        cls, config: DecoderConfig, *, key: PRNGKeyArray, dtype: DTypeLike = jnp.float32
    ) -> DecoderForSequenceClassification:
        """Random weights as HF initialises them; ``dtype`` must be a floating dtype."""
        dtype = require_float_dtype(dtype, f"{cls.__name__}.init: dtype")
        k_model, k_head = jax.random.split(key)
        score = Linear.init(
            config.hidden_size,
            config.num_labels,
            std=config.initializer_range,
            dtype=dtype,
            key=k_head,
        )
        return cls(cls.trunk.init(config, key=k_model, dtype=dtype), score)

    @property
    def config(self) -> DecoderConfig:
        return self.model.config

    def __call__(
        self,
        input_ids: Ids | None = None,
        *,
        inputs_embeds: Hidden | None = None,
        attention_mask: Mask | None = None,
        position_ids: Positions | None = None,
        segment_ids: Ids | None = None,
        output_hidden_states: bool = False,
    ) -> SequenceClassifierOutput:
        """Logits ``(batch, num_labels)`` at the last non-pad token of each row.

        That token is found as HF does: the last position whose id differs from
        ``config.pad_token_id``; without a pad id (or with ``inputs_embeds``) the last
        position with ``attention_mask`` 1, else the last position.
        """
        out = self.model(
            input_ids,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            segment_ids=segment_ids,
            output_hidden_states=output_hidden_states,
        )
        h = out.last_hidden_state
        batch, seq = h.shape[:2]
        if input_ids is not None and self.config.pad_token_id is not None:
            real = input_ids != self.config.pad_token_id
        elif attention_mask is not None:
            real = attention_mask.astype(jnp.bool_)
        else:
            real = jnp.ones((batch, seq), jnp.bool_)
        positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32)[None], (batch, seq))
        last = jnp.max(jnp.where(real, positions, 0), axis=1)
        pooled = jnp.take_along_axis(h, last.reshape(batch, 1, 1), axis=1)[:, 0]
        return SequenceClassifierOutput(self.score(pooled), out.hidden_states)

    def compute_loss(
        self,
        input_ids: Ids | None = None,
        labels: jax.Array | None = None,
        *,
        inputs_embeds: Hidden | None = None,
        attention_mask: Mask | None = None,
        position_ids: Positions | None = None,
    ) -> tuple[Float[Array, ""], dict[str, Array]]:
        """HF's sequence-classification loss (MSE / CE / BCE by ``config.problem_type``) on
        ``input_ids`` or ``inputs_embeds`` (pooled as ``__call__`` does). Single-label
        integer labels must be -100 or in ``[0, num_labels)`` (else ``ValueError``, also
        inside ``jax.jit``)."""
        if labels is None:
            raise ValueError("compute_loss: labels are required for sequence classification")
        c = self.config
        single = c.problem_type == "single_label_classification" or (
            c.problem_type is None and c.num_labels > 1
        )
        if c.run.check_inputs and single and jnp.issubdtype(labels.dtype, jnp.integer):
            labels = check_ids(labels, c.num_labels, name="labels", what="num_labels", ignore=-100)
        logits = self(
            input_ids,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
        ).logits
        return sequence_classification_loss(logits, labels, problem_type=self.config.problem_type)


M = TypeVar("M", bound=eqx.Module)
C = TypeVar("C")  # a config class


def configure(model: M, **changes: object) -> M:
    """The same weights under changed run options, e.g. ``configure(m, scan_layers=False)``
    or ``remat="full"`` or ``attention_impl="xla"`` or ``moe_impl="dense"``, or changed
    settings (``type(model.config).SETTINGS``: loss coefficients such as
    ``router_aux_loss_coef``, ``initializer_range``, ``hf_extra``).

    Any edl model: the decoders, CLIP / SigLIP (run options reach both towers) and LLaVA
    (both the vision tower and the language model). Every config in the model (a LLaVA
    model's own and its parts') is replaced consistently.

    The architecture does not change: a field that shapes the weights (``vocab_size``,
    ``num_attention_heads``, ``intermediate_size``, ...) or defines what they compute
    (``rope``, ``rms_norm_eps``, ``num_experts_per_tok``, ...) raises ``ValueError`` naming
    it, with the model's value and the requested one (:func:`reconfigure`).
    """
    old = model.config
    new = reconfigure(old, changes)
    return _with_configs(model, dict(_nested_configs(old, new)))


def _nested_configs(old: object, new: object) -> Iterator[tuple[object, object]]:
    """``(old, new)`` pairs: the configs and those nested in them (``text_config``, ...)."""
    yield old, new
    for f in dataclasses.fields(old):
        if hasattr(getattr(old, f.name), "SETTINGS"):
            yield from _nested_configs(getattr(old, f.name), getattr(new, f.name))


def _holds_config(node: object) -> bool:
    return isinstance(node, eqx.Module) and any(
        f.name == "config" for f in dataclasses.fields(node)
    )


def _with_configs(tree: T, new: dict[object, object]) -> T:
    """``tree`` with the ``config`` of each module holding one looked up in ``new``."""

    def swap(node: object) -> object:
        if not _holds_config(node):
            return node
        if node.config not in new:
            raise ValueError(
                f"configure: the model holds a {type(node).__name__} whose config is "
                f"neither the model's nor one nested in it: {node.config!r:.200}"
            )
        # A copy with the fields set, as Equinox's unflatten builds a module: ``__init__``
        # would re-check each field, and the arrays of an abstract model (from
        # ``eqx.filter_eval_shape``) are shapes only.
        out = copy.copy(node)
        object.__setattr__(out, "config", new[node.config])
        for f in dataclasses.fields(node):
            if f.name != "config" and not f.metadata.get("static", False):
                object.__setattr__(out, f.name, _with_configs(getattr(node, f.name), new))
        return out

    return jax.tree.map(swap, tree, is_leaf=_holds_config)


def reconfigure(config: C, changes: Mapping[str, object]) -> C:
    """``config.replace(**changes)`` for a model already built from ``config``: run options
    (``RUN_OPTIONS``, by name) and the fields in ``type(config).SETTINGS`` may change, and
    nested configs (``text_config=...``) as far as their own ``SETTINGS`` allow.

    Any other field shapes the weights (``vocab_size``, ``num_attention_heads``, ...) or
    defines what they compute (``rope``, ``rms_norm_eps``, ``num_experts_per_tok``, ...), so a
    change raises ``ValueError`` naming each such field with its current and requested value
    (as does a field ``config`` lacks). Asking for a field's current value is no change.
    """
    names = {f.name for f in dataclasses.fields(config)}
    unknown = sorted(set(changes) - names - RUN_OPTIONS)
    if unknown:
        raise ValueError(
            f"configure: {type(config).__name__} has no field or run option {unknown}; "
            f"{_changeable(config)}"
        )
    # The requested fields first, so that an invalid request is refused as a change too...
    changed = _architecture_changes(config, {k: v for k, v in changes.items() if k in names})
    new = None
    if not changed:
        new = config.replace(**changes)
        # ... then every field read, derived ones included.
        changed = _architecture_changes(config, _values(new))
    if changed:
        raise ValueError(
            f"configure: refused {', '.join(changed)}: {type(config).__name__} fields that shape "
            f"the weights or define what they compute; {_changeable(config)}. For another "
            "architecture, build a new config and model"
        )
    return new


def _values(config: object) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def _architecture_changes(config: object, values: Mapping[str, Any], prefix: str = "") -> list[str]:
    """``"path (model: current, requested: new)"`` for each field of ``values`` outside
    ``SETTINGS`` that differs from ``config``'s, looking into nested configs."""
    out = []
    for name, new in values.items():
        old = getattr(config, name)
        if name in type(config).SETTINGS or new == old:
            continue
        if hasattr(old, "SETTINGS") and type(new) is type(old):
            out += _architecture_changes(old, _values(new), f"{prefix}{name}.")
        else:
            out.append(f"{prefix}{name} (model: {old!r}, requested: {new!r})")
    return out


def _changeable(config: object) -> str:
    settings = sorted(type(config).SETTINGS - {"run"})
    return (
        f"a built model changes only its run options {sorted(RUN_OPTIONS)} and its "
        f"settings {settings}"
    )

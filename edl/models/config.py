"""``DecoderConfig``: the architecture of a decoder-only transformer, shared by every family.

Each family (``LlamaConfig``, ``GemmaConfig``, ``MixtralConfig``, ...) is a frozen subclass
that sets its own defaults (those of the matching transformers config class) and reads and
writes its HF ``config.json`` (``from_hf`` / ``to_hf``). The fields are the union of the
families' features, named after HF where HF has a name; one decoder implementation
(``edl.models.decoder``) runs them all. Run-time choices (``scan_layers``, ``remat``,
``attention_impl``, ``moe_impl``, ``moe_capacity_factor``, ``check_inputs``) are not HF
fields and are never written to ``config.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

from edl.nn.stack import remat_policy
from edl.ops.activations import activation
from edl.ops.attention import IMPLS as ATTENTION_IMPLS
from edl.ops.moe import MOE_IMPLS
from edl.ops.rope import RopeConfig

__all__ = ["DecoderConfig", "flops_per_token"]

PROBLEM_TYPES = (None, "regression", "single_label_classification", "multi_label_classification")
MLP_KINDS = ("dense", "moe")

# Plausibility bounds on sizes and counts, far above every released model (the largest
# have vocabularies of ~262k tokens, hidden sizes up to ~25k, MLPs up to ~74k wide, 126
# layers, 128 heads, head_dim 256, 512 experts and ~10M positions), so that only a mistaken
# or hostile config fails them, in microseconds (a config.json with a million layers took
# 81 s and 1.3 GB to fail).
INT_BOUNDS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 2**24),
    "hidden_size": (1, 2**18),
    "intermediate_size": (1, 2**20),
    "num_hidden_layers": (1, 2**12),
    "num_attention_heads": (1, 2**12),
    "num_key_value_heads": (1, 2**12),
    "head_dim": (1, 2**12),
    "max_position_embeddings": (1, 2**30),
    "sliding_window": (1, 2**30),
    "num_experts": (0, 2**14),
    "num_experts_per_tok": (1, 2**14),
    "moe_intermediate_size": (1, 2**20),
    "num_labels": (1, 2**24),
}
_TYPE_NAMES = {int: "int", float: "float", bool: "bool", str: "str"}

# HF keys every family's ``from_hf`` interprets (families add their own).
COMMON_HF_KEYS = frozenset({
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "max_position_embeddings", "initializer_range", "rms_norm_eps", "tie_word_embeddings",
    "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "num_labels",
    "pad_token_id", "problem_type", "architectures", "attention_dropout", "pretraining_tp",
    "dtype", "torch_dtype",  # describe the stored weights; save_pretrained rewrites them
})  # fmt: skip


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Architecture of a decoder (field names as in HF's ``config.json`` where HF has one).

    ``None`` for ``num_key_value_heads`` / ``head_dim`` / ``rope`` means the HF default
    (``num_attention_heads``, ``hidden_size // num_attention_heads``, default RoPE with theta
    10000). ``layer_windows`` gives each layer's sliding window (``None``: full attention);
    ``sliding_window`` alone applies one window to every layer. ``layer_mlps`` says which
    layers are ``"moe"`` (``num_experts`` experts, ``num_experts_per_tok`` per token) and
    which ``"dense"`` (default: every layer MoE when ``num_experts > 0``).
    """

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ()
    ROPE_THETA: ClassVar[float] = 10000.0  # the family's default RoPE base

    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope: RopeConfig | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm of each q / k head before RoPE
    sliding_window: int | None = None
    layer_windows: tuple[int | None, ...] | None = None
    # The Gemma line.
    norm_offset: float = 0.0  # RMSNorm scales by (offset + weight): Gemma's 1 + w
    embed_scale: bool = False  # token embeddings times sqrt(hidden_size)
    sandwich_norms: bool = False  # Gemma 2: norms after attention / MLP as well as before
    attn_softcap: float | None = None  # softcap * tanh(logits / softcap) on attention logits
    final_softcap: float | None = None  # ... and on the LM head's logits
    attn_scale: float | None = None  # attention logit scale; None: head_dim ** -0.5
    # Mixture of experts.
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None  # None: intermediate_size
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    layer_mlps: tuple[str, ...] | None = None
    router_aux_loss_coef: float = 0.001
    router_z_loss_coef: float = 0.0
    output_router_logits: bool = False  # HF's switch: add the auxiliary loss to the LM loss
    # Task heads.
    num_labels: int = 2
    problem_type: str | None = None
    pad_token_id: int | None = None
    # Run-time choices, not HF fields.
    scan_layers: bool = True
    remat: str = "none"
    attention_impl: str = "auto"
    moe_impl: str = "blocked"
    moe_capacity_factor: float | None = None
    # Token ids (and labels) outside the vocabulary raise, eagerly and in compiled programs
    # (``edl.ops.checks.check_ids``; ``benchmarks/input_checks.py`` measures the cost).
    check_inputs: bool = True
    # HF keys edl does not interpret, as sorted (key, JSON) pairs: written back by to_hf.
    hf_extra: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)
        self._check_scalar_fields()
        if self.MODEL_TYPES and self.model_type not in self.MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; {type(self).__name__} covers "
                f"{self.MODEL_TYPES}"
            )
        if self.num_key_value_heads is None:
            set_("num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                    f"{self.num_attention_heads}; set head_dim"
                )
            set_("head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.rope is None:
            set_("rope", RopeConfig(dim=self.head_dim, theta=self.ROPE_THETA))
        if self.layer_windows is None:
            set_("layer_windows", self._default_layer_windows())
        set_("layer_windows", tuple(self.layer_windows))
        self._check_per_layer("layer_windows", self.layer_windows)
        if any(w is not None and w <= 0 for w in self.layer_windows):
            raise ValueError(f"sliding windows must be positive, got {self.layer_windows}")
        if self.layer_mlps is None:
            kind = "moe" if self.num_experts > 0 else "dense"
            set_("layer_mlps", (kind,) * self.num_hidden_layers)
        set_("layer_mlps", tuple(self.layer_mlps))
        self._check_per_layer("layer_mlps", self.layer_mlps)
        if set(self.layer_mlps) - set(MLP_KINDS):
            raise ValueError(f"layer_mlps entries must be {MLP_KINDS}, got {self.layer_mlps}")
        if "moe" in self.layer_mlps and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"MoE layers need 1 <= num_experts_per_tok ({self.num_experts_per_tok}) <= "
                f"num_experts ({self.num_experts})"
            )
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl must be one of {MOE_IMPLS}, got {self.moe_impl!r}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(
                f"attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}"
            )
        activation(self.hidden_act)
        remat_policy(self.remat)
        if self.problem_type not in PROBLEM_TYPES:
            raise ValueError(f"unknown problem_type {self.problem_type!r}")

    def _check_scalar_fields(self) -> None:
        """Each int / float / bool / str field's type and range, before any is used."""
        for field in dataclasses.fields(self):
            # Annotations are strings here ("int | None"); a subclass may hold real types.
            kind = field.type if isinstance(field.type, str) else str(field.type)
            kind = _TYPE_NAMES.get(field.type, kind)
            value, optional = getattr(self, field.name), kind.endswith(" | None")
            if optional and value is None:
                continue
            kind = kind.removesuffix(" | None")
            if kind == "int":
                check_int(field.name, value, *INT_BOUNDS.get(field.name, (None, None)))
            elif kind == "float":
                check_number(field.name, value, FLOAT_SIGNS.get(field.name))
            elif kind == "bool" and not isinstance(value, bool):
                raise ValueError(f"{field.name} must be true or false, got {value!r}")
            elif kind == "str" and not isinstance(value, str):
                raise ValueError(f"{field.name} must be a string, got {value!r}")

    def _default_layer_windows(self) -> tuple[int | None, ...]:
        return (self.sliding_window,) * self.num_hidden_layers

    def _check_per_layer(self, name: str, values: tuple) -> None:
        if len(values) != self.num_hidden_layers:
            raise ValueError(
                f"{name} has {len(values)} entries for {self.num_hidden_layers} layers"
            )

    # -- derived --------------------------------------------------------------------------

    @property
    def expert_intermediate_size(self) -> int:
        """Each expert's MLP width."""
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def layer_groups(self) -> tuple[str, ...]:
        """The stack (``DecoderModel`` field) holding each layer: ``"layers"``, or for dense
        layers among MoE ones, ``"dense_layers"``."""
        if len(set(self.layer_mlps)) <= 1:
            return ("layers",) * self.num_hidden_layers
        return tuple("layers" if m == "moe" else "dense_layers" for m in self.layer_mlps)

    def replace(self, **changes: Any) -> DecoderConfig:
        """A copy with ``changes`` (e.g. ``scan_layers=False``, ``remat="full"``).

        Fields that still hold their derived defaults (``head_dim``, the RoPE dim, uniform
        ``layer_windows`` / ``layer_mlps``) are derived again from the changed fields.
        """
        for name in ("hidden_size", "num_attention_heads"):  # derived from below
            if name in changes:
                check_int(name, changes[name], *INT_BOUNDS[name])
        hidden = changes.get("hidden_size", self.hidden_size)
        heads = changes.get("num_attention_heads", self.num_attention_heads)
        if "head_dim" not in changes:
            derived = self.head_dim == self.hidden_size // self.num_attention_heads
            changes["head_dim"] = hidden // heads if derived else self.head_dim
        head_dim = changes["head_dim"] or hidden // heads
        if "rope" not in changes and self.rope.dim == self.head_dim:
            changes["rope"] = dataclasses.replace(self.rope, dim=head_dim)
        if "layer_windows" not in changes:
            if self.layer_windows == self._default_layer_windows():
                changes["layer_windows"] = None
            elif len(set(self.layer_windows)) == 1:
                changes["layer_windows"] = None
                changes.setdefault("sliding_window", self.layer_windows[0])
        if "layer_mlps" not in changes and len(set(self.layer_mlps)) <= 1:
            changes["layer_mlps"] = None
        return dataclasses.replace(self, **changes)

    # -- Hugging Face config.json ---------------------------------------------------------

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], **overrides: Any) -> DecoderConfig:
        """Read a HF ``config.json`` dict; ``overrides`` set edl fields (e.g. ``remat``).
        Families implement it; unsupported options raise ``ValueError``."""
        raise NotImplementedError(f"{cls.__name__} does not read HF configs")

    def to_hf(self, architectures: list[str] | None = None) -> dict[str, Any]:
        """A HF ``config.json`` dict that transformers loads as the same model."""
        raise NotImplementedError(f"{type(self).__name__} does not write HF configs")

    @classmethod
    def _default(cls, name: str) -> Any:
        return cls.__dataclass_fields__[name].default

    @classmethod
    def _check_model_type(cls, c: Mapping[str, Any]) -> str:
        model_type = c.get("model_type")
        if model_type not in cls.MODEL_TYPES:
            raise ValueError(
                f"config.json: unsupported model_type {model_type!r}; {cls.__name__} covers "
                f"{cls.MODEL_TYPES}"
            )
        return model_type

    @classmethod
    def _common_from_hf(cls, c: Mapping[str, Any], hidden_act: str | None = None) -> dict:
        """The fields every family reads the same way (HF defaults: ``cls``'s defaults)."""
        check_hf_values(c)
        d = cls._default
        heads = c.get("num_attention_heads", d("num_attention_heads"))
        hidden = c.get("hidden_size", d("hidden_size"))
        head_dim = c.get("head_dim") or d("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise ValueError(
                    f"config.json: hidden_size {hidden} is not divisible by "
                    f"num_attention_heads {heads}, and no head_dim is given"
                )
            head_dim = hidden // heads
        if c.get("attention_dropout", 0.0):
            warnings.warn(
                f"config.json: attention_dropout={c['attention_dropout']} is ignored (edl "
                "applies no dropout); inference is unaffected",
                stacklevel=3,
            )
        if c.get("pretraining_tp", 1) not in (1, None):
            # Sliced matmuls that sum to the same product: only rounding differs.
            warnings.warn("config.json: pretraining_tp > 1 is computed unsliced", stacklevel=3)
        return dict(
            model_type=c["model_type"],
            vocab_size=c.get("vocab_size", d("vocab_size")),
            hidden_size=hidden,
            intermediate_size=c.get("intermediate_size", d("intermediate_size")),
            num_hidden_layers=c.get("num_hidden_layers", d("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=c.get("num_key_value_heads") or d("num_key_value_heads") or heads,
            head_dim=head_dim,
            hidden_act=hidden_act or c.get("hidden_act", d("hidden_act")),
            max_position_embeddings=c.get("max_position_embeddings", d("max_position_embeddings")),
            initializer_range=c.get("initializer_range", d("initializer_range")),
            rms_norm_eps=c.get("rms_norm_eps", d("rms_norm_eps")),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", d("tie_word_embeddings"))),
            rope=RopeConfig.from_hf(c, head_dim, default_theta=cls.ROPE_THETA),
            num_labels=len(c["id2label"]) if c.get("id2label") else int(c.get("num_labels", 2)),
            problem_type=c.get("problem_type"),
            pad_token_id=c.get("pad_token_id", d("pad_token_id")),
        )

    @classmethod
    def _build(
        cls, c: Mapping[str, Any], fields: dict, read: Iterable[str], overrides: Mapping
    ) -> DecoderConfig:
        """``cls(**fields, **overrides)``, keeping the HF keys outside ``read`` in ``hf_extra``."""
        read = COMMON_HF_KEYS | set(read)
        extra = ((k, json.dumps(v)) for k, v in c.items() if k not in read)
        fields["hf_extra"] = tuple(sorted(extra))
        try:
            return cls(**{**fields, **overrides})
        except ValueError as e:
            source = (
                f"config.json with overrides {sorted(overrides)}" if overrides else "config.json"
            )
            raise ValueError(f"{source}: {e}") from e

    @classmethod
    def _router_from_hf(cls, c: Mapping[str, Any]) -> dict:
        """The MoE router's loss settings (``router_z_loss_coef`` is edl's, default 0)."""
        return dict(
            output_router_logits=bool(c.get("output_router_logits", False)),
            router_aux_loss_coef=c.get(
                "router_aux_loss_coef", cls._default("router_aux_loss_coef")
            ),
            router_z_loss_coef=c.get("router_z_loss_coef", 0.0),
        )

    def _router_to_hf(self) -> dict[str, Any]:
        out = dict(
            output_router_logits=self.output_router_logits,
            router_aux_loss_coef=self.router_aux_loss_coef,
        )
        if self.router_z_loss_coef:
            out["router_z_loss_coef"] = self.router_z_loss_coef
        return out

    def _common_to_hf(self, architectures: list[str] | None) -> dict[str, Any]:
        out: dict[str, Any] = {k: json.loads(v) for k, v in self.hf_extra}
        for labels in ("id2label", "label2id"):  # stale once num_labels was changed
            if labels in out and len(out[labels]) != self.num_labels:
                del out[labels]
        rope = self.rope
        rope_params: dict[str, Any] = {"rope_type": rope.rope_type, "rope_theta": rope.theta}
        if rope.rope_type != "default":
            rope_params["factor"] = rope.factor
        if rope.original_max_position_embeddings is not None:
            rope_params["original_max_position_embeddings"] = rope.original_max_position_embeddings
        if rope.rope_type == "llama3":
            rope_params["low_freq_factor"] = rope.low_freq_factor
            rope_params["high_freq_factor"] = rope.high_freq_factor
        if rope.dim != self.head_dim:
            rope_params["partial_rotary_factor"] = rope.dim / self.head_dim
        out.update(
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings,
            initializer_range=self.initializer_range,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            rope_theta=rope.theta,  # transformers 4 spelling ...
            rope_scaling=None if rope.rope_type == "default" else dict(rope_params),
            rope_parameters=rope_params,  # ... and transformers 5
            pad_token_id=self.pad_token_id,
            num_labels=self.num_labels,
        )
        if self.problem_type is not None:
            out["problem_type"] = self.problem_type
        if architectures is not None:
            out["architectures"] = list(architectures)
        return out

    GEMMA_FEATURES: ClassVar[tuple[str, ...]] = (
        "norm_offset", "embed_scale", "sandwich_norms", "attn_softcap", "final_softcap",
        "attn_scale",
    )  # fmt: skip

    def _require_defaults(self, names: tuple[str, ...]) -> None:
        """``to_hf``'s refusal of features (fields ``names``) the HF type lacks."""
        base = DecoderConfig.__dataclass_fields__
        changed = [n for n in names if getattr(self, n) != base[n].default]
        self._require(not changed, f"{changed} must keep edl's defaults")

    def _require(self, condition: bool, what: str) -> None:
        """``to_hf``'s refusal of settings the HF ``model_type`` cannot express."""
        if not condition:
            raise ValueError(f"this {type(self).__name__} has no HF {self.model_type!r} "
                             f"equivalent: {what}")  # fmt: skip


def check_int(name: str, value: Any, low: int | None = None, high: int | None = None) -> None:
    """``ValueError`` unless ``value`` is an int (not a bool) in ``[low, high]``."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if is_int and (low is None or value >= low) and (high is None or value <= high):
        return
    kind = {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"}
    what = kind.get(low, f"an integer >= {low}")
    if is_int and high is not None and value > high:
        what += f" of at most {high} (far beyond any real model)"
    raise ValueError(f"{name} must be {what}, got {value!r}")


def check_number(name: str, value: Any, sign: str | None = None) -> None:
    """``ValueError`` unless ``value`` is a finite int or float (not a bool), and
    ``"positive"`` / ``"non-negative"`` as ``sign`` asks."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok and sign == "positive":
        ok = value > 0
    elif ok and sign == "non-negative":
        ok = value >= 0
    if not ok:
        raise ValueError(
            f"{name} must be a {sign + ' ' if sign else 'finite '}number, got {value!r}"
        )


# Signs of the float fields (the others: any finite number).
FLOAT_SIGNS = {
    "rms_norm_eps": "positive", "attn_softcap": "positive", "final_softcap": "positive",
    "attn_scale": "positive", "moe_capacity_factor": "positive",
    "query_pre_attn_scalar": "positive", "initializer_range": "non-negative",
    "router_aux_loss_coef": "non-negative", "router_z_loss_coef": "non-negative",
}  # fmt: skip

# HF config.json keys (of every family) checked before a config is built: they size tuples
# and divide each other on the way. Ints: key -> (low, high, null allowed).
_HF_INTS = {
    **{k: (*INT_BOUNDS[k], False) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "max_position_embeddings", "num_labels", "num_experts",
        "num_experts_per_tok")},
    "num_local_experts": (*INT_BOUNDS["num_experts"], False),
    "num_key_value_heads": (*INT_BOUNDS["num_key_value_heads"], True),
    "head_dim": (*INT_BOUNDS["head_dim"], True),
    "moe_intermediate_size": (*INT_BOUNDS["moe_intermediate_size"], True),
    "sliding_window": (0, INT_BOUNDS["sliding_window"][1], True),
    "max_window_layers": (0, INT_BOUNDS["num_hidden_layers"][1], True),
    "decoder_sparse_step": (0, INT_BOUNDS["num_hidden_layers"][1], True),
    "pad_token_id": (None, None, True),
}  # fmt: skip
# Numbers: key -> (sign, null allowed).
_HF_NUMBERS = {
    "rms_norm_eps": ("positive", False), "initializer_range": ("non-negative", False),
    "rope_theta": ("positive", False), "attention_dropout": ("non-negative", False),
    "router_aux_loss_coef": ("non-negative", False),
    "router_z_loss_coef": ("non-negative", False),
    "router_jitter_noise": ("non-negative", False),
    "query_pre_attn_scalar": ("positive", False),
    "attn_logit_softcapping": ("positive", True), "final_logit_softcapping": ("positive", True),
}  # fmt: skip
_HF_BOOLS = (
    "tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window", "norm_topk_prob",
    "output_router_logits", "use_bidirectional_attention",
)  # fmt: skip
_HF_TYPES = {  # key -> (JSON type name, Python type); null is allowed
    "model_type": ("a string", str), "hidden_act": ("a string", str),
    "hidden_activation": ("a string", str), "problem_type": ("a string", str),
    "rope_scaling": ("an object", dict), "rope_parameters": ("an object", dict),
    "id2label": ("an object", dict), "layer_types": ("a list", list),
    "mlp_only_layers": ("a list", list), "architectures": ("a list", list),
}  # fmt: skip


def check_hf_values(c: Mapping[str, Any]) -> None:
    """Types and plausible ranges of the HF ``config.json`` values edl reads, before any is
    used: ``ValueError("config.json: num_attention_heads must be a positive integer, got
    0")``. Numbers as strings, bools for ints and a million layers all fail here."""
    try:
        for key, (low, high, nullable) in _HF_INTS.items():
            if key in c and not (nullable and c[key] is None):
                check_int(key, c[key], low, high)
        for key, (sign, nullable) in _HF_NUMBERS.items():
            if key in c and not (nullable and c[key] is None):
                check_number(key, c[key], sign)
        for key in _HF_BOOLS:
            if c.get(key) is not None and not isinstance(c[key], bool):
                raise ValueError(f"{key} must be true or false, got {c[key]!r}")
        for key, (name, kind) in _HF_TYPES.items():
            if c.get(key) is not None and not isinstance(c[key], kind):
                raise ValueError(f"{key} must be {name} or null, got {c[key]!r}")
    except ValueError as e:
        raise ValueError(f"config.json: {e}") from e


def flops_per_token(config: DecoderConfig, seq_len: int, *, training: bool = True) -> float:
    """Matmul FLOPs per token for sequences of ``seq_len`` tokens (EasyDeL's
    ``flops_per_token``).

    Counts every projection (``2 * in * out`` per token), the MoE router and only the
    ``num_experts_per_tok`` experts each token runs through, the LM head, and causal
    attention scores and values over the keys each query actually sees (sliding windows
    included), averaged over positions. Training is 3x the forward pass (backward = 2x
    forward). Elementwise work (norms, softmax, RoPE) is not counted.
    """
    c = config
    d, heads, kv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    attn_proj = d * heads * hd + 2 * d * kv * hd + heads * hd * d
    mlp = {
        "dense": 3 * d * c.intermediate_size,
        "moe": d * c.num_experts + c.num_experts_per_tok * 3 * d * c.expert_intermediate_size,
    }
    forward = 2.0 * (sum(attn_proj + mlp[m] for m in c.layer_mlps) + d * c.vocab_size)
    for window in c.layer_windows:
        w = seq_len if window is None else min(window, seq_len)
        # mean over positions t of min(t + 1, w) visible keys
        visible = (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len
        forward += 2 * 2 * heads * hd * visible  # q.k and p.v
    return 3.0 * forward if training else forward

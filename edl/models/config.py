"""``DecoderConfig``: the architecture of a decoder-only transformer, shared by every family;
``RunOptions``: how it runs.

Each family (``LlamaConfig``, ``GemmaConfig``, ``MixtralConfig``, ...) is a frozen subclass
that sets its own defaults (those of the matching transformers config class) and reads and
writes its HF ``config.json`` (``from_hf`` / ``to_hf``). The fields are the union of the
families' features, named after HF where HF has a name; one decoder implementation
(``edl.models.decoder``) runs them all.

The architecture (what ``config.json`` describes) and the run options (scan or unroll,
remat, attention and MoE implementation, the input check) are apart: ``config.run`` holds a
``RunOptions``, which is never written to ``config.json`` and never changes the function a
model computes, only its speed and memory (``moe_capacity_factor`` is the exception: it may
drop tokens, as capacity-based MoE does). ``replace`` and ``from_hf`` accept run options by
name (``config.replace(remat="full")``).

A model already built keeps its architecture: ``edl.models.configure`` changes the run
options and the few fields each config class lists in ``SETTINGS`` (neither the weights'
shapes nor the function the forward pass computes depend on them: loss coefficients,
init-only values, uninterpreted HF keys), and refuses every other field, naming it. Nested
configs (LLaVA's, CLIP's and SigLIP's ``text_config`` / ``vision_config``) are checked field
by field with their own ``SETTINGS``.

Sizes that HF derives when ``config.json`` omits them (``num_key_value_heads``,
``head_dim``, the RoPE settings, per-layer windows and MLP kinds) are *derived fields*
(``Derived``): the instance keeps what it was given (``None`` when nothing), and reading the
field derives the value from the others. So ``replace(hidden_size=...)`` re-derives exactly
the fields that were never set, and keeps an explicit ``head_dim`` even when it equals the
derived one. Equality and hashing compare the values read, so two configs describing the
same architecture are equal however they were spelled.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, TypeVar

from edl.models.flops import decoder_layer_flops
from edl.models.rope_config import rope_to_hf
from edl.models.validation import check_fields, check_hf_values
from edl.nn.stack import check_remat
from edl.ops.activations import activation
from edl.ops.attention import IMPLS as ATTENTION_IMPLS
from edl.ops.moe import MOE_IMPLS
from edl.ops.rope import RopeConfig

__all__ = ["DecoderConfig", "RunOptions"]

C = TypeVar("C")  # a config class

PROBLEM_TYPES = (None, "regression", "single_label_classification", "multi_label_classification")
MLP_KINDS = ("dense", "moe")

# HF keys every family's ``from_hf`` interprets (families add their own).
COMMON_HF_KEYS = frozenset(
    {
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "max_position_embeddings",
        "initializer_range",
        "rms_norm_eps",
        "tie_word_embeddings",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "partial_rotary_factor",
        "num_labels",
        "pad_token_id",
        "problem_type",
        "architectures",
        "attention_dropout",
        "pretraining_tp",
        "dtype",
        "torch_dtype",  # describe the stored weights; save_pretrained rewrites them
    }
)


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How a decoder runs: speed and memory, never the architecture or ``config.json``.

    Attributes:
        scan_layers: run each stack of identical layers as one ``lax.scan`` (one compiled
            layer) rather than unrolled.
        remat: what the backward pass recomputes (``edl.nn.stack.REMAT_POLICIES`` names;
            ``"auto"``: ``"dots"`` in programs lowered for CPU, ``"none"`` elsewhere).
        attention_impl: ``edl.ops.attention`` implementation (``"auto"``: per platform the
            program is lowered for, the native C++ kernel on CPU, Pallas on GPU and TPU).
        moe_impl: ``edl.ops.moe`` expert dispatch.
        moe_capacity_factor: tokens each expert takes, as a multiple of its even share
            (``None``: every token; a factor may drop tokens, changing the outputs).
        check_inputs: token ids (and labels) outside the vocabulary raise, eagerly and in
            compiled programs (``edl.ops.checks.check_ids``; its cost is measured in
            ``benchmarks/RESULTS.md``, "input checks").
        rope_length: the sequence length that length-dependent RoPE (``dynamic``,
            ``longrope``) reads: ``"batch"``, the batch's longest row (transformers' rule
            for a batch), or ``"row"``, each row's own (what each row would get alone; the
            serving engine's, whose rows are independent requests). Other RoPE types
            ignore it.
    """

    scan_layers: bool = True
    remat: str = "auto"
    attention_impl: str = "auto"
    moe_impl: str = "blocked"
    moe_capacity_factor: float | None = None
    check_inputs: bool = True
    rope_length: str = "batch"

    def __post_init__(self) -> None:
        check_fields(self, vars(self))
        if self.rope_length not in ("batch", "row"):
            raise ValueError(f"rope_length must be 'batch' or 'row', got {self.rope_length!r}")
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl must be one of {MOE_IMPLS}, got {self.moe_impl!r}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(
                f"attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}"
            )
        check_remat(self.remat)


RUN_OPTIONS = frozenset(f.name for f in dataclasses.fields(RunOptions))


class Derived:
    """A config field whose ``None`` means "derive it from the other fields", as HF does for
    ``head_dim`` or ``num_key_value_heads``.

    The instance keeps the value it was given; reading the field gives that value, or, for
    ``None``, ``config._default_<name>()`` (which families override). ``default`` is the
    field's dataclass default. A plain descriptor rather than a property so that the field
    keeps its HF name both as a constructor argument and as the attribute read.
    """

    def __init__(self, default: Any = None) -> None:
        self.default = default

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.slot = name, f"_given_{name}"

    def __get__(self, config: Any, owner: type | None = None) -> Any:
        if config is None:  # class access: the dataclass default
            return self.default
        given = self.given(config)
        return getattr(config, f"_default_{self.name}")() if given is None else given

    def __set__(self, config: Any, value: Any) -> None:
        # Only the dataclass ``__init__`` gets here: the frozen class refuses other writes.
        config.__dict__[self.slot] = tuple(value) if isinstance(value, list) else value

    def given(self, config: Any) -> Any:
        """What ``config`` was given for this field (``None``: derived)."""
        return config.__dict__[self.slot]


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Architecture of a decoder (field names as in HF's ``config.json`` where HF has one).

    Derived fields (``None``: derived; see the module docstring): ``num_key_value_heads``
    (``num_attention_heads``), ``head_dim`` (``hidden_size // num_attention_heads``),
    ``rope`` (default RoPE over ``head_dim`` with the family's theta), ``layer_windows``
    (each layer's sliding window, ``None`` for full attention; default ``sliding_window`` on
    every layer), ``sliding_rope`` (the sliding layers' RoPE; default ``rope``),
    ``nope_layers`` (the layers without RoPE; default none), ``layer_mlps`` (which layers
    are ``"moe"``, with ``num_experts`` experts and ``num_experts_per_tok`` per token, and
    which ``"dense"``; default every layer MoE when ``num_experts > 0``) and ``attn_scale``
    (``None``: ``head_dim ** -0.5``, applied by the attention op). ``run`` holds the run options.
    """

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ()
    ROPE_THETA: ClassVar[float] = 10000.0  # the family's default RoPE base
    # The family's HF layout fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``
    # (Phi-3): edl's layers then hold those fused matrices under HF's names.
    FUSED_PROJECTIONS: ClassVar[bool] = False
    MOE_BLOCK: ClassVar[str] = "sparse"  # the MoE MLP's kind: edl.models.decoder.MOE_BLOCKS
    # What ``edl.models.configure`` lets a built model change besides the run options: the training
    # loss's settings (the forward pass never reads them), an init-only value and the HF keys
    # edl does not interpret. Every other field is architecture (``pad_token_id`` too: the
    # classification head pools at it).
    SETTINGS: ClassVar[frozenset[str]] = frozenset(
        {
            "run",
            "router_aux_loss_coef",
            "router_z_loss_coef",
            "output_router_logits",
            "problem_type",
            "initializer_range",
            "hf_extra",
        }
    )

    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = Derived()
    head_dim: int | None = Derived()
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope: RopeConfig | None = Derived()
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm of each q / k head before RoPE
    # OLMo 2: one q (k) norm over all heads' features (``heads * head_dim``), not per head.
    qk_norm_over_heads: bool = False
    sliding_window: int | None = None
    layer_windows: tuple[int | None, ...] | None = Derived()
    # RoPE of the sliding-window layers where it differs from ``rope`` (Gemma 3's
    # ``rope_local_base_freq``, OLMo 3's ``rope_parameters["sliding_attention"]``).
    sliding_rope: RopeConfig | None = Derived()
    nope_layers: tuple[int, ...] | None = Derived()  # SmolLM3: layers without RoPE (NoPE)
    post_norms: bool = False  # OLMo 2: norms after attention / MLP only, none before
    # The Gemma line.
    norm_offset: float = 0.0  # RMSNorm scales by (offset + weight): Gemma's 1 + w
    embed_scale: bool = False  # token embeddings times sqrt(hidden_size)
    sandwich_norms: bool = False  # Gemma 2: norms after attention / MLP as well as before
    attn_softcap: float | None = None  # softcap * tanh(logits / softcap) on attention logits
    final_softcap: float | None = None  # ... and on the LM head's logits
    attn_scale: float | None = Derived()  # attention logit scale
    attention_sinks: bool = False  # GPT-OSS: a learned logit per head in the softmax
    # Mixture of experts.
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None  # None: intermediate_size
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    layer_mlps: tuple[str, ...] | None = Derived()
    router_aux_loss_coef: float = 0.001
    router_z_loss_coef: float = 0.0
    output_router_logits: bool = False  # HF's switch: add the auxiliary loss to the LM loss
    # Task heads.
    num_labels: int = 2
    problem_type: str | None = None
    pad_token_id: int | None = None
    # HF keys edl does not interpret, as sorted (key, JSON) pairs: written back by to_hf.
    hf_extra: tuple[tuple[str, str], ...] = ()
    run: RunOptions = RunOptions()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # A family's plain default for a derived field (Gemma's ``head_dim = 256``) would
        # hide the descriptor: wrap it, before the dataclass decorator reads the defaults.
        super().__init_subclass__(**kwargs)
        for name, value in list(vars(cls).items()):
            derived = isinstance(inspect.getattr_static(DecoderConfig, name, None), Derived)
            if derived and not isinstance(value, Derived):
                descriptor = Derived(value)
                descriptor.__set_name__(cls, name)
                setattr(cls, name, descriptor)

    def __post_init__(self) -> None:
        check_fields(self, self._given_fields())
        if self.MODEL_TYPES and self.model_type not in self.MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; {type(self).__name__} covers "
                f"{self.MODEL_TYPES}"
            )
        given = self._given_fields()
        if given["head_dim"] is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads}; set head_dim"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        for name in ("rope", "sliding_rope"):
            rope = getattr(self, name)
            if not isinstance(rope, RopeConfig | None):
                raise ValueError(f"{name} must be a RopeConfig or None, got {rope!r}")
            if rope is not None and rope.dim > self.head_dim:
                raise ValueError(f"{name}.dim {rope.dim} exceeds head_dim {self.head_dim}")
        self._check_per_layer("layer_windows", self.layer_windows)
        if any(w is not None and w <= 0 for w in self.layer_windows):
            raise ValueError(f"sliding windows must be positive, got {self.layer_windows}")
        self._check_per_layer("layer_mlps", self.layer_mlps)
        if not isinstance(self.nope_layers, tuple) or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_hidden_layers
            for i in self.nope_layers
        ):
            raise ValueError(
                f"nope_layers must be a tuple of layer indices in [0, {self.num_hidden_layers}), "
                f"got {self.nope_layers!r}"
            )
        if self.post_norms and self.sandwich_norms:
            raise ValueError("post_norms (OLMo 2) and sandwich_norms (Gemma 2) exclude each other")
        if set(self.layer_mlps) - set(MLP_KINDS):
            raise ValueError(f"layer_mlps entries must be {MLP_KINDS}, got {self.layer_mlps}")
        if "moe" in self.layer_mlps and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"MoE layers need 1 <= num_experts_per_tok ({self.num_experts_per_tok}) <= "
                f"num_experts ({self.num_experts})"
            )
        if not isinstance(self.run, RunOptions):
            raise ValueError(f"run must be a RunOptions, got {self.run!r}")
        activation(self.hidden_act)
        if self.problem_type not in PROBLEM_TYPES:
            raise ValueError(f"unknown problem_type {self.problem_type!r}")

    def _given_fields(self) -> dict[str, Any]:
        """Every field as given to the constructor (``None`` for a derived one not set)."""

        def given(name: str) -> Any:
            field = inspect.getattr_static(type(self), name)
            return field.given(self) if isinstance(field, Derived) else getattr(self, name)

        return {f.name: given(f.name) for f in dataclasses.fields(self)}

    def _check_per_layer(self, name: str, values: tuple) -> None:
        if len(values) != self.num_hidden_layers:
            raise ValueError(
                f"{name} has {len(values)} entries for {self.num_hidden_layers} layers"
            )

    # -- derived --------------------------------------------------------------------------

    def _default_num_key_value_heads(self) -> int:
        return self.num_attention_heads

    def _default_head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def _default_rope(self) -> RopeConfig:
        return RopeConfig(dim=self.head_dim, theta=self.ROPE_THETA)

    def _default_layer_windows(self) -> tuple[int | None, ...]:
        return (self.sliding_window,) * self.num_hidden_layers

    def _default_layer_mlps(self) -> tuple[str, ...]:
        return ("moe" if self.num_experts > 0 else "dense",) * self.num_hidden_layers

    def _default_sliding_rope(self) -> RopeConfig | None:
        return None  # the sliding layers rotate with ``rope``

    def _default_nope_layers(self) -> tuple[int, ...]:
        return ()

    def _default_attn_scale(self) -> float | None:
        return None  # the attention op's default, head_dim ** -0.5

    @property
    def expert_intermediate_size(self) -> int:
        """Each expert's MLP width."""
        return self.moe_intermediate_size or self.intermediate_size

    def layer_flops(self, index: int, seq_len: int) -> float:
        """Forward matmul FLOPs per token of layer ``index`` (``edl.models.flops``); a
        family whose layers differ from the shared decoder's overrides it."""
        return decoder_layer_flops(self, index, seq_len)

    @property
    def layer_settings(self) -> tuple[tuple[int | None, RopeConfig | None], ...]:
        """Each layer's static ``(window, rope)``: its sliding window (``None``: global) and
        the RoPE it applies (``sliding_rope`` on sliding layers where set, ``None`` on the
        ``nope_layers``). Layers of equal settings share a scan (``edl.nn.schedule``)."""
        nope = set(self.nope_layers)
        out = []
        for i, window in enumerate(self.layer_windows):
            rope = self.sliding_rope if window is not None and self.sliding_rope else self.rope
            out.append((window, None if i in nope else rope))
        return tuple(out)

    @property
    def layer_groups(self) -> tuple[str, ...]:
        """The stack (``DecoderModel`` field) holding each layer: ``"layers"``, or for dense
        layers among MoE ones, ``"dense_layers"``."""
        if len(set(self.layer_mlps)) <= 1:
            return ("layers",) * self.num_hidden_layers
        return tuple("layers" if m == "moe" else "dense_layers" for m in self.layer_mlps)

    def replace(self, **changes: Any) -> DecoderConfig:
        """A copy with ``changes``: architecture fields, or run options by name
        (``replace(scan_layers=False, remat="full")`` sets ``run``'s fields).

        Derived fields that were never given are derived again from the changed fields;
        given ones are kept (``None`` derives them again).
        """
        return type(self)(**{**self._given_fields(), **_route_run_options(self.run, changes)})

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
            return cls(**_route_run_options(RunOptions(), {**fields, **overrides}))
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
        # Layout features only the families listing them in WRITES can express.
        used = [f for f in self.LAYOUT_FEATURES if f not in self.WRITES and getattr(self, f)]
        self._require(not used, f"{used} must keep edl's defaults")
        out: dict[str, Any] = {k: json.loads(v) for k, v in self.hf_extra}
        for labels in ("id2label", "label2id"):  # stale once num_labels was changed
            if labels in out and len(out[labels]) != self.num_labels:
                del out[labels]
        rope = self.rope
        rope_params = rope_to_hf(rope, self.head_dim)
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

    LAYOUT_FEATURES: ClassVar[tuple[str, ...]] = (
        "qk_norm_over_heads",
        "sliding_rope",
        "nope_layers",
        "post_norms",
        "attention_sinks",
    )
    WRITES: ClassVar[frozenset[str]] = frozenset()  # the LAYOUT_FEATURES a to_hf writes

    GEMMA_FEATURES: ClassVar[tuple[str, ...]] = (
        "norm_offset",
        "embed_scale",
        "sandwich_norms",
        "attn_softcap",
        "final_softcap",
        "attn_scale",
    )

    def _require_defaults(self, names: tuple[str, ...]) -> None:
        """``to_hf``'s refusal of features (fields ``names``) the HF type lacks."""
        base = DecoderConfig.__dataclass_fields__
        changed = [n for n in names if getattr(self, n) != base[n].default]
        self._require(not changed, f"{changed} must keep edl's defaults")

    def _require(self, condition: bool, what: str) -> None:
        """``to_hf``'s refusal of settings the HF ``model_type`` cannot express."""
        if not condition:
            raise ValueError(
                f"this {type(self).__name__} has no HF {self.model_type!r} equivalent: {what}"
            )


def _route_run_options(run: RunOptions, changes: Mapping[str, Any]) -> dict[str, Any]:
    """``changes`` with the run options among them (``remat=...``) moved into ``run``."""
    options = {k: v for k, v in changes.items() if k in RUN_OPTIONS}
    out = {k: v for k, v in changes.items() if k not in RUN_OPTIONS}
    if options:
        out["run"] = dataclasses.replace(out.get("run", run), **options)
    return out

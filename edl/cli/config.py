"""``TrainConfig``: every option of ``edl train``, its default, its help and its check.

The options of the job (model, data, method, LoRA, optimizer, sample, processes) are its
fields; the run's (length, output directory, checkpoints, evaluation, logging, non-finite
policy, time limit, profile) are ``edl.train.RunConfig``'s, nested in ``run`` with the
defaults of ``EMBEDDED_RUN``. Flags, TOML keys and ``run.md``'s record are the flat names of
``edl._settings`` (``--save-every`` is ``run.checkpoint.every``); ``from_options`` /
``to_options`` / ``read_toml`` / ``write_toml`` round-trip them.

Imports nothing heavy: ``edl train --help`` and option errors answer before jax loads. The
options whose names are a registry's (``--loss-type``: ``PREFERENCE_LOSSES``, ``--quantize``:
``QUANT_FORMATS``) read it when their value is checked, last, so a registered entry is a
valid choice without an edit here.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from collections.abc import Mapping
from pathlib import Path

from edl._mesh_spec import MeshSpec
from edl._settings import (
    ConfigError,
    Leaf,
    Registered,
    check_option,
    check_options,
    from_options,
    leaves,
    to_options,
)
from edl._settings import option as _option
from edl.train.options import SCHEDULES, MuonConfig
from edl.train.run_config import (
    CheckpointConfig,
    EvalConfig,
    RunConfig,
    ThroughputConfig,
    TimeLimitConfig,
)

__all__ = ["CommandError", "ConfigError", "TrainConfig", "read_toml", "write_toml"]


class CommandError(Exception):
    """A command cannot run (a missing path, say); ``edl`` prints the message, exits 1."""


_METHOD_LOSSES = {
    "dpo": "edl.train.preference:PREFERENCE_LOSSES",
    "grpo": "edl.train.grpo_losses:GRPO_LOSSES",
}
"""The registry of each method's ``--loss-type``."""
_DEFAULT_LOSS = {"dpo": "sigmoid", "grpo": "dapo"}
"""``--loss-type``'s value when empty: ``make_dpo_step``'s and ``GRPOConfig``'s default."""

EMBEDDED_RUN = RunConfig(
    steps=1200,
    output_dir="runs/edl-train",
    resume=False,
    checkpoint=CheckpointConfig(every=250),
    eval=EvalConfig(every=200, batches=4),
    throughput=ThroughputConfig(peak_flops=1e11),
    time_limit=TimeLimitConfig(seconds=1200.0),
)
"""``edl train``'s run: the library's ``RunConfig`` defaults, sized for the embedded job
(checkpoints and held-out evaluations during its 1200 steps, a 20-minute safety net)."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The options of ``edl train``. The defaults train a ~0.8M-parameter byte-level Llama on
    the embedded corpus for a fixed number of steps, about four minutes on a 2-core CPU."""

    model: str = _option(
        "",
        "HF model directory, hub repo id or run directory to fine-tune (empty: the "
        "embedded byte-level job)",
    )
    data: str = _option(
        "",
        "training data: text / JSONL files, a directory, a glob, or a datasets name "
        "(empty: the embedded corpus)",
    )
    format: str = _option(
        "text",
        "what --data records hold: text, prompt / completion, or chat "
        "messages (loss on completions / assistant turns only)",
        choices=("text", "completion", "chat"),
    )
    method: str = _option(
        "sft",
        "what to train: sft (next-token loss on --data), dpo (preference pairs: "
        "prompt / chosen / rejected), reward (a reward model on preference pairs), grpo "
        "(online RL on prompt records with --reward), kto (unpaired preferences: prompt / "
        "completion / label), distill (from --teacher on prompt / completion or messages records)",
        choices=("sft", "dpo", "reward", "grpo", "kto", "distill"),
    )
    loss_type: str = _option(
        "",
        "--method dpo's / grpo's loss (empty: the method's default, dpo: sigmoid, grpo: "
        "dapo as TRL; a wrong name is answered with the list)",
        registry=Registered(",".join(_METHOD_LOSSES.values()), extra=("",)),
    )
    beta: float = _option(
        0.0,
        "DPO's / KTO's beta (0: 0.1, SimPO 2.0); GRPO's KL coefficient (0: no KL term); "
        "distill's generalised JSD beta in [0, 1] (0: forward KL, 1: reverse KL)",
        low=0.0,
    )
    desirable_weight: float = _option(
        1.0, "--method kto: weight of the desirable examples' losses", low=0.0
    )
    undesirable_weight: float = _option(
        1.0, "--method kto: weight of the undesirable examples' losses", low=0.0
    )
    reference: str = _option(
        "auto",
        "DPO / KTO / GRPO reference model: lora (the LoRA-off base, no copy), model (a "
        "frozen copy of --model), auto (lora with --lora-rank, else model)",
        choices=("auto", "lora", "model"),
    )
    teacher: str = _option(
        "",
        "--method distill: the teacher, a model directory, hub repo id or run directory "
        "with --model's vocabulary",
    )
    lmbda: float = _option(
        0.0,
        "--method distill: probability that a step trains on the student's own samples "
        "(GKD's lmbda; 0: off-policy)",
        low=0.0,
        high=1.0,
    )
    seq_kd: bool = _option(
        False, "--method distill: train the other steps on the teacher's samples"
    )
    reward: str = _option(
        "",
        "--method grpo: reward function(s), module:function[,...] "
        "(imported from the working directory or PYTHONPATH)",
    )
    environment: str = _option(
        "",
        "--method grpo: multi-turn rollouts (tool use) with an environment factory, "
        "module:function returning an edl.train.Environment (--reward then optional)",
    )
    max_turns: int = _option(
        1, "--method grpo with --environment: model turns per conversation", low=1.0
    )
    num_generations: int = _option(8, "--method grpo: completions per prompt", low=2.0)
    max_new_tokens: int = _option(
        64, "--method grpo / distill: tokens per sampled completion", low=1.0
    )
    temperature: float = _option(
        1.0,
        "--method grpo / distill: sampling temperature (distill: it also divides both "
        "models' logits in the loss)",
        low=0.0,
    )
    num_iterations: int = _option(
        1, "--method grpo: optimizer updates per batch of completions", low=1.0
    )
    importance_sampling_level: str = _option(
        "token",
        "--method grpo: importance ratio per token, or per sequence (GSPO: the mean log-ratio)",
        choices=("token", "sequence"),
    )
    mask_truncated_completions: bool = _option(
        False, "--method grpo: completions that end without EOS get no loss weight"
    )
    top_entropy_quantile: float = _option(
        1.0,
        "--method grpo: only completion tokens in this top fraction by entropy contribute (1: all)",
        low=0.0,
        high=1.0,
    )
    dynamic_sampling: bool = _option(
        False,
        "--method grpo: DAPO's dynamic sampling: replace prompts whose completions all scored "
        "the same by further prompts (at most 4 extra rollouts a step)",
    )
    rollout_backend: str = _option(
        "generate",
        "--method grpo: what samples the rollouts: generate (edl.generate's decode loop; the "
        "default, faster for short prompts: 16.1k vs 6.5k tokens/s on a tiny model) or engine "
        "(the serving engine, a prompt's pages shared by its samples: 2.8x faster with "
        "256-token prompts on a 4-layer width-256 model; benchmarks/RESULTS.md); single-turn",
        registry=Registered("edl.train.rollout_backends:ROLLOUT_BACKENDS"),
    )
    eval_data: str = _option("", "held-out data, read as --data (empty: none with --data)")
    packing: bool = _option(True, "pack several examples per row (segment ids keep them apart)")
    lora_rank: int = _option(0, "LoRA rank for --model runs (0: full fine-tuning)", low=0.0)
    lora_alpha: float = _option(16.0, "LoRA scaling numerator (scale = alpha / rank)", low=0.0)
    quantize: str = _option(
        "none",
        "quantize the frozen base (QLoRA; needs --lora-rank)",
        registry=Registered("edl.ops.quant:QUANT_FORMATS", extra=("none",)),
    )
    param_dtype: str = _option(
        "float32", "dtype of the trained weights (the master copy)", choices=("float32", "bfloat16")
    )
    compute_dtype: str = _option(
        "float32",
        "dtype of the forward and backward passes (softmax and losses stay float32)",
        choices=("float32", "bfloat16"),
    )
    run: RunConfig = EMBEDDED_RUN
    batch_size: int = _option(8, "sequences per step", low=1.0)
    seq_len: int = _option(128, "tokens per sequence (bytes)", low=2.0)
    hidden_size: int = _option(128, "model width", low=1.0)
    intermediate_size: int = _option(352, "MLP width", low=1.0)
    num_layers: int = _option(4, "decoder layers", low=1.0)
    num_heads: int = _option(4, "attention heads (must divide --hidden-size)", low=1.0)
    num_kv_heads: int = _option(2, "key/value heads (must divide --num-heads)", low=1.0)
    optimizer: str = _option(
        "adamw", "optimizer", registry=Registered("edl.train.optimizers:OPTIMIZERS")
    )
    schedule: str = _option("cosine", "learning rate after warmup", choices=SCHEDULES)
    learning_rate: float = _option(
        0.0,
        "peak learning rate (0: 2e-3 for the embedded job, 2e-4 with --lora-rank, 2e-5 "
        "for full fine-tuning)",
        low=0.0,
    )
    warmup_steps: int = _option(30, "linear warmup steps", low=0.0)
    weight_decay: float = _option(0.01, "AdamW / Lion / Muon weight decay", low=0.0)
    muon: MuonConfig = MuonConfig()
    clip_norm: float = _option(
        1.0, "clip the global gradient norm to this (0: no clipping)", low=0.0
    )
    grad_accum_steps: int = _option(1, "micro-batches per step (must divide --batch-size)", low=1.0)
    seed: int = _option(0, "seed of the weights, data order and sample", low=0.0)
    corpus_bytes: int = _option(4_000_000, "bytes of the embedded corpus to read", low=1.0)
    prompt: str = _option("def ", "prompt of the sample printed at the end")
    sample_tokens: int = _option(200, "bytes to sample at the end", low=1.0)
    sample_temperature: float = _option(0.7, "sampling temperature (0: greedy)", low=0.0)
    mesh: str = _option(
        "",
        "DP,FSDP,TP,SP[,EXPERT] device counts of the mesh (one may be -1: the rest; EXPERT "
        "splits MoE experts, default 1), optionally "
        "/N or /DP,FSDP,TP,SP[,EXPERT] slices (processes on GPU / CPU) across which each axis is "
        "repeated (/N: data parallel across N); empty: one device, or data parallel over "
        "all with several processes",
    )
    coordinator: str = _option(
        "", "HOST:PORT of process 0, for a run of several processes (jax.distributed)"
    )
    num_processes: int = _option(
        1,
        "processes of the run (each on its own machine or devices; all with the same options)",
        low=1.0,
    )
    process_id: int = _option(0, "this process's rank, 0 .. --num-processes - 1", low=0.0)

    def __post_init__(self) -> None:
        check_options(self, registered=False)  # the run's options checked themselves
        if self.run.steps < 1:  # the schedule spans the run: a run of 0 steps has none
            raise ConfigError(f"steps must be >= 1, got {self.run.steps}")
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"--num-heads ({self.num_heads}) must divide --hidden-size ({self.hidden_size})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"--num-kv-heads ({self.num_kv_heads}) must divide --num-heads ({self.num_heads})"
            )
        if self.quantize != "none" and not self.lora_rank:
            raise ConfigError(
                f"--quantize {self.quantize} freezes the base weights: it needs --lora-rank"
            )
        if self.lora_rank and not self.model:
            raise ConfigError("--lora-rank needs --model (a model to fine-tune)")
        if self.model and not self.data:
            raise ConfigError("--model needs --data (the embedded corpus is byte-level)")
        if not self.model and self.format != "text":
            raise ConfigError(f"--format {self.format} needs --model (a chat / SFT tokenizer)")
        if self.eval_data and not self.data:
            raise ConfigError("--eval-data needs --data")
        self._check_method()
        _ = self.mesh_spec  # parsed: checked early
        self._check_processes()
        if self.batch_size % self.grad_accum_steps:
            raise ConfigError(
                f"--grad-accum-steps ({self.grad_accum_steps}) must divide --batch-size "
                f"({self.batch_size})"
            )
        check_options(self, registered=True)  # last: a registry's module imports jax
        if self.loss_type and self.method in _METHOD_LOSSES:
            names = Registered(_METHOD_LOSSES[self.method]).names()
            if self.loss_type not in names:
                raise ConfigError(
                    f"--loss-type for --method {self.method} must be one of "
                    f"{', '.join(names)}, got {self.loss_type!r}"
                )

    def _check_method(self) -> None:
        method = self.method
        if method == "sft":
            return
        if not self.model:
            raise ConfigError(f"--method {method} needs --model (a pretrained model)")
        if self.format != "text":
            raise ConfigError(
                f"--format is for --method sft; --method {method} reads "
                + (
                    "prompt records"
                    if method == "grpo"
                    else "prompt / completion or messages records"
                    if method == "distill"
                    else "unpaired preference records (prompt / completion / label)"
                    if method == "kto"
                    else "preference records (prompt / chosen / rejected)"
                )
            )
        if self.eval_data and method in ("grpo", "distill"):
            raise ConfigError(f"--eval-data is for --method sft, dpo, reward and kto, not {method}")
        if (method == "distill") != bool(self.teacher):
            raise ConfigError("--teacher is for --method distill, which needs it")
        if method == "distill" and (self.beta > 1 or self.temperature <= 0):
            raise ConfigError(
                f"--method distill needs 0 <= --beta <= 1 and --temperature > 0, got "
                f"{self.beta} and {self.temperature}"
            )
        if method == "grpo" and not (self.reward or self.environment):
            raise ConfigError(
                "--method grpo needs --reward module:function (or --environment module:function)"
            )
        if method != "grpo" and self.environment:
            raise ConfigError(f"--environment is for --method grpo, not {method}")
        if self.max_turns > 1 and not self.environment:
            raise ConfigError("--max-turns is for --method grpo with --environment")
        if self.environment and self.rollout_backend != "generate":
            raise ConfigError(
                f"--rollout-backend {self.rollout_backend} is for single-turn --method grpo; "
                "--environment samples with generate"
            )
        if method != "grpo" and self.reward:
            raise ConfigError(f"--reward is for --method grpo, not {method}")
        if method == "grpo" and self.temperature <= 0:
            raise ConfigError("--temperature must be > 0 for --method grpo (it samples)")
        if self.reference == "lora" and not self.lora_rank:
            raise ConfigError("--reference lora needs --lora-rank (the LoRA-off base)")

    @property
    def reference_kind(self) -> str:
        """``reference``, with ``auto`` resolved: the LoRA-off base when training LoRA."""
        if self.reference != "auto":
            return self.reference
        return "lora" if self.lora_rank else "model"

    def _check_processes(self) -> None:
        if self.process_id >= self.num_processes:
            raise ConfigError(
                f"--process-id ({self.process_id}) must be below "
                f"--num-processes ({self.num_processes})"
            )
        if self.num_processes > 1:
            host, _, port = self.coordinator.rpartition(":")
            if not (host and port.isdigit()):
                raise ConfigError(
                    f"--num-processes {self.num_processes} needs --coordinator "
                    f"HOST:PORT (process 0's address), got "
                    f"{self.coordinator!r}"
                )
            if self.method != "sft":
                raise ConfigError(f"--num-processes > 1 is for --method sft, not {self.method}")
        elif self.coordinator:
            raise ConfigError("--coordinator is for runs of several processes (--num-processes N)")

    @property
    def mesh_spec(self) -> MeshSpec | None:
        """``mesh`` parsed (``edl._mesh_spec``: sizes within a slice, and across slices
        after a ``/``); ``None``: no mesh asked for."""
        if not self.mesh:
            return None
        try:
            return MeshSpec.parse(self.mesh)
        except ValueError as e:
            raise ConfigError(f"--mesh: {e}") from None

    @property
    def peak_learning_rate(self) -> float:
        """``learning_rate``, or when 0 the default of the kind of run."""
        if self.learning_rate:
            return self.learning_rate
        return 2e-3 if not self.model else 2e-4 if self.lora_rank else 2e-5

    def in_effect(self) -> dict[str, object]:
        """The options that shape this run, by flat name, as it uses them: the learning
        rate actually used (``peak_learning_rate``), and without the options of another
        kind of run (the embedded model's size, corpus and sample for a ``--model`` run;
        another method's options; LoRA settings without ``--lora-rank``).
        ``TrainConfig.from_options`` of it makes the same run."""
        options = self.to_options()
        options["learning_rate"] = self.peak_learning_rate
        if self.method in _DEFAULT_LOSS:
            options["loss_type"] = self.method_loss_type
        unused = set(_METHOD_OPTIONS.get("*", ())) - set(_METHOD_OPTIONS[self.method])
        if self.model:
            unused |= set(_EMBEDDED_JOB_OPTIONS)
        if not self.lora_rank:
            unused |= {"lora_alpha", "quantize", "save_base"}
        if self.optimizer != "muon":
            unused |= set(leaves(MuonConfig))
        return {name: value for name, value in options.items() if name not in unused}

    @property
    def method_loss_type(self) -> str:
        """``--loss-type``, or the method's default loss when it is empty."""
        return self.loss_type or _DEFAULT_LOSS.get(self.method, "")

    @classmethod
    def from_options(cls, values: Mapping[str, object], *, where: str = "") -> TrainConfig:
        """The configuration of flat ``values`` (flags / TOML keys / ``to_options``'s
        names) over the defaults; errors name the option, after ``where``."""
        return from_options(cls, values, where=where)

    def to_options(self) -> dict[str, object]:
        """Every option by its flat name (JSON / TOML-ready), as ``run.md`` records it;
        ``TrainConfig.from_options(config.to_options()) == config``."""
        return to_options(self)


_EMBEDDED_JOB_OPTIONS = (
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "corpus_bytes",
    "prompt",
    "sample_tokens",
    "sample_temperature",
)
"""The embedded byte-level job's options: its model, corpus and the sample it prints."""

_METHOD_OPTIONS = {
    "sft": (),
    "dpo": ("loss_type", "beta", "reference"),
    "kto": ("beta", "reference", "desirable_weight", "undesirable_weight"),
    "reward": (),
    "distill": ("beta", "teacher", "lmbda", "seq_kd", "temperature", "max_new_tokens"),
    "grpo": (
        "loss_type",
        "beta",
        "reference",
        "reward",
        "environment",
        "max_turns",
        "num_generations",
        "max_new_tokens",
        "temperature",
        "num_iterations",
        "importance_sampling_level",
        "mask_truncated_completions",
        "top_entropy_quantile",
        "dynamic_sampling",
        "rollout_backend",
    ),
}
"""The options each ``--method`` reads besides the common ones."""
_METHOD_OPTIONS["*"] = tuple(dict.fromkeys(n for names in _METHOD_OPTIONS.values() for n in names))

FIELDS: dict[str, Leaf] = leaves(TrainConfig)
"""Every option of ``edl train``, the run's included, by flat name, in ``--help`` order."""


def flag(name: str) -> str:
    """The command-line flag of option ``name``."""
    return "--" + name.replace("_", "-")


def default_of(leaf: Leaf) -> object:
    """``leaf``'s value in ``edl train``'s defaults (read from the field defaults: making a
    ``TrainConfig`` would check its registries, which import jax)."""
    field = next(f for f in dataclasses.fields(TrainConfig) if f.name == leaf.path[0])
    value = field.default
    for part in leaf.path[1:]:
        value = getattr(value, part)
    return value


def read_toml(path: Path) -> dict[str, object]:
    """The options in a TOML file (flat keys, as the flags), each checked; errors name the
    file."""
    try:
        values = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    for name, value in values.items():
        try:
            check_option(TrainConfig, name, value)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
    return values


def write_toml(config: TrainConfig, path: Path) -> None:
    """``config`` as a TOML file of flat options that ``edl train --config`` reads back to
    the same ``TrainConfig`` (values with a text form, such as ``trackers``, in it)."""
    lines = []
    for name, value in config.to_options().items():
        leaf = FIELDS[name]
        if leaf.spec.text is not None:
            value = leaf.shown(_native(value))
        if value is None:
            raise ConfigError(f"{name} is None, which TOML cannot hold")
        # JSON's scalars and lists are TOML's, once DEL (raw in JSON) is escaped.
        lines.append(
            f"{name} = " + json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
        )
    from edl.io.formats.files import write_text_atomic  # imports jax: only when writing

    write_text_atomic(path, "\n".join(lines) + "\n")


def _native(value: object) -> object:
    return tuple(value) if isinstance(value, list) else value

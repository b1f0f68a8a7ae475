"""Knowledge distillation of a causal LM (the student, the state's model) from a frozen
teacher with the same vocabulary, off-policy or on-policy (GKD,
https://huggingface.co/papers/2306.13649), as a step for ``edl.train.train``.

    teacher = edl.from_pretrained("big-model")
    step = make_distill_step(tx, teacher, beta=0.5, temperature=1.0, lmbda=0.5,
                             max_new_tokens=128, key=jax.random.key(0))
    state, summary = edl.train.train(state, step, DistillBatches(docs, ...), RunConfig(...))

The loss is ``edl.train.distill_loss.chunked_distill_loss``: TRL's generalised JSD between
the student's and the teacher's next-token distributions at each completion token, computed
chunk by chunk from both models' final hidden states and LM heads. The teacher may have
another width and depth; it is an argument of the compiled step (never donated, never baked
into the program, no gradient).

Each step trains on (TRL's ``GKDTrainer.training_step``):

- with probability ``lmbda``: completions the student samples from the batch's prompts
  (``edl.generate`` from the state's own arrays, at ``temperature``, up to
  ``max_new_tokens``, ending at EOS) — on-policy;
- else, with ``seq_kd``: completions the teacher samples (sequence-level KD);
- else the batch's own completions — off-policy.

The draw and the sampling key of step ``s`` come from ``fold_in(key, s)``, so a resumed run
draws and samples what the uninterrupted one would. With ``lmbda == 0`` and no ``seq_kd`` the
step is one compiled program (an ``edl.train.jitted.StepProgram``); otherwise it is a host
step, like GRPO's, around that program. The temperature divides both models' logits in the
loss and is the sampling temperature (``DistillationTrainer``'s convention).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Bool, Int, PRNGKeyArray

from edl import state as edl_state
from edl.generate import generate
from edl.generate.steps import CausalLM
from edl.ops.losses import mask_without_context
from edl.state import TrainState
from edl.train.distill_loss import chunked_distill_loss
from edl.train.distill_tools import check_tool_options, tool_batch
from edl.train.grpo_objective import completion_mask
from edl.train.preference_step import _with_reference

__all__ = ["DISTILL_KEYS", "DistillStep", "distill_divergence", "make_distill_step"]

DISTILL_KEYS = ("input_ids", "labels", "attention_mask")
Batch = Mapping[str, Any]  # numpy or jax arrays


def check_teacher(who: str, student: CausalLM, teacher: CausalLM) -> None:
    """``ValueError`` naming both sizes unless the teacher's vocabulary (``config.vocab_size``,
    its LM head's rows) is the student's."""
    sizes = {"student": student.config.vocab_size, "teacher": teacher.config.vocab_size}
    if sizes["student"] != sizes["teacher"]:
        raise ValueError(
            f"{who}: the teacher's vocabulary must be the student's: student vocab_size "
            f"{sizes['student']}, teacher vocab_size {sizes['teacher']}"
        )


def _counted(labels: Int[Array, "b s"], mask: Array) -> Bool[Array, "b s"]:
    """Position ``t`` counts when it predicts a completion token: ``labels[:, t + 1]`` is not
    -100, attended, and has its context (``mask_without_context``)."""
    labels = mask_without_context(labels, attention_mask=mask)
    valid = (labels != -100) & mask.astype(bool)
    return jnp.pad(valid[:, 1:], ((0, 0), (0, 1)))


def distill_divergence(
    model: CausalLM,
    teacher: CausalLM,
    batch: Batch,
    *,
    beta: float,
    temperature: float,
    chunk_size: int | None = None,
) -> tuple[Array, dict[str, Array]]:
    """``chunked_distill_loss`` of ``model`` against ``teacher`` on the batch's ``input_ids`` /
    ``labels`` / ``attention_mask`` (int32 ``(batch, seq)``, labels unshifted, -100 off the
    completion): ``(loss, {"loss", "count", "tokens"})``, ``count`` the completion tokens,
    ``tokens`` the attended ones. The teacher carries no gradient."""
    missing = [k for k in DISTILL_KEYS if k not in batch]
    if missing:
        raise ValueError(
            f"distill_divergence: the batch lacks {', '.join(missing)} (it has "
            f"{', '.join(sorted(batch))})"
        )
    ids, labels, mask = (jnp.asarray(batch[k]) for k in DISTILL_KEYS)
    shapes = {k: batch[k].shape for k in DISTILL_KEYS}
    if len(set(shapes.values())) != 1 or ids.ndim != 2:
        raise ValueError(f"distill_divergence: need one (batch, seq) for {shapes}")
    counted = _counted(labels, mask)
    student_hidden = model.model(ids, attention_mask=mask).last_hidden_state
    teacher_hidden = jax.lax.stop_gradient(
        teacher.model(ids, attention_mask=mask).last_hidden_state
    )
    loss, metrics = chunked_distill_loss(
        student_hidden,
        model.head_weight,
        teacher_hidden,
        jax.lax.stop_gradient(teacher.head_weight),
        counted,
        beta=beta,
        temperature=temperature,
        chunk_size=chunk_size,
        student_softcap=model.config.final_softcap,
        teacher_softcap=teacher.config.final_softcap,
    )
    return loss, {**metrics, "tokens": jnp.sum(mask.astype(jnp.int32))}


class DistillStep:
    """``step(state, batch) -> (state, metrics)`` with on-policy or teacher-sampled batches
    (module docstring); built by :func:`make_distill_step`. A host step: it draws, samples
    (``edl.generate``), then runs the compiled update. Metrics: the update's, ``on_policy`` /
    ``seq_kd`` (1.0 when this step's completions were the student's / the teacher's),
    ``completion_length`` (mean sampled tokens, EOS included; 0 off-policy), ``sample_s``."""

    def __init__(self, update, teacher, options: dict[str, Any], key: PRNGKeyArray) -> None:
        self.update, self.teacher, self.key = update, teacher, key
        self.lmbda, self.seq_kd = options["lmbda"], options["seq_kd"]
        self.max_new_tokens, self.temperature = options["max_new_tokens"], options["temperature"]
        self.eos_id, self.pad_id = options["eos_token_id"], options["pad_token_id"]
        self.options = options  # with "environment": multi-turn rollouts (distill_tools)

    def source(self, step: int) -> str:
        """Whose completions step ``step`` trains on: ``"student"``, ``"teacher"`` or
        ``"data"`` (a seeded draw per step, so resume draws the same)."""
        u = float(jax.random.uniform(jax.random.fold_in(jax.random.fold_in(self.key, step), 0)))
        if u < self.lmbda:
            return "student"
        return "teacher" if self.seq_kd else "data"

    def rollout(self, model: CausalLM, batch: Batch | list, key: PRNGKeyArray) -> dict[str, Array]:
        """``model``'s completions of the batch's ``prompt_ids`` (left-padded) as a train
        batch: prompt + completion, labels on the completion up to and including EOS."""
        if self.options.get("environment") is not None:
            return tool_batch(self.options, model, batch, key)
        for k in ("prompt_ids", "prompt_mask"):
            if k not in batch:
                raise ValueError(
                    f"DistillStep: on-policy and seq_kd steps need the batch's {k} (as "
                    f"edl.train.distill_data.DistillBatches yields); it has {sorted(batch)}"
                )
        prompt, prompt_mask = jnp.asarray(batch["prompt_ids"]), jnp.asarray(batch["prompt_mask"])
        out = generate(
            model,
            prompt,
            attention_mask=prompt_mask,
            max_new_tokens=self.max_new_tokens,
            key=key,
            do_sample=True,
            temperature=self.temperature,
            top_k=None,
            top_p=1.0,
            eos_token_id=self.eos_id,
            pad_token_id=self.pad_id,
        )
        new = out.sequences[:, prompt.shape[1] :]
        keep = completion_mask(new, (self.eos_id,)).astype(jnp.int32)
        return {
            "input_ids": jnp.concatenate([prompt, new], axis=1).astype(jnp.int32),
            "labels": jnp.concatenate(
                [jnp.full(prompt.shape, -100, jnp.int32), jnp.where(keep > 0, new, -100)], axis=1
            ).astype(jnp.int32),
            "attention_mask": jnp.concatenate([prompt_mask.astype(jnp.int32), keep], axis=1),
        }

    def __call__(self, state: TrainState, batch: Batch | list) -> tuple[TrainState, dict]:
        step = int(state.step)
        source = self.source(step)
        metrics: dict[str, Any] = {"completion_length": 0.0, "sample_s": 0.0}
        if source != "data":
            t0 = time.perf_counter()
            model = edl_state.model(state) if source == "student" else self.teacher
            key = jax.random.fold_in(jax.random.fold_in(self.key, step), 1)
            batch = jax.block_until_ready(self.rollout(model, batch, key))
            del model  # the update donates the state's buffers
            metrics["sample_s"] = time.perf_counter() - t0
            counted = np.asarray(batch["labels"]) != -100  # the sampled tokens up to EOS
            metrics["completion_length"] = float(counted.sum(axis=1).mean())
        batch = {k: batch[k] for k in DISTILL_KEYS}
        state, out = self.update(state, batch)
        metrics.update(jax.device_get(out))
        metrics["on_policy"] = float(source == "student")
        metrics["seq_kd"] = float(source == "teacher")
        return state, metrics


def make_distill_step(
    optimizer: optax.GradientTransformation,
    teacher: CausalLM,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    lmbda: float = 0.0,
    seq_kd: bool = False,
    max_new_tokens: int = 128,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    key: PRNGKeyArray | None = None,
    student: CausalLM | None = None,
    chunk_size: int | None = None,
    environment: Any = None,
    tokenizer: Any = None,
    max_turns: int = 1,
    **step_options: Any,
) -> Any:
    """A distillation ``step(state, batch) -> (state, metrics)`` (module docstring).

    Args:
        optimizer: the optimizer (``make_train_step``'s; ``step_options`` are its options:
            ``grad_accum_steps``, ``clip_norm``, ``schedule``, ``skip_nonfinite``,
            ``compute_dtype``, ``donate``, ``jit``, ``mesh``, ``rules``).
        teacher: a frozen causal LM with the student's vocabulary (any width / depth).
        beta, temperature: the divergence's (``distill_loss``; TRL's ``GKDConfig`` names).
        lmbda: the probability that a step trains on the student's own samples (GKD's
            ``lmbda``; 0: off-policy only).
        seq_kd: train the other steps on the teacher's samples (TRL's ``seq_kd``).
        max_new_tokens: tokens sampled per completion (on-policy / seq_kd).
        eos_token_id, pad_token_id: the sampler's; needed with sampling (pad: EOS).
        key: the draw's and the sampler's key (needed with sampling).
        student: the state's model, to check the teacher's vocabulary against it now (the
            check also runs when the step is first traced).
        chunk_size: tokens per LM-head chunk (None: ``edl.ops.losses.default_chunk_size``).
        environment, tokenizer, max_turns: sampled steps roll out conversations of up to
            ``max_turns`` turns with one ``environment()`` per row, rendered by
            ``tokenizer``'s chat template; batches are then prompt records
            (``edl.train.distill_tools``; needs ``lmbda == 1`` or ``seq_kd``).

    Metrics: ``loss`` (the mean divergence per completion token), ``count`` (completion
    tokens), ``tokens`` and the train step's; host steps add :class:`DistillStep`'s.
    """
    who = "make_distill_step"
    if not 0.0 <= beta <= 1.0 or not temperature > 0 or not 0.0 <= lmbda <= 1.0:
        raise ValueError(
            f"{who}: need 0 <= beta <= 1, temperature > 0 and 0 <= lmbda <= 1, got "
            f"beta={beta}, temperature={temperature}, lmbda={lmbda}"
        )
    if student is not None:
        check_teacher(who, student, teacher)
    samples = lmbda > 0 or seq_kd
    if samples and (key is None or eos_token_id is None or max_new_tokens < 1):
        raise ValueError(
            f"{who}: lmbda > 0 or seq_kd samples completions: it needs key=, eos_token_id= "
            f"and max_new_tokens >= 1; got key {'given' if key is not None else 'None'}, "
            f"eos_token_id={eos_token_id}, max_new_tokens={max_new_tokens}"
        )

    if environment is not None:
        check_tool_options(who, tokenizer, lmbda, seq_kd, max_turns)

    def loss_fn(model: CausalLM, batch: Batch, frozen: CausalLM | None):
        if frozen is None:  # make_train_step's argument check traces nothing: no teacher yet
            frozen = teacher
        check_teacher(who, model, frozen)
        return distill_divergence(
            model, frozen, batch, beta=beta, temperature=temperature, chunk_size=chunk_size
        )

    update = _with_reference(loss_fn, optimizer, teacher, step_options, who)
    if not samples:
        return update
    options = {
        "lmbda": lmbda,
        "seq_kd": seq_kd,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "eos_token_id": int(eos_token_id),
        "pad_token_id": int(eos_token_id if pad_token_id is None else pad_token_id),
        **({} if environment is None else {"environment": environment}),
        "tokenizer": tokenizer,
        "max_turns": max_turns,
    }
    return DistillStep(update, teacher, options, key)

"""GRPO with tools, worked example: a tiny byte-level Llama learns by reinforcement to call a
calculator for products it cannot compute itself.

Task: the prompt is ``"347*812"`` (two random 3-digit numbers); the reward is 1 when the
final answer is the product's digits, else 0. A 2-layer Llama (hidden 64) cannot multiply;
it can only copy: the calculator ``mul(a, b)`` (an ``edl.train.ToolEnvironment`` tool,
called in the Hermes / Qwen format ``<tool_call>{"name": "mul", "arguments": {"a": 347,
"b": 812}}</tool_call>``) answers with the product, which the model then copies.

Warm-up (1000 steps of 32 conversations, ~5-8 minutes): an SFT on conversations of two
kinds in equal parts: the call, the tool's answer and the copied product, or a direct guess
(a random 6-digit number), loss on the model's own tokens. After it the model calls the
tool most of the time but copies digits (into the call's arguments, from the tool's answer)
unreliably at temperature 1; GRPO (``make_grpo_step(..., environment=...)``, up to 2 turns,
60 steps of 8 problems x 8 samples) must raise the reward (the fraction of exact answers)
from the reward alone: calling rather than guessing, and copying exactly. A guess is right
with probability about 1e-6: the task cannot be solved without the tool.

Copying is what the warm-up must teach (its loss falls from ~0.6 to ~0.25 when it does), and
when it does so varies by seed: seed 0 by step 300, seed 2 by 400, seed 1 not within 1000;
a seed whose warm-up never copies scores 0 on every rollout and GRPO gets no signal. The
script reports every seed (``benchmarks/RESULTS.md``, "grpo_tools").

The tokenizer: byte-level (every byte one token, no merges) plus the chat markers as special
tokens (``<|im_start|>``, ``<|im_end|>``, ``<tool_call>``, ``</tool_call>``,
``<tool_response>``, ``</tool_response>``), with a compact Qwen-style chat template
(:data:`TEMPLATE`: the tools' names in a system turn, tool results as user turns in
``<tool_response>``).

    python -m benchmarks.grpo_tools [--seeds 0 1 2] [--steps 60] [--sft-steps 1000]

Prints progress, then LAST one JSON line: settings and per seed the reward (and the rate of
rows that called a tool) over the first / last 5 GRPO steps, seconds in SFT and GRPO.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import edl
from edl.models import LlamaConfig, LlamaForCausalLM
from edl.train import GRPOConfig, make_grpo_step, make_train_step
from edl.train.environments import ToolEnvironment
from edl.train.multiturn import template_suffix

SPECIALS = (
    "<pad>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\ntools:"
    "{%- for t in tools %} {{ t.function.name }}{%- endfor %}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>"
    '{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}'
    "</tool_call>{%- endfor %}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A Qwen-style template: the model's tool calls as ``<tool_call>{json}</tool_call>``."""


def tool_tokenizer():
    """The byte-level chat tokenizer with tool markers (module docstring), an
    ``edl.text.HFTokenizer``; EOS ``<|im_end|>``, pad ``<pad>``."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from edl.text import HFTokenizer

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token="<|im_end|>",
        pad_token="<pad>",
        additional_special_tokens=list(SPECIALS[1:]),
    )
    fast.chat_template = TEMPLATE
    return HFTokenizer(fast, "tool-bytes")


def mul(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return int(a) * int(b)


def exact_answer(record, messages) -> float:
    """1.0 when the final answer is the product's digits."""
    return float(messages[-1]["content"].strip() == str(record["answer"]))


def environment() -> ToolEnvironment:
    """The calculator environment (``--environment benchmarks.grpo_tools:environment``)."""
    return ToolEnvironment([mul], reward=exact_answer, timeout=5.0)


def _problem(rng: np.random.Generator) -> dict:
    a, b = (int(x) for x in rng.integers(100, 1000, 2))
    return {"prompt": f"{a}*{b}", "answer": str(a * b), "a": a, "b": b}


def _call_text(a: int, b: int) -> str:
    return f'<tool_call>{{"name": "mul", "arguments": {{"a": {a}, "b": {b}}}}}'


def sft_example(tok, problem: dict, call: bool, rng: np.random.Generator):
    """``(ids, own)`` of one warm-up conversation laid out as a rollout lays it out: the
    prompt; then either the call (ended by ``</tool_call>``), the template's tool turn and
    the copied product, or a guess (a random 6-digit number); ``own``: the model's tokens."""
    eos, env = tok.eos_id, environment()
    prompt = tok.apply_chat_template(
        env.reset(problem), add_generation_prompt=True, tools=env.tools
    )
    parts: list[tuple[list[int], bool]] = []
    if call:
        parts.append((tok.encode(_call_text(problem["a"], problem["b"]) + "</tool_call>"), True))
        answer = [{"role": "tool", "name": "mul", "content": problem["answer"]}]
        parts.append(([eos, *template_suffix(tok, answer, eos)], False))
        parts.append(([*tok.encode(problem["answer"]), eos], True))
    else:
        parts.append(([*tok.encode(str(int(rng.integers(10**5, 10**6)))), eos], True))
    ids = prompt + [t for p, _ in parts for t in p]
    own = [False] * len(prompt) + [o for p, o in parts for _ in p]
    return ids, own


def _sft_batches(tok, rng: np.random.Generator, batch: int, width: int):
    while True:
        ids = np.full((batch, width), tok.pad_id, np.int32)
        labels = np.full((batch, width), -100, np.int32)
        for i in range(batch):
            row, own = sft_example(tok, _problem(rng), bool(i % 2), rng)
            ids[i, : len(row)] = row
            labels[i, : len(row)] = np.where(own, row, -100)
        yield {"input_ids": jnp.asarray(ids), "labels": jnp.asarray(labels)}


def sft_model(tok, seed: int, steps: int, rng: np.random.Generator, lr: float):
    """The seed's Llama from scratch after ``steps`` warm-up steps of 32 conversations."""
    config = LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM.init(config, key=jax.random.key(seed))
    tx = optax.adam(lr)
    state = edl.create_state(model, tx)
    pad = tok.pad_id

    def loss_fn(m, b):
        return m.compute_loss(b["input_ids"], b["labels"], attention_mask=b["input_ids"] != pad)

    step = make_train_step(loss_fn, tx)
    data = _sft_batches(tok, rng, 32, 160)
    for i in range(steps):
        state, metrics = step(state, next(data))
        if (i + 1) % 100 == 0:
            print(f"  sft {i + 1}: loss {float(metrics['loss']):.3f}", flush=True)
    return edl.state.model(state)


def run_seed(args: argparse.Namespace, seed: int) -> dict:
    """SFT warm-up then GRPO with the calculator for one seed; the run's numbers."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    tok = tool_tokenizer()
    model = sft_model(tok, seed, args.sft_steps, rng, args.sft_lr)
    sft_s = time.perf_counter() - t0
    config = GRPOConfig(
        num_generations=args.generations,
        max_new_tokens=64,
        max_turns=2,
        temperature=1.0,
        loss_type=args.loss_type,
    )
    tx = optax.adam(args.lr)
    step = make_grpo_step(
        tx, tok, [], config, key=jax.random.key(seed + 1), environment=environment
    )
    state = edl.create_state(model, tx)
    del model
    history = []
    for i in range(args.steps):
        prompts = [_problem(rng) for _ in range(args.prompts)]
        state, metrics = step(state, prompts)
        calls = [
            any(m.get("role") == "tool" for m in c) for c in step.last_rollout["conversations"]
        ]
        metrics["call_rate"] = float(np.mean(calls))
        history.append(metrics)
        print(
            f"  step {i + 1}: reward {metrics['reward_mean']:.3f} calls "
            f"{metrics['call_rate']:.2f} turns {metrics['turns']:.2f} "
            f"({metrics['sample_s']:.1f} s sampling, {metrics['train_s']:.1f} s train)",
            flush=True,
        )
    k = max(1, min(5, len(history) // 4))
    mean = lambda rows, key: float(np.mean([r[key] for r in rows]))
    return {
        "seed": seed,
        "reward_first": mean(history[:k], "reward_mean"),
        "reward_last": mean(history[-k:], "reward_mean"),
        "call_rate_first": mean(history[:k], "call_rate"),
        "call_rate_last": mean(history[-k:], "call_rate"),
        "sft_s": sft_s,
        "grpo_s": time.perf_counter() - t0 - sft_s,
        "sample_s": sum(r["sample_s"] for r in history),
        "train_s": sum(r["train_s"] for r in history),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="one run per seed")
    p.add_argument("--steps", type=int, default=60, help="GRPO steps per seed")
    p.add_argument("--prompts", type=int, default=8, help="problems per GRPO step")
    p.add_argument("--generations", type=int, default=8, help="samples per problem")
    p.add_argument("--lr", type=float, default=1e-3, help="GRPO's Adam learning rate")
    p.add_argument("--loss-type", default="dapo", help="GRPOConfig.loss_type")
    p.add_argument("--sft-steps", type=int, default=1000, help="warm-up SFT steps")
    p.add_argument("--sft-lr", type=float, default=3e-3, help="warm-up Adam learning rate")
    return p


def main() -> None:
    args = build_parser().parse_args()
    results = [run_seed(args, seed) for seed in args.seeds]
    for r in results:
        print(
            f"seed {r['seed']}: reward {r['reward_first']:.3f} -> {r['reward_last']:.3f}, "
            f"tool calls {r['call_rate_first']:.2f} -> {r['call_rate_last']:.2f} "
            f"(sft {r['sft_s']:.0f} s, grpo {r['grpo_s']:.0f} s)"
        )
    print(json.dumps({"settings": vars(args), "results": results}))


if __name__ == "__main__":
    main()

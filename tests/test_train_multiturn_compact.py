"""Multi-turn rollouts decode only the rows still going (``multiturn.turn_batch_size``),
with exactly the tokens, masks and rewards of the full-batch turns they replace."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import pytest

from edl.train import multiturn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

pytest.importorskip("transformers")

from benchmarks.grpo_tools import tool_tokenizer  # noqa: E402


def test_turn_batch_sizes_are_powers_of_two_capped_at_the_rows():
    sizes = [multiturn.turn_batch_size(a, 12) for a in range(1, 13)]
    assert sizes == [1, 2, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12]
    assert multiturn.turn_batch_size(8, 8) == 8
    with pytest.raises(ValueError, match="need 1 <= active <= rows, got 0, 4"):
        multiturn.turn_batch_size(0, 4)


class _Chatter:
    """Answers every turn with a user message; done when the turn's text has an even
    length, so rows end at different turns. Reward: the turn's length."""

    tools = None
    stop = None

    def reset(self, record):
        return [{"role": "user", "content": record["prompt"]}]

    def step(self, message):
        n = len(message["content"])
        return [{"role": "user", "content": "go on"}], float(n), n % 2 == 0


def _eos_prone_model(tok):
    """A tiny random Llama whose turns often end after a few tokens: a constant direction in
    every embedding carries through the residual stream to a large EOS logit."""
    from edl.models import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    import equinox as eqx

    model = LlamaForCausalLM.init(config, key=jax.random.key(0))
    embed = model.model.embed_tokens.weight.at[:, 0].add(3.0)
    head = model.lm_head.weight.at[tok.eos_id, 0].set(1.0)
    where = lambda m: (m.model.embed_tokens.weight, m.lm_head.weight)
    return eqx.tree_at(where, model, (embed, head))


def _rollout(tok, model, monkeypatch, full: bool):
    if full:  # the old path: every turn generates a batch of all the rows
        monkeypatch.setattr(multiturn, "turn_batch_size", lambda active, rows: rows)
    sizes = []
    generate_turn = multiturn._generate_turn

    def recording(model, rows, key, sampling, size):
        sizes.append((len(rows), size))
        return generate_turn(model, rows, key, sampling, size)

    monkeypatch.setattr(multiturn, "_generate_turn", recording)
    rows = multiturn.multi_turn_rollout(
        model,
        tok,
        [_Chatter() for _ in range(8)],
        [{"prompt": p} for p in ("ab", "cd", "efg", "h") for _ in range(2)],
        key=jax.random.key(5),
        max_turns=4,
        eos_id=tok.eos_id,
        sampling={"max_new_tokens": 6, "temperature": 1.0, "pad_token_id": tok.pad_id},
    )
    monkeypatch.undo()
    return rows, sizes


@pytest.mark.slow  # two rollouts of a tiny model, generate compiled per batch size (~30 s)
def test_compacted_turns_match_full_batch_turns(monkeypatch):
    tok = tool_tokenizer()
    model = _eos_prone_model(tok)
    new, new_sizes = _rollout(tok, model, monkeypatch, full=False)
    old, old_sizes = _rollout(tok, model, monkeypatch, full=True)
    assert [n for n, _ in new_sizes] == [n for n, _ in old_sizes]
    assert all(size == 8 for _, size in old_sizes)
    assert [size for _, size in new_sizes] == [
        multiturn.turn_batch_size(n, 8) for n, _ in new_sizes
    ]
    assert any(size < 8 for _, size in new_sizes), new_sizes  # some turn was compacted
    for a, b in zip(new, old, strict=True):
        assert (a.tokens, a.own, a.reward, a.turns, a.truncated) == (
            b.tokens,
            b.own,
            b.reward,
            b.turns,
            b.truncated,
        )
    batch_new = multiturn.trajectory_batch(new, tok.pad_id)
    batch_old = multiturn.trajectory_batch(old, tok.pad_id)
    for k in batch_new:
        assert (batch_new[k] == batch_old[k]).all(), k

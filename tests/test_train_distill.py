"""Distillation: ``distill_loss`` vs TRL 1.16's own ``GKDTrainer.generalized_jsd_loss`` on
fixed inputs, the chunked form vs the unchunked one and float64 autodiff, the teacher's
vocabulary check, GKD data, and ``make_distill_step`` (off- and on-policy) training a student
towards a teacher of another width and depth, resuming bit-exactly."""

from __future__ import annotations

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import edl
from edl.models import LlamaConfig, LlamaForCausalLM
from edl.text import ByteTokenizer
from edl.train import CheckpointConfig, LogConfig, RunConfig, train
from edl.train.distill import DistillStep, distill_divergence, make_distill_step
from edl.train.distill_data import DistillBatches, encode_distill
from edl.train.distill_loss import chunked_distill_loss, distill_loss
from tests.conftest import TINY_LLAMA

torch = pytest.importorskip("torch")

_RNG = np.random.default_rng(11)
_STUDENT = _RNG.normal(0.0, 3.0, (2, 6, 13))
_TEACHER = _RNG.normal(0.0, 3.0, (2, 6, 13))
_LABELS = _RNG.integers(0, 13, (2, 6))
_LABELS[0, :3] = -100  # a prompt
_LABELS[1, -1] = -100  # padding


def _trl_jsd(student, teacher, labels, *, beta, temperature):
    """TRL's ``GKDTrainer.generalized_jsd_loss`` (trl/experimental/gkd/gkd_trainer.py), in
    float64."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's "experimental" warning
        from trl.experimental.gkd.gkd_trainer import GKDTrainer
    return GKDTrainer.generalized_jsd_loss(
        torch.tensor(student),
        torch.tensor(teacher),
        torch.tensor(labels),
        beta=beta,
        temperature=temperature,
    ).item()


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_distill_loss_matches_trl(beta, temperature):
    """beta 0: forward KL(teacher || student), 1: reverse, 0.5: TRL's mixture JSD; the
    masked mean over completion tokens; float64 exactly, float32 to rounding."""
    want = _trl_jsd(_STUDENT, _TEACHER, _LABELS, beta=beta, temperature=temperature)
    mask = jnp.asarray(_LABELS != -100)
    with jax.enable_x64(True):
        got, metrics = distill_loss(
            jnp.asarray(_STUDENT), jnp.asarray(_TEACHER), mask, beta=beta, temperature=temperature
        )
        assert got.dtype == jnp.float64 and int(metrics["count"]) == int(np.sum(_LABELS != -100))
        np.testing.assert_allclose(float(got), want, rtol=1e-12)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    got32, _ = distill_loss(
        f32(_STUDENT), f32(_TEACHER).astype(jnp.bfloat16), mask, beta=beta, temperature=temperature
    )
    assert got32.dtype == jnp.float32  # bfloat16 teacher logits widened, never computed in 16 bits
    want32 = _trl_jsd(
        _STUDENT,
        np.asarray(f32(_TEACHER).astype(jnp.bfloat16)).astype(np.float64),
        _LABELS,
        beta=beta,
        temperature=temperature,
    )
    np.testing.assert_allclose(float(got32), want32, rtol=2e-5)


def test_distill_loss_of_identical_models_is_zero_and_of_nothing_counted_is_zero():
    x = jnp.asarray(_STUDENT, jnp.float32)
    for beta in (0.0, 0.3, 1.0):
        loss, _ = distill_loss(x, x, jnp.ones(x.shape[:2], bool), beta=beta)
        assert abs(float(loss)) < 1e-6
    loss, metrics = distill_loss(x, x + 1.0, jnp.zeros(x.shape[:2], bool), beta=0.5)
    assert float(loss) == 0.0 and int(metrics["count"]) == 0  # not NaN


def _heads(seed=0, batch=2, seq=7, ds=5, dt=9, vocab=13):
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(batch, seq, ds)),
        rng.normal(size=(vocab, ds)),
        rng.normal(size=(batch, seq, dt)),
        rng.normal(size=(vocab, dt)),
        rng.random((batch, seq)) < 0.7,
    )


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_chunked_equals_unchunked_and_its_gradients_match_float64_autodiff(beta):
    """The chunked form over two heads of different widths (several chunks, a ragged last
    one) equals distill_loss on the full logits; its gradients reach the student's hidden
    states and head only, equal to float64 autodiff of the unchunked loss."""
    hs, ws, ht, wt, mask = _heads()
    options = dict(beta=beta, temperature=1.5)

    def unchunked(hs, ws, ht, wt):
        s, t = jnp.einsum("bsd,vd->bsv", hs, ws), jnp.einsum("bsd,vd->bsv", ht, wt)
        return distill_loss(s, t, jnp.asarray(mask), **options)[0]

    def chunked(hs, ws, ht, wt, chunk_size=4):
        return chunked_distill_loss(
            hs, ws, ht, wt, jnp.asarray(mask), chunk_size=chunk_size, **options
        )[0]

    with jax.enable_x64(True):
        args = [jnp.asarray(a) for a in (hs, ws, ht, wt)]
        want = unchunked(*args)
        np.testing.assert_allclose(float(chunked(*args)), float(want), rtol=1e-12)
        np.testing.assert_allclose(float(chunked(*args, chunk_size=100)), float(want), rtol=1e-12)
        g64 = jax.jit(jax.grad(unchunked, argnums=(0, 1)))(*args)
        g_chunked = jax.jit(jax.grad(chunked, argnums=(0, 1, 2, 3)))(*args)
        for a, b in zip(g_chunked[:2], g64, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-10, atol=1e-14)
        assert not np.any(np.asarray(g_chunked[2])) and not np.any(np.asarray(g_chunked[3]))
    args32 = [jnp.asarray(a, jnp.float32) for a in (hs, ws, ht, wt)]
    g32 = jax.jit(jax.grad(chunked, argnums=(0, 1)))(*args32)
    for a, b in zip(g32, g64, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=1e-6)


def test_losses_check_their_inputs():
    x = jnp.zeros((2, 3, 5))
    mask = jnp.ones((2, 3), bool)
    with pytest.raises(ValueError, match=r"0 <= beta <= 1 and temperature > 0, got beta=1\.5"):
        distill_loss(x, x, mask, beta=1.5)
    with pytest.raises(ValueError, match=r"temperature=0\.0"):
        distill_loss(x, x, mask, temperature=0.0)
    with pytest.raises((ValueError, TypeError), match=r"vocab|2, 3, 6"):  # jaxtyping or ours
        distill_loss(x, jnp.zeros((2, 3, 6)), mask)
    with pytest.raises((ValueError, TypeError), match=r"float|Float"):
        distill_loss(x.astype(jnp.int32), x, mask)
    hs, ws, ht, _, _ = _heads()
    with pytest.raises((ValueError, TypeError), match="vocab"):  # jaxtyping's or ours
        chunked_distill_loss(
            *map(jnp.asarray, (hs, ws, ht)), jnp.zeros((14, 9)), jnp.ones((2, 7), bool)
        )


_VOCAB = ByteTokenizer().vocab_size


def _models():
    """A 2-layer width-32 student and a 3-layer width-48 teacher on the byte tokenizer's
    vocabulary."""
    small = {**TINY_LLAMA, "vocab_size": _VOCAB}
    student = LlamaForCausalLM.init(LlamaConfig(**small), key=jax.random.key(0))
    wider = {**small, "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 3}
    teacher = LlamaForCausalLM.init(LlamaConfig(**wider), key=jax.random.key(5))
    # A peaked teacher: its distribution is worth learning and far from the student's.
    peaked = lambda x: x * 3.0 if x.ndim == 2 and x.shape[0] == _VOCAB else x
    return student, jax.tree.map(peaked, teacher)


def test_a_teacher_of_another_vocabulary_is_refused_naming_both_sizes():
    abstract = lambda **c: eqx.filter_eval_shape(
        LlamaForCausalLM.init, LlamaConfig(**{**TINY_LLAMA, **c}), key=jax.random.key(0)
    )
    student, other = abstract(), abstract(vocab_size=80, hidden_size=48)
    with pytest.raises(ValueError, match="student vocab_size 64, teacher vocab_size 80"):
        make_distill_step(optax.sgd(0.1), other, student=student)
    with pytest.raises(ValueError, match="needs key=, eos_token_id="):
        make_distill_step(optax.sgd(0.1), other, lmbda=0.5)
    with pytest.raises(ValueError, match=r"lmbda=2\.0"):
        make_distill_step(optax.sgd(0.1), other, lmbda=2.0)


def _docs(n=12):
    """Byte-level prompt / completion records (the CLI test covers chat messages)."""
    tok = ByteTokenizer()
    records = [
        {"prompt": f"q{i % 5}: ", "completion": "abc"[i % 3] * (2 + i % 4)} for i in range(n)
    ]
    return [encode_distill(tok, r, where=f"r{i}") for i, r in enumerate(records)]


def test_distill_records_and_batches():
    """prompt / completion records tokenized as TRL's preference prompt / chosen; messages
    split before the assistant's last turn; rows right-padded with the prompts also
    left-padded for sampling; resumable."""
    tok = ByteTokenizer()
    doc = encode_distill(tok, {"prompt": "hi ", "completion": "yo"})
    assert list(doc["prompt_ids"]) == [*b"hi "] and list(doc["completion_ids"])[-1] == tok.eos_id
    data = DistillBatches([doc, doc], batch_size=2, max_length=8, pad_id=0, shuffle=False)
    batch = next(data)
    assert batch["input_ids"][0].tolist() == [*b"hi yo", tok.eos_id, 0, 0]
    assert batch["labels"][0].tolist() == [-100] * 3 + [*b"yo", tok.eos_id, -100, -100]
    assert batch["prompt_ids"][0].tolist() == [0] * 5 + [*b"hi "]
    assert batch["prompt_mask"][0].tolist() == [0] * 5 + [1] * 3
    with pytest.raises(ValueError, match="r3: the last of 'messages' must be the assistant"):
        encode_distill(tok, {"messages": [{"role": "user", "content": "a"}] * 2}, where="r3")
    with pytest.raises(ValueError, match="r4: a distillation record needs 'messages' or"):
        encode_distill(tok, {"prompt": "a"}, where="r4")
    data = DistillBatches(_docs(), batch_size=4, max_length=16, pad_id=0, seed=2)
    next(data)
    position = data.position
    after = next(data)
    data.restore(position)
    for key, value in next(data).items():
        np.testing.assert_array_equal(value, after[key], err_msg=key)


def _held_out_kl(model, teacher, batch):
    return float(distill_divergence(model, teacher, batch, beta=0.0, temperature=1.0)[0])


@pytest.mark.slow  # 16 off-policy updates of tiny models (~50 s on the shared 2-core VM)
def test_off_policy_distillation_lowers_the_students_kl_to_the_teacher():
    student, teacher = _models()
    tx = optax.adam(3e-3)
    data = DistillBatches(_docs(), batch_size=4, max_length=16, pad_id=0, seed=1)
    held_out = next(DistillBatches(_docs(8), batch_size=4, max_length=16, pad_id=0, seed=9))
    before = _held_out_kl(student, teacher, held_out)
    step = make_distill_step(tx, teacher, beta=0.0, student=student)
    state = edl.create_state(student, tx)
    losses = []
    for _ in range(16):
        state, metrics = step(state, next(data))
        losses.append(float(metrics["loss"]))
    assert int(metrics["count"]) > 0 and losses[-1] < losses[0]
    after = _held_out_kl(edl.merge(state.params, state.other), teacher, held_out)
    assert after < 0.8 * before, (before, after)


def _run(tmp_path, steps, student, teacher):
    tx = optax.adam(3e-3)
    step = make_distill_step(
        tx,
        teacher,
        beta=0.5,
        lmbda=0.5,
        seq_kd=True,
        max_new_tokens=4,
        eos_token_id=ByteTokenizer().eos_id,
        pad_token_id=0,
        key=jax.random.key(3),
    )
    assert isinstance(step, DistillStep)
    data = DistillBatches(_docs(), batch_size=4, max_length=12, pad_id=0, seed=1)
    run = RunConfig(
        steps=steps,
        output_dir=tmp_path,
        checkpoint=CheckpointConfig(every=2),
        log=LogConfig(progress=False),
    )
    fresh = jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, student)
    return train(edl.create_state(fresh, tx), step, data, run), step  # the step donates it


@pytest.mark.slow  # three short on-policy runs through train(), a resume (~90 s, shared 2-core VM)
def test_on_policy_distillation_resumes_bit_exactly(tmp_path):
    """lmbda 0.5 with seq_kd: each step trains on the student's samples, the teacher's or
    (never here, seq_kd) the data's, by a seeded draw; a run stopped at step 2 and resumed
    ends with the uninterrupted run's parameters."""
    student, teacher = _models()
    (state_a, _), step = _run(tmp_path / "a", 4, student, teacher)
    sources = [step.source(s) for s in range(4)]
    assert set(sources) == {"student", "teacher"}, sources  # both kinds exercised
    _run(tmp_path / "b", 2, student, teacher)
    (state_b, summary_b), _ = _run(tmp_path / "b", 4, student, teacher)
    assert summary_b["resumed_from"] is not None and summary_b["end_step"] == 4
    for a, b in zip(jax.tree.leaves(state_a.params), jax.tree.leaves(state_b.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

"""Inputs that would silently compute garbage raise early, naming what is wrong: token ids
and labels outside the vocabulary (eagerly and inside compiled programs, on a mesh too),
empty sequences."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_LLAMA

from edl.generate import init_cache
from edl.models import (
    LlamaConfig,
    LlamaForSequenceClassification,
    configure,
)
from edl.ops.checks import check_ids
from edl.sharding import make_mesh, shard_batch

# Under jax.jit the callback's ValueError reaches the caller as it is or wrapped in a
# JaxRuntimeError that carries its message.
RAISED = (ValueError, jax.errors.JaxRuntimeError)
VOCAB = TINY_LLAMA["vocab_size"]


def _ids(bad=None, shape=(2, 6)):
    ids = np.arange(np.prod(shape), dtype=np.int32).reshape(shape) % VOCAB
    if bad is not None:
        ids[1, 3] = bad
    return jnp.asarray(ids)


@pytest.mark.parametrize("bad", [-1, VOCAB, 10**6])
def test_out_of_vocabulary_ids_raise_eagerly(tiny_llama, bad):
    with pytest.raises(
        ValueError, match=rf"input_ids must lie in \[0, 64\) \(vocab_size 64\), got {bad}$"
    ):
        tiny_llama(_ids(bad))
    with pytest.raises(ValueError, match=rf"input_ids .* got {bad}$"):
        tiny_llama.compute_loss(_ids(bad))


def test_out_of_vocabulary_ids_raise_under_jit(tiny_llama):
    forward = eqx.filter_jit(lambda m, ids: m(ids).logits)
    assert forward(tiny_llama, _ids()).shape == (2, 6, VOCAB)
    with pytest.raises(RAISED, match=r"input_ids must lie in \[0, 64\) \(vocab_size 64\), got -1"):
        jax.block_until_ready(forward(tiny_llama, _ids(-1)))


def test_out_of_vocabulary_ids_and_labels_raise_in_scan_and_grad(tiny_llama):
    @eqx.filter_jit
    def grads(model, ids, labels):
        loss = lambda m, ids, labels: m.compute_loss(ids, labels)[0]
        step = lambda c, batch: (c, eqx.filter_grad(loss)(model, *batch).model.norm.weight)
        return jax.lax.scan(step, 0, (ids, labels))[1]

    ids = jnp.stack([_ids(), _ids()])
    labels = ids.at[:, 0, :2].set(-100)  # ignored labels are fine
    assert grads(tiny_llama, ids, labels).shape == (2, TINY_LLAMA["hidden_size"])
    with pytest.raises(RAISED, match=r"input_ids .* got 64"):
        jax.block_until_ready(grads(tiny_llama, ids.at[1].set(_ids(VOCAB)), labels))
    bad_labels = labels.at[1, 1, 1].set(-1)
    with pytest.raises(
        RAISED, match=r"labels must be -100 \(ignored\) or lie in \[0, 64\) .*got -1"
    ):
        jax.block_until_ready(grads(tiny_llama, ids, bad_labels))


def test_out_of_vocabulary_ids_raise_in_cached_decode(tiny_llama):
    @eqx.filter_jit
    def decode(model, token):
        return model(token, cache=init_cache(model.config, 2, 8)).logits

    jax.block_until_ready(decode(tiny_llama, _ids(shape=(2, 1))))
    with pytest.raises(RAISED, match=r"input_ids .* got 99"):
        jax.block_until_ready(decode(tiny_llama, jnp.full((2, 1), 99, jnp.int32)))


def test_out_of_vocabulary_ids_raise_on_a_mesh_without_hanging(tiny_llama):
    """Every device stops at the check: a callback on device 0 alone would leave the others
    waiting in the next collective (XLA aborts the process after 40 s)."""
    mesh = make_mesh((2, 2, 2, 1))
    loss = eqx.filter_jit(lambda m, ids: m.compute_loss(ids)[0])
    with jax.set_mesh(mesh):
        jax.block_until_ready(loss(tiny_llama, shard_batch(_ids(shape=(8, 6)), mesh)))
        bad = _ids(shape=(8, 6)).at[5, 2].set(VOCAB + 1)
        with pytest.raises(RAISED, match=r"input_ids .* got 65"):
            jax.block_until_ready(loss(tiny_llama, shard_batch(bad, mesh)))


def test_check_ids_under_vmap_raises_only_on_bad_values():
    """Under vmap the cond runs both branches: the callback itself decides."""
    f = jax.jit(jax.vmap(lambda x: check_ids(x, 10, name="tokens", what="size")))
    np.testing.assert_array_equal(f(jnp.ones((3, 2), jnp.int32)), 1)
    with pytest.raises(RAISED, match=r"tokens must lie in \[0, 10\) \(size 10\), got -3 and 12"):
        jax.block_until_ready(f(jnp.array([[1, -3], [12, 2]])))


def test_check_inputs_off_leaves_the_check_out(tiny_llama):
    def jaxpr(model):
        return str(jax.make_jaxpr(lambda ids: model.compute_loss(ids, ids))(_ids()))

    assert jaxpr(tiny_llama).count("pure_callback") == 2  # input_ids and labels
    assert "pure_callback" not in jaxpr(configure(tiny_llama, check_inputs=False))


def test_sequence_classification_labels_are_checked():
    config = LlamaConfig(**TINY_LLAMA, num_labels=3)
    model = LlamaForSequenceClassification.init(config, key=jax.random.key(0))
    with pytest.raises(
        ValueError,
        match=r"labels must be -100 \(ignored\) or lie in \[0, 3\) \(num_labels 3\), got 3",
    ):
        model.compute_loss(_ids(), jnp.array([3, -100]))


def test_empty_sequence_is_named(tiny_llama):
    empty = jnp.zeros((2, 0), jnp.int32)
    with pytest.raises(ValueError, match=r"input_ids has sequence length 0 \(shape \(2, 0\)\)"):
        tiny_llama(empty)
    with pytest.raises(ValueError, match="input_ids has sequence length 0"):
        tiny_llama.compute_loss(empty)
    with pytest.raises(ValueError, match="inputs_embeds has sequence length 0"):
        tiny_llama(inputs_embeds=jnp.zeros((1, 0, TINY_LLAMA["hidden_size"])))
    with pytest.raises(ValueError, match="input_ids has sequence length 0"):
        tiny_llama(empty, cache=init_cache(tiny_llama.config, 2, 4))


def test_run_time_choices_are_checked_when_the_config_is_built():
    with pytest.raises(ValueError, match=r"attention_impl must be one of .*'xla'.*got 'flash'"):
        LlamaConfig(**TINY_LLAMA).replace(attention_impl="flash")

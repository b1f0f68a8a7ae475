"""Weight decay skips biases and norm scales, as transformers' ``Trainer`` does: edl's
``weight_decay_mask`` against ``Trainer.get_decay_parameter_names`` on the same tiny HF
models (names compared with HF's layer indices dropped, edl's layer stacks being one key),
and AdamW's update of a zero gradient (decay alone) on each kind of leaf."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_parity import VOCAB, random_hf_model

import edl
from edl.io.formats import hf
from edl.train import OptimizerConfig, make_optimizer
from edl.train.optimizers import weight_decay_mask

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2)


def _hf_config(model_type):
    return {
        "qwen2": lambda: transformers.Qwen2Config(
            **SMALL, num_attention_heads=2, num_key_value_heads=1
        ),
        "gemma3_text": lambda: transformers.Gemma3TextConfig(
            **SMALL, num_attention_heads=2, num_key_value_heads=1, head_dim=8
        ),
        "gpt_oss": lambda: transformers.GptOssConfig(
            **SMALL,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            num_local_experts=2,
            num_experts_per_tok=1,
        ),
    }[model_type]()


def _hf_no_decay(model):
    decays = set(transformers.Trainer.get_decay_parameter_names(None, model))
    names = {n for n, _ in model.named_parameters()} - decays
    return {re.sub(r"\.\d+\.", ".", n) for n in names}


def _edl_no_decay(model):
    mask = edl.tree.flatten(weight_decay_mask(edl.split(model)[0]))
    return {path for path, decays in mask.items() if decays is False}


@pytest.mark.parametrize("model_type", ["qwen2", "gemma3_text", "gpt_oss"])
def test_the_leaves_without_decay_are_transformers_trainers(model_type):
    hf_model = random_hf_model(_hf_config(model_type), "causal_lm")
    model = hf.from_state_dict(hf_model.config.to_dict(), hf_model.state_dict())
    expected = _hf_no_decay(hf_model)
    assert any(n.endswith("bias") for n in expected) or model_type == "gemma3_text"
    assert _edl_no_decay(model) == expected


def test_adamw_decays_weights_and_embeddings_but_not_norms_or_biases():
    hf_model = random_hf_model(_hf_config("qwen2"), "causal_lm")
    model = hf.from_state_dict(hf_model.config.to_dict(), hf_model.state_dict())
    params = edl.split(model)[0]
    lr, wd = 0.1, 0.5
    tx, _ = make_optimizer(OptimizerConfig(learning_rate=lr, schedule="constant", weight_decay=wd))
    zeros = jax.tree.map(jnp.zeros_like, params)
    with jax.numpy_dtype_promotion("standard"):
        updates, _ = tx.update(zeros, tx.init(params), params)
    flat, before = edl.tree.flatten(updates), edl.tree.flatten(params)
    layer = "model.layers.self_attn"
    for path in (f"{layer}.q_proj.weight", "model.embed_tokens.weight", "lm_head.weight"):
        np.testing.assert_allclose(flat[path], -lr * wd * before[path], rtol=1e-6)
    for path in (
        f"{layer}.q_proj.bias",
        "model.norm.weight",
        "model.layers.input_layernorm.weight",
    ):
        np.testing.assert_array_equal(flat[path], 0.0)

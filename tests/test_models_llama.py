"""Llama-family parity with transformers (torch, float32) through real HF files.

Each model type gets a small random config exercising its features; weights go
HF -> save_pretrained -> edl.from_pretrained and back, and logits must agree to 1e-4 (why that
tolerance: tests/hf_parity.py).
"""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_parity import TOL, VOCAB, assert_close_on_real_tokens, padded_batch, random_hf_model

import edl
from edl.io.formats import hf
from edl.io.formats.safetensors import load_file
from edl.kernels import native
from edl.models import LlamaConfig, LlamaForCausalLM, configure, flops_per_token

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


# What a GPU run must check (benchmarks/device/run.sh runs the gpu-marked tests there).
pytestmark = pytest.mark.gpu


def _hf_configs():
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, pad_token_id=0)
    return {
        # GQA, tied head, llama3 RoPE scaling with positions past the original context.
        "llama": transformers.LlamaConfig(
            **common,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8,
            },
        ),
        # MQA and a sliding window shorter than the sequence; head_dim != hidden / heads.
        "mistral": transformers.MistralConfig(
            **common,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            sliding_window=5,
        ),
        # q/k/v bias; full-attention first layer then sliding-window layers.
        "qwen2": transformers.Qwen2Config(
            **common,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=4,
            max_window_layers=1,
        ),
        # q/k RMSNorm, untied head, linear RoPE scaling.
        "qwen3": transformers.Qwen3Config(
            **common,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=False,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        ),
    }


def _hf_model(model_type, task="causal_lm", **overrides):
    config = _hf_configs()[model_type]
    for k, v in overrides.items():
        setattr(config, k, v)
    return random_hf_model(config, task)


def _hf_logits(model, ids, mask):
    with torch.no_grad():
        return model(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_causal_lm_parity_round_trip(model_type, tmp_path):
    hf_model = _hf_model(model_type)
    hf_model.save_pretrained(tmp_path / "hf")
    model = edl.from_pretrained(tmp_path / "hf")
    assert isinstance(model, LlamaForCausalLM)
    assert model.config.model_type == model_type

    ids, mask = padded_batch()
    ref = _hf_logits(hf_model, ids, mask)
    logits = model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)).logits
    assert_close_on_real_tokens(logits, ref, mask)

    # Loss: HF ignores -100 labels; edl also takes the mask. The first real token after left
    # padding is not a target (edl never predicts from a padded position).
    labels = np.where(mask == 1, ids, -100)
    labels[1, 3] = -100
    with torch.no_grad():
        hf_loss = hf_model(
            torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels)
        ).loss.item()
    loss, metrics = model.compute_loss(
        jnp.asarray(ids), jnp.asarray(labels), attention_mask=jnp.asarray(mask), chunk_size=8
    )
    np.testing.assert_allclose(float(loss), hf_loss, rtol=1e-5)
    assert int(metrics["count"]) == int((labels[:, 1:] != -100).sum())

    # edl -> HF: same keys as transformers writes, and transformers reproduces the logits.
    edl.save_pretrained(model, tmp_path / "edl", max_shard_size="20KB")
    hf_keys = set(load_file(tmp_path / "hf" / "model.safetensors"))
    edl_keys = set(
        json.loads((tmp_path / "edl" / "model.safetensors.index.json").read_text())["weight_map"]
    )
    assert edl_keys == hf_keys
    tied = {"lm_head.weight"} if hf_model.config.tie_word_embeddings else set()
    assert edl_keys == set(hf_model.state_dict()) - tied
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "edl", attn_implementation="eager"
    ).eval()
    assert type(reloaded) is type(hf_model)
    np.testing.assert_allclose(_hf_logits(reloaded, ids, mask), ref, atol=0, rtol=0)


def _factors(n, low, high, seed):
    return np.random.default_rng(seed).uniform(low, high, n).tolist()


# Llama with each length-extending scaling over an 11-token batch: yarn's attention factor
# (plain, and DeepSeek's mscale ratio), longrope past its original context of 8 (long factors)
# and within one of 16 (short factors), and dynamic NTK past max_position_embeddings.
ROPE_SCALINGS = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
    "yarn_mscale": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 4,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
        "beta_fast": 8,
    },
    "longrope_long": {
        "rope_type": "longrope",
        "original_max_position_embeddings": 8,
        "short_factor": _factors(4, 1.0, 1.2, 0),
        "long_factor": _factors(4, 1.0, 6.0, 1),
    },
    "longrope_short": {
        "rope_type": "longrope",
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "short_factor": _factors(4, 1.0, 1.2, 2),
        "long_factor": _factors(4, 1.0, 6.0, 3),
    },
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
}


@pytest.mark.parametrize("scaling", list(ROPE_SCALINGS))
def test_rope_scalings_match_transformers(scaling):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8,
        pad_token_id=0,
        rope_parameters={"rope_theta": 100.0, **ROPE_SCALINGS[scaling]},
    )
    hf_model = random_hf_model(config, "causal_lm")
    model = hf.from_state_dict(hf_model.config.to_dict(), hf_model.state_dict())
    assert model.config.rope.rope_type == ROPE_SCALINGS[scaling]["rope_type"]
    ids, mask = padded_batch()
    ref = _hf_logits(hf_model, ids, mask)
    assert_close_on_real_tokens(_logits(model, ids, mask), ref, mask)
    # Written back, transformers builds the same model.
    again = transformers.LlamaConfig.from_dict(model.config.to_hf(["LlamaForCausalLM"]))
    assert again.rope_parameters == hf_model.config.rope_parameters | {
        k: v for k, v in again.rope_parameters.items() if k not in hf_model.config.rope_parameters
    }
    hf_again = transformers.AutoModelForCausalLM.from_config(again, attn_implementation="eager")
    hf_again.eval()
    hf_again.load_state_dict(hf_model.state_dict())
    np.testing.assert_array_equal(_hf_logits(hf_again, ids, mask), ref)


def _logits(model, ids, mask):
    return np.asarray(model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)).logits)


def test_sequence_classification_parity(tmp_path):
    hf_model = _hf_model("qwen2", "sequence_classification", num_labels=3)
    hf_model.save_pretrained(tmp_path)
    model = edl.from_pretrained(tmp_path)
    assert type(model).__name__ == "LlamaForSequenceClassification"
    ids, mask = padded_batch()
    labels = np.array([0, 2, 1])
    with torch.no_grad():
        out = hf_model(
            torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels)
        )
    logits = model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)).logits
    np.testing.assert_allclose(logits, out.logits.numpy(), atol=TOL)
    loss, _ = model.compute_loss(
        jnp.asarray(ids), jnp.asarray(labels), attention_mask=jnp.asarray(mask)
    )
    np.testing.assert_allclose(float(loss), out.loss.item(), rtol=1e-5)
    edl.save_pretrained(model, tmp_path / "edl")
    again = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "edl")
    assert type(again) is type(hf_model)


def test_hidden_states_and_inputs_embeds_match_hf(tmp_path):
    hf_model = _hf_model("llama")
    model = hf.from_state_dict(hf_model.config.to_dict(), hf_model.state_dict())
    ids, _ = padded_batch(seed=1)
    with torch.no_grad():
        ref = hf_model(torch.tensor(ids), output_hidden_states=True).hidden_states
    out = model(jnp.asarray(ids), output_hidden_states=True)
    n = model.config.num_hidden_layers
    assert out.hidden_states.shape == (n + 1, *ids.shape, 32)
    # HF: embeddings, each layer's output, except the last entry is after the final norm.
    for i in range(n):
        np.testing.assert_allclose(out.hidden_states[i], ref[i].numpy(), atol=TOL)
    embeds = model.model.embed_tokens(jnp.asarray(ids))
    by_embeds = model(inputs_embeds=embeds).logits
    np.testing.assert_array_equal(by_embeds, out.logits)
    # compute_loss takes the embeddings too (with labels), and HF agrees on the loss.
    loss, _ = model.compute_loss(inputs_embeds=embeds, labels=jnp.asarray(ids))
    with torch.no_grad():
        ref_loss = hf_model(
            inputs_embeds=torch.tensor(np.asarray(embeds)), labels=torch.tensor(ids)
        ).loss
    assert abs(float(loss) - float(ref_loss)) <= TOL
    with pytest.raises(ValueError, match="with inputs_embeds, pass labels"):
        model.compute_loss(inputs_embeds=embeds)


@pytest.mark.parametrize(
    ("model_type", "variants"),
    [
        pytest.param(
            "qwen2",
            ({"scan_layers": False}, {"remat": "full"}, {"remat": "dots"}),
            marks=pytest.mark.slow,  # three more compiles of a train step
        ),
        ("mistral", ({"scan_layers": False},)),  # remat is schedule-independent: qwen2's
    ],
)
def test_scan_unrolled_and_remat_agree(model_type, variants):
    model = hf.from_state_dict(*_state(model_type))
    ids, mask = (jnp.asarray(x) for x in padded_batch())

    def loss(m):
        return m.compute_loss(ids, attention_mask=mask, chunk_size=16)[0]

    # Compiled whole: eagerly, each op of the scan and its gradient compiles on its own.
    value_and_grad = eqx.filter_jit(jax.value_and_grad(loss))
    base_loss, base_grads = value_and_grad(model)
    for changes in variants:
        v_loss, v_grads = value_and_grad(configure(model, **changes))
        np.testing.assert_allclose(v_loss, base_loss, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(v_grads), jax.tree.leaves(base_grads), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)


def _state(model_type):
    hf_model = _hf_model(model_type)
    return hf_model.config.to_dict(), hf_model.state_dict()


def test_packed_segments_equal_separate_sequences():
    model = hf.from_state_dict(*_state("mistral"))
    rng = np.random.default_rng(3)
    a, b = rng.integers(1, VOCAB, (1, 7)), rng.integers(1, VOCAB, (1, 6))
    packed = jnp.asarray(np.concatenate([a, b], axis=1))
    segments = jnp.asarray([[1] * 7 + [2] * 6])
    logits = model(packed, segment_ids=segments).logits
    np.testing.assert_allclose(logits[:, :7], model(jnp.asarray(a)).logits, atol=1e-5)
    np.testing.assert_allclose(logits[:, 7:], model(jnp.asarray(b)).logits, atol=1e-5)
    # The loss never asks the last token of `a` to predict the first of `b`.
    _, metrics = model.compute_loss(packed, segment_ids=segments)
    assert int(metrics["count"]) == 6 + 5


def test_sharded_checkpoint_equals_single_file(tmp_path):
    hf_model = _hf_model("qwen3")
    hf_model.save_pretrained(tmp_path / "one")
    hf_model.save_pretrained(tmp_path / "many", max_shard_size="10KB")
    assert (tmp_path / "many" / "model.safetensors.index.json").exists()
    one, many = edl.from_pretrained(tmp_path / "one"), edl.from_pretrained(tmp_path / "many")
    for (p, x), (q, y) in zip(
        edl.tree.flatten(one).items(), edl.tree.flatten(many).items(), strict=True
    ):
        assert p == q
        np.testing.assert_array_equal(x, y)


def test_dtype_on_load_and_save(tmp_path):
    hf_model = _hf_model("llama")
    hf_model.save_pretrained(tmp_path / "hf")
    model = edl.from_pretrained(tmp_path / "hf", dtype=jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(model)} == {jnp.dtype(jnp.bfloat16)}
    edl.save_pretrained(model, tmp_path / "bf16")
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert again.model.embed_tokens.weight.dtype == torch.bfloat16
    stored = edl.from_pretrained(tmp_path / "bf16")  # dtype=None keeps the stored bf16
    assert stored.model.embed_tokens.weight.dtype == jnp.bfloat16
    np.testing.assert_array_equal(stored.model.norm.weight, model.model.norm.weight)


def _random_model(model_type):
    config = LlamaConfig.from_hf(_hf_configs()[model_type].to_dict())
    return LlamaForCausalLM.init(config, key=jax.random.key(1))


def test_to_torch():
    model = _random_model("qwen3")
    ids, mask = padded_batch()
    torch_model = hf.to_torch(model)
    assert edl.count_params(model) == sum(p.numel() for p in torch_model.parameters())
    text = edl.summary(model)
    assert "model.layers.self_attn.q_norm.weight" in text and "(2, 16)" in text
    ref = _hf_logits(torch_model, ids, mask)
    assert_close_on_real_tokens(
        model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)).logits, ref, mask
    )


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_flops_per_token(model_type):
    model = _random_model(model_type)
    # flops_per_token against a count from the model itself: 2 flops per weight of every
    # projection (the stacked Linear weights and the head) plus q.k and p.v over the keys
    # each query really sees, counted from the attention masks.
    c = model.config
    matmul_weights = (
        sum(x.size for p, x in edl.tree.flatten(model).items() if p.endswith("proj.weight"))
        + model.head_weight.size
    )
    for seq in (4, 9):
        visible = sum(
            int(edl.ops.attention_mask(seq, seq, causal=True, window=w).sum())
            for w in c.layer_windows
        )
        attn = 2 * 2 * c.num_attention_heads * c.head_dim * visible / seq
        expected = 2 * matmul_weights + attn
        assert flops_per_token(c, seq, training=False) == pytest.approx(expected)
        assert flops_per_token(c, seq) == pytest.approx(3 * expected)


def test_from_state_dict_takes_a_bf16_torch_state_dict():
    hf_model = _hf_model("qwen3").to(torch.bfloat16)
    model = edl.from_state_dict(hf_model.config.to_dict(), hf_model.state_dict())
    weight = model.model.layers.mlp.up_proj.weight
    assert weight.dtype == jnp.bfloat16
    expected = hf_model.model.layers[1].mlp.up_proj.weight.float().detach().numpy()
    np.testing.assert_array_equal(np.asarray(weight[1], np.float32), expected)


def _qwen2_loss_and_jaxpr():
    model = hf.from_state_dict(*_state("qwen2"))
    ids, mask = (jnp.asarray(x) for x in padded_batch())

    def loss(m):
        return m.compute_loss(ids, attention_mask=mask, chunk_size=16)[0]

    def jaxpr(m):
        return str(jax.make_jaxpr(jax.value_and_grad(loss))(m))

    return model, loss, jaxpr


def test_default_attention_path_is_the_backends_kernel():
    """Models use impl="auto": on CPU the native kernel (where it can be built), elsewhere the
    Pallas kernel, in the forward pass and in the gradient; attention_impl="pallas" and "xla"
    trace their own paths."""
    model, _, jaxpr = _qwen2_loss_and_jaxpr()
    pallas_names = {"edl_flash_attention_fwd", "edl_flash_attention_dq", "edl_flash_attention_dkdv"}
    native_names = {"edl_flash_attention_forward", "edl_flash_attention_backward"}
    on_native = jax.default_backend() == "cpu" and native.unavailable() is None
    auto = jaxpr(model)
    assert all(name in auto for name in (native_names if on_native else pallas_names))
    pallas = jaxpr(configure(model, attention_impl="pallas"))
    assert "pallas_call" in pallas and all(name in pallas for name in pallas_names)
    xla = jaxpr(configure(model, attention_impl="xla"))
    assert "pallas_call" not in xla and "edl_flash_attention_forward" not in xla


@pytest.mark.slow  # the Pallas kernels interpreted through a whole loss and gradient (~12 s)
def test_every_attention_path_computes_the_defaults_loss():
    model, loss, _ = _qwen2_loss_and_jaxpr()
    np.testing.assert_allclose(
        loss(configure(model, attention_impl="pallas")), loss(model), rtol=1e-6
    )
    np.testing.assert_allclose(loss(configure(model, attention_impl="xla")), loss(model), rtol=1e-6)

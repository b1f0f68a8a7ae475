"""Gemma, Gemma 2, Mixtral and Qwen3-MoE parity with transformers (torch, float32) through
real HF files, as the Llama family's suite does (tests/test_models_llama.py).

Each config exercises its family's features: Gemma's (1 + w) norms, scaled embeddings, GeGLU
and MQA; Gemma 2's soft-capping (small caps, so tanh is far from linear), query scalar,
alternating sliding / global layers over an odd number of layers (a scanned pair plus a
tail) and sandwich norms; Mixtral's sliding window and renormalised top-2 of 4 experts;
Qwen3-MoE's q/k norms, unnormalised top-k, a dense layer among MoE ones (two stacks) and
experts narrower than the dense MLP. The auxiliary loss is switched on (coefficient 0.1, so
it shows in the loss). Tolerances as in the Llama suite: 1e-4 on logits, 1e-5 relative on
losses.
"""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_parity import TOL, VOCAB, assert_close_on_real_tokens, padded_batch, random_hf_model

import edl
from edl.generate import generate
from edl.io.formats import hf
from edl.io.formats.safetensors import load_file
from edl.models import configure, flops_per_token, registry

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TYPES = ["gemma", "gemma2", "mixtral", "qwen3_moe", "olmo2", "olmo3", "smollm3", "gemma3_text"]
# The families of tests/test_models_olmo_smollm3_gemma3.py (their other checks are there).
NEW_TYPES = ("olmo2", "olmo3", "smollm3", "gemma3_text")


def _hf_config(model_type, **overrides):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, pad_token_id=0)
    config = {
        "gemma": lambda: transformers.GemmaConfig(
            **common,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
        ),
        "gemma2": lambda: transformers.Gemma2Config(
            **common,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=4,
            query_pre_attn_scalar=20,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        ),
        "mixtral": lambda: transformers.MixtralConfig(
            **common,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=5,
            output_router_logits=True,
            router_aux_loss_coef=0.1,
        ),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            **common,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            mlp_only_layers=[2],
            norm_topk_prob=False,
            output_router_logits=True,
            router_aux_loss_coef=0.1,
        ),
        # Norms after attention / MLP, q/k norms over all heads, attention biases.
        "olmo2": lambda: transformers.Olmo2Config(
            **common,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            attention_bias=True,
        ),
        # Three sliding layers then a global one, plus a tail; the sliding layers with their
        # own RoPE base; a tied head.
        "olmo3": lambda: transformers.Olmo3Config(
            **common,
            num_hidden_layers=5,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=4,
            tie_word_embeddings=True,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
            },
        ),
        # NoPE every second layer, sliding windows on those, a tied head.
        "smollm3": lambda: transformers.SmolLM3Config(
            **common,
            num_hidden_layers=5,
            num_attention_heads=4,
            num_key_value_heads=2,
            no_rope_layer_interval=2,
            use_sliding_window=True,
            sliding_window=4,
        ),
        # One period of five sliding layers and a global one, plus a tail; linear scaling on
        # the global layers, a small local base; per-head (1 + w) q/k norms.
        "gemma3_text": lambda: transformers.Gemma3TextConfig(
            **common,
            num_hidden_layers=7,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=4,
            query_pre_attn_scalar=20,
            eos_token_id=None,  # HF's default (1) would end generations early
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
            },
        ),
    }[model_type]()
    for k, v in overrides.items():
        setattr(config, k, v)
    return config


def _hf_model(model_type, task="causal_lm", seed=0, std=0.2, **overrides):
    return random_hf_model(_hf_config(model_type, **overrides), task, seed=seed, std=std)


def _logits(model, ids, mask):
    return np.asarray(model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)).logits)


def _hf_forward(model, ids, mask, **kwargs):
    with torch.no_grad():
        return model(torch.tensor(ids), attention_mask=torch.tensor(mask), **kwargs)


# Mixtral checks MoE parity in the default set; Qwen3-MoE's (~22 s) is in the slow set.
@pytest.mark.parametrize(
    "model_type",
    [pytest.param(t, marks=pytest.mark.slow) if t == "qwen3_moe" else t for t in TYPES],
)
def test_causal_lm_parity_round_trip(model_type, tmp_path):
    hf_model = _hf_model(model_type)
    hf_model.save_pretrained(tmp_path / "hf")
    model = edl.from_pretrained(tmp_path / "hf")
    _, task = registry.family_of(model)
    assert task == "causal_lm" and model.config.model_type == model_type
    assert type(model).__name__ == type(hf_model).__name__

    ids, mask = padded_batch()
    labels = np.where(mask == 1, ids, -100)
    labels[1, 3] = -100  # edl never predicts from a padded position; HF must not count it
    ref = _hf_forward(hf_model, ids, mask, labels=torch.tensor(labels))
    assert_close_on_real_tokens(_logits(model, ids, mask), ref.logits.numpy(), mask)

    loss, metrics = model.compute_loss(
        jnp.asarray(ids), jnp.asarray(labels), attention_mask=jnp.asarray(mask), chunk_size=8
    )
    np.testing.assert_allclose(float(loss), ref.loss.item(), rtol=1e-5)
    if model.config.num_experts:
        # HF's loss includes router_aux_loss_coef * aux_loss (output_router_logits=True).
        np.testing.assert_allclose(float(metrics["aux_loss"]), ref.aux_loss.item(), rtol=1e-5)
        assert float(metrics["aux_loss"]) * 0.1 > 1e-3  # it really moved the loss

    # edl -> HF: the key set transformers writes (experts split per expert again), and
    # transformers reproduces the logits bit for bit.
    edl.save_pretrained(model, tmp_path / "edl", max_shard_size="20KB")
    hf_keys = set(load_file(tmp_path / "hf" / "model.safetensors"))
    index = json.loads((tmp_path / "edl" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == hf_keys
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "edl", attn_implementation="eager"
    ).eval()
    assert type(reloaded) is type(hf_model)
    np.testing.assert_array_equal(_hf_forward(reloaded, ids, mask).logits, ref.logits)

    # ... -> edl again: the same arrays under the same paths.
    again = edl.from_pretrained(tmp_path / "edl")
    flat, flat_again = edl.tree.flatten(model), edl.tree.flatten(again)
    assert flat.keys() == flat_again.keys()
    for path, x in flat.items():
        np.testing.assert_array_equal(flat_again[path], x, err_msg=path)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_experts_are_stacked_and_fused_state_dicts_load(model_type, tmp_path):
    """HF files keep one tensor per expert, transformers 5 in memory fuses them
    (``experts.gate_up_proj``): both load into the same stacked arrays."""
    hf_model = _hf_model(model_type)
    assert any("gate_up_proj" in k for k in hf_model.state_dict())
    hf_model.save_pretrained(tmp_path)
    from_files = edl.from_pretrained(tmp_path)
    from_memory = edl.from_state_dict(hf_model.config.to_dict(), hf_model.state_dict())
    for (p, x), (q, y) in zip(
        edl.tree.flatten(from_files).items(), edl.tree.flatten(from_memory).items(), strict=True
    ):
        assert p == q
        np.testing.assert_array_equal(x, y, err_msg=p)
    experts = from_files.model.layers.mlp.experts
    c = from_files.config
    moe_layers = c.layer_mlps.count("moe")
    assert experts.gate_proj.shape == (moe_layers, 4, c.expert_intermediate_size, 32)
    assert experts.down_proj.shape == (moe_layers, 4, 32, c.expert_intermediate_size)
    # Layer 1, expert 3 (HF's second MoE layer; Qwen3-MoE's layer 2 is dense).
    layer = 1
    hf_layer = hf_model.model.layers[layer]
    gate_up = hf_layer.mlp.experts.gate_up_proj.detach().numpy()
    np.testing.assert_array_equal(experts.gate_proj[layer, 3], gate_up[3, : gate_up.shape[1] // 2])
    np.testing.assert_array_equal(experts.up_proj[layer, 3], gate_up[3, gate_up.shape[1] // 2 :])


def test_mixed_dense_and_moe_layers_keep_two_stacks(tmp_path):
    model = hf.from_state_dict(*_state("qwen3_moe"))
    c = model.config
    assert c.layer_mlps == ("moe", "moe", "dense", "moe")
    assert model.model.dense_layers.mlp.up_proj.weight.shape == (1, 48, 32)
    assert model.model.layers.mlp.experts.up_proj.shape == (3, 4, 24, 32)
    names = hf.export_state_dict(model)
    assert "model.layers.2.mlp.up_proj.weight" in names
    assert "model.layers.3.mlp.experts.1.up_proj.weight" in names
    assert not any(k.startswith("model.layers.2.mlp.experts") for k in names)


def _state(model_type, **overrides):
    hf_model = _hf_model(model_type, **overrides)
    return hf_model.config.to_dict(), hf_model.state_dict()


# Slow: scan vs unrolled is checked by default on the Llama variants (test_models_llama).
@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["gemma2", "qwen3_moe"])
def test_scan_and_unrolled_agree(model_type):
    """Gemma 2 scans pairs of (sliding, global) layers plus a tail; Qwen3-MoE runs two stacks
    in schedule order. Unrolling must not change a number (remat over every kind of schedule
    is tested in test_nn_stack.py, and on a Llama in test_models_llama.py)."""
    model = hf.from_state_dict(*_state(model_type))
    ids, mask = (jnp.asarray(x) for x in padded_batch())

    def loss(m):
        return m.compute_loss(ids, attention_mask=mask, chunk_size=16)[0]

    # Compiled whole: eagerly, each op of the scan and its gradient compiles on its own.
    value_and_grad = eqx.filter_jit(jax.value_and_grad(loss))
    base_loss, base_grads = value_and_grad(model)
    v_loss, v_grads = value_and_grad(configure(model, scan_layers=False))
    np.testing.assert_allclose(v_loss, base_loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(v_grads), jax.tree.leaves(base_grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("model_type", ["gemma2", "qwen3_moe"])
def test_hidden_states_match_hf(model_type):
    hf_model = _hf_model(model_type)
    model = hf.from_state_dict(hf_model.config.to_dict(), hf_model.state_dict())
    ids, _ = padded_batch(seed=1)
    with torch.no_grad():
        ref = hf_model(torch.tensor(ids), output_hidden_states=True).hidden_states
    out = model(jnp.asarray(ids), output_hidden_states=True)
    n = model.config.num_hidden_layers
    assert out.hidden_states.shape == (n + 1, *ids.shape, 32)
    for i in range(n):  # HF's last entry is after the final norm
        np.testing.assert_allclose(out.hidden_states[i], ref[i].numpy(), atol=TOL, rtol=1e-5)


def test_sequence_classification_parity(tmp_path):
    hf_model = _hf_model("gemma2", "sequence_classification", num_labels=3)
    hf_model.save_pretrained(tmp_path)
    model = edl.from_pretrained(tmp_path)
    assert type(model).__name__ == "Gemma2ForSequenceClassification"
    ids, mask = padded_batch()
    labels = np.array([0, 2, 1])
    ref = _hf_forward(hf_model, ids, mask, labels=torch.tensor(labels))
    np.testing.assert_allclose(_logits(model, ids, mask), ref.logits.numpy(), atol=TOL)
    loss, _ = model.compute_loss(
        jnp.asarray(ids), jnp.asarray(labels), attention_mask=jnp.asarray(mask)
    )
    np.testing.assert_allclose(float(loss), ref.loss.item(), rtol=1e-5)


# Mixtral covers MoE decoding, Gemma 2 Gemma's (Gemma's layers plus windows and softcaps);
# Qwen3-MoE's and Gemma's (their logits parity is checked above) are slow.
@pytest.mark.parametrize(
    "model_type",
    [pytest.param(t, marks=pytest.mark.slow) if t in ("qwen3_moe", "gemma") else t for t in TYPES],
)
def test_greedy_generation_matches_transformers(model_type):
    # Peaked logits: argmax far from ties. (transformers' generate breaks on MoE models
    # with output_router_logits, which only changes the training loss.)
    moe = {"output_router_logits": False} if model_type in ("mixtral", "qwen3_moe") else {}
    hf_model = _hf_model(model_type, seed=3, std=0.25, **moe)
    model = hf.from_state_dict(hf_model.config.to_dict(), hf_model.state_dict())
    rng = np.random.default_rng(0)
    ids = rng.integers(2, VOCAB, (3, 7))
    mask = np.ones_like(ids)
    mask[1, :2], mask[2, :5] = 0, 0  # left-padded prompts of different lengths
    ids[mask == 0] = 0
    with torch.no_grad():
        ref = hf_model.generate(
            torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            do_sample=False,
            max_new_tokens=10,
            pad_token_id=0,
        )
    out = generate(model, ids, attention_mask=mask, max_new_tokens=10, pad_token_id=0)
    np.testing.assert_array_equal(np.asarray(out.sequences)[:, : ref.shape[1]], ref.numpy())


@pytest.mark.parametrize("model_type", TYPES)
def test_config_round_trips_through_transformers(model_type):
    family = registry.resolve({"model_type": model_type})[0]
    config = family.config_cls.from_hf(_hf_config(model_type).to_dict())
    hf_dict = config.to_hf(architectures=["X"])
    again = family.config_cls.from_hf(transformers.AutoConfig.for_model(**hf_dict).to_dict())
    assert again.replace(hf_extra=()) == config.replace(hf_extra=())


def test_family_defaults_equal_transformers_defaults():
    """A config built in Python without arguments is the HF default model of its type."""
    for model_type in TYPES:
        family = registry.resolve({"model_type": model_type})[0]
        hf_default = transformers.AutoConfig.for_model(model_type).to_dict()
        ours = family.config_cls()
        assert ours == family.config_cls.from_hf(hf_default).replace(hf_extra=()), model_type


@pytest.mark.parametrize("model_type", ["gemma2", "mixtral", "qwen3_moe"])
def test_flops_per_token_counts_active_experts(model_type):
    model = hf.from_state_dict(*_state(model_type))
    c = model.config
    flat = {p: x for p, x in edl.tree.flatten(model).items() if hasattr(x, "size")}
    dense = sum(x.size for p, x in flat.items() if p.endswith("proj.weight"))
    routers = sum(x.size for p, x in flat.items() if p.endswith("mlp.gate.weight"))
    experts = sum(x.size for p, x in flat.items() if ".experts." in p)
    # Each token runs top_k of num_experts experts.
    active = dense + routers + experts * c.num_experts_per_tok / max(c.num_experts, 1)
    seq = 9
    visible = sum(
        int(edl.ops.attention_mask(seq, seq, causal=True, window=w).sum()) for w in c.layer_windows
    )
    attn = 2 * 2 * c.num_attention_heads * c.head_dim * visible / seq
    expected = 2 * (active + model.head_weight.size) + attn
    assert flops_per_token(c, seq, training=False) == pytest.approx(expected)


def test_unsupported_options_raise():
    with pytest.raises(ValueError, match="bidirectional"):
        edl.models.GemmaConfig.from_hf(
            {**_hf_config("gemma").to_dict(), "use_bidirectional_attention": True}
        )
    with pytest.raises(ValueError, match="no HF 'mixtral' equivalent"):
        edl.models.MixtralConfig(num_hidden_layers=2, qk_norm=True).to_hf()
    with pytest.raises(ValueError, match=r"\['final_softcap'\] must keep edl's defaults"):
        edl.models.LlamaConfig(num_hidden_layers=1, final_softcap=30.0).to_hf()
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        edl.models.MixtralConfig(num_experts=2, num_experts_per_tok=3)
    with pytest.raises(ValueError, match="layer_mlps"):
        edl.models.Qwen3MoeConfig(num_hidden_layers=2, layer_mlps=("moe", "sparse"))


@pytest.mark.slow  # a mixed dense / MoE train step and its checkpoint round trip (~13 s)
def test_train_state_checkpoint_of_a_mixed_moe_model(tmp_path):
    """save_state / load_state with two layer stacks and stacked experts: the model goes out
    in HF layout (per-expert keys) and comes back bit for bit, optimizer state included."""
    import optax

    from edl.io.checkpoint import load_state, save_state

    model = hf.from_state_dict(*_state("qwen3_moe"))
    tx = optax.adamw(1e-2)
    state = edl.create_state(model, tx)
    grads = jax.tree.map(lambda p: jnp.sin(p) * 0.5, state.params)
    state = edl.apply_gradients(state, grads, tx)
    path = save_state(state, tmp_path)
    stored = load_file(next(path.glob("model*.safetensors")))
    assert "model.layers.3.mlp.experts.2.down_proj.weight" in stored
    assert "model.layers.2.mlp.down_proj.weight" in stored
    loaded, _ = load_state(tmp_path, like=edl.create_state(model, tx))
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

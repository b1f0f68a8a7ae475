"""Phi-3 / Phi-4-mini (``phi3``) against transformers (torch, float32) through real HF files.

Configs: LongRoPE past its original context of 8 (long factors, no explicit factor, so the
attention factor comes from max_position / original), Phi-4-mini's shape (partial rotary
0.5, tied embeddings, MQA-ish GQA) with LongRoPE inside its original context (short factors)
and a sliding window shorter than the batch, and plain RoPE with untied embeddings over three
layers. Tolerances as in tests/hf_parity.py (1e-4 on logits).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hf_parity import VOCAB, assert_close_on_real_tokens, padded_batch, random_hf_model

import edl
from edl.generate import generate
from edl.io.formats import hf
from edl.io.formats.peft import load_adapter, save_adapter
from edl.io.formats.safetensors import load_file
from edl.lora import apply_lora
from edl.models import Phi3Config, Phi3ForCausalLM, registry
from edl.sharding import make_mesh, shard

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _factors(n, low, high, seed):
    return np.random.default_rng(seed).uniform(low, high, n).tolist()


def _hf_config(name):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return {
        "longrope_long": lambda: transformers.Phi3Config(
            **common,
            num_hidden_layers=2,
            num_key_value_heads=2,
            max_position_embeddings=32,
            original_max_position_embeddings=8,
            rope_parameters={
                "rope_type": "longrope",
                "short_factor": _factors(4, 1.0, 1.2, 0),
                "long_factor": _factors(4, 1.0, 6.0, 1),
            },
        ),
        "phi4_mini_shape": lambda: transformers.Phi3Config(
            **common,
            num_hidden_layers=2,
            num_key_value_heads=1,
            max_position_embeddings=64,
            original_max_position_embeddings=16,
            partial_rotary_factor=0.5,
            tie_word_embeddings=True,
            sliding_window=5,
            rope_parameters={
                "rope_type": "longrope",
                "short_factor": _factors(2, 1.0, 1.2, 2),
                "long_factor": _factors(2, 1.0, 6.0, 3),
                "partial_rotary_factor": 0.5,
            },
        ),
        "default_rope": lambda: transformers.Phi3Config(
            **common, num_hidden_layers=3, num_key_value_heads=4, rope_theta=500.0
        ),
    }[name]()


CONFIGS = ["longrope_long", "phi4_mini_shape", "default_rope"]


def _hf_model(name, seed=0, std=0.2):
    return random_hf_model(_hf_config(name), "causal_lm", seed=seed, std=std)


def _hf_forward(model, ids, mask, **kwargs):
    with torch.no_grad():
        return model(torch.tensor(ids), attention_mask=torch.tensor(mask), **kwargs)


def _logits(model, ids, mask=None):
    mask = None if mask is None else jnp.asarray(mask)
    return np.asarray(model(jnp.asarray(ids), attention_mask=mask).logits)


# Plain RoPE over three layers (~3 s) is in the slow set.
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n == "default_rope" else n for n in CONFIGS]
)
def test_parity_loss_and_byte_equal_round_trip(name, tmp_path):
    hf_model = _hf_model(name)
    hf_model.save_pretrained(tmp_path / "hf")
    model = edl.from_pretrained(tmp_path / "hf")
    assert isinstance(model, Phi3ForCausalLM)
    layer = model.model.layers
    assert layer.self_attn.q_proj is None and layer.mlp.gate_proj is None  # HF's fused layout
    assert (model.lm_head is None) == hf_model.config.tie_word_embeddings

    ids, mask = padded_batch()
    labels = np.where(mask == 1, ids, -100)
    labels[1, 3] = -100  # edl never predicts from a padded position
    ref = _hf_forward(hf_model, ids, mask, labels=torch.tensor(labels))
    assert_close_on_real_tokens(_logits(model, ids, mask), ref.logits.numpy(), mask)
    loss, _ = model.compute_loss(
        jnp.asarray(ids), jnp.asarray(labels), attention_mask=jnp.asarray(mask), chunk_size=8
    )
    np.testing.assert_allclose(float(loss), ref.loss.item(), rtol=1e-5)

    # edl -> HF: the very tensors transformers wrote, and a config it reads as the same model.
    edl.save_pretrained(model, tmp_path / "edl")
    theirs, mine = load_file(tmp_path / "hf"), load_file(tmp_path / "edl")
    assert mine.keys() == theirs.keys()
    for key, x in theirs.items():
        assert mine[key].dtype == x.dtype and mine[key].tobytes() == x.tobytes(), key
    saved = json.loads((tmp_path / "edl" / "config.json").read_text())
    assert Phi3Config.from_hf(saved) == model.config
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "edl", attn_implementation="eager"
    ).eval()
    np.testing.assert_array_equal(_hf_forward(reloaded, ids, mask).logits, ref.logits)


@pytest.mark.parametrize(
    ("name", "width", "page_size"),
    [  # the default set crosses the original context on the paged cache (~6 s)
        pytest.param("longrope_long", 9, None, marks=pytest.mark.slow),
        pytest.param("longrope_long", 5, None, marks=pytest.mark.slow),
        ("longrope_long", 5, 4),
        pytest.param("phi4_mini_shape", 7, None, marks=pytest.mark.slow),
    ],
)
def test_greedy_generation_matches_transformers(name, width, page_size):
    """Contiguous and paged caches. ``longrope_long``'s 9-token prompts are already past the
    original context of 8 (long factors throughout); its 5-token ones cross it while
    decoding, where transformers re-runs the whole sequence with the long factors (and the
    prefill must not count the prompt bucket's padding as length); ``phi4_mini_shape``'s
    sequences stay inside its context of 16 (short factors) while its window of 5 slides."""
    hf_model = _hf_model(name, seed=3, std=0.25)
    model = hf.from_state_dict(hf_model.config.to_dict(), hf_model.state_dict())
    rng = np.random.default_rng(0)
    ids = rng.integers(3, VOCAB, (3, width))
    mask = np.ones_like(ids)
    mask[1, :2] = 0  # a left-padded prompt
    ids[mask == 0] = 0
    with torch.no_grad():
        ref = hf_model.generate(
            torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            do_sample=False,
            max_new_tokens=8,
            pad_token_id=0,
            eos_token_id=None,
        )
    out = generate(
        model, ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0, page_size=page_size
    )
    np.testing.assert_array_equal(np.asarray(out.sequences)[:, : ref.shape[1]], ref.numpy())


def _random_b(model):
    def one(path, x):
        if not path.endswith("lora_B.weight"):
            return x
        return jnp.asarray(0.1 * np.random.default_rng(len(path)).normal(size=x.shape), x.dtype)

    return edl.tree.named_map(one, model)


@pytest.mark.slow  # two transformers models through temporary files and peft (~8 s)
def test_lora_peft_files_both_ways(tmp_path):
    """LoRA on the fused ``qkv_proj`` / ``gate_up_proj``: edl's adapter loads in peft with
    the same logits, and peft's loads in edl with the same logits."""
    peft = pytest.importorskip("peft")
    hf_model = _hf_model("phi4_mini_shape", std=0.1)
    model = hf.from_state_dict(hf_model.config.to_dict(), hf_model.state_dict())
    ids = np.random.default_rng(1).integers(3, VOCAB, (2, 10))
    lora = apply_lora(
        model, rank=4, alpha=8, pattern="(qkv|gate_up|o)_proj$", key=jax.random.key(2)
    )
    lora = _random_b(lora)
    out = _logits(lora, ids)
    assert np.abs(out - _logits(model, ids)).max() > 1e-2
    save_adapter(lora, tmp_path / "edl")
    targets = json.loads((tmp_path / "edl" / "adapter_config.json").read_text())["target_modules"]
    assert targets == ["gate_up_proj", "o_proj", "qkv_proj"]
    loaded = peft.PeftModel.from_pretrained(edl.to_torch(model), tmp_path / "edl").eval()
    with torch.no_grad():
        theirs = loaded(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(theirs, out, rtol=0, atol=1e-4)

    config = peft.LoraConfig(
        r=2, lora_alpha=6, target_modules=["qkv_proj", "down_proj"], init_lora_weights=False
    )
    base = edl.to_torch(model)
    peft_model = peft.get_peft_model(base, config).eval()
    with torch.no_grad():
        want = peft_model(torch.tensor(ids)).logits.numpy()
    peft_model.save_pretrained(tmp_path / "peft")
    mine = load_adapter(model, tmp_path / "peft")
    assert mine.model.layers.self_attn.qkv_proj.rank == 2
    np.testing.assert_allclose(_logits(mine, ids), want, rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    ("fmt", "max_rel"), [("int8", 0.02), pytest.param("nf4", 0.2, marks=pytest.mark.slow)]
)
def test_quantized_fused_projections(fmt, max_rel):
    from edl.nn import QuantizedLinear
    from edl.quantize import QuantConfig, quantize

    hf_model = _hf_model("longrope_long", std=0.05)
    model = hf.from_state_dict(hf_model.config.to_dict(), hf_model.state_dict())
    quantized = quantize(model, QuantConfig(format=fmt))
    assert isinstance(quantized.model.layers.self_attn.qkv_proj, QuantizedLinear)
    assert isinstance(quantized.model.layers.mlp.gate_up_proj, QuantizedLinear)
    ids = np.random.default_rng(2).integers(3, VOCAB, (2, 10))
    ref, out = _logits(model, ids), _logits(quantized, ids)
    assert np.abs(out - ref).max() <= max_rel * np.abs(ref).max()


def test_sharded_forward_equals_one_device():
    """On 8 host devices (fsdp 4 x tp 2) the fused matrices split their outputs over tp and
    the forward pass equals one device's."""
    hf_model = _hf_model("phi4_mini_shape")
    model = hf.from_state_dict(hf_model.config.to_dict(), hf_model.state_dict())
    ids = np.random.default_rng(3).integers(3, VOCAB, (8, 12))
    mesh = make_mesh((1, 4, 2, 1))
    sharded = shard(model, None, mesh)
    qkv = sharded.model.layers.self_attn.qkv_proj.weight  # (2, (4 + 2 * 1) * 8, 32)
    assert qkv.addressable_shards[0].data.shape == (2, 48 // 2, 32 // 4)
    gate_up = sharded.model.layers.mlp.gate_up_proj.weight  # (2, 96, 32)
    assert gate_up.addressable_shards[0].data.shape == (2, 96 // 2, 32 // 4)
    with jax.sharding.set_mesh(mesh):
        out = jax.jit(lambda m, i: m(i).logits)(sharded, jnp.asarray(ids))
    np.testing.assert_allclose(np.asarray(out), _logits(model, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # two train-step compilations (~12 s)
def test_train_step_scanned_equals_unrolled():
    hf_model = _hf_model("longrope_long", std=0.1)
    model = hf.from_state_dict(hf_model.config.to_dict(), hf_model.state_dict())
    batch = {"ids": jnp.asarray(np.random.default_rng(4).integers(3, VOCAB, (2, 12)))}
    tx = optax.sgd(0.5)

    def run(m):
        step = edl.train.make_train_step(lambda m, b: m.compute_loss(b["ids"]), tx, donate=False)
        state, metrics = step(edl.create_state(m, tx), batch)
        return float(metrics["loss"]), state.params

    loss, params = run(model)
    loss_unrolled, params_unrolled = run(edl.models.configure(model, scan_layers=False))
    np.testing.assert_allclose(loss, loss_unrolled, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params_unrolled), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_config_reads_transformers_rope_rules():
    base = _hf_config("longrope_long").to_dict()
    # Old spellings "su" and "yarn" mean longrope; the top-level original context wins.
    for spelling in ("su", "yarn", "longrope"):
        rope = {**base["rope_parameters"], "rope_type": spelling}
        if spelling == "su":
            rope["original_max_position_embeddings"] = 8
        c = Phi3Config.from_hf({**base, "rope_parameters": rope, "max_position_embeddings": 32})
        assert c.rope.rope_type == "longrope" and c.rope.original_max_position_embeddings == 8
    with pytest.raises(ValueError, match="phi3 models take rope types default or longrope"):
        Phi3Config.from_hf({**base, "rope_parameters": {"rope_type": "linear", "factor": 2.0}})
    # Defaults are transformers' Phi3Config defaults; configs round trip through it.
    assert Phi3Config() == Phi3Config.from_hf(transformers.Phi3Config().to_dict()).replace(
        hf_extra=()
    )
    for name in CONFIGS:
        config = Phi3Config.from_hf(_hf_config(name).to_dict())
        hf_dict = config.to_hf(architectures=["Phi3ForCausalLM"])
        again = Phi3Config.from_hf(transformers.AutoConfig.for_model(**hf_dict).to_dict())
        assert again.replace(hf_extra=()) == config.replace(hf_extra=()), name
    assert registry.resolve({"model_type": "phi3"})[0].name == "phi3"


def test_edl_info_names_the_family_and_its_features(tmp_path, capsys):
    from edl.cli import main

    config = Phi3Config.from_hf(_hf_config("phi4_mini_shape").to_dict())
    edl.save_pretrained(Phi3ForCausalLM.init(config, key=jax.random.key(0)), tmp_path)
    main(["info", str(tmp_path)])
    first = capsys.readouterr().out.splitlines()[0]
    assert first == (
        "Phi3ForCausalLM (model_type phi3): MQA 4/1 heads of 8; fused qkv_proj and gate_up_proj "
        "matrices; RoPE longrope x4 theta 10000 (original context 16, attention factor 1.225, "
        "partial rotary: 4 of 8 dims); sliding window 5 on 2/2 layers; pre-norms; silu MLP; "
        "tied head; 2 layers scanned as 2 x 1 (repeats x period)"
    )


@pytest.mark.slow  # the engine's step shapes and three generate calls compile (~18 s)
def test_serving_engine_matches_generate():
    """The engine's continuous batching (chunked prefill, paged decode) gives generate's
    greedy tokens on Phi-4-mini's shape, every sequence inside the original context (the
    engine's rows share one step, and so its choice of LongRoPE factors)."""
    from edl.serve import Engine, SamplingParams

    hf_model = _hf_model("phi4_mini_shape", seed=3, std=0.25)
    model = hf.from_state_dict(hf_model.config.to_dict(), hf_model.state_dict())
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (5, 9, 3)]
    engine = Engine(model, max_batch=4, max_model_len=16, page_size=4, prefill_chunk=4)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    ids = [engine.add_request(p, params) for p in prompts]
    tokens = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    for prompt, i in zip(prompts, ids, strict=True):
        want = generate(model, np.array([prompt]), max_new_tokens=6, pad_token_id=0)
        assert tokens[i] == np.asarray(want.sequences)[0, len(prompt) :].tolist()


@pytest.mark.slow  # a second transformers model through files (~5 s)
def test_sequence_classification_parity(tmp_path):
    config = _hf_config("longrope_long")
    config.num_labels = 3
    hf_model = random_hf_model(config, "sequence_classification")
    hf_model.save_pretrained(tmp_path)
    model = edl.from_pretrained(tmp_path)
    assert type(model).__name__ == "Phi3ForSequenceClassification"
    ids, mask = padded_batch()
    ref = _hf_forward(hf_model, ids, mask).logits.numpy()
    out = np.asarray(model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)).logits)
    np.testing.assert_allclose(out, ref, atol=1e-4)

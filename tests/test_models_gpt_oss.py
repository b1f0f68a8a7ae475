"""GPT-OSS (``gpt_oss``) against transformers (torch, float32) through real HF files.

Configs: YaRN with alternating sliding (window 4, shorter than the batch) / full layers and
GQA; plain RoPE over all-full layers with tied embeddings, no attention bias, MHA, top-1
routing and a SwiGLU limit of 1 (the clamps bite); and four layers of the default pattern
(slow). Every weight, the sinks and the router / expert biases are drawn from N(0, 0.2).
Tolerances as in tests/hf_parity.py (1e-4 on logits).
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
from edl.models import GptOssConfig, GptOssForCausalLM, registry
from edl.sharding import make_mesh, shard

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore:edl attention.*no attention sinks")


def _hf_config(name):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=16,
        num_attention_heads=4,
        head_dim=8,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    yarn = {
        "rope_type": "yarn",
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 16,
        "rope_theta": 1000.0,
    }
    return {
        "yarn_sliding": lambda: transformers.GptOssConfig(
            **common,
            num_hidden_layers=2,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
            rope_parameters=yarn,
        ),
        "tied_full_clamped": lambda: transformers.GptOssConfig(
            **common,
            num_hidden_layers=2,
            num_key_value_heads=4,
            num_local_experts=3,
            num_experts_per_tok=1,
            sliding_window=4,
            layer_types=["full_attention", "full_attention"],
            attention_bias=False,
            tie_word_embeddings=True,
            swiglu_limit=1.0,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        ),
        "four_layers": lambda: transformers.GptOssConfig(
            **common,
            num_hidden_layers=4,
            num_key_value_heads=1,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=3,
            rope_parameters=yarn,
        ),
    }[name]()


CONFIGS = ["yarn_sliding", "tied_full_clamped", "four_layers"]


def _hf_model(name, seed=0, std=0.2):
    return random_hf_model(_hf_config(name), "causal_lm", seed=seed, std=std)


def _hf_forward(model, ids, mask, **kwargs):
    with torch.no_grad():
        return model(torch.tensor(ids), attention_mask=torch.tensor(mask), **kwargs)


def _logits(model, ids, mask=None):
    mask = None if mask is None else jnp.asarray(mask)
    return np.asarray(model(jnp.asarray(ids), attention_mask=mask).logits)


# The default set checks the YaRN / sliding config; the others (~5-10 s each) are slow.
@pytest.mark.parametrize(
    "name", [n if n == "yarn_sliding" else pytest.param(n, marks=pytest.mark.slow) for n in CONFIGS]
)
def test_parity_loss_and_byte_equal_round_trip(name, tmp_path):
    hf_model = _hf_model(name)
    hf_model.save_pretrained(tmp_path / "hf")
    model = edl.from_pretrained(tmp_path / "hf")
    assert isinstance(model, GptOssForCausalLM)
    layers = model.model.layers
    assert layers.self_attn.sinks.shape == (hf_model.config.num_hidden_layers, 4)
    assert layers.mlp.experts.gate_up_proj.shape[-1] == 2 * 16  # HF's interleaved layout
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
    assert GptOssConfig.from_hf(saved) == model.config
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "edl", attn_implementation="eager"
    ).eval()
    np.testing.assert_array_equal(_hf_forward(reloaded, ids, mask).logits, ref.logits)


def test_clamped_swiglu_matches_transformers_experts():
    """The experts alone on activations large enough for both clamps, against HF's."""
    from edl.nn.gpt_oss_moe import GptOssExperts, gpt_oss_expert_mlp

    config = _hf_config("yarn_sliding")
    config.swiglu_limit = 0.7
    hf_experts = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in hf_experts.parameters():
            p.normal_(0.0, 0.5)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 32)).astype(np.float32)
    chosen = np.stack([rng.permutation(4)[:2] for _ in range(6)]).astype(np.int64)
    weights = rng.uniform(0.1, 1.0, (6, 2)).astype(np.float32)
    with torch.no_grad():
        ref = hf_experts(torch.tensor(x), torch.tensor(chosen), torch.tensor(weights)).numpy()
    mine = GptOssExperts(
        *(jnp.asarray(p.detach().numpy()) for p in hf_experts.parameters()),
        alpha=config.swiglu_alpha,
        limit=0.7,
    )
    for impl in ("dense", "ragged"):
        out = gpt_oss_expert_mlp(
            jnp.asarray(x), jnp.asarray(weights), jnp.asarray(chosen, jnp.int32), mine, impl=impl
        )
        np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5, err_msg=impl)


@pytest.mark.parametrize(
    ("name", "page_size"),
    [  # the default set: the paged cache while the window slides (~7 s)
        pytest.param("yarn_sliding", None, marks=pytest.mark.slow),
        ("yarn_sliding", 4),
        pytest.param("tied_full_clamped", None, marks=pytest.mark.slow),
    ],
)
def test_greedy_generation_matches_transformers(name, page_size):
    """Contiguous and paged caches; the window of 4 slides while decoding 8 tokens after
    6-token prompts (one left-padded)."""
    hf_model = _hf_model(name, seed=3, std=0.25)
    model = hf.from_state_dict(hf_model.config.to_dict(), hf_model.state_dict())
    rng = np.random.default_rng(0)
    ids = rng.integers(3, VOCAB, (3, 6))
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


@pytest.mark.slow  # the engine's steps and three generate calls compile (~11 s)
def test_serving_engine_matches_generate():
    """The engine's continuous batching (chunked prefill, paged decode with sinks)."""
    from edl.serve import Engine, SamplingParams

    hf_model = _hf_model("yarn_sliding", seed=3, std=0.25)
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


def _random_b(model):
    def one(path, x):
        if not path.endswith("lora_B.weight"):
            return x
        return jnp.asarray(0.1 * np.random.default_rng(len(path)).normal(size=x.shape), x.dtype)

    return edl.tree.named_map(one, model)


@pytest.mark.slow  # two transformers models through files and peft (~7 s)
def test_lora_peft_files_both_ways(tmp_path):
    """LoRA on the attention projections: edl's adapter loads in peft with the same logits,
    and peft's loads in edl with the same logits."""
    peft = pytest.importorskip("peft")
    hf_model = _hf_model("yarn_sliding", std=0.1)
    model = hf.from_state_dict(hf_model.config.to_dict(), hf_model.state_dict())
    ids = np.random.default_rng(1).integers(3, VOCAB, (2, 10))
    lora = apply_lora(model, rank=4, alpha=8, pattern="(q|v|o)_proj$", key=jax.random.key(2))
    lora = _random_b(lora)
    out = _logits(lora, ids)
    assert np.abs(out - _logits(model, ids)).max() > 1e-2
    save_adapter(lora, tmp_path / "edl")
    targets = json.loads((tmp_path / "edl" / "adapter_config.json").read_text())["target_modules"]
    assert targets == ["o_proj", "q_proj", "v_proj"]
    loaded = peft.PeftModel.from_pretrained(edl.to_torch(model), tmp_path / "edl").eval()
    with torch.no_grad():
        theirs = loaded(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(theirs, out, rtol=0, atol=1e-4)

    config = peft.LoraConfig(
        r=2, lora_alpha=6, target_modules=["k_proj", "o_proj"], init_lora_weights=False
    )
    peft_model = peft.get_peft_model(edl.to_torch(model), config).eval()
    with torch.no_grad():
        want = peft_model(torch.tensor(ids)).logits.numpy()
    peft_model.save_pretrained(tmp_path / "peft")
    mine = load_adapter(model, tmp_path / "peft")
    assert mine.model.layers.self_attn.k_proj.rank == 2
    np.testing.assert_allclose(_logits(mine, ids), want, rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    ("fmt", "max_rel"),  # ~2.5 s each
    [
        pytest.param("int8", 0.02, marks=pytest.mark.slow),
        pytest.param("nf4", 0.2, marks=pytest.mark.slow),
    ],
)
def test_quantized_forward_stays_close(fmt, max_rel):
    """The Linear layers (attention projections, router, head) quantize; the experts'
    stacked parameters stay as they are."""
    from edl.nn import QuantizedLinear
    from edl.quantize import QuantConfig, quantize

    hf_model = _hf_model("yarn_sliding", std=0.05)
    model = hf.from_state_dict(hf_model.config.to_dict(), hf_model.state_dict())
    quantized = quantize(model, QuantConfig(format=fmt))
    assert isinstance(quantized.model.layers.self_attn.q_proj, QuantizedLinear)
    ids = np.random.default_rng(2).integers(3, VOCAB, (2, 10))
    ref, out = _logits(model, ids), _logits(quantized, ids)
    assert np.abs(out - ref).max() <= max_rel * np.abs(ref).max()


@pytest.mark.slow  # ~8-12 s
def test_sharded_forward_equals_one_device():
    """On 8 host devices (fsdp 4 x tp 2) the experts split their hidden size over fsdp and
    their width over tp (HF's layout: gate_up's last axis, down's middle one; experts over
    the expert axis, size 1 here); the forward pass equals one device's."""
    hf_model = _hf_model("yarn_sliding")
    model = hf.from_state_dict(hf_model.config.to_dict(), hf_model.state_dict())
    ids = np.random.default_rng(3).integers(3, VOCAB, (8, 12))
    mesh = make_mesh((1, 4, 2, 1))
    sharded = shard(model, None, mesh)
    gate_up = sharded.model.layers.mlp.experts.gate_up_proj  # (2, 4, 32, 32)
    assert gate_up.addressable_shards[0].data.shape == (2, 4, 8, 16)
    down = sharded.model.layers.mlp.experts.down_proj  # (2, 4, 16, 32)
    assert down.addressable_shards[0].data.shape == (2, 4, 8, 8)
    with jax.sharding.set_mesh(mesh):
        out = jax.jit(lambda m, i: m(i).logits)(sharded, jnp.asarray(ids))
    np.testing.assert_allclose(np.asarray(out), _logits(model, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # two train-step compilations (~13 s)
def test_train_step_scanned_equals_unrolled():
    """The scan over periods of (sliding, full) layers equals the unrolled stack, sinks,
    router and expert biases included."""
    hf_model = _hf_model("four_layers", std=0.1)
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
    sinks = params.model.layers.self_attn.sinks
    assert np.abs(np.asarray(sinks) - np.asarray(model.model.layers.self_attn.sinks)).max() > 0
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params_unrolled), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_config_defaults_round_trip_and_mxfp4_refusal():
    # Defaults are transformers' GptOssConfig defaults (YaRN x32 included).
    assert GptOssConfig() == GptOssConfig.from_hf(transformers.GptOssConfig().to_dict()).replace(
        hf_extra=()
    )
    for name in CONFIGS:
        config = GptOssConfig.from_hf(_hf_config(name).to_dict())
        hf_dict = config.to_hf(architectures=["GptOssForCausalLM"])
        again = GptOssConfig.from_hf(transformers.AutoConfig.for_model(**hf_dict).to_dict())
        assert again.replace(hf_extra=()) == config.replace(hf_extra=()), name
    base = _hf_config("yarn_sliding").to_dict()
    # MXFP4 is dequantised at load (tests/test_io_mxfp4.py): the config drops it; others refuse.
    mxfp4 = GptOssConfig.from_hf({**base, "quantization_config": {"quant_method": "mxfp4"}})
    assert mxfp4 == GptOssConfig.from_hf(base)
    assert "quantization_config" not in mxfp4.to_hf()
    with pytest.raises(ValueError, match="quant_method 'fp8' is not supported"):
        GptOssConfig.from_hf({**base, "quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(ValueError, match="no HF 'gpt_oss' equivalent: attention sinks"):
        GptOssConfig.from_hf(base).replace(attention_sinks=False).to_hf()
    # Other families refuse sinks (a layout feature only gpt_oss writes).
    with pytest.raises(ValueError, match="attention_sinks"):
        edl.models.LlamaConfig(attention_sinks=True).to_hf()
    assert registry.resolve({"model_type": "gpt_oss"})[0].name == "gpt_oss"


def test_edl_info_names_the_family_and_its_features(tmp_path, capsys):
    from edl.cli import main

    _hf_model("four_layers", std=0.02).save_pretrained(tmp_path)  # torch inits fast
    main(["info", str(tmp_path)])
    first = capsys.readouterr().out.splitlines()[0]
    assert first == (
        "GptOssForCausalLM (model_type gpt_oss): MQA 4/1 heads of 8; attention biases; "
        "attention sinks; RoPE yarn x4 theta 1000 (original context 16, attention factor "
        "1.139); sliding window 3 on 2/4 layers; pre-norms; MoE 2 of 4 experts on 4 layers; "
        "clamped SwiGLU experts with biases (alpha 1.702, limit 7); silu MLP; untied head; "
        "4 layers scanned as 2 x 2 (repeats x period)"
    )


@pytest.mark.slow  # a second transformers model through files (~3 s)
def test_sequence_classification_parity(tmp_path):
    config = _hf_config("yarn_sliding")
    config.num_labels = 3
    hf_model = random_hf_model(config, "sequence_classification")
    hf_model.save_pretrained(tmp_path)
    model = edl.from_pretrained(tmp_path)
    assert type(model).__name__ == "GptOssForSequenceClassification"
    ids, mask = padded_batch()
    ref = _hf_forward(hf_model, ids, mask).logits.numpy()
    out = np.asarray(model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)).logits)
    np.testing.assert_allclose(out, ref, atol=1e-4)


@pytest.mark.slow  # a model through files, the CLI's generate compiles (~5 s)
def test_cli_generate_and_export(tmp_path, capsys):
    """``edl generate`` (the byte tokenizer: vocab 259) on a GPT-OSS directory prints
    transformers' greedy continuation, and ``edl export --dtype bfloat16`` writes a directory
    transformers loads as a GPT-OSS model."""
    from edl.cli import main
    from edl.text import ByteTokenizer

    config = _hf_config("yarn_sliding")
    config.vocab_size = ByteTokenizer.vocab_size
    hf_model = random_hf_model(config, "causal_lm", seed=3, std=0.25)
    hf_model.save_pretrained(tmp_path / "hf")
    main(["generate", "--model", str(tmp_path / "hf"), "--prompt", "gpt", "--max-new-tokens", "4"])
    printed = capsys.readouterr().out
    prompt = ByteTokenizer().encode("gpt")
    with torch.no_grad():
        ref = hf_model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=4, eos_token_id=None
        )
    continuation = ByteTokenizer().decode(ref[0, len(prompt) :].tolist())
    assert continuation and continuation in printed
    main(["export", str(tmp_path / "hf"), str(tmp_path / "out"), "--dtype", "bfloat16"])
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(exported).__name__ == "GptOssForCausalLM"
    assert exported.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16

"""Qwen3-Next (``qwen3_next``) against transformers (torch, float32) through real HF files.

Configs: ``moe_mixed`` (four layers, three Gated DeltaNet then full attention, MoE with a
shared expert and a dense ``mlp_only_layers`` entry, value heads twice the key heads, GQA),
``dense_tied`` (no experts, tied embeddings, full attention every other layer, equal key
and value heads, full rotary) and ``moe_interval3`` (sparse every other layer by
``decoder_sparse_step``, one full layer in three, untied). Tolerances as in
tests/hf_parity.py (1e-4 on logits).
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
from edl.models import Qwen3NextConfig, Qwen3NextForCausalLM, registry
from edl.sharding import make_mesh, shard

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _hf_config(name):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        head_dim=16,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return {
        "moe_mixed": lambda: transformers.Qwen3NextConfig(
            **common,
            num_hidden_layers=4,
            num_key_value_heads=2,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            num_experts=4,
            num_experts_per_tok=2,
            mlp_only_layers=[1],
        ),
        "dense_tied": lambda: transformers.Qwen3NextConfig(
            **common,
            num_hidden_layers=2,
            num_key_value_heads=4,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            num_experts=0,
            tie_word_embeddings=True,
            full_attention_interval=2,
            partial_rotary_factor=1.0,
        ),
        "moe_interval3": lambda: transformers.Qwen3NextConfig(
            **common,
            num_hidden_layers=3,
            num_key_value_heads=1,
            linear_num_key_heads=1,
            linear_num_value_heads=2,
            num_experts=3,
            num_experts_per_tok=1,
            norm_topk_prob=False,
            decoder_sparse_step=2,
            full_attention_interval=3,
        ),
    }[name]()


CONFIGS = ["moe_mixed", "dense_tied", "moe_interval3"]


def _hf_model(name, seed=0, std=0.2):
    return random_hf_model(_hf_config(name), "causal_lm", seed=seed, std=std)


def _edl(hf_model):
    return hf.from_state_dict(hf_model.config.to_dict(), hf_model.state_dict())


def _hf_forward(model, ids, mask, **kwargs):
    with torch.no_grad():
        return model(torch.tensor(ids), attention_mask=torch.tensor(mask), **kwargs)


def _logits(model, ids, mask=None):
    mask = None if mask is None else jnp.asarray(mask)
    return np.asarray(model(jnp.asarray(ids), attention_mask=mask).logits)


# One config (~10 s on the shared 2-core VM) runs by default, the others (~10-30 s each) in
# the slow set.
@pytest.mark.parametrize(
    "name", [n if n == "dense_tied" else pytest.param(n, marks=pytest.mark.slow) for n in CONFIGS]
)
def test_parity_loss_and_byte_equal_round_trip(name, tmp_path):
    hf_model = _hf_model(name)
    hf_model.save_pretrained(tmp_path / "hf")
    model = edl.from_pretrained(tmp_path / "hf")
    assert isinstance(model, Qwen3NextForCausalLM)
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

    edl.save_pretrained(model, tmp_path / "edl")
    theirs, mine = load_file(tmp_path / "hf"), load_file(tmp_path / "edl")
    assert mine.keys() == theirs.keys()
    for key, x in theirs.items():
        assert mine[key].dtype == x.dtype and mine[key].tobytes() == x.tobytes(), key
    saved = json.loads((tmp_path / "edl" / "config.json").read_text())
    assert Qwen3NextConfig.from_hf(saved) == model.config
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "edl", attn_implementation="eager"
    ).eval()
    np.testing.assert_array_equal(_hf_forward(reloaded, ids, mask).logits, ref.logits)


def test_layers_stack_by_kind_and_scan_in_periods():
    config = Qwen3NextConfig.from_hf(_hf_config("moe_mixed").to_dict())
    assert config.layer_groups == ("layers", "dense_layers", "layers", "attn_layers")
    assert config.kv_cache_layers == 1
    deep = Qwen3NextConfig(
        hidden_size=32,
        num_hidden_layers=12,
        num_attention_heads=4,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        linear_num_key_heads=1,
        linear_num_value_heads=1,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    )
    from edl.nn.schedule import plan_schedule

    (segment,) = plan_schedule(deep.layer_groups, deep.layer_settings)
    assert (segment.repeats, len(segment.block)) == (3, 4)  # one scan of 3 periods of 4


# The paged cache's decode loop is one more compilation (~8 s on the shared VM): slow set.
@pytest.mark.parametrize(
    ("name", "page_size"),
    [
        ("dense_tied", None),
        pytest.param("dense_tied", 4, marks=pytest.mark.slow),
        pytest.param("moe_mixed", None, marks=pytest.mark.slow),
        pytest.param("moe_mixed", 4, marks=pytest.mark.slow),
    ],
)
def test_greedy_generation_matches_transformers(name, page_size):
    """A left-padded batch: the linear layers' conv and delta states carried in the cache
    from a (right-padded) prefill through one-token decode steps, beside the full layers'
    contiguous cache or their paged cache (pages of 4 tokens: rows cross pages)."""
    hf_model = _hf_model(name, seed=3, std=0.25)
    model = _edl(hf_model)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, VOCAB, (2, 7))
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    ids[mask == 0] = 0
    with torch.no_grad():
        ref = hf_model.generate(
            torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            do_sample=False,
            max_new_tokens=6,
            pad_token_id=0,
            eos_token_id=None,
        )
    out = generate(
        model, ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0, page_size=page_size
    )
    np.testing.assert_array_equal(np.asarray(out.sequences)[:, : ref.shape[1]], ref.numpy())


# Two forward compilations (~15 s on the loaded shared VM); tests/test_gated_deltanet.py
# checks the layer on packed segments by default. Speculation's refusal:
# tests/test_serve_recurrent.py.
@pytest.mark.slow
def test_packed_sequences_equal_each_segment_alone():
    """Three segments packed in one row (``segment_ids``): the linear layers restart their
    conv and delta states at each, the full layers attend within it (positions restart),
    so each segment's logits are those of the segment run alone; the row ends in padding."""
    model = _edl(_hf_model("dense_tied", seed=1))
    lengths = (5, 7, 4)
    ids = np.random.default_rng(0).integers(3, VOCAB, (1, sum(lengths) + 2))
    segments = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [[0, 0]])
    mask = (segments > 0)[None]
    packed = model(
        jnp.asarray(ids), segment_ids=jnp.asarray(segments[None]), attention_mask=jnp.asarray(mask)
    ).logits
    # The segments alone: one right-padded batch (padding after a segment changes nothing).
    alone_ids = np.zeros((len(lengths), max(lengths)), ids.dtype)
    alone_mask = np.zeros_like(alone_ids)
    starts = np.cumsum((0, *lengths))
    for i, n in enumerate(lengths):
        alone_ids[i, :n], alone_mask[i, :n] = ids[0, starts[i] : starts[i] + n], 1
    alone = _logits(model, alone_ids, alone_mask)
    for i, n in enumerate(lengths):
        got = packed[0, starts[i] : starts[i] + n]
        np.testing.assert_allclose(got, alone[i, :n], rtol=1e-5, atol=1e-5)


def _random_b(model):
    def one(path, x):
        if not path.endswith("lora_B.weight"):
            return x
        return jnp.asarray(0.1 * np.random.default_rng(len(path)).normal(size=x.shape), x.dtype)

    return edl.tree.named_map(one, model)


@pytest.mark.slow  # two transformers models through temporary files and peft (~15 s)
def test_lora_peft_files_both_ways(tmp_path):
    """LoRA on the attention and DeltaNet projections: edl's adapter loads in peft with the
    same logits, and peft's loads in edl with the same logits."""
    peft = pytest.importorskip("peft")
    hf_model = _hf_model("moe_mixed", std=0.1)
    model = _edl(hf_model)
    ids = np.random.default_rng(1).integers(3, VOCAB, (2, 10))
    pattern = "(q_proj|o_proj|in_proj_qkvz|out_proj)$"
    lora = _random_b(apply_lora(model, rank=4, alpha=8, pattern=pattern, key=jax.random.key(2)))
    out = _logits(lora, ids)
    assert np.abs(out - _logits(model, ids)).max() > 1e-2
    save_adapter(lora, tmp_path / "edl")
    loaded = peft.PeftModel.from_pretrained(edl.to_torch(model), tmp_path / "edl").eval()
    with torch.no_grad():
        theirs = loaded(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(theirs, out, rtol=0, atol=1e-4)

    config = peft.LoraConfig(
        r=2, lora_alpha=6, target_modules=["in_proj_ba", "v_proj"], init_lora_weights=False
    )
    peft_model = peft.get_peft_model(edl.to_torch(model), config).eval()
    with torch.no_grad():
        want = peft_model(torch.tensor(ids)).logits.numpy()
    peft_model.save_pretrained(tmp_path / "peft")
    mine = load_adapter(model, tmp_path / "peft")
    assert mine.model.layers.linear_attn.in_proj_ba.rank == 2
    np.testing.assert_allclose(_logits(mine, ids), want, rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    ("fmt", "max_rel"),
    [pytest.param(f, r, marks=pytest.mark.slow) for f, r in (("int8", 0.02), ("nf4", 0.2))],
)  # ~10 s each
def test_quantized_projections(fmt, max_rel):
    from edl.nn import QuantizedLinear
    from edl.quantize import QuantConfig, quantize

    model = _edl(_hf_model("dense_tied", std=0.05))
    # The default pattern covers the attention and MLP projections; DeltaNet's are named.
    pattern = r"((q|k|v|o|gate|up|down)_proj|in_proj_qkvz|in_proj_ba|out_proj)$"
    quantized = quantize(model, QuantConfig(format=fmt, pattern=pattern))
    assert isinstance(quantized.model.layers.linear_attn.in_proj_qkvz, QuantizedLinear)
    assert isinstance(quantized.model.attn_layers.self_attn.q_proj, QuantizedLinear)
    ids = np.random.default_rng(2).integers(3, VOCAB, (2, 10))
    ref, out = _logits(model, ids), _logits(quantized, ids)
    assert np.abs(out - ref).max() <= max_rel * np.abs(ref).max()


@pytest.mark.slow  # ~10 s quiet, 90 s on the loaded shared VM (8 host devices compile)
def test_sharded_forward_equals_one_device():
    """On 8 host devices (fsdp 4 x tp 2): the DeltaNet input projections split their
    outputs over tp, ``out_proj`` its inputs; the forward pass equals one device's."""
    model = _edl(_hf_model("moe_mixed"))
    ids = np.random.default_rng(3).integers(3, VOCAB, (8, 12))
    mesh = make_mesh((1, 4, 2, 1))
    sharded = shard(model, None, mesh)
    qkvz = sharded.model.layers.linear_attn.in_proj_qkvz.weight  # (2, 96, 32)
    assert qkvz.addressable_shards[0].data.shape == (2, 96 // 2, 32 // 4)
    with jax.sharding.set_mesh(mesh):
        out = jax.jit(lambda m, i: m(i).logits)(sharded, jnp.asarray(ids))
    np.testing.assert_allclose(np.asarray(out), _logits(model, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # two train-step compilations (~20 s)
def test_train_step_scanned_equals_unrolled():
    model = _edl(_hf_model("moe_mixed", std=0.1))
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


def test_config_round_trips_through_transformers():
    # Defaults are transformers' Qwen3NextConfig defaults (partial rotary 0.25 included).
    default = Qwen3NextConfig.from_hf(transformers.Qwen3NextConfig().to_dict())
    assert Qwen3NextConfig() == default.replace(hf_extra=())
    assert default.rope.dim == 64  # a quarter of head_dim 256
    for name in CONFIGS:
        config = Qwen3NextConfig.from_hf(_hf_config(name).to_dict())
        hf_dict = config.to_hf(architectures=["Qwen3NextForCausalLM"])
        again = Qwen3NextConfig.from_hf(transformers.AutoConfig.for_model(**hf_dict).to_dict())
        assert again.replace(hf_extra=()) == config.replace(hf_extra=()), name
    assert registry.resolve({"model_type": "qwen3_next"})[0].name == "qwen3_next"
    with pytest.raises(ValueError, match="layer_types entries"):
        Qwen3NextConfig(num_hidden_layers=2, layer_types=("linear_attention", "mamba"))


@pytest.mark.slow  # builds and saves a model through transformers (~15-30 s)
def test_edl_info_names_the_hybrid_layers(tmp_path, capsys):
    from edl.cli import main

    config = Qwen3NextConfig.from_hf(_hf_config("moe_mixed").to_dict())
    edl.save_pretrained(Qwen3NextForCausalLM.init(config, key=jax.random.key(0)), tmp_path)
    main(["info", str(tmp_path)])
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("Qwen3NextForCausalLM (model_type qwen3_next): GQA 4/2 heads of 16;")
    assert "Gated DeltaNet on 3/4 layers (2 key / 4 value heads of 8 / 8, conv 4)" in first
    assert "RoPE theta 10000 (partial rotary: 4 of 16 dims)" in first
    assert "MoE 2 of 4 experts on 3 layers; sigmoid-gated shared expert of width 24" in first

"""DeepSeek-V3 (``deepseek_v3``) against transformers on tiny random configs: logits on
several configs (q_lora_rank set / None, tied / untied, interleaved or half-split RoPE, YaRN
with ``mscale_all_dim``, shared experts, grouped routing with a score-correction bias),
files both ways, greedy generation through the latent cache (contiguous and paged) and the
materialised one, LoRA with peft both ways, int8 / NF4, a sharded forward, the scanned
train step, and the configs edl refuses or reads (FP8, MTP layers, Kimi K2 / Moonlight).
Tolerances as in tests/hf_parity.py (1e-4 on float32 logits).
"""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hf_parity import VOCAB, assert_close_on_real_tokens, padded_batch, random_hf_model

import edl
from edl.generate import generate, init_cache
from edl.io.formats import hf
from edl.io.formats.peft import load_adapter, save_adapter
from edl.lora import apply_lora
from edl.models import configure
from edl.models.deepseek_v3 import DeepseekV3Config
from edl.models.features import features
from edl.nn.schedule import plan_schedule
from edl.quantize import QuantConfig
from edl.quantize import dequantize as dequantize_model
from edl.quantize import quantize as quantize_model
from edl.sharding import make_mesh, shard, shard_batch
from edl.train import make_train_step

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4
YARN = dict(
    rope_type="yarn",
    factor=4.0,
    rope_theta=10000.0,
    original_max_position_embeddings=64,
    mscale=1.0,
    mscale_all_dim=0.707,
    beta_fast=32,
    beta_slow=1,
)
VARIANTS = {
    # q through q_a_proj / q_a_layernorm / q_b_proj, an untied head, 2 groups of 4 experts.
    "q_lora": dict(),
    # One q_proj, a tied head.
    "q_proj_tied": dict(q_lora_rank=None, tie_word_embeddings=True),
    # Half-split RoPE, two shared experts, weights not renormalised, one group.
    "plain_rope": dict(
        rope_interleave=False, n_shared_experts=2, norm_topk_prob=False, n_group=1, topk_group=1
    ),
    # YaRN with its softmax mscale, attention biases.
    "yarn": dict(rope_parameters=YARN, max_position_embeddings=256, attention_bias=True),
}


def _config(**overrides):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,  # HF's eager attention repeats kv heads by heads // kv_heads
        n_routed_experts=8,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=12,
        v_head_dim=10,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        num_nextn_predict_layers=0,
        pad_token_id=0,
    )
    return transformers.DeepseekV3Config(**{**base, **overrides})


def _hf_model(variant="q_lora", seed=0, std=0.2, **overrides):
    model = random_hf_model(
        _config(**VARIANTS[variant], **overrides), "causal_lm", seed=seed, std=std
    )
    with torch.no_grad():  # a bias that changes the choice of experts
        for layer in model.model.layers[model.config.first_k_dense_replace :]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.5)
    return model


def _load(hf_model):
    return hf.from_state_dict(hf_model.config.to_dict(), hf_model.state_dict())


def _logits(model, ids, mask=None):
    mask = None if mask is None else jnp.asarray(mask)
    return np.asarray(model(jnp.asarray(ids), attention_mask=mask).logits)


def _torch_logits(torch_model, ids, mask=None):
    mask = None if mask is None else torch.tensor(mask)
    with torch.no_grad():
        return torch_model(torch.tensor(np.asarray(ids)), attention_mask=mask).logits.numpy()


# By default q_lora (MLA's full q path, grouped routing with a bias) and yarn (the softmax
# mscale, biases); the others are slow (~5-15 s each on the shared 2-core machine).
@pytest.mark.parametrize(
    "variant",
    [v if v in ("q_lora", "yarn") else pytest.param(v, marks=pytest.mark.slow) for v in VARIANTS],
)
def test_logits_match_transformers(variant):
    hf_model = _hf_model(variant)
    model = _load(hf_model)
    ids, mask = padded_batch(seq=13)
    assert_close_on_real_tokens(_logits(model, ids, mask), _torch_logits(hf_model, ids, mask), mask)
    assert type(model.config).from_hf(model.config.to_hf()) == model.config


@pytest.mark.slow  # ~15 s
def test_files_round_trip_with_transformers(tmp_path):
    """transformers' saved directory loads in edl, and edl's saved one in transformers,
    with the same logits (per-expert tensors on disk, the router's bias included)."""
    hf_model = _hf_model("q_lora", seed=1)
    hf_model.save_pretrained(tmp_path / "hf")
    model = edl.from_pretrained(tmp_path / "hf")
    ids = np.random.default_rng(0).integers(1, VOCAB, (2, 9))
    ref = _torch_logits(hf_model, ids)
    np.testing.assert_allclose(_logits(model, ids), ref, rtol=0, atol=TOL)
    edl.save_pretrained(model, tmp_path / "edl")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "edl").eval()
    np.testing.assert_allclose(_torch_logits(again, ids), ref, rtol=0, atol=TOL)


@pytest.mark.slow  # ~10 s
def test_mtp_layers_are_skipped_with_a_warning():
    """A checkpoint with a multi-token-prediction layer (HF layer index num_hidden_layers)
    loads with a warning naming it, and the base model's logits are unchanged."""
    hf_model = _hf_model("q_lora", seed=2)
    config = {**hf_model.config.to_dict(), "num_nextn_predict_layers": 1}
    state = dict(hf_model.state_dict())
    for key, value in list(state.items()):
        if key.startswith("model.layers.2."):
            state[key.replace("layers.2.", "layers.3.")] = value.clone()
    state["model.layers.3.eh_proj.weight"] = torch.zeros(32, 64)  # an MTP-only tensor
    with pytest.warns(UserWarning, match=r"multi-token-prediction layers \(model.layers.3"):
        model = hf.from_state_dict(config, state)
    ids = np.random.default_rng(1).integers(1, VOCAB, (2, 7))
    np.testing.assert_allclose(_logits(model, ids), _torch_logits(hf_model, ids), atol=TOL)


def test_unsupported_configs_are_refused_by_name():
    base = _config().to_dict()
    fp8 = {**base, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    with pytest.raises(ValueError, match=r"quantization_config \('fp8'.*FP8 block-quantised"):
        DeepseekV3Config.from_hf(fp8)
    for key, value in (("scoring_func", "softmax"), ("topk_method", "greedy")):
        with pytest.raises(ValueError, match=f"{key}={value!r} is not supported"):
            DeepseekV3Config.from_hf({**base, key: value})


def test_kimi_and_moonlight_config_keys_are_read():
    """Moonlight / Kimi K2 write DeepSeek-V3's remote-code keys: legacy rope_scaling YaRN
    with mscale / mscale_all_dim, one group, and routing keys that must say V3's method."""
    moonlight = {
        **{k: v for k, v in _config().to_dict().items() if k not in ("rope_parameters",)},
        "rope_theta": 50000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.827,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "moe_layer_freq": 1,
        "aux_loss_alpha": 0.001,
        "seq_aux": True,
        "ep_size": 1,
    }
    config = DeepseekV3Config.from_hf(moonlight)
    assert config.rope.rope_type == "yarn" and config.rope.factor == 32.0
    mscale = 0.1 * np.log(32.0) + 1.0
    np.testing.assert_allclose(config.attn_scale, 20**-0.5 * mscale**2)
    assert (config.n_group, config.routed_scaling_factor) == (1, 2.827)
    out = config.to_hf()
    assert out["scoring_func"] == "sigmoid" and out["seq_aux"] is True
    assert DeepseekV3Config.from_hf(out) == config
    # Kimi K2 names the same architecture model_type kimi_k2, and it is written back so.
    _, kimi, cls = edl.models.registry.resolve({**moonlight, "model_type": "kimi_k2"})
    assert cls.__name__ == "DeepseekV3ForCausalLM" and kimi.to_hf()["model_type"] == "kimi_k2"


@pytest.mark.gpu  # the latent cache through the GPU's decode kernels
@pytest.mark.parametrize(
    "how",
    ["latent", *(pytest.param(h, marks=pytest.mark.slow) for h in ("paged", "materialised"))],
)
def test_greedy_generation_matches_transformers(how):
    """Greedy tokens equal transformers' through the latent cache (contiguous: one array of
    kv_lora_rank + qk_rope_head_dim per token and layer; paged: pools of latent pages) and
    through per-head keys / values (those two slow; ~10-30 s)."""
    hf_model = _hf_model("q_lora", seed=3, std=0.25)
    model = _load(hf_model)
    if how == "materialised":
        model = configure(model, mla_cache="materialised")
    rng = np.random.default_rng(0)
    ids = rng.integers(2, VOCAB, (3, 7))
    mask = np.ones_like(ids)
    mask[1, :2], mask[2, :5] = 0, 0
    ids[mask == 0] = 0
    with torch.no_grad():
        ref = hf_model.generate(
            torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            do_sample=False,
            max_new_tokens=10,
            pad_token_id=0,
        ).numpy()
    page = {"page_size": 4} if how == "paged" else {}
    out = generate(model, ids, attention_mask=mask, max_new_tokens=10, pad_token_id=0, **page)
    np.testing.assert_array_equal(np.asarray(out.sequences)[:, : ref.shape[1]], ref)


def test_the_latent_cache_holds_no_per_head_keys_or_values():
    config = DeepseekV3Config.from_hf(_config().to_dict())
    cache = init_cache(config, 2, 20)
    assert [x.shape for x in jax.tree.leaves(cache)] == [(3, 2, 32, 1, 16 + 8), (2,)]
    wide = init_cache(config.replace(mla_cache="materialised"), 2, 20)
    assert wide.k.shape == (3, 2, 32, 4, 12 + 8)


@pytest.mark.slow  # ~15 s
def test_lora_adapters_round_trip_with_peft(tmp_path):
    """edl's adapter on MLA's projections loads in peft with edl's logits; peft's loads in
    edl with peft's."""
    peft = pytest.importorskip("peft")
    model = _load(_hf_model("q_lora", seed=4))
    ids = np.random.default_rng(1).integers(1, VOCAB, (2, 9))
    # MLA's projections. (Not gate / up / down_proj: with transformers 5, peft maps those
    # short names onto the routed experts' fused gate_up_proj as well, which edl's adapter
    # does not hold; a limit of PEFT's MoE names, not of MLA.)
    pattern = r"(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)$"
    lora = apply_lora(model, rank=4, alpha=8, pattern=pattern, key=jax.random.key(0))
    lora = edl.tree.named_map(
        lambda p, x: (
            0.1 * jax.random.normal(jax.random.key(len(p)), x.shape, x.dtype)
            if p.endswith("lora_B.weight")
            else x
        ),
        lora,
    )
    mine = _logits(lora, ids)
    assert np.abs(mine - _logits(model, ids)).max() > 1e-2
    save_adapter(lora, tmp_path / "edl")
    theirs = peft.PeftModel.from_pretrained(edl.to_torch(model), tmp_path / "edl").eval()
    np.testing.assert_allclose(_torch_logits(theirs, ids), mine, rtol=0, atol=TOL)

    config = peft.LoraConfig(r=2, lora_alpha=6, target_modules=["kv_b_proj", "q_b_proj"])
    theirs = peft.get_peft_model(edl.to_torch(model), config)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    theirs.eval().save_pretrained(tmp_path / "peft")
    loaded = load_adapter(model, tmp_path / "peft")
    np.testing.assert_allclose(_logits(loaded, ids), _torch_logits(theirs, ids), rtol=0, atol=TOL)


@pytest.mark.slow  # ~5-45 s (two generate compiles)
def test_lora_wrapped_kv_b_proj_decodes_absorbed():
    """The absorbed decode reads kv_b_proj's merged weight: a LoRA model generates the
    tokens its own forward pass picks greedily."""
    model = _load(_hf_model("q_proj_tied", seed=5, std=0.25))
    lora = apply_lora(model, rank=2, alpha=4, pattern=r"kv_b_proj$", key=jax.random.key(1))
    lora = edl.tree.named_map(
        lambda p, x: 0.3 * jnp.ones_like(x) if p.endswith("lora_B.weight") else x, lora
    )
    ids = np.random.default_rng(2).integers(1, VOCAB, (1, 5))
    out = np.asarray(generate(lora, ids, max_new_tokens=4).sequences)[:, :9]
    for t in range(5, 9):
        assert out[0, t] == int(np.argmax(_logits(lora, out[:, :t])[0, -1]))


@pytest.mark.slow  # ~15 s
def test_int8_and_nf4_models_stay_close():
    """Relative RMS error of the logits within ~2x of what this random model measured
    (int8 ~0.02, nf4 ~0.3); the quantized forward equals the dequantized model's."""
    model = _load(_hf_model("q_lora", seed=6))
    ids = np.random.default_rng(2).integers(1, VOCAB, (2, 9))
    ref = _logits(model, ids).astype(np.float64)
    for fmt, bound in (("int8", 0.06), ("nf4", 0.9)):
        q = quantize_model(model, QuantConfig(fmt))
        got = _logits(q, ids).astype(np.float64)
        rel = np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref**2))
        assert 0 < rel < bound, (fmt, rel)
        np.testing.assert_allclose(got, _logits(dequantize_model(q), ids), rtol=0, atol=1e-5)


@pytest.mark.slow  # ~20 s
def test_sharded_forward_equals_one_device():
    """MLA's partition rules (q_b / kv_b split over tp, the low-rank down-projections over
    fsdp) on 8 host devices give one device's logits."""
    model = _load(_hf_model("q_lora", seed=7))
    ids = np.random.default_rng(3).integers(1, VOCAB, (4, 8))
    ref = _logits(model, ids)
    mesh = make_mesh((1, 2, 4, 1))
    sharded = shard(model, None, mesh)
    assert len(sharded.model.layers.self_attn.kv_b_proj.weight.sharding.device_set) == 8
    batch = shard_batch({"ids": jnp.asarray(ids)}, mesh)
    with jax.set_mesh(mesh):
        got = eqx.filter_jit(lambda m, i: m(i).logits)(sharded, batch["ids"])
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # a train step compiled scanned and unrolled: ~30 s
def test_scanned_train_step_equals_unrolled():
    """Two SGD steps with the dense prefix and the MoE layers scanned (two stacks) and
    unrolled: the same losses and weights."""
    model = _load(_hf_model("q_lora", seed=8, num_hidden_layers=4, first_k_dense_replace=2))
    ids = jnp.asarray(np.random.default_rng(4).integers(1, VOCAB, (2, 9)))
    tx = optax.sgd(0.5)

    def run(m):
        state = edl.create_state(m, tx)
        step = make_train_step(lambda m, b: m.compute_loss(b["ids"]), tx, donate=False)
        losses = []
        for _ in range(2):
            state, metrics = step(state, {"ids": ids})
            losses.append(float(metrics["loss"]))
        return losses, edl.state.model(state)

    scanned, m1 = run(model)
    unrolled, m2 = run(configure(model, scan_layers=False))
    np.testing.assert_allclose(scanned, unrolled, rtol=1e-6)
    assert scanned[1] < scanned[0]
    for a, b in zip(jax.tree.leaves(m1), jax.tree.leaves(m2), strict=True):
        if eqx.is_array(a):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # ~12 s
def test_compute_loss_equals_transformers():
    hf_model = _hf_model("q_lora", seed=9)
    model = _load(hf_model)
    ids = np.random.default_rng(5).integers(1, VOCAB, (2, 9))
    with torch.no_grad():
        ref = hf_model(torch.tensor(ids), labels=torch.tensor(ids)).loss.item()
    loss, metrics = model.compute_loss(jnp.asarray(ids))
    np.testing.assert_allclose(float(loss), ref, rtol=1e-5)
    assert float(metrics["loss"]) == float(loss)  # no auxiliary loss, as in transformers


def test_dense_prefix_and_moe_layers_scan_flat_in_depth():
    """The full-size default schedule: 3 dense layers then 58 MoE layers, two scans; the
    traced program of 2 + 2 layers is as long as that of 2 + 6."""
    segments = plan_schedule(DeepseekV3Config().layer_groups, DeepseekV3Config().layer_settings)
    assert [(len(s.block), s.repeats) for s in segments] == [(1, 3), (1, 58)]

    def size(layers):
        c = {**_config().to_dict(), "num_hidden_layers": layers, "first_k_dense_replace": 2}
        _, config, cls = edl.models.registry.resolve(c)
        model = eqx.filter_eval_shape(cls.init, config, key=jax.random.key(0))
        ids = jax.ShapeDtypeStruct((1, 8), jnp.int32)
        return len(str(jax.make_jaxpr(lambda m, i: m(i).logits)(model, ids)).splitlines())

    assert size(4) == size(8)


def test_features_name_mla_and_the_routing():
    words = features(DeepseekV3Config())
    assert "MLA 128 heads: q rank 1536, kv latent 512 + RoPE key 64, v 128" in words
    assert "MoE 8 of 256 experts on 58 layers" in words
    assert "sigmoid routing in 4 of 8 groups, scale 2.5, 1 shared expert" in words
    assert not any(w.startswith("MHA") for w in words)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert features(DeepseekV3Config.from_hf(_config().to_dict()))


@pytest.mark.slow  # ~20-40 s
def test_serving_engine_greedy_matches_transformers():
    """The serving engine (paged pools of latent pages, chunked prefill, a request joining
    mid-flight) gives transformers' greedy tokens."""
    from edl.serve import Engine, SamplingParams

    hf_model = _hf_model("q_lora", seed=3, std=0.25)
    model = _load(hf_model)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(2, VOCAB, n).tolist() for n in (11, 5, 7)]
    want = []
    for p in prompts:
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([p]), do_sample=False, max_new_tokens=6, pad_token_id=0
            )
        want.append(out[0, len(p) :].tolist())
    engine = Engine(model, max_batch=4, max_model_len=32, page_size=4, prefill_chunk=4)
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    ids = [engine.add_request(p, greedy) for p in prompts[:2]]
    got, step = {i: [] for i in ids}, 0
    while engine.has_unfinished() or step < 3:
        if step == 2:  # the third joins while the others decode
            ids.append(engine.add_request(prompts[2], greedy))
            got[ids[-1]] = []
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
        step += 1
        assert step < 200
    assert [got[i] for i in ids] == want


def test_defaults_and_config_round_trip_equal_transformers():
    """``DeepseekV3Config()`` is transformers' default model (its one MTP layer named in the
    warning), and a config written by edl reads back through transformers unchanged."""
    with pytest.warns(UserWarning, match="num_nextn_predict_layers=1"):
        theirs = DeepseekV3Config.from_hf(transformers.DeepseekV3Config().to_dict())
    assert DeepseekV3Config() == theirs.replace(hf_extra=())
    for variant in ("q_proj_tied", "yarn"):
        config = DeepseekV3Config.from_hf(_config(**VARIANTS[variant]).to_dict())
        hf_dict = config.to_hf(architectures=["DeepseekV3ForCausalLM"])
        again = transformers.AutoConfig.for_model(**hf_dict).to_dict()
        assert DeepseekV3Config.from_hf(again).replace(hf_extra=()) == config.replace(hf_extra=())


def test_edl_info_prints_mla_and_the_routing(tmp_path, capsys):
    from edl.cli import main

    _hf_model("q_lora").save_pretrained(tmp_path)
    main(["info", str(tmp_path)])
    out = capsys.readouterr().out
    assert "DeepseekV3ForCausalLM (model_type deepseek_v3): MLA 4 heads: q rank 24" in out
    assert "sigmoid routing in 1 of 2 groups, scale 2.5, 1 shared expert" in out

"""OLMo 2 / OLMo 3, SmolLM3 and Gemma 3 (text): what tests/test_models_families.py does not
check for every family (its parity, round trip, greedy and config tests cover these four
too, on one tiny config each).

Here: more configs per family against transformers (tied / untied heads, biases, default
layer patterns, the legacy RoPE spelling), the layer schedules (a repeated pattern of
sliding / global / NoPE layers is scanned as periods: the traced program does not grow with
depth), generation through the paged cache, LoRA adapters both ways with peft, int8 / NF4,
a forward pass sharded over the 8 host devices and the scanned train step. Tolerances as in
tests/hf_parity.py (1e-4 on float32 logits).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hf_parity import VOCAB, assert_close_on_real_tokens, padded_batch, random_hf_model
from test_models_families import NEW_TYPES, _hf_model

import edl
from edl.generate import generate
from edl.io.formats import hf
from edl.io.formats.peft import load_adapter, save_adapter
from edl.lora import apply_lora
from edl.models import configure
from edl.models.features import features
from edl.models.gemma3 import Gemma3TextConfig
from edl.models.olmo import Olmo2Config, Olmo3Config
from edl.models.smollm3 import SmolLM3Config
from edl.nn.schedule import plan_schedule
from edl.quantize import QuantConfig
from edl.quantize import dequantize as dequantize_model
from edl.quantize import quantize as quantize_model
from edl.sharding import make_mesh, shard, shard_batch
from edl.train import make_train_step

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TOL = 1e-4
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, pad_token_id=0)
_SMALL = dict(num_attention_heads=4, num_key_value_heads=2)

# A second config per family, unlike test_models_families.py's in the head tying, biases,
# the default layer patterns (spanning more than one period) and the RoPE spelling.
VARIANTS = {
    # A tied head, no biases.
    "olmo2": lambda: transformers.Olmo2Config(
        **_COMMON, **_SMALL, num_hidden_layers=3, tie_word_embeddings=True
    ),
    # HF's default pattern (3 sliding + 1 global) twice, transformers 4's rope_theta.
    "olmo3": lambda: transformers.Olmo3Config(
        **_COMMON, **_SMALL, num_hidden_layers=8, sliding_window=3, rope_theta=300.0
    ),
    # NoPE every fourth layer (the default), global attention, biases, an untied head.
    "smollm3": lambda: transformers.SmolLM3Config(
        **_COMMON,
        **_SMALL,
        num_hidden_layers=8,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=False,
    ),
    # Two periods of 5 sliding + 1 global and a tail, soft-capping, an untied head, the
    # default RoPE bases (1M global, 10k local).
    "gemma3_text": lambda: transformers.Gemma3TextConfig(
        **_COMMON,
        **_SMALL,
        num_hidden_layers=13,
        head_dim=16,
        sliding_window=3,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
        tie_word_embeddings=False,
    ),
}


def _default_only(model_type):
    """``NEW_TYPES`` with every family but ``model_type`` in the slow set."""
    return [t if t == model_type else pytest.param(t, marks=pytest.mark.slow) for t in NEW_TYPES]


def _logits(model, ids, mask=None):
    mask = None if mask is None else jnp.asarray(mask)
    return np.asarray(model(jnp.asarray(ids), attention_mask=mask).logits)


def _torch_logits(torch_model, ids, mask=None):
    mask = None if mask is None else torch.tensor(mask)
    with torch.no_grad():
        return torch_model(torch.tensor(np.asarray(ids)), attention_mask=mask).logits.numpy()


@pytest.mark.parametrize("model_type", sorted(VARIANTS))
def test_more_configs_match_transformers(model_type):
    hf_model = random_hf_model(VARIANTS[model_type](), "causal_lm")
    model = hf.from_state_dict(hf_model.config.to_dict(), hf_model.state_dict())
    ids, mask = padded_batch(seq=13)
    assert_close_on_real_tokens(_logits(model, ids, mask), _torch_logits(hf_model, ids, mask), mask)
    # The config writes back to what transformers reads as the same model.
    again = type(model.config).from_hf(model.config.to_hf())
    assert again == model.config


def _segments(config):
    return plan_schedule(config.layer_groups, config.layer_settings)


def test_layer_patterns_are_scanned_as_periods():
    """HF's default layer patterns at full depth: one scanned segment of periods (plus
    Gemma 3's tail of two), each period holding one layer per kind."""
    gemma3 = _segments(Gemma3TextConfig())  # 26 layers: 5 sliding + 1 global, repeated
    assert [(len(s.block), s.repeats) for s in gemma3] == [(6, 4), (1, 2)]
    local, glob = Gemma3TextConfig().layer_settings[0], Gemma3TextConfig().layer_settings[5]
    assert local == (4096, Gemma3TextConfig().sliding_rope) and local[1].theta == 1e4
    assert glob == (None, Gemma3TextConfig().rope) and glob[1].theta == 1e6
    smol = _segments(SmolLM3Config())  # 36 layers: 3 RoPE + 1 NoPE, repeated
    assert [(len(s.block), s.repeats) for s in smol] == [(4, 9)]
    assert [rope is None for _, rope in SmolLM3Config().layer_settings[:4]] == [0, 0, 0, 1]
    olmo3 = _segments(Olmo3Config())  # 32 layers: 3 sliding + 1 global, repeated
    assert [(len(s.block), s.repeats) for s in olmo3] == [(4, 8)]
    assert [(len(s.block), s.repeats) for s in _segments(Olmo2Config())] == [(1, 32)]


@pytest.mark.parametrize(
    "model_type", [pytest.param("smollm3", marks=pytest.mark.slow), "gemma3_text"]
)
def test_traced_program_does_not_grow_with_depth(model_type):
    """Two and four periods trace to programs of the same size: the layers are a scan over
    periods, not an unrolled loop (compile time flat in depth)."""
    config = VARIANTS[model_type]().to_dict()
    period = 6 if model_type == "gemma3_text" else 4

    def size(periods):
        n = periods * period
        c = {**config, "num_hidden_layers": n, "layer_types": None, "no_rope_layers": None}
        c = {k: v for k, v in c.items() if v is not None}
        model = eqx.filter_eval_shape(
            lambda: edl.models.registry.resolve(c)[2].init(
                edl.models.registry.resolve(c)[1], key=jax.random.key(0)
            )
        )
        ids = jax.ShapeDtypeStruct((1, 8), jnp.int32)
        jaxpr = jax.make_jaxpr(lambda m, i: m(i).logits)(model, ids)
        return len(str(jaxpr).splitlines())

    assert size(2) == size(4)


# By default one family (SmolLM3: NoPE layers through the paged cache); each ~10-15 s.
@pytest.mark.parametrize("model_type", _default_only("smollm3"))
def test_paged_greedy_generation_matches_transformers(model_type):
    hf_model = _hf_model(model_type, seed=3, std=0.25)
    model = hf.from_state_dict(hf_model.config.to_dict(), hf_model.state_dict())
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
    out = generate(model, ids, attention_mask=mask, max_new_tokens=10, pad_token_id=0, page_size=4)
    np.testing.assert_array_equal(np.asarray(out.sequences)[:, : ref.shape[1]], ref)


# By default OLMo 2 (its q/k norms over all heads sit between q/k_proj and attention);
# each ~10-20 s.
@pytest.mark.parametrize("model_type", _default_only("olmo2"))
def test_lora_adapters_round_trip_with_peft(model_type, tmp_path):
    """edl's adapter loads in peft with edl's logits; peft's loads in edl with peft's. The
    adapters target every projection (OLMo 2's q / k norms over all heads follow q / k)."""
    model = hf.from_state_dict(*_state(model_type))
    ids = np.random.default_rng(1).integers(1, VOCAB, (2, 9))
    lora = apply_lora(
        model, rank=4, alpha=8, pattern=r"(q|k|v|o|gate|up|down)_proj$", key=jax.random.key(0)
    )
    lora = edl.tree.named_map(
        lambda p, x: (
            0.1 * jax.random.normal(jax.random.key(len(p)), x.shape, x.dtype)
            if p.endswith("lora_B.weight")
            else x
        ),
        lora,
    )
    mine = _logits(lora, ids)
    assert np.abs(mine - _logits(model, ids)).max() > 1e-2  # the adapters matter
    save_adapter(lora, tmp_path / "edl")
    theirs = peft.PeftModel.from_pretrained(edl.to_torch(model), tmp_path / "edl").eval()
    np.testing.assert_allclose(_torch_logits(theirs, ids), mine, rtol=0, atol=TOL)

    config = peft.LoraConfig(
        r=2, lora_alpha=6, target_modules=["q_proj", "k_proj", "down_proj"], task_type="CAUSAL_LM"
    )
    theirs = peft.get_peft_model(edl.to_torch(model), config)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    theirs.eval().save_pretrained(tmp_path / "peft")
    loaded = load_adapter(model, tmp_path / "peft")
    np.testing.assert_allclose(_logits(loaded, ids), _torch_logits(theirs, ids), rtol=0, atol=TOL)


def _state(model_type):
    hf_model = _hf_model(model_type)
    return hf_model.config.to_dict(), hf_model.state_dict()


# All in the slow set (each ~5-20 s; int8 / NF4 models stay close to float32 in
# tests/test_quantize.py (Llama) in the default suite).
@pytest.mark.slow
@pytest.mark.parametrize("model_type", _default_only("smollm3"))
def test_int8_and_nf4_models_stay_close(model_type):
    """Relative RMS error of the logits within ~2x of what these random models (weights
    ~ N(0, 0.2), up to 7 layers) measured: int8 0.010-0.027, nf4 0.13-0.47 (Gemma 3's
    the largest: its q/k norms and sandwich norms amplify weight errors); the quantized
    forward equals the dequantized model's."""
    model = hf.from_state_dict(*_state(model_type))
    ids = np.random.default_rng(2).integers(1, VOCAB, (2, 9))
    ref = _logits(model, ids).astype(np.float64)
    for fmt, bound in (("int8", 0.06), ("nf4", 0.9)):
        q = quantize_model(model, QuantConfig(fmt))
        got = _logits(q, ids).astype(np.float64)
        rel = np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref**2))
        assert 0 < rel < bound, (fmt, rel)
        np.testing.assert_allclose(got, _logits(dequantize_model(q), ids), rtol=0, atol=1e-5)


# By default OLMo 2 (norms over all heads under a tp split) and SmolLM3 (a tied head: on
# this mesh its logits were wrong until the trunk's output got the activation sharding);
# each ~5-12 s.
@pytest.mark.parametrize(
    "model_type",
    [
        t if t in ("olmo2", "smollm3") else pytest.param(t, marks=pytest.mark.slow)
        for t in NEW_TYPES
    ],
)
def test_sharded_forward_equals_one_device(model_type):
    """The family's partition rules on 8 host devices (data x FSDP x tensor parallel, each
    of 2): the same logits as one device (OLMo 2's norms over all q / k heads span the tp
    split)."""
    model = hf.from_state_dict(*_state(model_type))
    ids = np.random.default_rng(3).integers(1, VOCAB, (4, 8))
    ref = _logits(model, ids)
    mesh = make_mesh((2, 2, 2, 1))
    sharded = shard(model, None, mesh)
    assert len(sharded.model.layers.self_attn.q_proj.weight.sharding.device_set) == 8
    batch = shard_batch({"ids": jnp.asarray(ids)}, mesh)
    with jax.set_mesh(mesh):
        got = eqx.filter_jit(lambda m, i: m(i).logits)(sharded, batch["ids"])
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # a train step compiled scanned and unrolled: ~20-45 s per family
@pytest.mark.parametrize("model_type", NEW_TYPES)
def test_scanned_train_step_equals_unrolled(model_type):
    """Two SGD steps with the layers scanned (periods of sliding / global / NoPE layers)
    and unrolled: the same losses and weights. (SGD: Adam's first step moves every weight
    by ~lr whatever its gradient, so float noise in a ~0 gradient would show.)"""
    model = hf.from_state_dict(*_state(model_type))
    ids = jnp.asarray(np.random.default_rng(4).integers(1, VOCAB, (2, 9)))
    tx = optax.sgd(0.5)

    def loss(m, batch):
        return m.compute_loss(batch["ids"])

    def run(m):
        state = edl.create_state(m, tx)
        step = make_train_step(loss, tx, donate=False)
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


def test_features_name_each_layout():
    """What ``edl info`` prints: each family's distinctive features and its schedule."""
    assert features(Gemma3TextConfig()) == [
        "GQA 8/4 heads of 256",
        "q/k norms per head",
        "attention scale 0.0625",
        "RoPE theta 1e+06",
        "sliding window 4096 on 22/26 layers",
        "sliding layers RoPE theta 10000",
        "sandwich norms",
        "norm scale 1 + w",
        "scaled embeddings",
        "gelu_pytorch_tanh MLP",
        "tied head",
        "26 layers scanned as 4 x 6 + 2 x 1 (repeats x period)",
    ]
    smol = features(SmolLM3Config())
    assert "NoPE on 9/36 layers" in smol and smol[-1].startswith("36 layers scanned as 9 x 4")
    olmo = features(Olmo3Config())
    assert {"q/k norms over all heads", "post-norms", "sliding window 4096 on 24/32 layers"} <= set(
        olmo
    )
    assert features(None) == []


def test_edl_info_prints_the_features(tmp_path, capsys):
    from edl.cli import main

    hf_model = _hf_model("olmo2")
    hf_model.save_pretrained(tmp_path)
    main(["info", str(tmp_path)])
    out = capsys.readouterr().out
    line = "Olmo2ForCausalLM (model_type olmo2): GQA 4/2 heads of 8; attention biases; q/k norms"
    assert line + " over all heads" in out
    assert "post-norms" in out and "model.layers.post_feedforward_layernorm.weight" in out


def test_unsupported_variants_and_layouts_say_what_is_missing():
    # gemma3 (the multimodal model) loads: tests/test_models_gemma3_vision.py.
    with pytest.raises(
        ValueError, match=r"unsupported model_type 'gemma3n': .*per-layer embeddings"
    ):
        edl.models.registry.resolve({"model_type": "gemma3n"})
    # HF's sliding mask would use sliding_window where its attention does not.
    smol = {**VARIANTS["smollm3"]().to_dict(), "layer_types": ["sliding_attention"] * 8}
    with pytest.raises(ValueError, match="use_sliding_window is off"):
        SmolLM3Config.from_hf(smol)
    with pytest.raises(ValueError, match=r"\['post_norms'\] must keep edl's defaults"):
        edl.models.LlamaConfig(num_hidden_layers=1, post_norms=True).to_hf()
    with pytest.raises(ValueError, match=r"\['nope_layers'\] must keep edl's defaults"):
        Olmo2Config(num_hidden_layers=2, nope_layers=(1,)).to_hf()
    with pytest.raises(ValueError, match="HF's Gemma 3 applies none"):
        Gemma3TextConfig(num_hidden_layers=2, attn_softcap=5.0).to_hf()
    with pytest.raises(ValueError, match="nope_layers must be a tuple of layer indices"):
        SmolLM3Config(num_hidden_layers=2, nope_layers=(2,))


# Each ~10-25 s: the slow set (the engine's own tests and test_models_families run Llama-
# shaped families through it by default).
@pytest.mark.slow
@pytest.mark.parametrize("model_type", NEW_TYPES)
def test_serving_engine_greedy_matches_transformers(model_type):
    """The serving engine (paged cache, chunked prefill, requests joining mid-flight) gives
    transformers' greedy tokens for prompts longer than the sliding window."""
    from edl.serve import Engine, SamplingParams

    hf_model = _hf_model(model_type, seed=3, std=0.25)
    model = hf.from_state_dict(hf_model.config.to_dict(), hf_model.state_dict())
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

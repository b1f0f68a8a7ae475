"""Variants as registry entries: a quantization format, a DPO loss type and a GRPO loss are
each added by one entry (scoped to the test), and then work everywhere the built-in ones do
(quantizing a model, checkpoints, ``make_dpo_step``, ``GRPOConfig``, the CLI's choices),
checked against float64 formulas written here."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import edl
from edl._registry import Registry
from edl.cli import main
from edl.cli.config import ConfigError, TrainConfig
from edl.io.checkpoint import save_state
from edl.io.export import load_model
from edl.io.formats.structure import layer_structure, rebuild
from edl.nn import QuantizedLinear
from edl.ops.quant import QUANT_FORMATS, QuantFormat, dequantize_weight, quantize_weight
from edl.quantize import QuantConfig
from edl.quantize import quantize as quantize_model
from edl.train import make_dpo_step
from edl.train.grpo import GRPOConfig
from edl.train.grpo_objective import GRPO_LOSSES, GRPOLoss, grpo_loss
from edl.train.preference import PREFERENCE_LOSSES, PreferenceLoss, dpo_loss
from edl.train.preference_step import preference_logps


@dataclasses.dataclass(frozen=True)
class _Entry:
    name: str


def test_registry_registers_refuses_duplicates_and_scopes_entries():
    reg = Registry("toy", [_Entry("a")])
    with pytest.raises(ValueError, match=r"toy 'a' is already registered"):
        reg.register(_Entry("a"))
    for bad in ("", "two words", "a,b"):
        with pytest.raises(ValueError, match="non-empty strings without spaces or commas"):
            reg.register(_Entry(bad))

    def fails_inside() -> None:
        with reg.registered(_Entry("b"), _Entry("c")):
            assert list(reg) == ["a", "b", "c"]
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fails_inside()
    assert list(reg) == ["a"]  # unregistered again, also after the error
    with pytest.raises(ValueError, match=r"^where\.kind must be one of a, got 'b'$"):
        reg.lookup("b", "where.kind")
    with pytest.raises(ValueError, match="must be one of a, got 3"):
        reg.lookup(3, "json value")
    assert reg.unregister("a") == _Entry("a") and len(reg) == 0


# ---------------------------------------------------------------- a quantization format ---

_INT4_MAX = 7


def _int4_encode(normed):
    """Symmetric int4 in [-7, 7], stored offset by 8 as nibbles, two per uint8 (high first)."""
    q = (jnp.clip(jnp.round(normed), -_INT4_MAX, _INT4_MAX) + 8).astype(jnp.uint8)
    pairs = q.reshape(*q.shape[:-1], q.shape[-1] // 2, 2)
    return (pairs[..., 0] << 4) | pairs[..., 1]


def _int4_decode(q):
    nibbles = jnp.stack([q >> 4, q & 15], axis=-1).astype(jnp.float32) - 8.0
    return nibbles.reshape(*q.shape[:-1], 2 * q.shape[-1])


INT4 = QuantFormat(
    "int4",
    _int4_encode,
    _int4_decode,
    max_code=float(_INT4_MAX),
    codes_per_byte=2,
    default_block=32,
)


def _int4_reference(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """float64 block-wise absmax int4 of each (out, in) matrix, from the format's definition:
    ``(codes (*lead, blocks, block), scale per element (*lead, out, in))``."""
    flat = w.reshape(*w.shape[:-2], -1).astype(np.float64)
    blocks = flat.reshape(*flat.shape[:-1], -1, block)  # out * in divides by block here
    scale = np.abs(blocks).max(-1, keepdims=True) / _INT4_MAX
    codes = np.clip(np.rint(blocks / np.where(scale > 0, scale, 1)), -7, 7)
    return codes, np.broadcast_to(scale, blocks.shape).reshape(w.shape)


def test_a_quantization_format_is_one_entry(tiny_llama):
    w = np.random.default_rng(0).normal(size=(3, 16, 64)).astype(np.float32)
    with QUANT_FORMATS.registered(INT4):
        q, s = quantize_weight(jnp.asarray(w), format="int4", block_size=32)
        assert q.dtype == jnp.uint8 and q.shape == (3, 32, 16) and s.shape == (3, 32)
        got = np.asarray(dequantize_weight(q, s, format="int4", shape=(16, 64)), np.float64)
        codes, scale = _int4_reference(w, 32)
        # Within half a step of the float64 scale (float32 scales: a few ulps more).
        assert np.all(np.abs(got - w) <= scale * (0.5 + 1e-5))
        # The codes are the float64 ones, but where float32 rounding flips a value sitting
        # on a rounding boundary (by one).
        diff = np.abs(np.asarray(_int4_decode(q)) - codes)
        assert diff.max() <= 1 and np.mean(diff) < 0.01
        # The scale rule, absmax / max_code (XLA divides by a reciprocal: an ulp apart).
        absmax = np.abs(w).reshape(3, 32, 32).max(-1).astype(np.float64)
        np.testing.assert_allclose(np.asarray(s), absmax / 7, rtol=2.5e-7)

        qmodel = quantize_model(tiny_llama, QuantConfig("int4"))
        layer = qmodel.model.layers.self_attn.q_proj
        assert isinstance(layer, QuantizedLinear) and layer.format == "int4"
        assert layer.block_size == 32  # the format's default block
        dense = np.asarray(tiny_llama.model.layers.self_attn.q_proj.weight, np.float64)
        _, scale = _int4_reference(dense, 32)
        assert np.all(np.abs(np.asarray(layer.weight, np.float64) - dense) <= scale * 0.50001)

        # A checkpoint's state.json records the format by name; rebuilt from it, the model
        # has the same layers.
        structure = layer_structure(qmodel)
        assert structure["model.layers.self_attn.q_proj"]["quantized"] == {
            "format": "int4",
            "block_size": 32,
            "scale_dtype": "float32",
            "dtype": "float32",
        }
        shapes = eqx.filter_eval_shape(rebuild, tiny_llama, structure)
        assert jax.tree.structure(shapes) == jax.tree.structure(qmodel)
        TrainConfig(model="m", data="d", lora_rank=4, quantize="int4")  # a CLI choice now
    # Scoped: gone after the block, for the library, the CLI and a checkpoint that names it.
    with pytest.raises((ValueError, TypeError), match="int4"):
        QuantConfig("int4")
    with pytest.raises(ConfigError, match="quantize must be one of none, int8, nf4; got 'int4'"):
        TrainConfig(model="m", data="d", lora_rank=4, quantize="int4")
    with pytest.raises(ValueError, match=r"q_proj: quantized\.format must be one of int8, nf4"):
        rebuild(tiny_llama, structure)


@pytest.mark.slow  # two forwards of a quantized model and a checkpoint (~10-20 s)
def test_a_registered_format_checkpoint_round_trips(tiny_llama, tiny_ids, tmp_path):
    with QUANT_FORMATS.registered(INT4):
        qmodel = quantize_model(tiny_llama, QuantConfig("int4"))
        logits = np.asarray(qmodel(tiny_ids).logits)
        dense = np.asarray(tiny_llama(tiny_ids).logits)
        assert 0 < np.abs(logits - dense).max() < 0.1 * np.abs(dense).max()
        checkpoint = save_state(edl.create_state(qmodel, optax.sgd(0.1)), tmp_path)
        loaded = load_model(checkpoint)
        layer, again = (m.model.layers.self_attn.q_proj for m in (qmodel, loaded))
        assert again.format == "int4" and again.block_size == 32
        for x, y in ((again.qweight, layer.qweight), (again.scales, layer.scales)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        # (run options such as the attention implementation are not in config.json)
        np.testing.assert_allclose(np.asarray(loaded(tiny_ids).logits), logits, atol=1e-6)
    with pytest.raises(ValueError, match=r"state\.json 'layers'.*q_proj: quantized\.format"):
        load_model(checkpoint)


def test_a_format_whose_encode_breaks_its_contract_is_named():
    wide = dataclasses.replace(INT4, name="int4_wide", encode=lambda x: x.astype(jnp.int8))
    with QUANT_FORMATS.registered(wide), pytest.raises(ValueError, match="'int4_wide': encode"):
        quantize_weight(jnp.ones((4, 8)), format="int4_wide", block_size=8)
    with pytest.raises(ValueError, match="block_size must be a positive multiple of 3"):
        dataclasses.replace(INT4, name="int4_odd", codes_per_byte=3, default_block=32)


def test_rebuild_names_the_layer_of_an_unknown_format(tiny_llama):
    spec = {"format": "int3", "block_size": 32, "scale_dtype": "float32", "dtype": "float32"}
    with pytest.raises(
        ValueError,
        match=r"^ckpt/state\.json: model\.layers\.self_attn\.q_proj: "
        r"quantized\.format must be one of int8, nf4, got 'int3'$",
    ):
        rebuild(
            tiny_llama,
            {"model.layers.self_attn.q_proj": {"quantized": spec}},
            where="ckpt/state.json",
        )


# ---------------------------------------------------------------- a DPO loss type ---


def _robust(pairs, options):
    """Robust DPO (Chowdhury et al., 2024; TRL's ``loss_type="robust"``): the conservative
    loss unbiased for label noise ε: ``(-(1 - ε) log σ(β h) + ε log σ(-β h)) / (1 - 2 ε)``."""
    h, eps = options.beta * (pairs.chosen - pairs.rejected), options.label_smoothing
    losses = -(1 - eps) * jax.nn.log_sigmoid(h) + eps * jax.nn.log_sigmoid(-h)
    return jnp.mean(losses / (1 - 2 * eps)), {}


ROBUST = PreferenceLoss("robust", _robust)


def _robust64(pc, pr, rc, rr, beta, eps):
    h = beta * ((pc - rc) - (pr - rr))
    log_sigmoid = lambda x: -np.logaddexp(0.0, -x)
    return np.mean((-(1 - eps) * log_sigmoid(h) + eps * log_sigmoid(-h)) / (1 - 2 * eps))


def _pairs(tiny_ids):
    ids = np.asarray(tiny_ids, np.int32)
    labels = np.where(np.arange(ids.shape[1]) >= 4, ids, -100)
    mask = np.ones_like(ids)
    return {
        k: jnp.asarray(v, jnp.int32)
        for k, v in {
            "chosen_input_ids": ids,
            "chosen_labels": labels,
            "chosen_attention_mask": mask,
            "rejected_input_ids": ids[::-1],
            "rejected_labels": labels[::-1],
            "rejected_attention_mask": mask,
        }.items()
    }


def test_a_dpo_loss_type_is_one_entry(tmp_path, capsys):
    rng = np.random.default_rng(1)
    pc, pr = -rng.uniform(5, 40, 6), -rng.uniform(5, 40, 6)
    rc, rr = pc + rng.normal(0, 3, 6), pr + rng.normal(0, 3, 6)
    f32 = [np.float32(x) for x in (pc, pr, rc, rr)]
    with PREFERENCE_LOSSES.registered(ROBUST):
        loss, metrics = dpo_loss(
            *map(jnp.asarray, f32), beta=0.3, loss_type="robust", label_smoothing=0.2
        )
        want = _robust64(*(x.astype(np.float64) for x in f32), beta=0.3, eps=0.2)
        np.testing.assert_allclose(float(loss), want, rtol=2e-6)
        np.testing.assert_allclose(
            float(metrics["rewards/chosen"]),
            0.3 * np.mean(f32[0].astype(np.float64) - f32[2]),
            rtol=2e-6,
        )
        # make_dpo_step takes it, as a loss against a reference (reference='model' wants
        # the model; the step itself: the slow test below).
        tx = optax.sgd(0.0)
        make_dpo_step(tx, loss_type="robust", reference="batch")
        with pytest.raises(
            ValueError,
            match=r"needed exactly when loss_type is one of \("
            r"'sigmoid', 'ipo', 'hinge', 'robust'\)",
        ):
            make_dpo_step(tx, loss_type="robust", reference="model")
        # The CLI's --loss-type choices are the registry's.
        config = TrainConfig(model="m", data="d", method="dpo", loss_type="robust")
        assert config.loss_type == "robust"
    with pytest.raises(ValueError, match="loss_type must be one of sigmoid, ipo, hinge"):
        dpo_loss(*map(jnp.asarray, f32), loss_type="robust")
    with pytest.raises(ValueError, match="loss_type must be one of sigmoid, ipo, hinge, simpo"):
        make_dpo_step(optax.sgd(0.0), loss_type="robust", reference="batch")
    with pytest.raises(SystemExit):
        main(["train", "--loss-type", "robust", "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    # --loss-type names DPO's losses and GRPO's (each method checks its own); '' is the
    # method's default.
    assert "loss_type must be one of '', sigmoid, ipo, hinge, simpo, orpo, grpo," in err
    assert "got 'robust'" in err
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    main_help = " ".join(capsys.readouterr().out.split())
    assert (
        "'' or a name in edl.train.preference.PREFERENCE_LOSSES or "
        "edl.train.grpo_losses.GRPO_LOSSES (default: )" in main_help
    )
    assert "none or a name in edl.ops.quant.QUANT_FORMATS (default: none)" in main_help


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "robust"])
def test_dpo_loss_takes_both_lengths_or_neither_for_every_loss(loss_type):
    """The entries share one input check: a lone length is refused by every loss (it was
    ignored by all but IPO)."""
    x = jnp.full((3,), -2.0, jnp.float32)
    with (
        PREFERENCE_LOSSES.registered(ROBUST),
        pytest.raises(
            ValueError, match=f"loss_type='{loss_type}' takes both chosen_lengths and rejected"
        ),
    ):
        dpo_loss(x, x, x, x, loss_type=loss_type, chosen_lengths=x)


@pytest.mark.slow  # compiles a DPO train step of tiny_llama (~10-15 s)
def test_a_registered_dpo_loss_trains_through_make_dpo_step(tiny_llama, tiny_ids):
    """The step's loss is the formula's, on the policy's log-probs and the batch's
    reference ones."""
    tx = optax.sgd(0.0)
    batch = _pairs(tiny_ids)
    policy = jax.jit(preference_logps)(tiny_llama, batch)
    ref_c, ref_r = policy["chosen_logps"] + 1.5, policy["rejected_logps"] - 0.5
    with PREFERENCE_LOSSES.registered(ROBUST):
        step = make_dpo_step(
            tx, loss_type="robust", reference="batch", label_smoothing=0.1, donate=False
        )
        state = edl.create_state(tiny_llama, tx)
        _, got = step(state, {**batch, "ref_chosen_logps": ref_c, "ref_rejected_logps": ref_r})
    logps64 = [
        np.asarray(x, np.float64)
        for x in (policy["chosen_logps"], policy["rejected_logps"], ref_c, ref_r)
    ]
    np.testing.assert_allclose(
        float(got["loss"]), _robust64(*logps64, beta=0.1, eps=0.1), rtol=1e-5
    )


# ---------------------------------------------------------------- a GRPO loss ---


def test_a_grpo_loss_is_one_entry():
    """A reduction as TRL's ``luspo`` reduces: each completion's masked sum, averaged."""
    rng = np.random.default_rng(2)
    logps = rng.uniform(-3, 0, (4, 6)).astype(np.float32)
    old = (logps + rng.normal(0, 0.1, (4, 6))).astype(np.float32)
    adv = rng.normal(size=4).astype(np.float32)
    mask = (rng.uniform(size=(4, 6)) > 0.3).astype(np.float32)
    seq_sum = GRPOLoss("seq_sum", lambda per_token, m, _: jnp.mean(jnp.sum(per_token * m, 1)))
    with GRPO_LOSSES.registered(seq_sum):
        loss, _ = grpo_loss(*map(jnp.asarray, (logps, old, adv, mask)), loss_type="seq_sum")
        ratio = np.exp(logps.astype(np.float64) - old)
        a = adv.astype(np.float64)[:, None]
        per_token = -np.minimum(ratio * a, np.clip(ratio, 0.8, 1.2) * a)
        np.testing.assert_allclose(float(loss), np.mean(np.sum(per_token * mask, 1)), rtol=1e-5)
        assert GRPOConfig(loss_type="seq_sum").loss_type == "seq_sum"
    with pytest.raises(ValueError, match=r"GRPOConfig\.loss_type must be one of grpo, bnpo, "):
        GRPOConfig(loss_type="seq_sum")

"""``configure``: a built model's run options and settings change, its architecture never.

The classification of every field is checked by construction over every registered family:
each field a config class lets a built model change (the run options and its ``SETTINGS``)
leaves the shapes ``init`` gives identical, and any other field (nested ones included:
LLaVA's, CLIP's and SigLIP's ``text_config`` / ``vision_config``) is refused, naming it, when
asked to take another value (a valid one for nested fields; a top-level field is refused
before its value is even checked). The models are abstract (``eqx.filter_eval_shape``), so
the families' real default sizes cost nothing.
"""

from __future__ import annotations

import dataclasses
import re

import equinox as eqx
import jax
import pytest

from edl.models import (
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    MixtralConfig,
    MixtralForCausalLM,
    configure,
    registry,
)
from edl.models.config import RUN_OPTIONS, RunOptions
from edl.models.encoder_config import CLIPVisionConfig, SiglipVisionConfig
from edl.ops.attention import IMPLS as ATTENTION_IMPLS
from edl.ops.moe import MOE_IMPLS
from edl.ops.rope import RopeConfig

KEY = jax.random.key(0)

# Other values to try for string and tuple fields (a candidate must build a valid config).
STRINGS = {
    "remat": ("full", "none"),
    "attention_impl": ATTENTION_IMPLS,
    "moe_impl": MOE_IMPLS,
    "rope_length": ("row", "batch"),
    "hidden_act": ("gelu", "silu"),
    "projector_hidden_act": ("silu", "gelu"),
    "vision_feature_select_strategy": ("full", "default"),
    "model_type": ("mistral", "llama"),
    "mla_cache": ("materialised", "latent"),
}


def _tuples(name, value):
    n = len(value)
    return {
        "hf_extra": [(("edl_test", "1"),)],
        "layer_windows": [(1,) * n, (None,) * n],
        "layer_mlps": [("dense",) * n, ("moe",) * n],
        "vision_feature_layer": [(-1,)],
        "nope_layers": [(0,), ()],
    }.get(name, [])


def _candidates(name, value):
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value * 2, value + 1, 1, 4]
    if isinstance(value, float):
        return [value * 2 + 1.0]
    if value is None and name == "sliding_rope":
        return [RopeConfig(dim=2, theta=50.0)]
    if value is None:
        return [1.5, 1, True, "regression"]
    if isinstance(value, str):
        return list(STRINGS.get(name, ()))
    if isinstance(value, tuple):
        return _tuples(name, value)
    if isinstance(value, RopeConfig):
        return [dataclasses.replace(value, theta=value.theta * 2)]
    if isinstance(value, RunOptions):
        return [dataclasses.replace(value, scan_layers=not value.scan_layers)]
    raise AssertionError(f"no candidate values for {name}={value!r}: add some")


def _changed(config, name):
    """A valid config with ``name`` (a field or a run option) set to another value, or
    ``None`` when no candidate builds one."""
    current = getattr(config, name, None)
    if name in RUN_OPTIONS:
        current = getattr(_any_run(config), name)
    for value in _candidates(name, current):
        try:
            new = config.replace(**{name: value})
        except (TypeError, ValueError):
            continue
        if new != config:
            return new
    return None


def _any_run(config):
    """A ``RunOptions`` of ``config`` (a nesting config's: its text model's)."""
    return config.run if hasattr(config, "run") else _any_run(config.text_config)


def _variants(config, nested=False):
    """``(path, changes, new, allowed)`` for each run option and each field of ``config``,
    nested configs' fields by path: ``configure(model, **changes)`` asks for another value,
    a valid one (giving the config ``new``) where the field may change or is nested.
    ``changes`` is ``None`` where no other valid value exists."""
    for name in sorted(RUN_OPTIONS):
        new = _changed(config, name)
        assert new is not None, f"{type(config).__name__}: no other value for {name}"
        yield name, {name: getattr(_any_run(new), name)}, new, True
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        allowed = f.name in type(config).SETTINGS
        if hasattr(value, "SETTINGS"):  # a nested config
            for path, _, inner, ok in _variants(value, nested=True):
                # The whole config is built only where the change is allowed: a refusal
                # comes before it.
                outer = _replace(config, {f.name: inner}) if ok and inner else None
                changes = None if inner is None or (ok and outer is None) else {f.name: inner}
                yield f"{f.name}.{path}", changes, outer, ok
        elif allowed or nested:
            new = _changed(config, f.name)
            yield f.name, None if new is None else {f.name: getattr(new, f.name)}, new, allowed
        else:  # refused whatever the value, valid or not (checked before it is built)
            other = [v for v in _candidates(f.name, value) if v != value] or [f"not {value}"]
            yield f.name, {f.name: other[0]}, None, False


def _replace(config, changes):
    try:
        return config.replace(**changes)
    except (TypeError, ValueError):
        return None


def _configs_in(tree):
    """The ``config`` of every module in ``tree`` holding one."""

    def holds(x):
        return isinstance(x, eqx.Module) and "config" in {f.name for f in dataclasses.fields(x)}

    out = []
    for node in jax.tree.leaves(tree, is_leaf=holds):
        if holds(node):
            out.append(node.config)
            for f in dataclasses.fields(node):
                if f.name != "config" and not f.metadata.get("static", False):
                    out += _configs_in(getattr(node, f.name))
    return out


def _nested(config):
    out = [config]
    for f in dataclasses.fields(config):
        if hasattr(getattr(config, f.name), "SETTINGS"):
            out += _nested(getattr(config, f.name))
    return out


def _shapes(model):
    return [
        (jax.tree_util.keystr(p), x.shape, x.dtype) for p, x in jax.tree.leaves_with_path(model)
    ]


def _family_config(family):
    if family.config_cls is LlavaConfig:
        return LlavaConfig(
            text_config=LlamaConfig(), vision_config=CLIPVisionConfig(), image_token_index=5
        )
    return family.config_cls()


def _init(family, config, tasks=None):
    """The models of ``family``'s ``tasks`` (default: all) under ``config``, abstract."""
    classes = {t: c for t, c in family.tasks.items() if tasks is None or t in tasks}
    return eqx.filter_eval_shape(
        lambda c: {task: cls.init(c, key=KEY) for task, cls in classes.items()}, config
    )


def _check_configured(model, changes, new, path):
    configured = configure(model, **changes)
    assert configured.config == new, path
    # Every part's config follows (a LLaVA model's tower and language model too).
    assert set(_configs_in(configured)) <= set(_nested(new)), path
    assert _shapes(configured) == _shapes(model), path


FAMILIES = {f.name: f for f in registry.registered()}


@pytest.mark.parametrize("name", FAMILIES)
def test_changeable_fields_keep_shapes_and_the_rest_is_refused(name):
    """Each field a built model may change, changed alone, gives the default task's
    ``init`` the same shapes (all of them changed at once: every task's); every other field
    is refused. (A nested config's fields change shapes as in their own family's case.)"""
    family = FAMILIES[name]
    config = _family_config(family)
    models = _init(family, config)
    task, model = next(iter(models.items()))
    together, refused = {}, 0
    for path, changes, new, allowed in _variants(config):
        if allowed:
            assert changes is not None, f"{path}: no other valid value to check"
            _check_configured(model, changes, new, path)
            if "." not in path:
                assert _shapes(_init(family, new, [task])) == _shapes({task: model}), path
                together.update(changes)
        elif changes is not None:
            with pytest.raises(ValueError, match="configure: refused") as error:
                configure(model, **changes)
            assert re.search(rf"(refused |, ){re.escape(path)} \(model: ", str(error.value))
            refused += 1
        else:  # no other valid value (a single-type model_type, ...): nothing to refuse
            # (post_norms: Gemma 3's sandwich norms admit no other value, as gemma3's text_config)
            assert path.rpartition(".")[2] in ("model_type", "layer_mlps", "post_norms"), path
    assert refused >= 10
    new = config.replace(**together)
    for other in models.values():
        _check_configured(other, together, new, "all at once")
    assert _shapes(_init(family, new)) == _shapes(models)


@pytest.mark.parametrize(
    ("field", "value"), [("num_attention_heads", 8), ("vocab_size", 128), ("intermediate_size", 32)]
)
def test_configure_refuses_shape_bearing_fields(tiny_llama, field, value):
    current = getattr(tiny_llama.config, field)
    message = rf"refused {field} \(model: {current}, requested: {value}\)"
    with pytest.raises(ValueError, match=message):
        configure(tiny_llama, **{field: value})
    with pytest.raises(ValueError, match=message):  # the trunk alone too
        configure(tiny_llama.model, **{field: value})


@pytest.mark.parametrize(
    "changes",
    [
        {"rope": RopeConfig(dim=8, theta=500000.0)},
        {"rms_norm_eps": 1e-3},
        {"num_experts_per_tok": 1},
        {"norm_topk_prob": False},
        {"hidden_act": "gelu"},
        {"pad_token_id": 0},
    ],
    ids=lambda c: next(iter(c)),
)
def test_configure_refuses_fields_that_define_the_function(changes):
    """Fields that change what the weights compute, not their shapes, are refused too."""
    config = MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_experts=4,
    )
    model = eqx.filter_eval_shape(MixtralForCausalLM.init, config, key=KEY)
    with pytest.raises(ValueError, match=f"refused {next(iter(changes))} "):
        configure(model, **changes)


def test_configure_names_unknown_fields(tiny_llama):
    with pytest.raises(ValueError, match=r"no field or run option \['scan'\]"):
        configure(tiny_llama, scan=False)


def test_run_options_and_settings_still_change(tiny_llama):
    """Run options and settings change, on the same weights; asking for an architecture
    field's current value is no change."""
    c = tiny_llama.config
    options = dict(
        scan_layers=False,
        remat="full",
        attention_impl="reference",
        moe_impl="dense",
        moe_capacity_factor=2.0,
        check_inputs=False,
    )
    settings = dict(
        router_aux_loss_coef=0.5,
        router_z_loss_coef=0.1,
        output_router_logits=True,
        problem_type="regression",
        initializer_range=0.1,
        hf_extra=(("bos_token_id", "1"),),
    )
    changed = configure(tiny_llama, **options, **settings, vocab_size=c.vocab_size)
    assert changed.config.run == RunOptions(**options)
    assert changed.config == c.replace(**options, **settings)
    for a, b in zip(jax.tree.leaves(changed), jax.tree.leaves(tiny_llama), strict=True):
        assert a is b
    assert configure(tiny_llama.model, **options).config == c.replace(**options)


@pytest.mark.parametrize("vision", [CLIPVisionConfig, SiglipVisionConfig])
def test_configure_reaches_every_part_of_a_llava_model(vision):
    config = LlavaConfig(
        text_config=LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
        ),
        vision_config=vision(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=16,
            patch_size=8,
        ),
        image_token_index=5,
    )
    model = eqx.filter_eval_shape(LlavaForConditionalGeneration.init, config, key=KEY)
    unrolled = configure(model, scan_layers=False)
    assert not unrolled.model.language_model.config.run.scan_layers
    assert not unrolled.model.vision_tower.config.run.scan_layers
    assert not unrolled.config.text_config.run.scan_layers
    bigger = config.text_config.replace(vocab_size=128)
    with pytest.raises(ValueError, match=r"refused text_config\.vocab_size \(model: 64, "):
        configure(model, text_config=bigger)

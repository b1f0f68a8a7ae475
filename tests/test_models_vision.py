"""CLIP and SigLIP against transformers: the dual models, the bare towers and the
``...WithProjection`` towers, losses, hidden states, both ways through the files.

Tolerance: TOL (1e-4, see hf_parity) on float32 outputs of dims <= 37 with every weight
drawn from N(0, 0.2) (so that each one matters: HF's init leaves biases zero and norms one).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_parity import TOL
from safetensors import safe_open

import edl

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TEXT = dict(
    vocab_size=99,
    hidden_size=32,
    intermediate_size=37,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=16,
    bos_token_id=97,
    eos_token_id=98,
    pad_token_id=0,
)
VISION = dict(
    hidden_size=24,
    intermediate_size=30,
    num_hidden_layers=3,
    num_attention_heads=2,
    image_size=30,
    patch_size=6,
)


def _randomize(model, seed=0):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.eval()


def _inputs():
    """Three texts (row 0 padded after its EOS, row 2 padded early) and three images."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 97, (3, 10))
    ids[0, 6], ids[1, 9], ids[2, 3] = 98, 98, 98
    mask = np.ones((3, 10), np.int64)
    mask[0, 8:], mask[2, 5:] = 0, 0
    pixels = rng.standard_normal((3, 3, 30, 30)).astype(np.float32)
    return ids, mask, pixels


def _keys(directory):
    with safe_open(str(directory / "model.safetensors"), "np") as f:
        return set(f.keys())


def _close(edl_value, hf_value, where=None):
    diff = np.abs(np.asarray(edl_value) - hf_value.detach().numpy())
    diff = diff if where is None else diff[where]
    assert diff.max() <= TOL, f"max |edl - hf| = {diff.max():.2e}"


DUALS = {
    "clip": lambda: transformers.CLIPModel(
        transformers.CLIPConfig(text_config=TEXT, vision_config=VISION, projection_dim=20)
    ),
    "siglip": lambda: transformers.SiglipModel(
        transformers.SiglipConfig(text_config={**TEXT, "projection_size": 24}, vision_config=VISION)
    ),
}


@pytest.mark.parametrize("kind", sorted(DUALS))
def test_dual_model_matches_transformers_both_ways(kind, tmp_path):
    hf = _randomize(DUALS[kind]())
    hf.save_pretrained(tmp_path / "hf")
    ids, mask, pixels = _inputs()
    with torch.no_grad():
        ref = hf(
            input_ids=torch.tensor(ids),
            pixel_values=torch.tensor(pixels),
            attention_mask=torch.tensor(mask),
            return_loss=True,
            output_hidden_states=True,
        )
    model = edl.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == {"clip": "CLIPModel", "siglip": "SiglipModel"}[kind]
    # One compiled program for the forward and the loss (eager dispatch costs more here).
    run = jax.jit(
        lambda m, i, p, k: (
            m(i, p, attention_mask=k, output_hidden_states=True),
            m.compute_loss(i, p, attention_mask=k),
        )
    )
    out, (loss, metrics) = run(model, jnp.asarray(ids), jnp.asarray(pixels), jnp.asarray(mask))
    for name in ("logits_per_image", "logits_per_text", "text_embeds", "image_embeds"):
        _close(getattr(out, name), getattr(ref, name))
    real = mask.astype(bool)
    _close(out.text_model_output.last_hidden_state, ref.text_model_output.last_hidden_state, real)
    _close(out.vision_model_output.last_hidden_state, ref.vision_model_output.last_hidden_state)
    for mine, theirs in zip(
        out.vision_model_output.hidden_states, ref.vision_model_output.hidden_states, strict=True
    ):
        _close(mine, theirs)
    assert abs(float(loss) - float(ref.loss)) <= TOL * max(1.0, abs(float(ref.loss)))
    assert set(metrics) == {"loss", "accuracy"}

    # edl -> HF -> edl: the same files, which transformers reads as the same model.
    edl.save_pretrained(model, tmp_path / "edl")
    assert _keys(tmp_path / "edl") == _keys(tmp_path / "hf")
    config = json.loads((tmp_path / "edl" / "config.json").read_text())
    assert config["architectures"] == [type(hf).__name__]
    again = type(hf).from_pretrained(tmp_path / "edl").eval()
    with torch.no_grad():
        re_ref = again(
            input_ids=torch.tensor(ids),
            pixel_values=torch.tensor(pixels),
            attention_mask=torch.tensor(mask),
        )
    np.testing.assert_array_equal(re_ref.logits_per_image.numpy(), ref.logits_per_image.numpy())
    reloaded = edl.from_pretrained(tmp_path / "edl")
    np.testing.assert_array_equal(np.asarray(reloaded.logit_scale), np.asarray(model.logit_scale))


def _towers():
    t = transformers
    return {
        "clip_vision": (t.CLIPVisionModel, t.CLIPVisionConfig(**VISION), "vision"),
        "clip_vision_proj": (
            t.CLIPVisionModelWithProjection,
            t.CLIPVisionConfig(**VISION, projection_dim=20),
            "vision",
        ),
        "clip_text": (t.CLIPTextModel, t.CLIPTextConfig(**TEXT), "text"),
        "clip_text_proj": (
            t.CLIPTextModelWithProjection,
            t.CLIPTextConfig(**TEXT, projection_dim=20),
            "text",
        ),
        "siglip_vision": (t.SiglipVisionModel, t.SiglipVisionConfig(**VISION), "vision"),
        "siglip_text": (t.SiglipTextModel, t.SiglipTextConfig(**TEXT), "text"),
    }


@pytest.mark.parametrize("name", sorted(_towers()))
def test_towers_match_transformers(name, tmp_path):
    cls, config, kind = _towers()[name]
    hf = _randomize(cls(config))
    hf.save_pretrained(tmp_path / "hf")
    ids, mask, pixels = _inputs()
    if kind == "text":
        args, mine_args = (
            dict(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)),
            ((jnp.asarray(ids),), dict(attention_mask=jnp.asarray(mask))),
        )
    else:
        args, mine_args = dict(pixel_values=torch.tensor(pixels)), ((jnp.asarray(pixels),), {})
    with torch.no_grad():
        ref = hf(**args)
    model = edl.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == cls.__name__
    out = model(*mine_args[0], **mine_args[1])
    where = mask.astype(bool) if kind == "text" else None
    _close(out.last_hidden_state, ref.last_hidden_state, where)
    if name.endswith("_proj"):
        _close(out.embeds, ref.text_embeds if kind == "text" else ref.image_embeds)
    else:
        _close(out.pooler_output, ref.pooler_output)
    edl.save_pretrained(model, tmp_path / "edl")
    assert _keys(tmp_path / "edl") == _keys(tmp_path / "hf")
    assert json.loads((tmp_path / "edl" / "config.json").read_text())["architectures"] == [
        cls.__name__
    ]


def test_older_prefixed_tower_files_load(tmp_path):
    """Files of transformers 4 name a bare tower's keys ``vision_model.*`` and kept the
    ``position_ids`` buffer: both load (the buffer is ignored), and save as transformers 5
    does."""
    from safetensors.numpy import save_file

    hf = _randomize(transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**VISION)))
    hf.save_pretrained(tmp_path / "new")
    with safe_open(str(tmp_path / "new" / "model.safetensors"), "np") as f:
        tensors = {f"vision_model.{k}": f.get_tensor(k) for k in list(f.keys())}
    tensors["vision_model.embeddings.position_ids"] = np.arange(26)[None]
    (tmp_path / "old").mkdir()
    save_file(tensors, str(tmp_path / "old" / "model.safetensors"))
    (tmp_path / "old" / "config.json").write_text((tmp_path / "new" / "config.json").read_text())
    old, new = edl.from_pretrained(tmp_path / "old"), edl.from_pretrained(tmp_path / "new")
    pixels = jnp.asarray(_inputs()[2])
    np.testing.assert_array_equal(old(pixels).pooler_output, new(pixels).pooler_output)


def test_config_and_input_errors_name_the_problem(tmp_path):
    from edl.models import CLIPConfig
    from edl.models.clip import CLIPVisionModel
    from edl.models.encoder_config import CLIPVisionConfig

    with pytest.raises(ValueError, match="image_size 30 is not a multiple of patch_size 7"):
        CLIPVisionConfig(**{**VISION, "patch_size": 7})
    with pytest.raises(ValueError, match="num_hidden_layers must be a positive integer"):
        CLIPConfig.from_hf({"model_type": "clip", "vision_config": {"num_hidden_layers": "2"}})
    with pytest.raises(ValueError, match="unknown overrides"):
        CLIPConfig.from_hf({"model_type": "clip"}, hidden_size=8)
    import equinox as eqx
    import jax

    # The shape check comes before any compute: an abstract tower will do.
    tower = eqx.filter_eval_shape(
        CLIPVisionModel.init, CLIPVisionConfig(**VISION), key=jax.random.key(0)
    )
    with pytest.raises(ValueError, match=r"pixel_values must be \(batch, 3, 30, 30\)"):
        tower(jnp.zeros((1, 3, 32, 32)))
    hf = transformers.CLIPTextModel(transformers.CLIPTextConfig(**TEXT))
    hf.save_pretrained(tmp_path)
    text = edl.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="at most max_position_embeddings = 16"):
        text(jnp.ones((1, 17), jnp.int32))
    with pytest.raises(ValueError, match="input_ids must lie in"):
        text(jnp.full((1, 4), 99, jnp.int32))

"""LLaVA against transformers: the forward with images, the loss, greedy generation with an
image, files both ways (and the older layouts), LoRA on the language model with the vision
tower frozen, and the model sharded over a mesh.

Tolerance: TOL (1e-4, see hf_parity) on float32 logits of dims <= 37, every weight drawn
from N(0, 0.2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hf_parity import TOL
from safetensors import safe_open
from safetensors.numpy import save_file

import edl
from edl.generate import generate, generate_stream
from edl.models.llava import merge_image_features

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

IMAGE = 100  # the image placeholder id
VISION = dict(
    hidden_size=24,
    intermediate_size=30,
    num_hidden_layers=3,
    num_attention_heads=2,
    image_size=12,
    patch_size=6,
)
TEXT = dict(
    vocab_size=120,
    hidden_size=32,
    intermediate_size=37,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
# CLIP tower, "default" (the class token dropped: 4 patches per image), layer -2; SigLIP
# tower, "full" (4 patches), two feature layers concatenated.
KINDS = {
    "clip": (transformers.CLIPVisionConfig, "default", -2),
    "siglip": (transformers.SiglipVisionConfig, "full", [-1, 0]),
}


def _hf_llava(kind):
    vision, strategy, layer = KINDS[kind]
    config = transformers.LlavaConfig(
        vision_config=vision(**VISION),
        text_config=transformers.LlamaConfig(**TEXT),
        image_token_index=IMAGE,
        vision_feature_select_strategy=strategy,
        vision_feature_layer=layer,
    )
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.eval()


def _inputs():
    """Two prompts with one image each (4 placeholders), at different positions."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 99, (2, 12))
    ids[0, 2:6], ids[1, 5:9] = IMAGE, IMAGE
    pixels = rng.standard_normal((2, 3, 12, 12)).astype(np.float32)
    return ids, pixels


@pytest.fixture(scope="module", params=sorted(KINDS))
def llava(request, tmp_path_factory):
    """(kind, transformers model, its directory, edl model loaded from it)."""
    directory = tmp_path_factory.mktemp(f"llava-{request.param}")
    hf = _hf_llava(request.param)
    hf.save_pretrained(directory)
    return request.param, hf, directory, edl.from_pretrained(directory)


def test_forward_and_loss_match_transformers(llava):
    _, hf, _, model = llava
    ids, pixels = _inputs()
    labels = np.where(ids == IMAGE, -100, ids)
    with torch.no_grad():
        ref = hf(
            input_ids=torch.tensor(ids),
            pixel_values=torch.tensor(pixels),
            labels=torch.tensor(labels),
        )
    # One program: the logits and the loss with its default labels (the ids with the image
    # tokens ignored, as given to transformers).
    run = jax.jit(lambda m, i, p: (m(i, p).logits, m.compute_loss(i, pixel_values=p)))
    logits, (loss, metrics) = run(model, jnp.asarray(ids), jnp.asarray(pixels))
    diff = np.abs(np.asarray(logits) - ref.logits.numpy()).max()
    assert diff <= TOL, f"max |edl - hf| = {diff:.2e}"
    assert abs(float(loss) - float(ref.loss)) <= TOL * float(ref.loss)
    assert int(metrics["count"]) == int((labels[:, 1:] != -100).sum())
    # One placeholder too few: named eagerly, and still refused inside a compiled program.
    short = ids.copy()
    short[0, 2] = 1
    features = jnp.zeros((2, 4, TEXT["hidden_size"]))
    embeds = jnp.zeros((*short.shape, TEXT["hidden_size"]))
    with pytest.raises(ValueError, match=r"hold 7 image tokens \(id 100\) but 2 images"):
        merge_image_features(embeds, jnp.asarray(short), features, IMAGE)
    with pytest.raises(Exception, match="image token count != images"):
        run(model, jnp.asarray(short), jnp.asarray(pixels))[0].block_until_ready()


def test_greedy_generation_with_an_image_matches_transformers(llava):
    kind, hf, _, model = llava
    if kind != "clip":
        pytest.skip("the towers differ before the language model: the forward test has both")
    ids, pixels = _inputs()
    ids, pixels = ids[1:], pixels[1:]
    with torch.no_grad():
        ref = hf.generate(
            input_ids=torch.tensor(ids),
            pixel_values=torch.tensor(pixels),
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=0,
        )
    settings = dict(max_new_tokens=8, pad_token_id=0, eos_token_id=None)
    out = generate(model, ids, pixel_values=pixels, **settings)
    np.testing.assert_array_equal(np.asarray(out.sequences), ref.numpy())
    streamed = [int(t[0]) for t in generate_stream(model, ids, pixel_values=pixels, **settings)]
    assert streamed == ref.numpy()[0, ids.shape[1] :].tolist()
    short = ids.copy()
    short[0, 5] = 1  # 3 placeholders left for 4 features
    with pytest.raises(ValueError, match=r"hold 3 image tokens \(id 100\); 1 images need 4"):
        generate(model, short, pixel_values=pixels, **settings)
    with pytest.raises(TypeError, match="pixel_values need a vision-language model"):
        generate(model.text_lm(), ids, pixel_values=pixels, **settings)


def _assert_same_arrays(a, b):
    flat_a, flat_b = edl.tree.flatten(a), edl.tree.flatten(b)
    assert set(flat_a) == set(flat_b)
    for path, x in flat_a.items():
        if hasattr(x, "shape"):
            np.testing.assert_array_equal(x, flat_b[path], err_msg=path)


def _keys(path):
    with safe_open(str(path), "np") as f:
        return {k: f.get_tensor(k) for k in list(f.keys())}


def test_files_both_ways_and_older_layouts(llava, tmp_path):
    kind, _, directory, model = llava
    if kind != "clip":
        pytest.skip("the key tables differ only inside the tower: the tower tests have both")
    edl.save_pretrained(model, tmp_path / "edl")
    ours, theirs = (_keys(d / "model.safetensors") for d in (tmp_path / "edl", directory))
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        np.testing.assert_array_equal(ours[key], value, err_msg=key)
    _assert_same_arrays(edl.from_pretrained(tmp_path / "edl"), model)

    # transformers 5's in-memory names, and the older vision_tower.vision_model.* tower.
    def rename(key):
        if key.startswith("language_model.model."):
            return "model.language_model." + key.removeprefix("language_model.model.")
        if key == "language_model.lm_head.weight":
            return "lm_head.weight"
        if key.startswith("vision_tower."):
            return "vision_tower.vision_model." + key.removeprefix("vision_tower.")
        return key

    (tmp_path / "old").mkdir()
    save_file({rename(k): v for k, v in theirs.items()}, str(tmp_path / "old/model.safetensors"))
    (tmp_path / "old" / "config.json").write_text((directory / "config.json").read_text())
    _assert_same_arrays(edl.from_pretrained(tmp_path / "old"), model)


@pytest.mark.slow  # a LoRA train step of the whole LLaVA compiled, PEFT's forward (~25 s)
def test_lora_on_the_language_model_with_the_vision_tower_frozen(llava, tmp_path):
    kind, _, directory, model = llava
    if kind != "clip":
        pytest.skip("one tower suffices")
    lora = edl.lora.apply_lora(
        model,
        rank=2,
        alpha=4,
        pattern=r"language_model\..*(q|k|v|o|gate|up|down)_proj$",
        key=jax.random.key(1),
    )
    wrapped = edl.lora.lora_layers(lora)
    assert wrapped and all(p.startswith("model.language_model.") for p in wrapped)
    state = edl.create_state(lora, optax.adam(1e-2), trainable=edl.lora.lora_trainable)
    assert all("lora_" in p for p in edl.tree.flatten(state.params))
    ids, pixels = _inputs()
    batch = {"input_ids": jnp.asarray(ids), "pixel_values": jnp.asarray(pixels)}

    def loss_fn(m, batch):
        return m.compute_loss(batch["input_ids"], pixel_values=batch["pixel_values"])

    step = edl.train.make_train_step(loss_fn, optax.adam(1e-2), donate=False)
    first = loss_fn(lora, batch)[0]
    for _ in range(3):
        state, metrics = step(state, batch)
    assert float(metrics["loss"]) < float(first)
    trained = edl.merge(state.params, state.other)
    vision_before = edl.tree.flatten(lora.model.vision_tower)
    vision_after = edl.tree.flatten(trained.model.vision_tower)
    assert all(bool(jnp.all(vision_before[k] == vision_after[k])) for k in vision_before)

    # The trained adapter as PEFT writes it (module names of transformers 5's LLaVA):
    # peft applies it to the transformers model with the same result.
    peft = pytest.importorskip("peft")
    from edl.io.formats.peft import load_adapter, save_adapter

    save_adapter(trained, tmp_path / "adapter")
    base = transformers.LlavaForConditionalGeneration.from_pretrained(directory)
    with_adapter = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        ref = with_adapter(input_ids=torch.tensor(ids), pixel_values=torch.tensor(pixels)).logits
    mine = trained(batch["input_ids"], batch["pixel_values"]).logits
    np.testing.assert_allclose(np.asarray(mine), ref.numpy(), atol=TOL)
    again = load_adapter(model, tmp_path / "adapter")
    np.testing.assert_array_equal(again(batch["input_ids"], batch["pixel_values"]).logits, mine)


@pytest.mark.slow  # the forward compiled on one device and on a 2 x 4 mesh (~14 s)
def test_sharded_over_a_mesh_equals_one_device(llava):
    kind, _, _, model = llava
    if kind != "siglip":
        pytest.skip("one tower suffices")
    mesh = edl.sharding.make_mesh((1, 2, 4, 1))  # dp, fsdp, tp, sp
    sharded = edl.sharding.shard(model, None, mesh)
    specs = edl.tree.flatten(edl.sharding.partition_specs(model, None, mesh=mesh))
    assert specs["model.vision_tower.encoder.layers.mlp.fc1.weight"] != jax.sharding.PartitionSpec()
    ids, pixels = (jnp.asarray(x) for x in _inputs())
    run = jax.jit(lambda m, i, p: m(i, p).logits)
    np.testing.assert_allclose(run(sharded, ids, pixels), run(model, ids, pixels), atol=TOL)

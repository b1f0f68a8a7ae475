"""Gemma 3's multimodal model (``gemma3``) against transformers' Gemma3ForConditionalGeneration:
the forward with images (causal, and with ``token_type_ids`` opening each image both ways),
the loss, greedy generation with an image (its prefill's bidirectional images), files both
ways (and the released checkpoints' ``vision_tower.vision_model.*``), ``edl info``, LoRA on
the language model as PEFT files and the model sharded over a mesh (slow).

The tiny model: a SigLIP tower of 4 x 4 patches pooled to 4 image tokens, a Gemma 3 text
model of one sliding (window 3, shorter than an image) and one full layer. Every weight is
drawn from N(0, 0.2). Tolerance TOL (1e-4, see hf_parity) on float32 logits.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hf_parity import TOL
from safetensors import safe_open
from safetensors.numpy import save_file

import edl
from edl.generate import generate
from edl.models.gemma3_vision import Gemma3Config, Gemma3ForConditionalGeneration

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

IMAGE, BOI, EOI = 100, 98, 99


def _hf_config():
    text = transformers.Gemma3TextConfig(
        vocab_size=120,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=3,
        max_position_embeddings=64,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=8,
    )
    vision = transformers.SiglipVisionConfig(
        hidden_size=24,
        intermediate_size=30,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=16,
        patch_size=4,
    )
    return transformers.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=IMAGE,
        boi_token_index=BOI,
        eoi_token_index=EOI,
    )


def _inputs():
    """Two prompts with one image each (BOI, 4 placeholders, EOI), row 1 left-padded by 2;
    ``token_type_ids`` as the processor gives them (1 on the placeholders)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 97, (2, 14))
    ids[0, 2], ids[0, 3:7], ids[0, 7] = BOI, IMAGE, EOI
    ids[1, 6], ids[1, 7:11], ids[1, 11] = BOI, IMAGE, EOI
    mask = np.ones_like(ids)
    mask[1, :2] = 0
    ids[1, :2] = 0
    pixels = rng.standard_normal((2, 3, 16, 16)).astype(np.float32)
    return ids, mask, (ids == IMAGE).astype(np.int64), pixels


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(transformers model, its directory, edl model loaded from it)."""
    directory = tmp_path_factory.mktemp("gemma3")
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(_hf_config()).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.2)
    hf.save_pretrained(directory)
    return hf, directory, edl.from_pretrained(directory)


def _reference(hf, ids, mask, pixels, types=None, labels=None):
    extra = {} if types is None else {"token_type_ids": torch.tensor(types)}
    if labels is not None:
        extra["labels"] = torch.tensor(labels)
    with torch.no_grad():
        return hf(
            input_ids=torch.tensor(ids),
            pixel_values=torch.tensor(pixels),
            attention_mask=torch.tensor(mask),
            **extra,
        )


def test_forward_matches_transformers_causal_and_with_token_type_ids(gemma3):
    hf, _, model = gemma3
    assert isinstance(model, Gemma3ForConditionalGeneration)
    ids, mask, types, pixels = _inputs()
    real = mask.astype(bool)
    # One program: the causal forward and the one whose images attend both ways.
    run = jax.jit(
        lambda m, i, p, a, t: (
            m(i, p, attention_mask=a).logits,
            m(i, p, attention_mask=a, token_type_ids=t).logits,
        )
    )
    causal, both = run(model, *(jnp.asarray(x) for x in (ids, pixels, mask, types)))
    for name, mine, t in (("causal", causal, None), ("bidirectional", both, types)):
        ref = _reference(hf, ids, mask, pixels, t).logits.numpy()
        diff = np.abs(np.asarray(mine) - ref)[real].max()
        assert diff <= TOL, f"{name}: max |edl - hf| = {diff:.2e}"
    # The images' own tokens see their future: the two masks give other logits.
    assert np.abs(np.asarray(causal) - np.asarray(both))[real].max() > 1e-2


@pytest.mark.slow  # the loss compiled (~8 s)
def test_loss_matches_transformers(gemma3):
    hf, _, model = gemma3
    ids, mask, types, pixels = _inputs()
    labels = np.where((ids == IMAGE) | (mask == 0), -100, ids)
    labels[1, 2] = -100  # edl never predicts from a padded position
    ref = _reference(hf, ids, mask, pixels, types, labels).loss
    args = (jnp.asarray(x) for x in (ids, pixels, mask, types))
    run = jax.jit(
        lambda m, i, p, a, t: m.compute_loss(i, pixel_values=p, attention_mask=a, token_type_ids=t)
    )
    loss, metrics = run(model, *args)
    assert abs(float(loss) - float(ref)) <= TOL * float(ref)
    assert int(metrics["count"]) == int((labels[:, 1:] != -100).sum())


@pytest.mark.slow  # generate compiled with images twice, two eager forwards (~40 s)
def test_greedy_generation_with_an_image_matches_transformers(gemma3):
    hf, _, model = gemma3
    ids, _, types, pixels = _inputs()
    ids, types, pixels = ids[:1], types[:1], pixels[:1]
    with torch.no_grad():
        ref = hf.generate(
            input_ids=torch.tensor(ids),
            pixel_values=torch.tensor(pixels),
            token_type_ids=torch.tensor(types),
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=0,
        )
    out = generate(
        model,
        ids,
        pixel_values=pixels,
        max_new_tokens=6,
        pad_token_id=0,
        eos_token_id=None,
        logprobs=1,
    )
    np.testing.assert_array_equal(np.asarray(out.sequences), ref.numpy())
    settings = dict(max_new_tokens=6, pad_token_id=0, eos_token_id=None, page_size=4)
    paged = generate(model, ids, pixel_values=pixels, **settings)
    np.testing.assert_array_equal(np.asarray(paged.sequences), ref.numpy())
    # The prefill opened the image both ways: its first log-prob is the bidirectional
    # forward's, not the causal one's.
    first = int(out.sequences[0, ids.shape[1]])
    for t, same in ((types, True), (None, False)):
        t = None if t is None else jnp.asarray(t)
        logits = model(jnp.asarray(ids), jnp.asarray(pixels), token_type_ids=t).logits
        want = float(jax.nn.log_softmax(logits[0, -1].astype(jnp.float32))[first])
        assert (abs(float(out.logprobs[0, 0]) - want) <= 1e-5) == same


def _tensors(path):
    with safe_open(str(path), "np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no iter)


def test_files_both_ways_and_edl_info(gemma3, tmp_path, capsys):
    hf, directory, model = gemma3
    edl.save_pretrained(model, tmp_path / "edl")
    ours, theirs = (_tensors(d / "model.safetensors") for d in (tmp_path / "edl", directory))
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        assert ours[key].dtype == value.dtype and ours[key].tobytes() == value.tobytes(), key
    saved = json.loads((tmp_path / "edl" / "config.json").read_text())
    assert saved["architectures"] == ["Gemma3ForConditionalGeneration"]
    assert Gemma3Config.from_hf(saved) == model.config
    again = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "edl").eval()
    assert again.config.mm_tokens_per_image == 4
    assert again.config.text_config.layer_types == hf.config.text_config.layer_types

    # The released checkpoints' tower layout (vision_tower.vision_model.*) loads too.
    (tmp_path / "released").mkdir()
    renamed = {
        k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in theirs.items()
    }
    save_file(renamed, str(tmp_path / "released" / "model.safetensors"))
    (tmp_path / "released" / "config.json").write_text((directory / "config.json").read_text())
    released = edl.tree.flatten(edl.from_pretrained(tmp_path / "released"))
    for path, x in edl.tree.flatten(model).items():
        if hasattr(x, "shape"):
            np.testing.assert_array_equal(released[path], x, err_msg=path)

    from edl.cli import main

    main(["info", str(directory)])
    out = capsys.readouterr().out
    assert "Gemma3ForConditionalGeneration (model_type gemma3)" in out
    assert "q/k norms" in out and "sliding window 3" in out


def test_config_checks_name_the_field():
    base = _hf_config().to_dict()
    with pytest.raises(ValueError, match="mm_tokens_per_image 9 must be a square whose side"):
        Gemma3Config.from_hf({**base, "mm_tokens_per_image": 9})
    with pytest.raises(ValueError, match="image_token_index 500 must lie in the language"):
        Gemma3Config.from_hf({**base, "image_token_index": 500})
    llama_text = {**base, "text_config": {"model_type": "llama"}}
    with pytest.raises(ValueError, match=r"text_config.model_type 'llama' is not 'gemma3_text'"):
        Gemma3Config.from_hf(llama_text)


@pytest.mark.slow  # a LoRA train step of the whole model compiled, PEFT's forward (~35 s)
def test_lora_as_peft_files_both_ways(gemma3, tmp_path):
    _, directory, model = gemma3
    peft = pytest.importorskip("peft")
    from edl.io.formats.peft import load_adapter, save_adapter

    lora = edl.lora.apply_lora(
        model, rank=2, alpha=4, pattern=r"language_model\..*(q|v)_proj$", key=jax.random.key(1)
    )
    state = edl.create_state(lora, optax.adam(1e-2), trainable=edl.lora.lora_trainable)
    ids, mask, types, pixels = (jnp.asarray(x) for x in _inputs())

    def loss_fn(m, batch):
        return m.compute_loss(ids, pixel_values=pixels, attention_mask=mask, token_type_ids=types)

    step = edl.train.make_train_step(loss_fn, optax.adam(1e-2), donate=False)
    for _ in range(2):
        state, _ = step(state, {})
    trained = edl.merge(state.params, state.other)
    save_adapter(trained, tmp_path / "adapter")
    base = transformers.Gemma3ForConditionalGeneration.from_pretrained(directory)
    with_adapter = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        ref = with_adapter(
            input_ids=torch.tensor(np.asarray(ids)),
            pixel_values=torch.tensor(np.asarray(pixels)),
            attention_mask=torch.tensor(np.asarray(mask)),
            token_type_ids=torch.tensor(np.asarray(types)),
        ).logits.numpy()
    mine = trained(ids, pixels, attention_mask=mask, token_type_ids=types).logits
    real = np.asarray(mask).astype(bool)
    assert np.abs(np.asarray(mine) - ref)[real].max() <= TOL
    again = load_adapter(model, tmp_path / "adapter")
    np.testing.assert_array_equal(
        again(ids, pixels, attention_mask=mask, token_type_ids=types).logits, mine
    )


def test_block_ids_and_mask_match_transformers():
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    from edl.ops.block_attention import BidirectionalBlocks, block_ids

    types = np.array([[0, 1, 1, 0, 1, 1, 1, 0], [1, 1, 0, 0, 0, 1, 0, 1]])
    blocks = block_ids(jnp.asarray(types))
    ref = get_block_sequence_ids_for_mask(torch.tensor(types))
    np.testing.assert_array_equal(np.asarray(blocks), ref.numpy())
    # window AND (causal OR same block) AND the key not padded (row 1's last key).
    valid = np.array([[1] * 8, [1] * 7 + [0]])
    pad = jnp.where(jnp.asarray(valid) == 1, 1, -1)
    mask = BidirectionalBlocks.of((jnp.ones((2, 8), jnp.int32), pad), blocks).mask(True, 2)
    q, k = np.arange(8)[:, None], np.arange(8)[None]
    b = np.asarray(blocks)
    same = (b[:, :, None] == b[:, None, :]) & (b[:, :, None] >= 0)
    want = ((k <= q) | same) & (k > q - 2) & (valid[:, None, :] == 1)
    np.testing.assert_array_equal(np.asarray(mask), want)


@pytest.mark.slow  # the forward compiled on one device and on a 2 x 4 mesh (~12 s)
def test_sharded_over_a_mesh_equals_one_device(gemma3):
    _, _, model = gemma3
    mesh = edl.sharding.make_mesh((1, 2, 4, 1))  # dp, fsdp, tp, sp
    sharded = edl.sharding.shard(model, None, mesh)
    ids, mask, types, pixels = (jnp.asarray(x) for x in _inputs())
    run = jax.jit(lambda m: m(ids, pixels, attention_mask=mask, token_type_ids=types).logits)
    np.testing.assert_allclose(run(sharded), run(model), atol=TOL)

"""MXFP4 checkpoints (GPT-OSS's released experts) dequantised at load as transformers does.

The tiny checkpoint is a random transformers GptOss whose expert weights this file quantises
from the format's definition (one E8M0 scale per 32 values, the nearest e2m1 code, two codes
a byte with the low nibble first, rows and columns transposed as transformers' layout has
them), then compared with transformers loading the same directory with
``Mxfp4Config(dequantize=True)``: the expert arrays bit for bit, logits to 1e-4.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from hf_parity import VOCAB, assert_close_on_real_tokens, padded_batch, random_hf_model

import edl
from edl.io.formats import hf
from edl.io.formats.mxfp4 import FP4_VALUES, dequantize_mxfp4
from edl.io.formats.safetensors import load_file, save_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
mxfp4_hf = pytest.importorskip("transformers.integrations.mxfp4")

pytestmark = pytest.mark.filterwarnings("ignore:edl attention.*no attention sinks")

EXPERTS = ("gate_up_proj", "down_proj")


def _quantize(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(experts, in, out)`` float32 -> MXFP4 ``blocks`` ``(experts, out, in / 32, 16)`` and
    ``scales`` ``(experts, out, in / 32)``, from the format's definition."""
    rows = np.swapaxes(weight, 1, 2)  # transformers' blocks run along the input dim
    e, out, inp = rows.shape
    groups = rows.reshape(e, out, inp // 32, 32)
    amax = np.abs(groups).max(-1, keepdims=True)
    # 6 = 1.5 * 2**2 is e2m1's largest value: scale so the block's largest lands in [4, 8).
    exp = np.floor(np.log2(np.maximum(amax, 1e-30))) - 2
    scaled = groups / np.exp2(exp)
    codes = np.abs(scaled[..., None] - FP4_VALUES).argmin(-1).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exp[..., 0] + 127).astype(np.uint8)


def _tiny(tmp_path):
    """A float32 GPT-OSS directory and its MXFP4 twin; returns both paths."""
    config = transformers.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=32,
        num_attention_heads=4,
        head_dim=8,
        num_hidden_layers=2,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        pad_token_id=0,
    )
    random_hf_model(config, "causal_lm", std=0.2).save_pretrained(tmp_path / "float")
    tensors = load_file(tmp_path / "float")
    quantized = {k: v for k, v in tensors.items() if not k.endswith(EXPERTS)}
    for key in (k for k in tensors if k.endswith(EXPERTS)):
        quantized[key + "_blocks"], quantized[key + "_scales"] = _quantize(tensors[key])
    (tmp_path / "mxfp4").mkdir()
    save_file(quantized, tmp_path / "mxfp4" / "model.safetensors")
    hf_config = json.loads((tmp_path / "float" / "config.json").read_text())
    hf_config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"],
    }
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps(hf_config))
    return tmp_path / "float", tmp_path / "mxfp4"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_is_transformers_bit_for_bit(dtype):
    # Every byte under every E8M0 scale (0 and 255 included), two experts.
    blocks = np.broadcast_to(np.arange(256, dtype=np.uint8).reshape(16, 16), (2, 256, 16, 16))
    scales = np.broadcast_to(np.arange(256, dtype=np.uint8)[:, None], (2, 256, 16))
    ref = mxfp4_hf.convert_moe_packed_tensors(
        torch.from_numpy(blocks.copy()), torch.from_numpy(scales.copy()), dtype=dtype
    )
    np_dtype = {torch.float32: np.float32, torch.float16: np.float16}.get(dtype, jnp.bfloat16)
    mine = dequantize_mxfp4(blocks, scales, np_dtype)
    theirs = ref.view(torch.int16).numpy() if dtype == torch.bfloat16 else ref.numpy()
    assert mine.shape == tuple(ref.shape)
    assert mine.tobytes() == theirs.tobytes()


def test_mxfp4_checkpoint_loads_dequantized_and_saves_float(tmp_path):
    _, quantized = _tiny(tmp_path)
    model = edl.from_pretrained(quantized)
    experts, stored = model.model.layers.mlp.experts, load_file(quantized)
    for name in EXPERTS:
        mine = np.asarray(getattr(experts, name))
        assert mine.dtype == np.float32, name  # the checkpoint's dtype (config.json)
        for i in range(2):
            key = f"model.layers.{i}.mlp.experts.{name}"
            blocks, scales = (torch.from_numpy(stored[key + s]) for s in ("_blocks", "_scales"))
            ref = mxfp4_hf.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            assert mine[i].tobytes() == ref.numpy().tobytes(), key

    # A model dtype: dequantised straight into it, as transformers does into its params.
    half = edl.from_pretrained(quantized, dtype=jnp.bfloat16).model.layers.mlp.experts
    key = "model.layers.1.mlp.experts.down_proj"
    want = dequantize_mxfp4(stored[key + "_blocks"], stored[key + "_scales"], jnp.bfloat16)
    assert np.asarray(half.down_proj[1]).tobytes() == want.tobytes()

    # Saving writes the dequantised weights and a config without quantization_config.
    edl.save_pretrained(model, tmp_path / "saved")
    saved = load_file(tmp_path / "saved")
    assert not any(k.endswith(("_blocks", "_scales")) for k in saved)
    gate_up = np.asarray(experts.gate_up_proj[0])
    assert saved["model.layers.0.mlp.experts.gate_up_proj"].tobytes() == gate_up.tobytes()
    assert "quantization_config" not in json.loads((tmp_path / "saved/config.json").read_text())


@pytest.mark.slow  # ~12 s: transformers' dequantising load and both forwards
def test_mxfp4_logits_match_transformers_dequantize(tmp_path):
    _, quantized = _tiny(tmp_path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        quantized,
        quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.float32,
        attn_implementation="eager",
    ).eval()
    model = edl.from_pretrained(quantized)
    for name in EXPERTS:
        mine = np.asarray(getattr(model.model.layers.mlp.experts, name))
        for i, layer in enumerate(theirs.model.layers):
            ref = getattr(layer.mlp.experts, name).detach().numpy()
            assert mine[i].tobytes() == ref.tobytes(), (name, i)
    ids, mask = padded_batch()
    with torch.no_grad():
        ref = theirs(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    logits = model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)).logits
    assert_close_on_real_tokens(np.asarray(logits), ref, mask)
    edl.save_pretrained(model, tmp_path / "saved")
    again = edl.from_pretrained(tmp_path / "saved")
    logits = again(jnp.asarray(ids), attention_mask=jnp.asarray(mask)).logits
    assert_close_on_real_tokens(np.asarray(logits), ref, mask)


def test_mxfp4_errors_name_the_tensor_and_shapes(tmp_path):
    float_dir, quantized = _tiny(tmp_path)
    config = hf.load_config(quantized)
    tensors = load_file(quantized)
    key = "model.layers.0.mlp.experts.down_proj"

    def load(mapping):
        return hf.from_state_dict(config, mapping)

    lacking = {k: v for k, v in tensors.items() if k != key + "_scales"}
    with pytest.raises(ValueError, match=f"{key}_blocks: MXFP4 blocks without {key}_scales"):
        load(lacking)
    wide = {**tensors, key + "_blocks": tensors[key + "_blocks"].reshape(4, 64, 2, 8)}
    with pytest.raises(ValueError, match=rf"{key}_blocks: .* \(experts, rows, groups, 16\).*"):
        load(wide)
    short = {**tensors, key + "_scales": tensors[key + "_scales"][:, :32]}
    expected = rf"{key}_scales: expected shape \(4, 64, 1\).*found \(4, 32, 1\)"
    with pytest.raises(ValueError, match=expected):
        load(short)
    # The float checkpoint is unchanged by all this; a config without MXFP4 reads no pairs.
    plain = hf.load_config(float_dir)
    with pytest.raises(ValueError, match="unexpected keys"):
        hf.from_state_dict(plain, tensors)

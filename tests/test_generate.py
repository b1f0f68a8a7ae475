"""Generation: KV-cache forward = full forward, greedy and beam search token-for-token equal
to transformers' ``generate``, sampling reproducible and distributed as the processed
softmax, streaming = compiled, clear errors before compiling."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from packaging.version import Version

import edl
from edl.generate import (
    GenerationConfig,
    free_rows,
    generate,
    generate_stream,
    init_cache,
    init_paged_cache,
    paged_cache_config,
)
from edl.generate import decode as decode_module
from edl.io.formats.hf import from_state_dict
from edl.models import LlamaConfig, LlamaForCausalLM
from edl.ops.cached_attention import cached_attention

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 64
PAD = 0


# What a GPU run must check (benchmarks/device/run.sh runs the gpu-marked tests there).
pytestmark = pytest.mark.gpu


def _hf_model(model_type: str, seed: int = 0):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, pad_token_id=PAD)
    config = {
        "llama": transformers.LlamaConfig(
            **common,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8,
            },
        ),
        "qwen2": transformers.Qwen2Config(  # a sliding window shorter than the output
            **common,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=4,
            max_window_layers=1,
        ),
        "qwen3": transformers.Qwen3Config(
            **common,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            tie_word_embeddings=False,
        ),
    }[model_type]
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in hf.parameters():  # peaked logits: argmax far from ties
            p.normal_(0.0, 0.25)
    return hf, from_state_dict(config.to_dict(), hf.state_dict())


def _prompts(batch=3, seq=7, seed=0):
    """Left-padded prompts of different lengths (ids >= 2, so 0/1 can be pad/EOS)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(2, VOCAB, (batch, seq))
    mask = np.ones_like(ids)
    for row in range(1, batch):
        mask[row, : min(seq - 1, 2 * row + 1)] = 0
    ids[mask == 0] = PAD
    return ids, mask


def _hf_generate(hf, ids, mask, **kwargs):
    with torch.no_grad():
        return hf.generate(
            torch.tensor(ids), attention_mask=torch.tensor(mask), pad_token_id=PAD, **kwargs
        )


def _assert_same_tokens(hf_sequences, ours, pad=PAD):
    """HF trims columns every row left empty; edl keeps ``max_new_tokens`` columns."""
    hf_sequences = np.asarray(hf_sequences)
    ours = np.asarray(ours)
    np.testing.assert_array_equal(ours[:, : hf_sequences.shape[1]], hf_sequences)
    assert np.all(ours[:, hf_sequences.shape[1] :] == pad)


def _assert_same_greedy_tokens(hf_output, ours, prompt_len, tie=1e-4):
    """Token-exact with HF, except that a row may part from HF's where HF's own processed
    scores rank the two tokens within ``tie`` (on a GPU, float32 sums in another order move
    a near-tie's winner); the row is compared no further after that."""
    expected = hf_output.sequences.numpy()
    ours = np.asarray(ours)[:, : expected.shape[1]]
    for row in range(expected.shape[0]):
        differ = np.flatnonzero(ours[row] != expected[row])
        if differ.size == 0:
            continue
        col = int(differ[0])
        assert col >= prompt_len, f"row {row}: prompt changed at column {col}"
        scores = hf_output.scores[col - prompt_len][row].numpy()
        margin = scores[expected[row, col]] - scores[ours[row, col]]
        assert margin <= tie, (
            f"row {row}, column {col}: edl chose {ours[row, col]}, HF {expected[row, col]}, "
            f"{margin:.3g} below HF's choice in HF's processed scores (a near-tie is <= {tie})"
        )


# qwen2 / qwen3 differ from llama in their attention biases / q-k norms, which the logits
# parity tests check per family; their decoding end to end is in the slow set.
@pytest.mark.parametrize(
    "model_type",
    [
        "llama",
        pytest.param("qwen2", marks=pytest.mark.slow),
        pytest.param("qwen3", marks=pytest.mark.slow),
    ],
)
def test_greedy_matches_transformers(model_type):
    hf, model = _hf_model(model_type)
    ids, mask = _prompts()
    new = 12
    ref = _hf_generate(hf, ids, mask, do_sample=False, max_new_tokens=new).numpy()
    out = generate(model, ids, attention_mask=mask, max_new_tokens=new, pad_token_id=PAD)
    _assert_same_tokens(ref, out.sequences)
    np.testing.assert_array_equal(out.num_new, [new] * 3)

    # Stop tokens: two ids the unconstrained run produced early in different rows.
    eos = (int(ref[0, ids.shape[1] + 2]), int(ref[2, ids.shape[1] + 4]))
    ref = _hf_generate(hf, ids, mask, do_sample=False, max_new_tokens=new, eos_token_id=list(eos))
    out = generate(
        model, ids, attention_mask=mask, max_new_tokens=new, eos_token_id=eos, pad_token_id=PAD
    )
    _assert_same_tokens(ref.numpy(), out.sequences)
    generated = np.asarray(out.sequences)[:, ids.shape[1] :]
    for row, n in enumerate(np.asarray(out.num_new)):
        assert n == new or generated[row, n - 1] in eos
        assert np.all(generated[row, n:] == PAD)


@pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.24"),
    reason="transformers before 5.24 (5.17 on the GPU image) penalises the left padding too",
)
def test_repetition_penalty_matches_transformers():
    """HF penalises the prompt without its left padding, and every generated token."""
    hf, model = _hf_model("llama", seed=2)
    ids, mask = _prompts(seed=2)
    kw = dict(max_new_tokens=10, repetition_penalty=1.5)
    ref = _hf_generate(
        hf, ids, mask, do_sample=False, output_scores=True, return_dict_in_generate=True, **kw
    )
    out = generate(model, ids, attention_mask=mask, pad_token_id=PAD, **kw)
    _assert_same_greedy_tokens(ref, out.sequences, ids.shape[1])
    plain = generate(model, ids, attention_mask=mask, max_new_tokens=10, pad_token_id=PAD)
    assert not np.array_equal(plain.sequences, out.sequences)  # the penalty mattered


@pytest.mark.slow  # a bfloat16 decode loop compiled (~15 s)
def test_bfloat16_model_generates():
    model = edl.to_dtype(_tiny_model(), jnp.bfloat16)
    ids, mask = _prompts()
    out = generate(model, ids, attention_mask=mask, max_new_tokens=5)
    new = np.asarray(out.sequences)[:, ids.shape[1] :]
    assert new.shape == (3, 5) and new.min() >= 0 and new.max() < VOCAB
    paged = generate(model, ids, attention_mask=mask, max_new_tokens=5, page_size=16)
    np.testing.assert_array_equal(paged.sequences, out.sequences)


@pytest.mark.parametrize(
    ("early_stopping", "length_penalty"),
    [
        pytest.param(False, 1.0, marks=pytest.mark.slow),
        (True, 0.5),
        pytest.param("never", 2.0, marks=pytest.mark.slow),
    ],  # one stopping rule by default
)
def test_beam_search_matches_transformers(early_stopping, length_penalty):
    hf, model = _hf_model("qwen2", seed=1)
    ids, mask = _prompts(seed=1)
    new = 10
    # An EOS the model emits inside some beams, so beams finish at different lengths.
    probe = _hf_generate(hf, ids, mask, do_sample=False, max_new_tokens=new).numpy()
    eos = int(probe[1, ids.shape[1] + 3])
    kwargs = dict(
        num_beams=4,
        max_new_tokens=new,
        eos_token_id=eos,
        early_stopping=early_stopping,
        length_penalty=length_penalty,
    )
    ref = _hf_generate(
        hf,
        ids,
        mask,
        do_sample=False,
        num_return_sequences=2,
        output_scores=True,
        return_dict_in_generate=True,
        **kwargs,
    )
    out = generate(
        model, ids, attention_mask=mask, num_return_sequences=2, pad_token_id=PAD, **kwargs
    )
    # HF fills finished beams with `pad_token_id or eos` (so EOS when pad is 0): compare the
    # tokens up to each beam's end, and edl's padding after it.
    hf_seqs, ours = ref.sequences.numpy(), np.asarray(out.sequences)
    ends = ids.shape[1] + np.asarray(out.num_new)
    for row, end in enumerate(ends):
        np.testing.assert_array_equal(ours[row, :end], hf_seqs[row, :end])
        assert np.all(ours[row, end:] == PAD)
        assert end == hf_seqs.shape[1] or set(hf_seqs[row, end:]) <= {PAD, eos}
    assert hf_seqs.shape[1] == ends.max()
    np.testing.assert_allclose(out.scores, ref.sequences_scores.numpy(), rtol=1e-5, atol=1e-6)


@eqx.filter_jit
def _forward(model, ids, cache=None, attention_mask=None):
    """``model(ids, ...)`` compiled once per shape: run eagerly, every op of a prefill or a
    decode step compiles on its own, several times the cost of one program."""
    return model(ids, attention_mask=attention_mask, cache=cache)


def _tiny_model(vocab=VOCAB, seed=0, **changes):
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ).replace(**changes)
    return LlamaForCausalLM.init(config, key=jax.random.key(seed))


# The default set: scanned with the kernel dispatch, unrolled with the Pallas kernel; the
# other four pairings are in the slow set (each compiles a prefill and a decode loop).
@pytest.mark.parametrize(
    ("impl", "scan"),
    [
        ("auto", True),
        ("pallas", False),
        pytest.param("reference", False, marks=pytest.mark.slow),
        pytest.param("auto", False, marks=pytest.mark.slow),
        pytest.param("pallas", True, marks=pytest.mark.slow),
        pytest.param("reference", True, marks=pytest.mark.slow),
    ],
)
def test_cached_forward_equals_full_forward(impl, scan):
    """Prefill + token-by-token decode + a multi-token chunk reproduce the full forward,
    with a sliding-window layer."""
    model = _tiny_model(attention_impl=impl, scan_layers=scan, layer_windows=(None, 3))
    ids = jax.random.randint(jax.random.key(1), (2, 11), 0, VOCAB)
    full = _forward(model, ids).logits
    out = _forward(model, ids[:, :5], init_cache(model.config, 2, 11))
    np.testing.assert_allclose(out.logits, full[:, :5], atol=1e-5)
    cache = out.cache
    for t in range(5, 8):
        out = _forward(model, ids[:, t : t + 1], cache)
        cache = out.cache
        np.testing.assert_allclose(out.logits[:, 0], full[:, t], atol=1e-5)
    out = _forward(model, ids[:, 8:], cache)  # several new tokens through a filled cache
    np.testing.assert_allclose(out.logits, full[:, 8:], atol=1e-5)
    np.testing.assert_array_equal(out.cache.lengths, [11, 11])


def test_cached_attention_kernel_matches_reference():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(3, 2, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(3, 32, 2, 16)), jnp.float32) for _ in range(2))
    lengths = jnp.asarray([2, 17, 32], jnp.int32)
    for window in (None, 5):
        ref = cached_attention(q, k, v, lengths, window=window, impl="reference")
        out = cached_attention(q, k, v, lengths, window=window, impl="pallas")
        np.testing.assert_allclose(out, ref, atol=1e-5)


def test_sampling_is_reproducible_and_streams_identically():
    model = _tiny_model()
    ids, mask = _prompts()
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=True, top_p=0.9, temperature=0.8)
    a = generate(model, ids, key=jax.random.key(3), **kw)
    b = generate(model, ids, key=jax.random.key(3), **kw)
    c = generate(model, ids, key=jax.random.key(4), **kw)
    np.testing.assert_array_equal(a.sequences, b.sequences)
    assert not np.array_equal(a.sequences, c.sequences)
    streamed = np.stack(list(generate_stream(model, ids, key=jax.random.key(3), **kw)), axis=1)
    np.testing.assert_array_equal(np.asarray(a.sequences)[:, ids.shape[1] :], streamed)


def test_first_sampled_token_follows_processed_softmax():
    """Chi-square: 4000 rows of one prompt sample their first token (independent draws per
    row) from softmax(logits / 0.7) restricted to the top 6 tokens."""
    model = _tiny_model(vocab=16, seed=2)
    rows, prompt = 4000, np.array([[3, 7, 1, 12]])
    out = generate(
        model,
        np.repeat(prompt, rows, 0),
        max_new_tokens=1,
        do_sample=True,
        temperature=0.7,
        top_k=6,
        key=jax.random.key(0),
    )
    drawn = np.asarray(out.sequences)[:, -1]
    logits = np.asarray(_forward(model, jnp.asarray(prompt)).logits[0, -1], np.float64) / 0.7
    kept = np.argsort(logits)[-6:]
    probs = np.exp(logits[kept] - logits[kept].max())
    probs /= probs.sum()
    assert set(np.unique(drawn)) <= set(kept.tolist())
    counts = np.array([(drawn == t).sum() for t in kept])
    chi2 = np.sum((counts - rows * probs) ** 2 / (rows * probs))
    assert chi2 < 20.5  # the 0.999 quantile of chi-square with 5 degrees of freedom


def test_decode_loop_is_one_compiled_program():
    model = _tiny_model(attention_impl="pallas")  # "auto" takes the XLA form on CPU
    ids, mask = _prompts()
    config = GenerationConfig(max_new_tokens=4)
    processor = decode_module.logits_processor_for(config)
    jaxpr = jax.make_jaxpr(
        lambda m, i, a: decode_module._generate_compiled(
            m, i, a, jax.random.key(0), config=config, processor=processor, max_new=4
        )
    )(model, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.bool_))
    assert "while" in str(jaxpr)
    assert "edl_decode_attention" in str(jaxpr)  # decode steps use the Pallas kernel
    before = decode_module._generate_compiled._cache_size()
    generate(model, ids, attention_mask=mask, config=config)
    generate(model, ids + 1, attention_mask=mask, config=config)
    assert decode_module._generate_compiled._cache_size() == before + 1


@pytest.mark.slow  # ~10 s; test_decode_loop_is_one_compiled_program runs by default
def test_nearby_prompt_lengths_share_one_compiled_program():
    widths = [decode_module.prompt_bucket(n) for n in (1, 16, 17, 24, 25, 33, 48, 49, 65, 100)]
    assert widths == [16, 16, 24, 24, 32, 48, 48, 64, 96, 128]
    model = _tiny_model()
    config = GenerationConfig(max_new_tokens=4)
    prompts = {n: (np.arange(1, n + 1)[None] * 7) % VOCAB for n in (5, 9, 13, 16)}
    before = decode_module._generate_compiled._cache_size()
    bucketed = {n: generate(model, ids, config=config) for n, ids in prompts.items()}
    assert decode_module._generate_compiled._cache_size() == before + 1  # one bucket: 16
    for n, ids in prompts.items():
        # The output keeps the prompt as given, and the padding changes no token.
        plain = generate(model, ids, config=config, bucket_prompts=False)
        assert bucketed[n].sequences.shape == (1, n + 4)
        np.testing.assert_array_equal(bucketed[n].sequences, plain.sequences)
        np.testing.assert_array_equal(bucketed[n].num_new, plain.num_new)


@pytest.mark.slow  # a model saved, loaded and run twice (~9 s)
def test_a_saved_models_generation_config_is_its_default(tmp_path):
    import dataclasses
    import json

    model = _tiny_model()
    ids = np.array([[5, 9, 2, 7]])
    free = np.asarray(generate(model, ids, max_new_tokens=6).sequences)[0, 4:]
    eos = int(free[2])  # the third greedy token becomes the end of text
    stop_at = int(np.flatnonzero(free == eos)[0]) + 1
    defaults = {"eos_token_id": [eos], "max_new_tokens": 6, "bos_token_id": 1}
    pairs = tuple(sorted((k, json.dumps(v)) for k, v in defaults.items()))
    edl.save_pretrained(dataclasses.replace(model, generation_config=pairs), tmp_path)
    assert json.loads((tmp_path / "generation_config.json").read_text()) == defaults
    assert transformers.GenerationConfig.from_pretrained(tmp_path).eos_token_id == [eos]

    loaded = edl.from_pretrained(tmp_path)
    assert loaded.generation_config == pairs
    out = generate(loaded, ids)  # max_new_tokens and the EOS come from the file
    assert int(out.num_new[0]) == stop_at
    np.testing.assert_array_equal(np.asarray(out.sequences)[0, 4 : 4 + stop_at], free[:stop_at])
    assert int(generate(loaded, ids, eos_token_id=None).num_new[0]) == 6  # overridden
    assert int(generate(loaded, ids, config=GenerationConfig(max_new_tokens=6)).num_new[0]) == 6
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(
        ValueError, match=r"generation_config\.json: generation config must hold a JSON object"
    ):
        edl.from_pretrained(tmp_path)


def _slices_in_loops(jaxpr, in_loop=False):
    """Shapes of the arrays that ``slice`` / ``dynamic_slice`` cut inside ``while`` bodies."""
    found = []
    for eqn in jaxpr.eqns:
        if in_loop and eqn.primitive.name in ("slice", "dynamic_slice"):
            found.append(tuple(eqn.invars[0].aval.shape))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _slices_in_loops(sub, in_loop or eqn.primitive.name == "while")
    return found


@pytest.mark.slow  # two decode loops of a 4-layer model, each compiled (~20 s per impl)
@pytest.mark.parametrize("impl", ["auto", "xla"])
def test_unstacked_layers_decode_identically_without_slicing_weights(impl):
    """``unstack_layers`` cuts the layer weights out of their stacks once, before the decode
    loop; the tokens are those of the stacked model (the default), sliced every step."""
    model = _tiny_model(attention_impl=impl, layer_windows=(None, 3))
    ids, mask = _prompts()
    kw = dict(attention_mask=mask, max_new_tokens=9, do_sample=True, key=jax.random.key(5))
    stacked = generate(model, ids, **kw)
    unstacked = generate(model, ids, unstack_layers=True, **kw)
    np.testing.assert_array_equal(unstacked.sequences, stacked.sequences)
    streamed = np.stack(list(generate_stream(model, ids, unstack_layers=True, **kw)), axis=1)
    np.testing.assert_array_equal(np.asarray(stacked.sequences)[:, ids.shape[1] :], streamed)
    beams = dict(attention_mask=mask, max_new_tokens=5, num_beams=3)
    np.testing.assert_array_equal(
        generate(model, ids, unstack_layers=True, **beams).sequences,
        generate(model, ids, **beams).sequences,
    )

    config = GenerationConfig(max_new_tokens=4)
    weights = {x.shape for x in jax.tree.leaves(model.model.layers) if x.ndim >= 3}
    for unstack_layers, expect_weight_slices in ((True, False), (False, True)):
        jaxpr = jax.make_jaxpr(
            lambda m, i, a, u=unstack_layers: decode_module._generate_compiled(
                m,
                i,
                a,
                jax.random.key(0),
                config=config,
                max_new=4,
                unstack_layers=u,
                processor=decode_module.logits_processor_for(config),
            )
        )(model, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.bool_))
        sliced = set(_slices_in_loops(jaxpr.jaxpr))
        assert bool(sliced & weights) == expect_weight_slices, (unstack_layers, sliced)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens must be positive"),
        ({"max_length": 5}, ValueError, "leaves no room after the prompt"),
        ({}, ValueError, "set max_new_tokens or max_length"),
        ({"max_new_tokens": 2, "do_sample": True}, ValueError, "needs a PRNG key"),
        ({"max_new_tokens": 2, "attention_mask": np.ones((3, 6))}, ValueError, "must match"),
        (
            {"max_new_tokens": 2, "num_beams": 2, "num_return_sequences": 3},
            ValueError,
            "num_return",
        ),
    ],
)
def test_bad_arguments_fail_before_compiling(kwargs, error, match, monkeypatch):
    model = _tiny_model()
    ids, mask = _prompts()
    kwargs = {"attention_mask": mask, **kwargs}

    def no_compile(*args, **kw):
        raise AssertionError("compiled before validating")

    monkeypatch.setattr(decode_module, "_generate_compiled", no_compile)
    with pytest.raises(error, match=match):
        generate(model, ids, **kwargs)


def test_bad_inputs_are_named(monkeypatch):
    model = _tiny_model()
    ids, mask = _prompts()
    with pytest.raises(ValueError, match="input_ids must be integers"):
        generate(model, ids.astype(np.float32), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, 64\) \(vocab_size 64\)"):
        generate(model, ids + VOCAB, max_new_tokens=2)
    # Finished rows feed pad_token_id to the model, whose id check would fire mid-loop.
    with pytest.raises(ValueError, match=r"pad_token_id -1 must lie in \[0, 64\)"):
        generate(model, ids, max_new_tokens=2, pad_token_id=-1)
    mask[1] = 0
    with pytest.raises(ValueError, match=r"prompt rows \[1\] have no tokens"):
        generate(model, ids, attention_mask=mask, max_new_tokens=2)
    with pytest.raises(ValueError, match="beam search cannot be streamed"):
        next(generate_stream(model, ids, max_new_tokens=2, num_beams=2))


def test_generation_config_from_hf():
    config = GenerationConfig.from_hf(
        {
            "eos_token_id": [1, 2],
            "pad_token_id": None,
            "do_sample": True,
            "top_p": 0.9,
            "transformers_version": "5.0",
            "max_length": 64,
        }
    )
    assert config.eos_ids == (1, 2) and config.pad_id == 1 and config.top_k == 50
    assert config.new_tokens(10) == 54


def test_paged_cache_forward_allocation_and_free():
    """Prefill + decode through a paged cache equal the full forward; pages are taken as
    rows grow and returned by free_rows."""
    model = _tiny_model(layer_windows=(None, 3))
    ids = jax.random.randint(jax.random.key(1), (2, 11), 0, VOCAB)
    full = _forward(model, ids).logits
    cache = init_paged_cache(model.config, 7, 4, batch=2, cache_len=12)
    out = _forward(model, ids[:, :5], cache)  # 5 tokens -> 2 pages per row
    np.testing.assert_allclose(out.logits, full[:, :5], atol=1e-5)
    np.testing.assert_array_equal(out.cache.page_table, [[0, 1, -1], [2, 3, -1]])
    cache = out.cache
    for t in range(5, 11):
        out = _forward(model, ids[:, t : t + 1], cache)
        cache = out.cache
        np.testing.assert_allclose(out.logits[:, 0], full[:, t], atol=1e-5)
    np.testing.assert_array_equal(cache.page_table, [[0, 1, 4], [2, 3, 5]])
    assert int(np.sum(~np.asarray(cache.free))) == 6
    cache = free_rows(cache, jnp.array([True, False]))
    np.testing.assert_array_equal(cache.page_table[0], [-1, -1, -1])
    np.testing.assert_array_equal(cache.lengths, [0, 11])
    np.testing.assert_array_equal(np.flatnonzero(~np.asarray(cache.free)), [2, 3, 5])
    # The freed pages serve a new sequence in row 0.
    out = _forward(model, ids[:1, :3].repeat(2, 0), cache, jnp.array([[1, 1, 1], [0, 0, 0]]))
    np.testing.assert_array_equal(out.cache.page_table[0], [0, -1, -1])
    np.testing.assert_allclose(out.logits[0], full[0, :3], atol=1e-5)


def test_paged_cache_runs_out_of_pages_loudly():
    model = _tiny_model()
    cache = init_paged_cache(model.config, 3, 4, batch=2, cache_len=12)
    ids = jnp.ones((2, 7), jnp.int32)  # needs 4 pages
    with pytest.raises(Exception, match="out of free pages"):
        jax.block_until_ready(model(ids, cache=cache).logits)


# On CPU "auto" is the XLA form; the Pallas paged kernel is checked in test_kernels_paged.
# Slow: by default the serving engine's paged steps are checked against edl.generate's
# contiguous cache (test_serve_engine); this one adds sliding windows and sampling.
@pytest.mark.slow
@pytest.mark.parametrize("impl", ["auto", "pallas"])
def test_paged_generation_equals_contiguous(impl):
    model = _tiny_model(layer_windows=(None, 4), attention_impl=impl)
    ids, mask = _prompts()
    kw = dict(attention_mask=mask, max_new_tokens=9, do_sample=True, key=jax.random.key(1))
    a = generate(model, ids, **kw)
    b = generate(model, ids, page_size=4, **kw)
    np.testing.assert_array_equal(a.sequences, b.sequences)
    streamed = np.stack(list(generate_stream(model, ids, page_size=4, **kw)), axis=1)
    np.testing.assert_array_equal(np.asarray(a.sequences)[:, ids.shape[1] :], streamed)
    with pytest.raises(ValueError, match="num_beams 1"):
        generate(model, ids, max_new_tokens=2, num_beams=2, page_size=4)


def test_paged_cache_config_sizes_the_pool_from_free_memory(monkeypatch):
    from edl.generate import paged

    model = _tiny_model()
    real_free = paged._free_device_bytes(jax.devices()[0])
    assert real_free > 2**20  # the host's available memory on CPU
    monkeypatch.setattr(paged, "_free_device_bytes", lambda device: 2**20)
    geometry = paged_cache_config(model.config, page_size=16, cache_len=256, memory_fraction=0.5)
    per_page = 2 * 2 * 16 * 2 * 8 * 4  # k+v, layers, page, kv heads, head_dim, fp32 bytes
    assert geometry.num_pages == 2**19 // per_page
    assert geometry.pages_per_seq == 16
    with pytest.raises(ValueError, match="fewer than one sequence"):
        paged_cache_config(model.config, cache_len=2**20, memory_fraction=0.5)


def test_generate_checks_ids_before_compiling_not_in_every_decode_step():
    """The prompt and pad_token_id are checked eagerly and sampled ids lie in the
    vocabulary, so the decode loop runs without the model's in-program id check (on GPU a
    host round trip per step)."""
    model = _tiny_model()
    ids, mask = _prompts()
    assert "pure_callback" in str(jax.make_jaxpr(lambda m: m(jnp.asarray(ids)).logits)(model))
    loop = jax.make_jaxpr(lambda m: generate(m, ids, attention_mask=mask, max_new_tokens=2))
    assert "pure_callback" not in str(loop(model))

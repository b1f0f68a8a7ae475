"""edl's programs lowered for every platform from this CPU host (abstract shapes, no memory):
each holds its platform's kernels and nothing that only runs elsewhere.

A program lowered for ``"cuda"`` holds the Pallas kernels compiled through Triton, one
lowered for ``"tpu"`` the Pallas kernels compiled through Mosaic, one lowered for ``"cpu"``
edl's native C++ kernels; none of them holds another platform's kernel or a host callback it
could not run (``edl.platforms``). Covered: attention forward and backward, train steps of a
Llama, a Gemma 2 (soft-capped logits, sliding windows) and a Mixtral (MoE) model (and, in
the slow set, DeepSeek-V3, GPT-OSS and Qwen3-Next), with and without a mesh of the 8 host
devices under the models' fsdp / tp rules (and Mixtral's with its experts split over the
expert axis), ``generate``'s decode step over contiguous and paged caches and its whole
decode loop, and the serving engine's ``model_step``.

Only lowering is checked: compiling needs the platform's backend. The names a kernel leaves
in the lowered text: Triton calls are ``__gpu$xla.gpu.triton`` custom calls naming the Pallas
kernel; Mosaic ones ``tpu_custom_call`` with the kernel's name; the native kernels are
custom calls to their FFI targets; host callbacks call ``xla_ffi_python_cpu_callback``.
"""

from __future__ import annotations

import dataclasses
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import export

import edl
from edl.generate import steps
from edl.generate.cache import init_cache
from edl.generate.paged import init_paged_cache
from edl.kernels import native
from edl.models import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)
from edl.platforms import PLATFORMS
from edl.serve.step import model_step
from edl.sharding import make_mesh
from edl.train import make_train_step

ACCELERATORS = ("cuda", "tpu")
# What only runs on a CPU: the native kernels' FFI targets and host callbacks.
CPU_ONLY = re.compile(r"edl_flash_attention_(forward|backward)|edl_paged_attention|python_cpu")
KERNEL_CALLS = {  # a platform's Pallas kernel calls, as the lowered text names them
    "cuda": re.compile(r"__gpu\$xla\.gpu\.triton"),
    "tpu": re.compile(r"tpu_custom_call"),
}

COMMON = dict(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
)
MODELS = {
    "llama": (LlamaForCausalLM, LlamaConfig(**COMMON)),
    "gemma2": (Gemma2ForCausalLM, Gemma2Config(**COMMON, sliding_window=64)),
    "mixtral": (
        MixtralForCausalLM,
        MixtralConfig(**COMMON, num_experts=4, num_experts_per_tok=2),
    ),
}
# Llama's steps in the default suite, Gemma 2's (sliding windows, softcaps) and Mixtral's
# (MoE) in the slow set: each lowers a whole train step (10-16 s on a loaded VM).
MODEL_NAMES = [
    n if n == "llama" else pytest.param(n, marks=pytest.mark.slow) for n in sorted(MODELS)
]


MOE = dict(num_experts=4, num_experts_per_tok=2)
FAMILIES_2026 = {  # MLA and grouped routing; attention sinks; Gated DeltaNet
    "deepseek_v3": (
        DeepseekV3ForCausalLM,
        DeepseekV3Config(
            **{**COMMON, "num_key_value_heads": 4},
            **MOE,
            moe_intermediate_size=128,
            q_lora_rank=64,
            kv_lora_rank=64,
            qk_nope_head_dim=64,
            qk_rope_head_dim=64,
            v_head_dim=64,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
        ),
    ),
    "gpt_oss": (GptOssForCausalLM, GptOssConfig(**COMMON, **MOE, sliding_window=64)),
    "qwen3_next": (
        Qwen3NextForCausalLM,
        Qwen3NextConfig(
            **COMMON,
            **MOE,
            moe_intermediate_size=128,
            shared_expert_intermediate_size=128,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            layer_types=("linear_attention", "full_attention"),
        ),
    ),
}


def _abstract(cls, config):
    return eqx.filter_eval_shape(cls.init, config, key=jax.random.key(0))


def _lowered_text(fn, *args, platform: str) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def _check(text: str, platform: str, *kernels: str) -> None:
    """``text`` holds ``platform``'s kernel calls, among them ``kernels`` (names), and no
    CPU-only call (on CPU: holds the native kernel instead)."""
    if platform == "cpu":
        assert CPU_ONLY.search(text), "no native kernel in the CPU program"
        return
    assert KERNEL_CALLS[platform].search(text), f"no {platform} kernel call"
    for name in kernels:
        assert name in text, f"{name} missing from the {platform} program"
    found = CPU_ONLY.search(text)
    assert found is None, f"the {platform} program holds {found.group()}"


@pytest.mark.parametrize("platform", ["cpu", *ACCELERATORS])
def test_attention_forward_and_backward(platform):
    def loss(q, k, v, ids):
        out = edl.ops.attention(q, k, v, causal=True, segment_ids=ids, softcap=30.0)
        return jnp.sum(out.astype(jnp.float32))

    q = jax.ShapeDtypeStruct((2, 512, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 512, 2, 128), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((2, 512), jnp.int32)
    text = _lowered_text(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, ids, platform=platform)
    prefix = "edl_tpu_flash_attention" if platform == "tpu" else "edl_flash_attention"
    kernels = () if platform == "cpu" else (f"{prefix}_fwd", f"{prefix}_dq", f"{prefix}_dkdv")
    _check(text, platform, *kernels)


def _train_step_text(name: str, platform: str, mesh, debug_info: bool = False) -> str:
    cls, config = {**MODELS, **FAMILIES_2026}[name]
    tx = optax.adamw(1e-3)
    state = jax.eval_shape(lambda m: edl.create_state(m, tx), _abstract(cls, config))

    def loss_fn(model, batch):
        return model.compute_loss(batch["input_ids"], segment_ids=batch["segment_ids"])

    step = make_train_step(loss_fn, tx, clip_norm=1.0, mesh=mesh)
    batch = {
        "input_ids": jax.ShapeDtypeStruct((8, 256), jnp.int32),
        "segment_ids": jax.ShapeDtypeStruct((8, 256), jnp.int32),
    }
    return step.lower(state, batch, platforms=(platform,)).as_text(debug_info=debug_info)


@pytest.mark.parametrize("platform", ACCELERATORS)
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_train_step(name, platform):
    prefix = "edl_tpu_flash_attention" if platform == "tpu" else "edl_flash_attention"
    _check(_train_step_text(name, platform, None), platform, f"{prefix}_fwd", f"{prefix}_dkdv")


@pytest.mark.slow  # ~4 s a program
@pytest.mark.parametrize("platform", ACCELERATORS)
@pytest.mark.parametrize("name", sorted(FAMILIES_2026))
def test_train_step_of_the_2026_families(name, platform):
    """MLA (DeepSeek-V3), attention sinks (GPT-OSS) and Gated DeltaNet (Qwen3-Next) lowered
    for accelerators hold their Pallas kernels and none of the CPU's."""
    _check(_train_step_text(name, platform, None), platform)


DELTA_RULE_KERNELS = {  # the chunk scan's forward and backward kernels
    "cuda": ("edl_delta_rule_chunk_scan_states", "edl_delta_rule_chunk_scan_bwd"),
    "tpu": ("edl_tpu_delta_rule_fwd", "edl_tpu_delta_rule_fwd_states", "edl_tpu_delta_rule_bwd"),
}


@pytest.mark.slow  # ~10 s a program
@pytest.mark.parametrize("platform", ACCELERATORS)
def test_qwen3_next_train_step_runs_the_delta_rule_kernels_forward_and_backward(platform):
    from edl.kernels.delta_rule import XLA_SCAN_SCOPE

    text = _train_step_text("qwen3_next", platform, None, debug_info=True)
    _check(text, platform, *DELTA_RULE_KERNELS[platform])
    assert XLA_SCAN_SCOPE not in text, f"an XLA scan of the delta rule in the {platform} step"


@pytest.mark.parametrize("platform", ACCELERATORS)
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_train_step_on_a_mesh(name, platform):
    """fsdp x tp over the 8 host devices, the models' own partition rules: the kernels run
    once per shard (``shard_map``), the program is partitioned for 8 devices."""
    mesh = make_mesh((1, 4, 2, 1))  # dp, fsdp, tp, sp
    text = _train_step_text(name, platform, mesh)
    _check(text, platform)
    assert "mhlo.num_partitions = 8" in text


@pytest.mark.slow  # ~5 s each: a Mixtral train step traced with its expert dispatch
@pytest.mark.parametrize("platform", ACCELERATORS)
def test_moe_train_step_with_expert_parallelism(platform):
    """fsdp 2 x expert 4: the MoE layers dispatch their tokens with the ragged all-to-all
    (``edl.ops.expert_parallel``) beside the platform's attention kernels."""
    text = _train_step_text("mixtral", platform, make_mesh((1, 2, 1, 1, 4)))
    _check(text, platform)
    assert "ragged_all_to_all" in text and "mhlo.num_partitions = 8" in text


def _llama(dtype=jnp.bfloat16):
    cls, config = MODELS["llama"]
    return jax.eval_shape(lambda m: edl.module.to_dtype(m, dtype), _abstract(cls, config))


DECODE_KERNELS = {
    (None, "cuda"): "edl_decode_attention",
    (None, "tpu"): "edl_tpu_decode_attention",
    (16, "cuda"): "edl_paged_decode_attention",
    (16, "tpu"): "edl_tpu_paged_decode_attention",
}


@pytest.mark.parametrize("platform", ACCELERATORS)
@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "paged"])
def test_generate_prefill_and_decode_step(page_size, platform):
    """``generate``'s program pieces: the prefill into a fresh cache (the flash kernel) and
    one decode step through it (the decode kernel of the cache's kind)."""
    model = _llama()

    def prefill_then_decode(model, ids, mask):
        logits, cache, _, _ = steps.start(model, ids, mask, 64, page_size)
        return steps.decode_step(model, jnp.argmax(logits, axis=-1).astype(jnp.int32), cache)

    ids = jax.ShapeDtypeStruct((4, 128), jnp.int32)
    mask = jax.ShapeDtypeStruct((4, 128), jnp.bool_)
    text = _lowered_text(prefill_then_decode, model, ids, mask, platform=platform)
    _check(text, platform, DECODE_KERNELS[page_size, platform])


@pytest.mark.parametrize("platform", ACCELERATORS)
@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "paged"])
def test_generate_decode_step_alone(page_size, platform):
    """A decode step over a filled cache (not ``fresh``), as ``generate``'s loop runs it."""
    model, config = _llama(), MODELS["llama"][1]
    if page_size is None:
        cache = init_cache(config, 4, 1024, jnp.bfloat16)
    else:
        cache = init_paged_cache(
            config, 256, page_size, batch=4, cache_len=1024, dtype=jnp.bfloat16
        )
    cache = jax.eval_shape(lambda: dataclasses.replace(cache, fresh=False))
    tokens = jax.ShapeDtypeStruct((4,), jnp.int32)
    text = _lowered_text(steps.decode_step, model, tokens, cache, platform=platform)
    _check(text, platform, DECODE_KERNELS[page_size, platform])


@pytest.mark.parametrize("platform", ACCELERATORS)
def test_serving_model_step(platform):
    """The engine's one jitted call (its model unstacked, pools stacked over layers and
    donated), for a decode-sized and a prefill-sized width."""
    model = jax.eval_shape(lambda m: m.unstacked(), _llama())
    config = MODELS["llama"][1]
    pools = jax.ShapeDtypeStruct((config.num_hidden_layers, 512, 16, 2, 64), jnp.bfloat16)
    for width in (1, 64):
        args = (
            model,
            pools,
            pools,
            jax.ShapeDtypeStruct((8, 32), jnp.int32),
            jax.ShapeDtypeStruct((8,), jnp.int32),
            jax.ShapeDtypeStruct((8, width), jnp.int32),
            jax.ShapeDtypeStruct((8,), jnp.int32),
        )
        text = model_step.trace(*args).lower(lowering_platforms=(platform,)).as_text()
        _check(text, platform, DECODE_KERNELS[16, platform])


@pytest.mark.slow  # two whole CPU train steps compiled and compared (about 15 s)
@pytest.mark.skipif(native.unavailable() is not None, reason="needs the native CPU kernel")
def test_choosing_by_platform_costs_the_cpu_program_nothing():
    """Lowered for CPU, the defaults (remat and attention "auto": platform_dependent branches
    for every platform) compile to the buffers of the CPU choices named outright (remat
    "dots", the native kernel): the other branches' residuals are gone."""
    config = LlamaConfig(**{**COMMON, "hidden_size": 64, "intermediate_size": 128})
    tx = optax.adamw(1e-3)
    batch = {
        "input_ids": jnp.zeros((2, 64), jnp.int32),
        "segment_ids": jnp.ones((2, 64), jnp.int32),
    }

    def temp_bytes(remat: str, attention_impl: str) -> int:
        model = LlamaForCausalLM.init(
            config.replace(remat=remat, attention_impl=attention_impl), key=jax.random.key(0)
        )
        step = make_train_step(
            lambda m, b: m.compute_loss(b["input_ids"], segment_ids=b["segment_ids"]), tx
        )
        compiled = step.lower(edl.create_state(model, tx), batch).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temp_bytes("auto", "auto") == temp_bytes("dots", "native")


# What jax.export must be told it may serialise, per platform (docs/ARCHITECTURE.md).
UNSTABLE_CALLS = {
    "tpu": (),  # Mosaic calls are on jax's list of stable custom calls
    "cuda": ("__gpu$xla.gpu.triton",),
    "cpu": ("edl_flash_attention_forward", "edl_flash_attention_backward"),
}


@pytest.mark.parametrize("platform", ["cpu", *ACCELERATORS])
def test_export_for_one_platform(platform):
    def loss(q, k, v):
        return jnp.sum(edl.ops.attention(q, k, v, causal=True).astype(jnp.float32))

    q = jax.ShapeDtypeStruct((2, 256, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 256, 2, 128), jnp.bfloat16)
    checks = [export.DisabledSafetyCheck.custom_call(t) for t in UNSTABLE_CALLS[platform]]
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    exported = export.export(grad, platforms=[platform], disabled_checks=checks)(q, kv, kv)
    assert exported.platforms == (platform,)
    if UNSTABLE_CALLS[platform]:
        with pytest.raises(ValueError, match="custom calls whose targets have no compatib"):
            export.export(grad, platforms=[platform])(q, kv, kv)


@pytest.mark.slow  # exports for three platforms at once (about 9 s)
def test_export_for_several_platforms_without_pallas_kernels():
    """One export for cpu, cuda, rocm and tpu: a Llama train loss with XLA attention exports
    and runs here as the jitted function does. With Pallas kernels jax refuses
    (it lowers each platform's branch for every platform of the export)."""
    config = LlamaConfig(**{**COMMON, "hidden_size": 64, "intermediate_size": 128})
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 32)), jnp.int32)

    def value_and_grad(attention_impl: str):
        model = LlamaForCausalLM.init(
            config.replace(attention_impl=attention_impl), key=jax.random.key(0)
        )
        params, other = edl.split(model)
        loss = lambda params, ids: edl.merge(params, other).compute_loss(ids)[0]
        return jax.jit(jax.value_and_grad(loss)), params

    fn, params = value_and_grad("xla")
    exported = export.export(fn, platforms=PLATFORMS)(params, ids)
    assert exported.platforms == PLATFORMS
    (value, grads), (want, want_grads) = exported.call(params, ids), fn(params, ids)
    np.testing.assert_allclose(value, want, rtol=1e-6)
    for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)
    fn, params = value_and_grad("pallas")
    with pytest.raises(ValueError, match=r"cannot be used for tpu lowering|Only interpret mode"):
        export.export(fn, platforms=PLATFORMS)(params, ids)

"""Multi-head latent attention (edl.ops.mla, edl.nn.mla) and DeepSeek-V3's grouped routing
(edl.ops.group_routing) against plain references.

- float64: the absorbed decode over a latent cache equals the materialised attention, token
  by token; MLA's gradients equal autodiff of a plain per-head softmax written here.
- the interleaved RoPE and the router against transformers' own functions.
- the kernels: MLA's attention through the dispatch lowers to the Pallas kernels for cuda
  and tpu from this CPU machine; on a GPU (``-m gpu``) the Triton path equals the float64
  reference.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from edl.generate.cache import KVCache, LatentKVCache
from edl.nn.mla import MultiHeadLatentAttention
from edl.ops.group_routing import grouped_sigmoid_route
from edl.ops.mla import interleaved_rope, mla_attention
from edl.ops.norms import rms_norm
from edl.ops.rope import RopeConfig, rope_tables

# edl's attention ops keep float32 logits and softmax even for float64 inputs (as the kernels
# do): float64 checks through them agree to ~1e-7 relative, far below what a wrong scale,
# RoPE pair or absorbed weight would change.
RTOL, ATOL = 1e-5, 1e-6
DIMS = dict(q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5)


def _mla(dtype, *, q_lora_rank=12, seed=0):
    dims = {**DIMS, "q_lora_rank": q_lora_rank}
    layer = MultiHeadLatentAttention.init(16, 3, **dims, dtype=dtype, key=jax.random.key(seed))
    # Larger weights than the init's 0.02, so that every term matters.
    return jax.tree.map(lambda w: w * 10 if w.ndim == 2 else w, layer)


def _tables(seq, dtype, start=0):
    pos = jnp.broadcast_to(jnp.arange(start, start + seq)[None], (2, seq))
    cos, sin = rope_tables(pos, RopeConfig(dim=DIMS["qk_rope_head_dim"], theta=100.0))
    return cos.astype(dtype), sin.astype(dtype)


def _plain_mla(layer, x, cos, sin):
    """MLA written out per head with an explicit softmax: the definition (the RMS norms
    are edl's, which normalise in float32 as transformers does: checked on their own in
    test_ops_rope_norm.py)."""
    b, s, _ = x.shape
    h, dn, dr, dv = layer.num_heads, layer.qk_nope_head_dim, layer.qk_rope_head_dim, 5
    if layer.q_proj is not None:
        q = x @ layer.q_proj.weight.T
    else:
        qa = x @ layer.q_a_proj.weight.T
        qa = rms_norm(qa, layer.q_a_layernorm.weight, 1e-6)
        q = qa @ layer.q_b_proj.weight.T
    q = q.reshape(b, s, h, dn + dr)
    kv = x @ layer.kv_a_proj_with_mqa.weight.T
    c, kr = kv[..., : layer.kv_lora_rank], kv[..., layer.kv_lora_rank :]
    c = rms_norm(c, layer.kv_a_layernorm.weight, 1e-6)
    kvb = (c @ layer.kv_b_proj.weight.T).reshape(b, s, h, dn + dv)

    def rot(t):  # HF's interleaved pairs, de-interleaved
        half = dr // 2
        cc, ss = cos[:, :, None, :half], sin[:, :, None, :half]
        t1, t2 = t[..., 0::2], t[..., 1::2]
        return jnp.concatenate([t1 * cc - t2 * ss, t2 * cc + t1 * ss], -1)

    qf = jnp.concatenate([q[..., :dn], rot(q[..., dn:])], -1)
    kr = jnp.broadcast_to(rot(kr[:, :, None]), (b, s, h, dr))
    kf = jnp.concatenate([kvb[..., :dn], kr], -1)
    logits = jnp.einsum("bqhd,bkhd->bhqk", qf, kf) / np.sqrt(dn + dr)
    logits = jnp.where(jnp.tril(jnp.ones((s, s), bool)), logits, -jnp.inf)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, -1), kvb[..., dn:])
    return out.reshape(b, s, h * dv) @ layer.o_proj.weight.T


# ~6-20 s each: the slow set (the model's logits against transformers run by default).
@pytest.mark.slow
@pytest.mark.parametrize("q_lora_rank", [12, None])
def test_float64_materialised_mla_and_its_gradients_equal_the_plain_definition(q_lora_rank):
    with jax.enable_x64(True):
        layer = _mla(jnp.float64, q_lora_rank=q_lora_rank)
        x = jax.random.normal(jax.random.key(1), (2, 7, 16), jnp.float64)
        cos, sin = _tables(7, jnp.float64)
        mine = lambda m, x: jnp.sum(jnp.sin(m(x, cos, sin, impl="xla")))
        plain = lambda m, x: jnp.sum(jnp.sin(_plain_mla(m, x, cos, sin)))
        np.testing.assert_allclose(
            layer(x, cos, sin, impl="xla"), _plain_mla(layer, x, cos, sin), rtol=RTOL, atol=ATOL
        )
        g_mine = jax.jit(jax.grad(mine, argnums=(0, 1)))(layer, x)
        g_plain = jax.jit(jax.grad(plain, argnums=(0, 1)))(layer, x)
        for a, b in zip(jax.tree.leaves(g_mine), jax.tree.leaves(g_plain), strict=True):
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


# ~10-20 s each: slow (test_models_deepseek_v3's greedy generation through the latent
# cache runs by default).
@pytest.mark.slow
@pytest.mark.parametrize("cache_kind", ["latent", "materialised"])
def test_float64_absorbed_decode_equals_the_materialised_form(cache_kind):
    """A prompt of 4 tokens, then 3 tokens one at a time through the cache: each step's
    outputs equal the materialised forward over the whole sequence at those positions.
    The latent cache holds only ``[latent, k_rope]`` (one head of kv_lora_rank +
    qk_rope_head_dim), read absorbed; the per-head cache holds materialised keys / values."""
    with jax.enable_x64(True):
        layer = _mla(jnp.float64)
        x = jax.random.normal(jax.random.key(2), (2, 7, 16), jnp.float64)
        full = layer(x, *_tables(7, jnp.float64), impl="xla")
        lengths = jnp.zeros((2,), jnp.int32)
        if cache_kind == "latent":
            latent = jnp.zeros((1, 2, 16, 1, layer.latent_dim), jnp.float64)
            cache = LatentKVCache(latent, lengths, fresh=True)
        else:
            kv = jnp.zeros((1, 2, 16, 3, 10), jnp.float64)
            cache = KVCache(kv, kv, lengths, fresh=True)
        outs = []
        for start, stop in ((0, 4), (4, 5), (5, 6), (6, 7)):
            cos, sin = _tables(stop - start, jnp.float64, start)
            out, cache = layer.decode(x[:, start:stop], cos, sin, cache, 0, impl="xla")
            cache = cache.advance(jnp.full((2,), stop - start, jnp.int32))
            outs.append(out)
        np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=RTOL, atol=ATOL)
        if cache_kind == "latent":
            assert not hasattr(cache, "k") and cache.latent.shape[-2:] == (1, 14)


def test_interleaved_rope_equals_transformers():
    torch = pytest.importorskip("torch")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 3, 8)).astype(np.float32)
    cos, sin = rope_tables(jnp.arange(5)[None].repeat(2, 0), RopeConfig(dim=8, theta=50.0))
    mine = interleaved_rope(jnp.asarray(x), cos, sin)
    t = lambda a: torch.tensor(np.asarray(a))
    # HF's layout is (batch, heads, seq, dim).
    ref, _ = hf.apply_rotary_pos_emb_interleave(
        t(x).transpose(1, 2), t(x).transpose(1, 2), t(cos), t(sin)
    )
    np.testing.assert_allclose(mine, ref.transpose(1, 2).numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("n_group", "topk_group", "normalize"), [(4, 2, True), (1, 1, False)])
def test_grouped_routing_equals_transformers_router(n_group, topk_group, normalize):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    config = transformers.DeepseekV3Config(
        hidden_size=8,
        n_routed_experts=16,
        num_experts_per_tok=3,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=normalize,
        routed_scaling_factor=2.5,
    )
    router = hf.DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.normal_(0, 1.0)
        router.e_score_correction_bias.normal_(0, 0.5)
    x = torch.randn(11, 8)
    logits, ref_w, ref_i = router(x)
    weights, chosen, _ = grouped_sigmoid_route(
        jnp.asarray(logits.detach().numpy()),
        jnp.asarray(router.e_score_correction_bias.numpy()),
        3,
        n_group=n_group,
        topk_group=topk_group,
        normalize=normalize,
        scaling=2.5,
    )
    order = np.argsort(ref_i.numpy(), -1)  # torch's topk(sorted=False) order is unspecified
    mine = np.argsort(np.asarray(chosen), -1)
    np.testing.assert_array_equal(
        np.take_along_axis(np.asarray(chosen), mine, -1),
        np.take_along_axis(ref_i.numpy(), order, -1),
    )
    np.testing.assert_allclose(
        np.take_along_axis(np.asarray(weights), mine, -1),
        np.take_along_axis(ref_w.detach().numpy(), order, -1),
        rtol=1e-6,
    )


def test_routing_refuses_groups_it_cannot_score():
    logits, bias = jnp.zeros((2, 6)), jnp.zeros((6,))
    with pytest.raises(ValueError, match="n_group=4 groups"):
        grouped_sigmoid_route(logits, bias, 2, n_group=4, topk_group=1, normalize=True, scaling=1.0)
    with pytest.raises(ValueError, match="groups of 1 experts"):
        grouped_sigmoid_route(logits, bias, 1, n_group=6, topk_group=1, normalize=True, scaling=1.0)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_mla_attention_lowers_to_the_pallas_kernels(platform):
    """Values narrower than keys (DeepSeek-V3's 192 / 128) go through the flash kernels,
    forward and backward, from this CPU machine."""

    def loss(q, k, v):
        return jnp.sum(mla_attention(q, k, v).astype(jnp.float32))

    q = jax.ShapeDtypeStruct((1, 256, 4, 192), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
    text = (
        jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        .trace(q, q, v)
        .lower(lowering_platforms=(platform,))
        .as_text()
    )
    prefix = "edl_tpu_flash_attention" if platform == "tpu" else "edl_flash_attention"
    for kernel in ("_fwd", "_dq", "_dkdv"):
        assert prefix + kernel in text


@pytest.mark.gpu
def test_mla_attention_on_gpu_equals_the_float64_reference():
    """The Triton flash kernel on MLA's shapes (q/k 192, v 128, padded to 192), forward and
    gradients, against the float64 reference."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    rng = np.random.default_rng(0)
    q, k = (rng.standard_normal((2, 128, 4, 192)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((2, 128, 4, 128)).astype(np.float32)

    def loss(impl, q, k, v):
        return jnp.sum(jnp.sin(mla_attention(q, k, v, impl=impl)))

    got = jax.jit(jax.value_and_grad(lambda *a: loss("pallas", *a), argnums=(0, 1, 2)))(q, k, v)
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        args = [jnp.asarray(a, jnp.float64) for a in (q, k, v)]
        ref = jax.value_and_grad(lambda *a: loss("reference", *a), argnums=(0, 1, 2))(*args)
        ref = jax.tree.map(np.asarray, ref)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b)
        assert np.max(np.abs(a - b)) / max(1.0, np.abs(b).max()) < 2e-2


@pytest.mark.gpu
def test_absorbed_decode_at_deepseek_v3_sizes_on_gpu():
    """One decode step over a latent cache of DeepSeek-V3's width (512 + 64: one shared
    head of 576) through ``cached_attention``'s "auto" choice on a GPU (the Triton decode
    kernel, or XLA with a warning naming why) equals the reference."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    from edl.ops.cached_attention import cached_attention

    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((2, 1, 16, 576)), jnp.float32)
    latent = jnp.asarray(rng.standard_normal((1, 2, 64, 1, 576)), jnp.float32)
    lengths = jnp.asarray([37, 64], jnp.int32)
    run = lambda impl: cached_attention(q, latent, latent, lengths, layer=0, impl=impl)
    got, want = jax.jit(lambda: run("auto"))(), run("reference")
    np.testing.assert_allclose(got[..., :512], want[..., :512], rtol=2e-2, atol=2e-2)

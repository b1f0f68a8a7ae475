"""Sharding on the 8 forced host devices: meshes, rules over key paths, train steps on
every mesh layout equal to one device, really split arrays, checkpoints across meshes."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import edl
from edl._mesh_spec import MeshSpec
from edl.io.checkpoint import load_state, save_state
from edl.models import LlamaConfig, LlamaForCausalLM
from edl.models.llama import PARTITION_RULES
from edl.sharding import (
    _hybrid_devices,
    constrain,
    gather,
    make_mesh,
    mesh_slices,
    partition_specs,
    shard,
    shard_batch,
    shard_state,
    shard_with_shape,
    state_shardings,
)
from edl.train import CheckpointConfig, LogConfig, RunConfig, make_eval_step, make_train_step

# The default suite keeps pure data and pure FSDP parallelism; the mixes (tensor and
# sequence axes included) run in the slow set.
MESHES = [
    (8, 1, 1, 1),
    (1, 8, 1, 1),
    pytest.param((1, 4, 2, 1), marks=pytest.mark.slow),
    pytest.param((2, 2, 2, 1), marks=pytest.mark.slow),
    pytest.param((1, 2, 2, 2), marks=pytest.mark.slow),
]
CONFIG = LlamaConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def _model():
    return LlamaForCausalLM.init(CONFIG, key=jax.random.key(0))


def _batch():
    return {"ids": jax.random.randint(jax.random.key(1), (8, 16), 0, CONFIG.vocab_size)}


def _loss(model, batch):
    return model.compute_loss(batch["ids"])


def _run(tx, mesh=None, steps=3, model=None, **kw):
    state = edl.create_state(_model() if model is None else model, tx)
    step = make_train_step(_loss, tx, donate=False, mesh=mesh, rules=PARTITION_RULES, **kw)
    losses = []
    for _ in range(steps):
        state, metrics = step(state, _batch())
        losses.append(float(metrics["loss"]))
    return np.array(losses), state


@functools.cache
def _reference(optimizer: str, grad_accum_steps: int = 1):
    """The single-device run, computed once per setting for all meshes."""
    return _run(_OPTIMIZERS[optimizer](), grad_accum_steps=grad_accum_steps)


_OPTIMIZERS = {"sgd": lambda: optax.sgd(0.5), "adamw": lambda: optax.adamw(1e-2)}


def _max_relative(a, b):
    return max(
        float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def test_make_mesh_fills_minus_one_and_names_bad_shapes():
    mesh = make_mesh()
    assert dict(mesh.shape) == {"dp": 1, "fsdp": 8, "tp": 1, "sp": 1, "expert": 1}
    assert dict(make_mesh((2, -1, 2, 1)).shape)["fsdp"] == 2
    with pytest.raises(ValueError, match=r"product 3\) do not divide the 8 devices"):
        make_mesh((3, -1, 1, 1))
    with pytest.raises(ValueError, match="one -1"):
        make_mesh((-1, -1, 1, 1))
    with pytest.raises(ValueError, match="cover 4 devices"):
        make_mesh((2, 2, 1, 1))
    with pytest.raises(ValueError, match="need one size per axis"):
        make_mesh((8, 1))


@dataclasses.dataclass(frozen=True)
class _FakeDevice:
    """What ``create_hybrid_device_mesh`` reads of a device (a GPU has no ``slice_index``)."""

    id: int
    process_index: int
    slice_index: int = 0  # as jax's GPU and CPU devices: 0 for every process's
    platform: str = "gpu"
    device_kind: str = "fake"


def test_hybrid_meshes_keep_each_process_one_block_and_count_tpu_slices():
    """16 GPU-like devices of 4 processes (each with ``slice_index`` 0, as jax gives them):
    the axis ``dcn`` spans steps across processes, the others stay within one, and ``-1``
    counts a process's devices. On TPUs the slices are the devices' ``slice_index``es
    (their layout within a slice needs real TPU coordinates, so only the count is checked)."""
    processes = [_FakeDevice(i, i // 4) for i in range(16)]
    grid = _hybrid_devices((1, -1, 2, 1), (4, 1, 1, 1), processes)
    assert grid.shape == (4, 2, 2, 1)
    assert [{d.process_index for d in block.flat} for block in grid] == [{0}, {1}, {2}, {3}]
    grid = _hybrid_devices((1, 2, 2, 1), (1, 4, 1, 1), processes)
    assert grid.shape == (1, 8, 2, 1)
    assert [{d.process_index for d in grid[0, 2 * i : 2 * i + 2].flat} for i in range(4)] == [
        {0},
        {1},
        {2},
        {3},
    ]
    tpus = [_FakeDevice(i, 0, slice_index=i // 8, platform="tpu") for i in range(16)]
    assert mesh_slices(tpus) == (2, "slices") and mesh_slices(processes) == (4, "processes")
    with pytest.raises(ValueError, match=r"spans 4 slices, but the 16 devices are in 2 slices"):
        _hybrid_devices((1, -1, 1, 1), (4, 1, 1, 1), tpus)


def test_make_mesh_across_processes_on_one_process():
    """One process is one slice: ``dcn`` of ones is the plain mesh; more is refused."""
    assert make_mesh((2, -1, 1, 1), dcn=(1, 1, 1, 1)).devices.shape == (2, 4, 1, 1, 1)
    with pytest.raises(ValueError, match=r"spans 2 slices, but the 8 devices are in 1 process"):
        make_mesh((1, -1, 1, 1), dcn=(2, 1, 1, 1))


@pytest.mark.parametrize(
    ("spec", "ici", "dcn"),
    [
        ("1,-1,1,1", (1, -1, 1, 1), None),
        ("1,-1,1,1/2", (1, -1, 1, 1), (2, 1, 1, 1)),
        ("1,4,2,1/1,2,1,1", (1, 4, 2, 1), (1, 2, 1, 1)),
    ],
)
def test_mesh_specs_parse(spec, ici, dcn):
    assert MeshSpec.parse(spec) == MeshSpec(ici, dcn)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("1,-1,-1,1", "one of them may be -1"),
        ("1,2,1", "four sizes"),
        ("1,-1,1,1/-1", "one number or four sizes >= 1"),
        ("1,-1,1,1/2,1", "one number or four sizes >= 1"),
        ("a,b", "expected DP,FSDP,TP,SP"),
    ],
)
def test_bad_mesh_specs_are_refused_naming_them(spec, message):
    with pytest.raises(ValueError, match=message):
        MeshSpec.parse(spec)


def test_partition_specs_follow_rules_and_fall_back_to_replication(caplog):
    model = _model()
    specs = edl.tree.flatten(partition_specs(model, PARTITION_RULES))
    assert specs["model.layers.self_attn.q_proj.weight"] == P(None, "tp", "fsdp")
    assert specs["model.layers.mlp.down_proj.weight"] == P(None, "fsdp", "tp")
    assert specs["model.embed_tokens.weight"] == P(None, ("tp", "fsdp"))
    assert specs["lm_head.weight"] == P("tp", "fsdp")
    assert specs["model.norm.weight"] == P(None)
    mesh = make_mesh((1, 1, 8, 1))
    odd = LlamaForCausalLM.init(CONFIG.replace(vocab_size=60), key=jax.random.key(0))
    with caplog.at_level("DEBUG", logger="edl.sharding"):
        odd_specs = edl.tree.flatten(partition_specs(odd, PARTITION_RULES, mesh=mesh))
    assert "lm_head.weight: mesh axis 'tp' (8) does not divide dim 60" in caplog.text
    assert odd_specs["lm_head.weight"] == P(None, "fsdp")  # tp=8 does not divide 60
    assert odd_specs["model.layers.self_attn.q_proj.weight"] == P(None, "tp", "fsdp")
    with pytest.raises(ValueError, match=r"'model.norm.weight'.*axis 'model'"):
        partition_specs(model, [(r"^model\.norm", P("model"))], mesh=mesh)
    with pytest.raises(ValueError, match=r"more entries than 'model\.norm\.weight'"):
        partition_specs(model, [(r"^model\.norm", P(None, None))])


@pytest.mark.parametrize("dims", MESHES)
def test_train_steps_on_every_mesh_equal_one_device(dims):
    """SGD keeps parameters a linear function of the gradients, so they are compared to
    1e-5 relative; AdamW divides by sqrt(v) + 1e-8 and amplifies reduction-order noise in
    near-zero gradients to ~1e-3, so its losses (and placement of its moments) are checked
    instead, on the meshes with both fsdp and tp."""
    mesh = make_mesh(dims)
    ref_losses, ref = _reference("sgd")
    losses, state = _run(_OPTIMIZERS["sgd"](), mesh)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert _max_relative(state.params, ref.params) <= 1e-5
    if mesh.shape["fsdp"] == 1 or mesh.shape["tp"] == 1:
        return

    adam_ref, _ = _reference("adamw")
    adam_losses, adam_state = _run(_OPTIMIZERS["adamw"](), mesh)
    np.testing.assert_allclose(adam_losses, adam_ref, rtol=1e-5)

    # Parameters and their Adam moments are really split.
    fsdp, tp = mesh.shape["fsdp"], mesh.shape["tp"]
    q = adam_state.params.model.layers.self_attn.q_proj.weight  # (2, 32, 32)
    assert q.addressable_shards[0].data.shape == (2, 32 // tp, 32 // fsdp)
    mu = adam_state.opt_state[0].mu.model.layers.self_attn.q_proj.weight
    assert mu.sharding.spec == q.sharding.spec
    assert mu.addressable_shards[0].data.shape == q.addressable_shards[0].data.shape


@pytest.mark.parametrize("dims", [(2, 1, 1, 4), pytest.param((1, 1, 2, 4), marks=pytest.mark.slow)])
def test_ring_attention_train_steps_equal_one_device(dims):
    """``attention_impl="ring"``: the sequence of 16 split over sp=4 (heads over tp=2, or
    rows over dp=2); losses and SGD parameters as one device's, to rounding (1e-5)."""
    from edl.models import configure

    ref_losses, ref = _reference("sgd")
    model = configure(_model(), attention_impl="ring")
    losses, state = _run(_OPTIMIZERS["sgd"](), make_mesh(dims), model=model)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert _max_relative(state.params, ref.params) <= 1e-5
    with pytest.raises(ValueError, match="needs a mesh with axis 'sp'"):
        model(_batch()["ids"])


@pytest.mark.slow  # accumulation on a mesh (test_train_loop checks it on one device)
def test_grad_accumulation_and_eval_on_a_mesh():
    mesh = make_mesh((2, 2, 2, 1))
    ref_losses, ref = _reference("sgd", grad_accum_steps=2)
    losses, state = _run(_OPTIMIZERS["sgd"](), mesh, grad_accum_steps=2)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert _max_relative(state.params, ref.params) <= 1e-5
    evaluate = make_eval_step(_loss, mesh=mesh)
    np.testing.assert_allclose(
        float(evaluate(state, shard_batch(_batch(), mesh))["loss"]),
        float(make_eval_step(_loss)(ref, _batch())["loss"]),
        rtol=1e-5,
    )


def test_activations_are_constrained_and_attention_runs_per_shard():
    model, ids = _model(), _batch()["ids"]
    assert constrain(ids, P("dp")) is ids  # no mesh: a no-op
    mesh = make_mesh((2, 2, 2, 1))
    with jax.set_mesh(mesh):
        jaxpr = str(jax.make_jaxpr(lambda m, i: m(i).logits)(model, ids))
    assert "sharding_constraint" in jaxpr
    kernel = "pallas_call" in jaxpr or "edl_flash_attention_forward" in jaxpr  # GPU / CPU
    assert "shard_map" in jaxpr and kernel


def test_checkpoints_move_between_meshes(tmp_path):
    tx = optax.adamw(1e-2)
    _, trained = _run(tx, make_mesh((1, 8, 1, 1)), steps=2)
    save_state(trained, tmp_path / "ckpt")
    fresh = edl.create_state(_model(), tx)
    target_mesh = make_mesh((2, 2, 2, 1))
    like = shard_state(fresh, PARTITION_RULES, target_mesh)
    loaded, _ = load_state(tmp_path / "ckpt", like)
    host = gather(trained)
    for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(host), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
    q = loaded.params.model.layers.self_attn.q_proj.weight
    assert q.sharding == like.params.model.layers.self_attn.q_proj.weight.sharding
    single, _ = load_state(tmp_path / "ckpt", fresh)  # and onto one device
    for got, want in zip(jax.tree.leaves(single), jax.tree.leaves(host), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
    assert len(single.params.model.layers.self_attn.q_proj.weight.devices()) == 1


def test_shard_with_shape_creates_sharded_arrays():
    mesh = make_mesh((1, 4, 2, 1))
    init = shard_with_shape(
        lambda key: LlamaForCausalLM.init(CONFIG, key=key), PARTITION_RULES, mesh
    )
    model = init(jax.random.key(0))
    q = model.model.layers.self_attn.q_proj.weight
    assert q.sharding.spec == P(None, "tp", "fsdp")
    assert q.addressable_shards[0].data.shape == (2, 16, 8)
    for got, want in zip(jax.tree.leaves(gather(model)), jax.tree.leaves(_model()), strict=True):
        np.testing.assert_allclose(got, np.asarray(want), rtol=1e-6)  # jit vs eager: 1 ulp


def test_state_shardings_and_shard_batch():
    mesh = make_mesh((2, 4, 1, 1))
    state = edl.create_state(_model(), optax.adamw(1e-2))
    shardings = state_shardings(state, PARTITION_RULES, mesh)
    assert all(isinstance(s, NamedSharding) for s in jax.tree.leaves(shardings))
    assert shardings.step.spec == P()
    batch = shard_batch(_batch(), mesh)
    assert batch["ids"].sharding.spec == P(("dp", "fsdp", "expert"), None)  # expert: 1
    assert batch["ids"].addressable_shards[0].data.shape == (1, 16)
    odd = shard_batch({"ids": jnp.zeros((6, 4), jnp.int32)}, mesh)  # 8 does not divide 6
    assert odd["ids"].sharding.spec == P(("dp", "expert"), None)
    placed = shard(_model(), PARTITION_RULES, mesh)
    assert placed.lm_head.weight.sharding.spec == P("tp", "fsdp")
    assert placed.lm_head.weight.addressable_shards[0].data.shape == (64, 8)


def test_rules_none_means_the_models_own_rules():
    """``None`` rules are the model family's (EasyDeL's ``shard_model(partition_rules=None)``):
    for a model, a train state (of a LoRA'd model too) and a shape-only init."""
    from edl.lora import apply_lora, lora_trainable
    from edl.models import registry

    for family in (
        registry.LLAMA,
        registry.GEMMA,
        registry.GEMMA2,
        registry.MIXTRAL,
        registry.QWEN3_MOE,
    ):
        for cls in (*family.tasks.values(), family.tasks["causal_lm"].trunk):
            assert cls.partition_rules is PARTITION_RULES, cls
    mesh = make_mesh((1, 4, 2, 1))
    model = _model()
    specs = lambda tree: [s.spec for s in jax.tree.leaves(jax.tree.map(lambda x: x.sharding, tree))]
    assert specs(shard(model, None, mesh)) == specs(shard(model, PARTITION_RULES, mesh))
    assert specs(shard(model.model, None, mesh)) == specs(shard(model.model, PARTITION_RULES, mesh))
    for state in (
        edl.create_state(model, optax.adamw(1e-2)),
        edl.create_state(
            apply_lora(model, rank=2, alpha=2, key=jax.random.key(1)),
            optax.adamw(1e-2),
            trainable=lora_trainable,
        ),
    ):
        assert state.partition_rules is PARTITION_RULES
        assert specs(shard_state(state, None, mesh)) == specs(
            shard_state(state, PARTITION_RULES, mesh)
        )
    init = shard_with_shape(lambda key: LlamaForCausalLM.init(CONFIG, key=key), None, mesh)
    assert init(jax.random.key(0)).model.layers.self_attn.q_proj.weight.sharding.spec == P(
        None, "tp", "fsdp"
    )
    with pytest.raises(ValueError, match=r"shard: rules=None .* a dict has none"):
        shard({"w": jnp.ones(8)}, None, mesh)
    tx = optax.sgd(0.1)  # a train step without rules places the state by the model's own
    step = make_train_step(_loss, tx, mesh=mesh)
    placed = step.place(edl.create_state(model, tx))
    assert specs(placed.params) == specs(shard(model, PARTITION_RULES, mesh))
    mlp_state = edl.create_state({"w": jnp.ones((8, 4))}, tx)  # no rules: replicated
    placed = make_train_step(lambda m, b: (jnp.sum(m["w"]), {}), tx, mesh=mesh).place(mlp_state)
    assert placed.params["w"].sharding.is_fully_replicated


@pytest.mark.slow  # end to end: train, checkpoint, resume on a second mesh
def test_trainer_runs_a_sharded_step_and_resumes_on_another_mesh(tmp_path):
    """``train`` with ``make_train_step(mesh=...)``: an unplaced state and host batches are
    placed by the step; the run's checkpoint resumes on a different mesh."""
    from edl.train import TokenBatches, train

    docs = [np.random.default_rng(i).integers(0, 64, 40).tolist() for i in range(16)]

    def run(dims, steps):
        tx = optax.adamw(1e-2)
        step = make_train_step(
            lambda m, b: m.compute_loss(jnp.asarray(b["input_ids"])),
            tx,
            mesh=make_mesh(dims),
            rules=PARTITION_RULES,
        )
        data = TokenBatches(docs, batch_size=8, max_length=16, pad_id=0)
        return train(
            edl.create_state(_model(), tx),
            step,
            data,
            RunConfig(
                steps=steps,
                output_dir=tmp_path,
                checkpoint=CheckpointConfig(every=2),
                log=LogConfig(progress=False),
            ),
        )

    state, summary = run((1, 8, 1, 1), 2)
    up = state.params.model.layers.mlp.up_proj.weight  # (2, 64, 32)
    assert up.addressable_shards[0].data.shape == (2, 64, 4)
    state, summary = run((2, 2, 2, 1), 4)  # resumes from step 2 on a new mesh
    assert int(state.step) == 4 and np.isfinite(summary["final_loss"])
    up = state.params.model.layers.mlp.up_proj.weight
    assert up.addressable_shards[0].data.shape == (2, 32, 16)


@pytest.mark.slow  # a sharded MoE train step end to end
def test_moe_experts_split_over_fsdp_and_tp_and_steps_equal_one_device():
    """Expert weights ``(layers, experts, inter, hidden)`` split their hidden size over fsdp
    and their width over tp (experts over the expert axis, size 1 here); SGD steps of a
    Mixtral-style model equal the single-device run."""
    from edl.models import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
    )
    model = MixtralForCausalLM.init(config, key=jax.random.key(0))
    tx = optax.sgd(0.5)

    def run(mesh):
        state = edl.create_state(model, tx)
        step = make_train_step(_loss, tx, donate=False, mesh=mesh, rules=PARTITION_RULES)
        losses = []
        for _ in range(3):
            state, metrics = step(state, _batch())
            losses.append(float(metrics["loss"]))
        return np.array(losses), state

    ref_losses, ref = run(None)
    mesh = make_mesh((1, 4, 2, 1))
    losses, state = run(mesh)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert _max_relative(state.params, ref.params) <= 1e-5
    gate = state.params.model.layers.mlp.experts.gate_proj  # (2, 4, 48, 32)
    assert gate.sharding.spec == P(None, "expert", "tp", "fsdp")  # expert = 1 here
    assert gate.addressable_shards[0].data.shape == (2, 4, 24, 8)
    down = state.params.model.layers.mlp.experts.down_proj  # (2, 4, 32, 48)
    assert down.addressable_shards[0].data.shape == (2, 4, 8, 24)


@pytest.mark.slow  # wrapped layers on a mesh, end to end
def test_lora_and_quantized_weights_follow_the_rules():
    """QLoRA on a mesh: the quantized base's blocks split over fsdp, LoRA-wrapped dense bases
    split like plain weights, the rank-sized adapters stay whole; SGD on the adapters gives
    the single-device losses."""
    from edl.lora import apply_lora, lora_trainable
    from edl.quantize import QuantConfig, quantize

    base = apply_lora(_model(), rank=4, alpha=8, key=jax.random.key(2))
    qlora = apply_lora(
        quantize(_model(), QuantConfig("nf4", pattern=r"mlp\.")),
        rank=4,
        alpha=8,
        key=jax.random.key(2),
    )
    mesh = make_mesh((1, 4, 2, 1))
    specs = edl.tree.flatten(partition_specs(qlora, PARTITION_RULES, mesh=mesh))
    assert specs["model.layers.mlp.up_proj.base_layer.qweight"] == P(None, "fsdp", None)
    assert specs["model.layers.mlp.up_proj.base_layer.scales"] == P(None, "fsdp")
    assert specs["model.layers.self_attn.q_proj.base_layer.weight"] == P(None, "tp", "fsdp")
    assert specs["model.layers.self_attn.q_proj.lora_A.weight"] == P(None, None, None)
    placed = shard(base, PARTITION_RULES, mesh)
    q = placed.model.layers.self_attn.q_proj.base_layer.weight  # (2, 32, 32)
    assert q.addressable_shards[0].data.shape == (2, 16, 8)

    tx = optax.sgd(0.5)

    def run(mesh):
        state = edl.create_state(qlora, tx, trainable=lora_trainable)
        step = make_train_step(_loss, tx, donate=False, mesh=mesh, rules=PARTITION_RULES)
        losses = []
        for _ in range(3):
            state, metrics = step(state, _batch())
            losses.append(float(metrics["loss"]))
        return np.array(losses)

    ref = run(None)
    assert ref[-1] < ref[0]  # the adapters learn
    np.testing.assert_allclose(run(mesh), ref, rtol=1e-5)

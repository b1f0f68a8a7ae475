"""Test configuration: strict promotion, 8 host devices, runtime-checked annotations."""

import gc
import importlib
import os
import pkgutil

# Must precede the first jax import: 8 CPU devices so sharding is exercised on CPU.
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

# The ``edl`` command's persistent compilation cache stays off in tests (the commands run in
# process and in subprocesses, which inherit this): no test writes to the user's real cache,
# and no test's outcome depends on what an earlier run left there. tests/test_compile_cache.py
# turns it on in temporary directories.
os.environ["EDL_COMPILE_CACHE"] = "0"

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from jaxtyping import install_import_hook  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

# Every edl function's jaxtyping/typing annotations are checked by beartype under test: every
# module is imported here, under the hook (``import edl`` itself loads its names lazily).
# Where an optional extra is not installed (the lent GPU machine has no lm-eval), its modules
# are left out; the tests that need it skip through ``pytest.importorskip``.
_OPTIONAL_EXTRAS = {"lm_eval"}
with install_import_hook("edl", "beartype.beartype"):
    import edl

    for _module in pkgutil.walk_packages(edl.__path__, "edl."):
        try:
            importlib.import_module(_module.name)
        except ModuleNotFoundError as _missing:
            if (_missing.name or "").split(".")[0] not in _OPTIONAL_EXTRAS:
                raise

# First calls compile, so wall-clock deadlines would only measure XLA; CI replays examples
# deterministically so a failure there is reproducible from the log.
settings.register_profile(
    "edl", deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("ci", parent=settings.get_profile("edl"), derandomize=True)
# A lent GPU's run (benchmarks/device/run.sh) has about two minutes for the gpu-marked tests,
# every new shape a Triton compile: fewer examples, replayed deterministically.
settings.register_profile("device", parent=settings.get_profile("ci"), max_examples=8)
settings.load_profile(
    os.environ.get("EDL_HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "edl")
)

from edl.models.config import RunOptions  # noqa: E402  (after the hook: checked)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop jax's compiled programs after each test module: the suite compiles thousands,
    and a process that kept them all grew past 10 GB (and once crashed inside XLA)."""
    yield
    jax.clear_caches()
    gc.collect()


TINY_LLAMA = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    run=RunOptions(attention_impl="xla"),
)


@pytest.fixture(scope="session")
def tiny_llama():
    """A random 2-layer GQA Llama (``TINY_LLAMA``), shared by the LoRA and quantization
    tests: read it, never donate it."""
    from edl.models import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM.init(LlamaConfig(**TINY_LLAMA), key=jax.random.key(0))


@pytest.fixture(scope="session")
def tiny_ids():
    """``(2, 10)`` token ids for ``tiny_llama``."""
    return jax.random.randint(jax.random.key(1), (2, 10), 0, TINY_LLAMA["vocab_size"])

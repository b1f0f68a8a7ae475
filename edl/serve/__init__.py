"""Serving: a continuous-batching engine over the paged KV cache (``edl.serve.engine``) and
an OpenAI-compatible HTTP server over it (``edl.serve.server``).

``edl.serve.types`` (the engine interface: ``SamplingParams``, ``RequestOutput``,
``QueueFull``, the ``Engine`` protocol), ``edl.serve.engine`` (``Engine``: scheduler, pages,
the jitted model step), ``edl.serve.driver`` (the engine thread), ``edl.serve.protocol``
(OpenAI's request / response shapes), ``edl.text.detokenize`` (incremental text, stop
strings), ``edl.serve.server`` (``create_app``: Starlette, the ``edl-jax[serve]`` extra)::

    engine = Engine(model, max_batch=8, eos_token_ids=(2,))
    rid = engine.add_request([5, 9, 2], SamplingParams(max_tokens=16, temperature=0.0))
    while engine.has_unfinished():
        outputs = engine.step()

The names below load on first use, so ``import edl.serve`` (and ``edl serve --help``)
import no jax.
"""

from edl._lazy import lazy_attributes

_EXPORTS = {
    "Engine": "edl.serve.engine:Engine",
    **{
        name: f"edl.serve.types:{name}" for name in ("QueueFull", "RequestOutput", "SamplingParams")
    },
}

__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS)

__all__ = sorted(_EXPORTS)

"""Serving: an OpenAI-compatible HTTP server over a continuous-batching engine.

``edl.serve.types`` (the engine interface), ``edl.serve.driver`` (the engine thread),
``edl.serve.protocol`` (OpenAI's request / response shapes), ``edl.serve.detokenize``
(incremental text, stop strings), ``edl.serve.server`` (``create_app``: Starlette, the
``edl[serve]`` extra). Nothing is imported here, so ``import edl.serve`` stays light.
"""

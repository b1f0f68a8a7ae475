"""Serving: a continuous-batching engine over the paged KV cache (``edl.serve.engine``).

engine = Engine(model, max_batch=8, eos_token_ids=(2,))
rid = engine.add_request([5, 9, 2], SamplingParams(max_tokens=16, temperature=0.0))
while engine.has_unfinished():
    outputs = engine.step()
"""

from edl.serve.engine import Engine, QueueFull, RequestOutput, SamplingParams

__all__ = ["Engine", "QueueFull", "RequestOutput", "SamplingParams"]

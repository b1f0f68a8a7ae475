"""The serving engine's recurrent state slots: a model whose layers carry a state from token
to token (Qwen3-Next's Gated DeltaNet: each linear layer's conv tail and delta-rule state)
keeps, besides its keys / values in the page pools, one state slot per running request.

What the engine asks of a model (``RecurrentTrunk``, the trunk ``model.model``; no family
names): ``RECURRENT_STATE`` says it has states, ``init_states(rows)`` gives zero states (a
pytree whose every leaf has its rows on axis 1, ``(layers, rows, ...)``), ``wrap_cache(kv,
states)`` puts those rows' states beside a KV cache, and the wrapped cache's ``states`` /
``kv`` give them and the KV cache back after a call.

The slots: ``StateSlots`` holds the pool (``init_states(max_batch)``, on the device, donated
to each call like the page pools) and, on the host, which request owns which slot: a request
takes a free one when admitted (``admit``) and gives it back when it finishes or is aborted
(``release``). Each call (``state_model_step``) gathers its rows' states from their slots,
runs ``model_step``'s body with them and writes the states after the call back (padding rows
have no slot: slot ``max_batch``, out of range, read as zeros and never written). A row at
cache length 0, the first chunk of its prompt, starts from zero states whatever its slot
held, so a reused slot needs no clearing, and a request computed again from its first token
(as a preempted one would be; this engine reserves every page at admission and never
preempts) restarts from zeros. Chunked prefill carries the states across chunks: each chunk
starts from the slot the last one wrote.

What such a model cannot do in the engine, and why:

- Prefix caching: shared prompt pages hold keys / values, not the recurrent state after
  them, so a request could not start past them. ``prefix_caching`` is off for these models
  (every prompt is computed from its first token; no page is published or shared).
- Speculative decoding: rejected drafts are taken back by moving a request's ``computed``
  back, which cannot undo a state that has absorbed them; ``check_speculation`` refuses it
  (also for a draft model with recurrent state).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from edl.generate.steps import CausalLM
from edl.ops.kv_quant import QuantizedPages
from edl.serve.step import PromptLogprobs, run_model, step_cache

__all__ = ["RecurrentTrunk", "StateSlots", "check_speculation", "has_state", "state_model_step"]


@runtime_checkable
class RecurrentTrunk(Protocol):
    """A decoder trunk with recurrent states (``edl.models.qwen3_next_trunk.Qwen3NextTrunk``)."""

    RECURRENT_STATE: bool

    def init_states(self, rows: int) -> Any:
        """Zero states of ``rows`` rows: every leaf ``(layers, rows, ...)``."""
        ...

    def wrap_cache(self, kv: Any, states: Any = None) -> Any:
        """``kv`` with these rows' ``states``: a cache with ``.kv`` and ``.states``."""
        ...


def has_state(model: Any) -> bool:
    """Whether ``model`` (a causal LM) keeps recurrent states in its cache."""
    return bool(getattr(getattr(model, "model", None), "RECURRENT_STATE", False))


def check_speculation(model: CausalLM, speculative: Any, draft_model: Any) -> None:
    """Refuse speculative decoding with a model or draft model that has recurrent states
    (module docstring), naming which."""
    if speculative is None:
        return
    for role, m in (("model", model), ("draft model", draft_model)):
        if m is not None and has_state(m):
            raise ValueError(
                f"Engine: speculative decoding is not supported with a {role} with recurrent "
                f"state (model_type {m.config.model_type!r}): rejected drafts cannot be taken "
                "back out of its Gated DeltaNet states; serve it without speculative="
            )


def gather_rows(pool: Any, slots: Int[Array, " rows"], lengths: Int[Array, " rows"]) -> Any:
    """The states of slots ``slots`` (an out-of-range slot reads zeros), zero where a row's
    cache is empty (``lengths == 0``: a new prompt starts from zero states)."""

    def one(leaf: Float[Array, "layers slots *rest"]) -> Float[Array, "layers rows *rest"]:
        rows = jnp.take(leaf, slots, axis=1, mode="fill", fill_value=0)
        fresh = (lengths == 0).reshape((1, -1) + (1,) * (leaf.ndim - 2))
        return jnp.where(fresh, jnp.zeros((), leaf.dtype), rows)

    return jax.tree.map(one, pool)


def scatter_rows(pool: Any, slots: Int[Array, " rows"], states: Any) -> Any:
    """``pool`` with slot ``slots[b]`` set to row ``b`` of ``states`` (out-of-range slots,
    padding rows, dropped)."""
    return jax.tree.map(
        lambda leaf, rows: leaf.at[:, slots].set(rows.astype(leaf.dtype), mode="drop"),
        pool,
        states,
    )


@functools.partial(jax.jit, donate_argnums=(1, 2, 3), static_argnames=("logprobs", "every"))
def state_model_step(
    model: CausalLM,
    k_pages: Float[Array, "layers num_pages page_size kv_heads head_dim"],
    v_pages: Float[Array, "layers num_pages page_size kv_heads head_dim"],
    pool: Any,
    slots: Int[Array, " batch"],
    page_table: Int[Array, "batch pages"],
    lengths: Int[Array, " batch"],
    tokens: Int[Array, "batch width"],
    num_new: Int[Array, " batch"],
    targets: Int[Array, "batch width"] | None = None,
    *,
    logprobs: bool = False,
    every: bool = False,
) -> tuple[Array, Array, Any, Float[Array, "batch *width vocab"], PromptLogprobs | None]:
    """``edl.serve.step.model_step`` for a model with recurrent states: row ``b`` continues
    the states of slot ``slots[b]`` of ``pool`` (zeros at cache length 0) and writes them
    back. Returns ``(k_pages, v_pages, pool, logits, prompt log-probs)``; the pools and
    ``pool`` are donated."""
    cache = step_cache(k_pages, v_pages, page_table, lengths)
    cache = model.model.wrap_cache(cache, gather_rows(pool, slots, lengths))
    logits, extra, cache = run_model(model, cache, tokens, num_new, targets, logprobs, every)
    pool = scatter_rows(pool, slots, cache.states)
    return cache.kv.k_pages, cache.kv.v_pages, pool, logits, extra


class StateSlots:
    """The recurrent state slots of an engine of ``max_batch`` places (module docstring);
    for a model without recurrent states it holds nothing and ``run`` calls the plain
    step."""

    def __init__(self, model: CausalLM, max_batch: int) -> None:
        self.recurrent = has_state(model)
        self.max_batch = max_batch
        self.pool = model.model.init_states(max_batch) if self.recurrent else None
        self._free = list(range(max_batch - 1, -1, -1))  # pop() hands out slot 0 first
        self._owner: dict[int, int] = {}  # request id -> slot

    @property
    def num_free(self) -> int:
        return len(self._free)

    def admit(self, request_id: int) -> None:
        """A free slot for request ``request_id`` (admitted now); nothing without states."""
        if not self.recurrent:
            return
        if request_id in self._owner:
            raise ValueError(f"StateSlots: request {request_id} holds slot already")
        if not self._free:
            raise RuntimeError(f"StateSlots: all {self.max_batch} slots are taken")
        self._owner[request_id] = self._free.pop()

    def release(self, request_id: int) -> None:
        """Give request ``request_id``'s slot back (finished or aborted)."""
        if not self.recurrent:
            return
        slot = self._owner.pop(request_id, None)
        if slot is None:
            raise ValueError(f"StateSlots.release: request {request_id} holds no slot")
        self._free.append(slot)

    def slot_of(self, request_id: int) -> int:
        return self._owner[request_id]

    def slots(self, request_ids: Sequence[int], rows: int) -> np.ndarray:
        """A call's slot per row ``(rows,)``: its request's, ``max_batch`` for padding."""
        out = np.full(rows, self.max_batch, np.int32)
        out[: len(request_ids)] = [self._owner[i] for i in request_ids]
        return out

    def run(
        self,
        step: Callable[..., tuple[Any, Any, Any, Any]],
        request_ids: Sequence[int],
        model: CausalLM,
        k_pages: Array | QuantizedPages,
        v_pages: Array | QuantizedPages,
        page_table: Array,
        *args: Any,
        **options: Any,
    ) -> tuple[Any, Any, Any, Any]:
        """``step(model, k_pages, v_pages, page_table, *args, **options)`` (the engine's
        ``model_step``) for a model without states; else ``state_model_step`` over these
        requests' slots, keeping the updated pool. Returns ``model_step``'s four values."""
        if not self.recurrent:
            return step(model, k_pages, v_pages, page_table, *args, **options)
        slots = jnp.asarray(self.slots(request_ids, page_table.shape[0]))
        k, v, self.pool, logits, extra = state_model_step(
            model, k_pages, v_pages, self.pool, slots, page_table, *args, **options
        )
        return k, v, logits, extra

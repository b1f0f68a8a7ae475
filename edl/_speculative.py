"""``SpeculativeConfig``: how speculative decoding drafts, for ``generate`` and the serving
engine alike (``edl.generate.speculative``, ``edl.serve.speculation``).

Declared here, with no jax, so that ``edl serve --help`` lists its options as flags before
jax is imported; ``edl.generate`` exports it (``edl.generate.SpeculativeConfig``).
"""

from __future__ import annotations

import dataclasses

from edl._settings import ConfigError, Registered, check_options, option

__all__ = ["SpeculativeConfig"]


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """How ``generate(..., speculative=...)`` and ``edl.serve.Engine(...,
    speculative=...)`` draft. Hashable: a static argument of the compiled loop. The draft
    model itself (``method="draft"``) is ``generate``'s ``draft_model`` argument, an array
    pytree. Options (``edl._settings``): ``edl serve``'s flags derive from them
    (``--speculative-method``, ``--num-speculative-tokens``, ``--prompt-lookup-min`` /
    ``--prompt-lookup-max``)."""

    method: str = option(
        "ngram",
        "how tokens are drafted: ngram (prompt lookup) or draft (a smaller model)",
        name="speculative_method",
        registry=Registered("edl.generate.proposers:PROPOSERS"),
    )
    num_speculative_tokens: int = option(
        4, "tokens drafted per row and verified in one target forward", low=1, high=64
    )
    prompt_lookup_max: int = option(3, "ngram: the longest n-gram matched", low=1)
    prompt_lookup_min: int = option(1, "ngram: the shortest n-gram matched", low=1)

    def __post_init__(self) -> None:
        check_options(self)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(
                f"SpeculativeConfig: prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )

"""``MeshSpec``: a mesh's shape as ``edl train --mesh`` and ``edl.sharding.make_mesh`` take
it, parsed with no jax (so that option errors answer before jax is imported).

``"DP,FSDP,TP,SP[,EXPERT]"`` sizes the ``(dp, fsdp, tp, sp, expert)`` axes over the fast
links of one slice (ICI on TPUs, NVLink within a GPU host); one may be -1 (the devices left).
The fifth size, expert parallelism (``edl.ops.expert_parallel``), may be left out: four sizes
mean expert = 1. An optional ``"/DCN"`` part sizes the same axes across slices (the
data-centre network, DCN; on GPUs and CPUs, processes): four or five sizes, or one number N,
shorthand for ``N,1,1,1,1`` (data
parallelism across slices: the axis whose collectives, one gradient all-reduce per step,
tolerate the slowest links). The mesh's size on each axis is the product of its two parts::

    "1,-1,1,1"       FSDP over every device
    "1,-1,1,1/2"     FSDP within each of 2 slices, data parallel across them
    "1,4,2,1/2,1,1,1" the same, written out, with 4-way FSDP and 2-way TP in a slice
    "1,2,1,1,4"      4-way expert parallelism, 2-way FSDP
"""

from __future__ import annotations

import dataclasses

__all__ = ["MeshSpec"]

AXIS_COUNT = 5  # dp, fsdp, tp, sp, expert
OLD_COUNT = 4  # the form before the expert axis: expert = 1
SIZES = (OLD_COUNT, AXIS_COUNT)


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """``ici``: per-axis sizes within a slice (one may be -1); ``dcn``: per-axis numbers of
    slices (``None``: one slice, a plain mesh). Four sizes mean expert = 1
    (``edl.sharding.make_mesh`` appends it)."""

    ici: tuple[int, ...]
    dcn: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        ici, dcn = self.ici, self.dcn
        if len(ici) not in SIZES or any(d == 0 or d < -1 for d in ici) or ici.count(-1) > 1:
            raise ValueError(
                f"mesh sizes must be DP,FSDP,TP,SP[,EXPERT]: four sizes >= 1 (five with "
                f"EXPERT), one of them may be -1, got {ici}"
            )
        if dcn is not None and (len(dcn) not in SIZES or any(d < 1 for d in dcn)):
            raise ValueError(
                f"mesh slice counts (after '/') must be one number or four sizes >= 1 (five "
                f"with EXPERT), got {dcn}"
            )

    @classmethod
    def parse(cls, spec: str) -> MeshSpec:
        """``"DP,FSDP,TP,SP[,EXPERT][/DCN]"`` (module docstring); ``ValueError`` quotes
        ``spec``."""
        ici_text, slash, dcn_text = spec.partition("/")
        try:
            ici = tuple(int(p) for p in ici_text.split(","))
            dcn = tuple(int(p) for p in dcn_text.split(",")) if slash else None
            if dcn is not None and len(dcn) == 1:
                dcn = (dcn[0],) + (1,) * (OLD_COUNT - 1)
            return cls(ici, dcn)
        except ValueError as e:
            raise ValueError(
                f"mesh {spec!r}: expected DP,FSDP,TP,SP[,EXPERT] (one may be -1), optionally "
                f"followed by /SLICES or /DP,FSDP,TP,SP[,EXPERT] across slices ({e})"
            ) from None

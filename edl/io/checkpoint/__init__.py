"""Training checkpoints: a train state's files (``train_state``: ``save_state`` /
``load_state``), a run's ``checkpoint-N`` directories and what a checkpoint's ``state.json``
says (``directory``: listing, atomic replacement, pruning, ``verify_checkpoint``, the files
a ``state.json`` may name, ``read_manifest``)
the multi-process layout (``sharded``: each process's pieces; ``shard_index``: their
``shards.json``) and a LoRA model's adapter-only checkpoints (``adapter_only``: the
adapters and a reference to the base, ``save_state(..., base=)``).

The checkpoint layer of ``edl.io``: it builds on the model files (``edl.io.model_files``)
and the formats (``edl.io.formats``), and ``edl.io.export`` builds on it."""

from edl.io.checkpoint.directory import (
    STATE_NAME,
    latest_checkpoint,
    list_checkpoints,
    read_manifest,
    verify_checkpoint,
)
from edl.io.checkpoint.train_state import FORMAT, load_state, save_state

__all__ = [
    "FORMAT",
    "STATE_NAME",
    "latest_checkpoint",
    "list_checkpoints",
    "load_state",
    "read_manifest",
    "save_state",
    "verify_checkpoint",
]

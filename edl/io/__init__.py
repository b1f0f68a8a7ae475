"""Files on disk: Hugging Face safetensors checkpoints, configs and the hub, training
checkpoints, PEFT adapters, and exports of checkpoints as plain Hugging Face directories."""

from edl.io import checkpoint, export, hf, model_files, peft, safetensors, structure
from edl.io.hf import (
    export_state_dict,
    from_pretrained,
    from_state_dict,
    push_to_hub,
    save_pretrained,
    to_torch,
)

__all__ = [
    "checkpoint",
    "export",
    "export_state_dict",
    "from_pretrained",
    "from_state_dict",
    "hf",
    "model_files",
    "peft",
    "push_to_hub",
    "safetensors",
    "save_pretrained",
    "structure",
    "to_torch",
]

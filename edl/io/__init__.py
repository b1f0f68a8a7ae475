"""Files on disk: Hugging Face safetensors checkpoints, configs and the hub."""

from edl.io import checkpoint, hf, safetensors
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
    "export_state_dict",
    "from_pretrained",
    "from_state_dict",
    "hf",
    "push_to_hub",
    "safetensors",
    "save_pretrained",
    "to_torch",
]

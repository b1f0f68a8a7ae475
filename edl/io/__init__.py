"""Files on disk: Hugging Face safetensors checkpoints, configs and the hub, training
checkpoints and PEFT adapters."""

from edl.io import checkpoint, hf, peft, safetensors
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
    "peft",
    "push_to_hub",
    "safetensors",
    "save_pretrained",
    "to_torch",
]

"""Files on disk, in layers (each imports only those before it, ``tests/test_layers.py``):

- ``edl.io.formats``: safetensors, Hugging Face model directories (``hf``), PEFT adapters
  (``peft``), the load plan, the model ``manifest`` the writers take, and ``base_ref``: the
  base model an adapter-only checkpoint points at (path or repo id, sha256 of its weights);
- ``edl.io.model_files``: a model's files as checkpoints and exports hold them (LoRA
  adapters as PEFT's embedded adapter, quantized codes aside);
- ``edl.io.checkpoint``: training checkpoints (``save_state`` / ``load_state``), sharded
  across processes or not, a LoRA model's adapter-only (``adapter_only``);
- ``edl.io.export``: ``load_model`` of any edl model directory (an adapter-only checkpoint's
  base found and checked), ``load_base``, ``export_model`` to a plain Hugging Face
  directory.
"""

from edl.io import checkpoint, export, model_files
from edl.io.formats import hf, manifest, peft, safetensors
from edl.io.formats.hf import (
    export_state_dict,
    from_pretrained,
    from_state_dict,
    push_to_hub,
    save_pretrained,
    to_torch,
)
from edl.io.formats.manifest import Manifest, describe

__all__ = [
    "Manifest",
    "checkpoint",
    "describe",
    "export",
    "export_state_dict",
    "from_pretrained",
    "from_state_dict",
    "hf",
    "manifest",
    "model_files",
    "peft",
    "push_to_hub",
    "safetensors",
    "save_pretrained",
    "to_torch",
]

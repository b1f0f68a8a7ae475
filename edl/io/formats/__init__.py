"""The file formats edl reads and writes, and the model descriptions they carry: atomic
writes and JSON (``files``), safetensors (``safetensors``), the one load path from named
tensors into a model's arrays (``plan``), Hugging Face model directories (``hf``), PEFT
adapters (``peft``), a model's LoRA / quantized layers (``structure``), what a model is
(``manifest``: family, task, architecture, config, layer structure) and the base model an
adapter-only checkpoint was trained on (``base_ref``: where, and the sha256 of its weights).

The bottom layer of ``edl.io``: nothing here imports the model files, checkpoints or
exports built on it (``tests/test_layers.py``)."""

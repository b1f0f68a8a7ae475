"""The fine-tune tutorial's commands (docs/tutorials/finetune.md, "finetune-commands"), run as
written on a small model.

The test builds what a researcher downloads: a Llama-architecture model directory with a
byte-level BPE tokenizer trained here by the `tokenizers` library and a ChatML chat template,
and a chat JSONL file. Only the block's ``MODEL=`` line is changed (to that directory).
Then transformers is the oracle: it loads the exported directory and the run's checkpoints,
and its greedy tokens equal what ``edl generate`` printed for the export.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "docs" / "tutorials" / "finetune.md"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATIONS = [
    [("What is the capital of France?", "Paris is the capital of France.")],
    [("How do I add two numbers in Python?", "Use the plus operator: a + b.")],
    [("Say hello.", "Hello! How can I help you today?")],
]


def _commands() -> str:
    block = re.search(
        r"<!-- finetune-commands -->\n```bash\n(.*?)\n```\n<!-- /finetune-commands -->",
        TUTORIAL.read_text(),
        flags=re.S,
    )
    assert block is not None, f"{TUTORIAL} has no finetune-commands block"
    return block.group(1)


def _build_model(directory: Path, hidden_size: int = 64, intermediate_size: int = 128) -> None:
    """A 2-layer Llama (random weights) with a BPE tokenizer trained on the conversations."""
    import jax
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    import edl
    from edl.models import LlamaConfig, LlamaForCausalLM

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    texts = [t for c in CONVERSATIONS for turn in c for t in turn]
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(texts * 8, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = CHATML
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
    )
    edl.save_pretrained(LlamaForCausalLM.init(config, key=jax.random.key(0)), directory)
    tokenizer.save_pretrained(directory)
    generation = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    (directory / "generation_config.json").write_text(json.dumps(generation))


def _write_chats(path: Path) -> None:
    with path.open("w") as f:
        for i in range(24):
            user, assistant = CONVERSATIONS[i % len(CONVERSATIONS)][0]
            messages = [
                {"role": "user", "content": user},
                {"role": "assistant", "content": assistant},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")


def _run(script: str, cwd: Path) -> str:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, f"{script}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    return done.stdout


@pytest.mark.slow  # three CLI runs that each compile a model (~2 minutes)
def test_readme_finetune_commands_train_generate_and_export(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _build_model(tmp_path / "model")
    _write_chats(tmp_path / "chat.jsonl")
    commands = _commands()
    model_line = re.search(r"^MODEL=.*$", commands, flags=re.M)
    assert model_line is not None, "the tutorial's block sets MODEL="
    script = commands.replace(model_line.group(0), f"MODEL={tmp_path / 'model'}")
    out = _run(script, tmp_path)
    results = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert results["end_step"] == 60 and results["final_loss"] < results["first_loss"]

    # Every checkpoint loads in transformers, tokenizer included.
    checkpoints = sorted((tmp_path / "runs/sft/checkpoints").glob("checkpoint-*"))
    assert [c.name for c in checkpoints] == ["checkpoint-00000030", "checkpoint-00000060"]
    for checkpoint in checkpoints:
        assert AutoTokenizer.from_pretrained(checkpoint).chat_template == CHATML

    # The export: transformers' greedy reply equals `edl generate`'s on it.
    exported = tmp_path / "exported"
    tokenizer = AutoTokenizer.from_pretrained(exported)
    model = AutoModelForCausalLM.from_pretrained(exported)
    prompt = "What is the capital of France?"
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    generated = model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1] :]
    expected = tokenizer.decode(generated, skip_special_tokens=True)
    printed = _run(
        f"edl generate --model exported --chat --prompt {prompt!r} --max-new-tokens 24", tmp_path
    )
    assert expected.strip() and printed.strip() == expected.strip()

    # The run's newest checkpoint itself (the PEFT adapter alone, its base_model_name_or_path
    # the base's absolute path) in transformers + peft: its greedy reply equals `edl generate
    # --model runs/sft`'s.
    assert not list(checkpoints[-1].glob("model*.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(checkpoints[-1])
    generated = model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1] :]
    expected = tokenizer.decode(generated, skip_special_tokens=True)
    printed = _run(
        f"edl generate --model runs/sft --chat --prompt {prompt!r} --max-new-tokens 24", tmp_path
    )
    assert expected.strip() and printed.strip() == expected.strip()


def _json_line(out: str) -> dict:
    return json.loads(next(line for line in out.splitlines() if line.startswith("{")))


@pytest.mark.slow  # four small CLI runs, each compiling a train step (~2 minutes)
def test_finetune_options_qlora_bf16_completion_resume_and_full(tmp_path, capsys):
    """The flags the tutorial names but does not run: QLoRA (nf4) with bfloat16 compute on
    prompt / completion records without packing, resumed; full fine-tuning in bfloat16."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    import edl
    from edl.cli import main

    _build_model(tmp_path / "model")
    data = tmp_path / "pairs.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": u + " ", "completion": a}) + "\n"
            for c in CONVERSATIONS
            for u, a in c
        )
        * 4
    )
    run = tmp_path / "qlora"
    common = [
        "train",
        "--model",
        str(tmp_path / "model"),
        "--data",
        str(data),
        "--format",
        "completion",
        "--batch-size",
        "2",
        "--seq-len",
        "64",
        "--save-every",
        "1",
        "--output-dir",
        str(run),
    ]
    qlora = ["--lora-rank", "4", "--quantize", "nf4", "--compute-dtype", "bfloat16", "--no-packing"]
    main([*common, *qlora, "--steps", "2"])
    assert _json_line(capsys.readouterr().out)["end_step"] == 2
    main([*common, *qlora, "--steps", "3", "--resume"])
    resumed = _json_line(capsys.readouterr().out)
    assert (resumed["start_step"], resumed["end_step"]) == (2, 3)
    info = json.loads((run / "checkpoints/checkpoint-00000003/state.json").read_text())
    assert info["layers"]["model.layers.self_attn.q_proj"]["lora"]["rank"] == 4

    main(["export", str(run), str(tmp_path / "merged"), "--merge-lora"])
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    ids = np.arange(3, 19)[None]
    with torch.no_grad():
        want = hf(torch.tensor(ids)).logits.numpy()
    got = edl.from_pretrained(tmp_path / "merged")(jnp.asarray(ids, jnp.int32)).logits
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4)
    # The QLoRA checkpoints hold the adapters and a reference to the unquantized base, no
    # codes (derived from the base again on resume and load). Exported without
    # --merge-lora (the dequantized base, the adapter beside it) it is the same model in
    # transformers + peft.
    last = run / "checkpoints/checkpoint-00000003"
    assert not list(last.glob("model*.safetensors")) and not list(last.glob("quantized*"))
    assert info["base"]["quantization"]["format"] == "nf4"
    main(["export", str(run), str(tmp_path / "adapter")])
    checkpoint = AutoModelForCausalLM.from_pretrained(tmp_path / "adapter")
    with torch.no_grad():
        np.testing.assert_allclose(checkpoint(torch.tensor(ids)).logits.numpy(), want, atol=1e-4)

    main(
        [
            "train",
            "--model",
            str(tmp_path / "model"),
            "--data",
            str(data),
            "--format",
            "completion",
            "--param-dtype",
            "bfloat16",
            "--steps",
            "1",
            "--batch-size",
            "2",
            "--seq-len",
            "64",
            "--output-dir",
            str(tmp_path / "full"),
        ]
    )
    assert _json_line(capsys.readouterr().out)["end_step"] == 1
    full = edl.from_pretrained(tmp_path / "full/checkpoints/checkpoint-00000001")
    floats = [x for x in jax.tree.leaves(full) if eqx.is_array(x)]
    assert {x.dtype for x in floats} == {jnp.dtype(jnp.bfloat16)}

"""lm-eval's wall time with the model "edl" and with its own hf backend, on one model and task.

A random Llama (``--hidden``, ``--layers``; vocabulary of a byte-level BPE trained here) is
saved as a model directory that both backends load; the task is ``--questions``
four-choice questions over a local JSON Lines file. Each round runs lm-eval's
``simple_evaluate`` once per backend (model loading included), the backends interleaved;
edl's first run, which compiles its programs, is reported apart. Both must give the same
acc and acc_norm (checked).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

_TEXT = (
    "the a of to and in is was for on that with as by at from it be are this an which or "
    "have not had but were one all their there been has when who will more no if out so "
    "said what up its about into than them can only other new some could time these two may "
    "then do first any my now such like our over man me even most made after also did many"
)
WORDS = _TEXT.split()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256, help="model width (default: 256)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default: 4)")
    parser.add_argument(
        "--questions", type=int, default=200, help="multiple-choice questions (default: 200)"
    )
    parser.add_argument("--batch-size", type=int, default=16, help="rows per batch (default: 16)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (default: 3)")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch's intra-op threads for the hf backend (default: torch's own choice)",
    )
    return parser


def _setup(root: Path, hidden: int, layers: int, questions: int) -> None:
    """The model directory (``root/model``) and the task (``root/tasks``)."""
    import jax
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from edl.io.formats.hf import save_pretrained
    from edl.models import LlamaConfig, LlamaForCausalLM
    from edl.text import load_tokenizer

    rng = np.random.default_rng(0)
    sentence = lambda n: " ".join(rng.choice(WORDS, n))
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator([sentence(40) for _ in range(400)], trainer)
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    model_dir = root / "model"
    fast.save_pretrained(model_dir)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=512,
    )
    model = LlamaForCausalLM.init(config, key=jax.random.key(0))
    save_pretrained(model, model_dir, tokenizer=load_tokenizer(model_dir))
    rows = [
        {
            "question": f"{sentence(int(rng.integers(20, 60)))}?",
            "choices": [sentence(int(rng.integers(2, 12))) for _ in range(4)],
            "answer": int(rng.integers(4)),
        }
        for _ in range(questions)
    ]
    data = root / "mc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (root / "tasks").mkdir()
    (root / "tasks" / "mc.yaml").write_text(
        f"task: bench_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        'test_split: test\noutput_type: multiple_choice\ndoc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n",
        encoding="utf-8",
    )


def main() -> None:
    args = build_parser().parse_args()
    import lm_eval
    import torch

    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)

    from edl.eval.run import task_manager

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _setup(root, args.hidden, args.layers, args.questions)
        manager = task_manager(root / "tasks", ["bench_mc"])
        backends = {
            "hf": {"pretrained": str(root / "model"), "dtype": "float32", "device": "cpu"},
            "edl": {"pretrained": str(root / "model")},
        }
        times: dict[str, list[float]] = {"hf": [], "edl": []}
        cpu: dict[str, list[float]] = {"hf": [], "edl": []}
        accs: dict[str, set] = {"hf": set(), "edl": set()}
        for _ in range(args.rounds + 1):  # edl's first run compiles: reported apart
            for name, model_args in backends.items():
                start, start_cpu = time.perf_counter(), time.process_time()
                out = lm_eval.simple_evaluate(
                    model=name,
                    model_args=model_args,
                    tasks=["bench_mc"],
                    task_manager=manager,
                    batch_size=args.batch_size,
                    log_samples=False,
                )
                times[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
                result = out["results"]["bench_mc"]
                accs[name].add((result["acc,none"], result["acc_norm,none"]))
    assert accs["hf"] == accs["edl"] and len(accs["hf"]) == 1, accs
    threads = torch.get_num_threads()
    print(f"{args.questions * 4} loglikelihood requests, batch {args.batch_size}, torch {threads}")
    for what, seconds in (("wall", times), ("CPU", cpu)):
        hf, edl = statistics.median(seconds["hf"]), statistics.median(seconds["edl"][1:])
        print(
            f"{what} s: hf median {hf:.2f} {_shown(seconds['hf'])}, edl first run "
            f"{seconds['edl'][0]:.2f} (compiles), edl median {edl:.2f} "
            f"{_shown(seconds['edl'][1:])}; edl / hf {edl / hf:.2f}x"
        )
    print(f"acc, acc_norm {accs['hf'].pop()} on both")


def _shown(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.1f}" for v in values) + "]"


if __name__ == "__main__":
    main()

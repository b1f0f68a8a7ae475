"""edl.eval: lm-evaluation-harness's model ``"edl"`` against lm-eval's own ``hf`` backend,
``edl eval``, ``python -m edl.eval`` and the ``LMEval`` train callback.

No network: the model is a random 2-layer Llama over a byte-level BPE trained here (as in
test_text_generate.py), saved as a model directory that both backends load; the tasks are
YAMLs over local JSON Lines files (``dataset_path: json``). Every expectation is lm-eval's
``hf`` backend's answer (or transformers' log-softmax) on the same files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
lm_eval = pytest.importorskip("lm_eval")

import edl  # noqa: E402
from edl.cli import main  # noqa: E402
from edl.eval import callback as callback_module  # noqa: E402
from edl.eval.callback import LMEval  # noqa: E402
from edl.eval.lm import EdlLM  # noqa: E402
from edl.eval.run import evaluate, task_manager, task_metrics  # noqa: E402
from edl.eval.scoring import IGNORE, Request, batches, score_requests  # noqa: E402
from edl.io.formats.hf import save_pretrained  # noqa: E402
from edl.models import LlamaConfig, LlamaForCausalLM  # noqa: E402
from edl.text import load_tokenizer  # noqa: E402
from edl.train import RunConfig, make_train_step, train  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CORPUS = [
    "The capital of France is Paris.",
    "Two plus two is four.",
    "The sky is blue and the grass is green.",
    "Cats and dogs are animals.",
]
TASKS = ("edl_tiny_mc", "edl_tiny_ppl", "edl_tiny_gen")
TASK_YAMLS = {
    "mc": """\
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
  - metric: acc_norm
""",
    "ppl": """\
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""",
    "gen": """\
output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["."]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
""",
}


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _tokenizer(path: Path) -> None:
    """A byte-level BPE whose default encoding prepends ``<s>`` (as Llama's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(CORPUS * 4, trainer)
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(path)


def _model(vocab_size: int, seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,  # the rolling task's documents span several windows
    )
    return LlamaForCausalLM.init(config, key=jax.random.key(seed))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model")
    _tokenizer(path)
    tokenizer = load_tokenizer(path)
    save_pretrained(_model(len(tokenizer.hf)), path, tokenizer=tokenizer)
    return path


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    """Three tasks over local JSON Lines: multiple choice (choices differing per question),
    perplexity over documents longer than the model's 64 tokens, and greedy generation."""
    root = tmp_path_factory.mktemp("tasks")
    rng = np.random.default_rng(0)
    words = " ".join(CORPUS).replace(".", "").split()
    mc = [
        {
            "question": f"Question {i}: {' '.join(rng.choice(words, 4))}?",
            "choices": [" ".join(rng.choice(words, int(n))) for n in rng.integers(1, 4, 4)],
            "answer": int(rng.integers(4)),
        }
        for i in range(8)
    ]
    ppl = [{"text": " ".join(CORPUS[i:] + CORPUS * (i + 2))} for i in range(3)]
    gen = [{"question": c[:12], "answer": c[12:]} for c in CORPUS]
    for name, rows in (("mc", mc), ("ppl", ppl), ("gen", gen)):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        head = (
            f"task: edl_tiny_{name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {data}\ntest_split: test\n"
        )
        (root / f"{name}.yaml").write_text(head + TASK_YAMLS[name], encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def both(model_dir, task_dir) -> dict[str, dict]:
    """lm-eval's results (with samples) for ``hf`` and ``edl`` on the three tasks."""
    manager = task_manager(task_dir, TASKS)
    out = {}
    for backend, args in (
        ("hf", {"pretrained": str(model_dir), "dtype": "float32", "device": "cpu"}),
        ("edl", {"pretrained": str(model_dir)}),
    ):
        out[backend] = lm_eval.simple_evaluate(
            model=backend, model_args=args, tasks=list(TASKS), task_manager=manager, batch_size=4
        )
    return out


def _responses(results: dict, task: str) -> list:
    return [s["resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


# The three hf-parity tests share one run of each backend over the three tasks: ~15 s on a
# quiet 2-core machine, ~35 s on a busy one.
@pytest.mark.slow
def test_multiple_choice_equals_the_hf_backend(both):
    """acc / acc_norm equal; each choice's log-likelihood within 1e-4, is_greedy equal."""
    hf, edl_ = both["hf"]["results"]["edl_tiny_mc"], both["edl"]["results"]["edl_tiny_mc"]
    assert (edl_["acc,none"], edl_["acc_norm,none"]) == (hf["acc,none"], hf["acc_norm,none"])
    hf_resps = _responses(both["hf"], "edl_tiny_mc")
    edl_resps = _responses(both["edl"], "edl_tiny_mc")
    assert len(hf_resps) == len(edl_resps) == 8
    for hf_doc, edl_doc in zip(hf_resps, edl_resps, strict=True):
        for [(hf_ll, hf_greedy)], [(ll, greedy)] in zip(hf_doc, edl_doc, strict=True):
            assert abs(ll - hf_ll) < 1e-4 and greedy == hf_greedy


@pytest.mark.slow
def test_loglikelihood_rolling_equals_the_hf_backend(both):
    """Documents spanning several 64-token windows: each document's total within float32
    rounding of its sum, the perplexities equal to 1e-6 (relative)."""
    for [hf_ll], [ll] in zip(
        _responses(both["hf"], "edl_tiny_ppl"), _responses(both["edl"], "edl_tiny_ppl"), strict=True
    ):
        assert ll == pytest.approx(hf_ll, rel=1e-6)
    hf, edl_ = both["hf"]["results"]["edl_tiny_ppl"], both["edl"]["results"]["edl_tiny_ppl"]
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert edl_[metric] == pytest.approx(hf[metric], rel=1e-6)


@pytest.mark.slow
def test_generate_until_equals_hf_greedy(both):
    hf_texts = _responses(both["hf"], "edl_tiny_gen")
    assert _responses(both["edl"], "edl_tiny_gen") == hf_texts
    assert any(t[0] for t in hf_texts)  # something was generated


def test_scores_equal_transformers_log_softmax_and_greedy(model_dir):
    """Per-token log-probabilities of continuations (two widths, a padded batch) against
    transformers' float32 log-softmax; a continuation that is the argmax is greedy."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 200, n).tolist() for n in (5, 19, 30)]
    with torch.no_grad():
        logps = [torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1) for p in prompts]
    greedy_next = [int(lp[-2].argmax()) for lp in logps]
    requests = [Request((*p[:-1], g), 1) for p, g in zip(prompts, greedy_next, strict=True)]
    requests += [Request(tuple(p), 4) for p in prompts]
    lm = EdlLM(pretrained=str(model_dir), batch_size=4)
    scores = score_requests(lm.model, requests, batch_size=4, max_length=64)
    for i, (p, lp) in enumerate(zip(prompts, logps, strict=True)):
        expected = [float(lp[t - 1, p[t]]) for t in range(len(p) - 4, len(p))]
        assert np.allclose(scores[3 + i].token_logprobs, expected, atol=1e-5)
        assert scores[3 + i].logprob == pytest.approx(sum(expected), abs=1e-4)
        assert scores[i].is_greedy
        assert scores[i].logprob == pytest.approx(float(lp[-2].max()), abs=1e-5)


def test_batches_sort_longest_first_and_pad_to_few_widths():
    requests = [Request(tuple(range(1, n + 1)), 2) for n in (3, 40, 17, 9, 21)]
    out = list(batches(requests, 2, max_length=64))
    assert [indices for indices, _, _ in out] == [[1, 4], [2, 3], [0]]
    assert [tokens.shape for _, tokens, _ in out] == [(2, 48), (2, 16), (2, 16)]
    _, tokens, targets = out[0]
    assert tokens[0, :39].tolist() == list(range(1, 40)) and not tokens[0, 39:].any()
    assert targets[0, 37:39].tolist() == [39, 40]
    assert (targets[0, :37] == IGNORE).all() and (targets[0, 39:] == IGNORE).all()
    assert (out[2][2][1] == IGNORE).all()  # the filler row scores nothing
    # The width never exceeds max_length (17 tokens: 16 inputs fit exactly).
    assert [t.shape[1] for _, t, _ in batches([Request(tuple(range(17)), 1)], 1, 16)] == [16]


def test_generate_until_stops_when_every_row_has_hit_a_stop_string(model_dir, monkeypatch):
    """The stream ends at the step where the last row's text first holds a stop string
    (not after max_gen_toks), and each text is what the whole generation cut there gives."""
    from lm_eval.api.instance import Instance

    from edl.eval import lm as lm_module

    steps = []
    real_stream = lm_module.generate_stream

    def counted(*args, **kwargs):
        for tokens in real_stream(*args, **kwargs):
            steps.append(tokens)
            yield tokens

    monkeypatch.setattr(lm_module, "generate_stream", counted)
    lm = EdlLM(pretrained=str(model_dir), batch_size=2)
    contexts = ["The sky is", "Two plus"]

    def ask(until: list[str]) -> list[str]:
        kwargs = {"until": until, "max_gen_toks": 12, "do_sample": False}
        requests = [Instance("generate_until", {}, (c, kwargs), i) for i, c in enumerate(contexts)]
        steps.clear()
        return lm.generate_until(requests, disable_tqdm=True)

    whole = ask([])  # only EOS ends a row: the random model never emits it here
    assert len(steps) == 12 and all(len(t) >= 6 for t in whole)
    stops = [whole[0][2:4], whole[1][4:6]]  # text each row produces a few tokens in
    cut = ask(stops)
    assert len(steps) < 12
    assert cut == [w.split(stops[0])[0].split(stops[1])[0] for w in whole]


def test_unsupported_generation_settings_and_batch_sizes_are_refused_by_name(model_dir):
    lm = EdlLM(pretrained=str(model_dir))
    with pytest.raises(ValueError, match=r"\['num_beams'\]"):
        lm._settings({"until": ["."], "num_beams": 4})
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 'auto'"):
        EdlLM(pretrained=str(model_dir), batch_size="auto")
    with pytest.raises(ValueError, match="pretrained=DIR, or model= and tokenizer="):
        EdlLM()


def test_edl_eval_writes_lm_evals_results(model_dir, task_dir, tmp_path, capsys):
    """The table on stdout and the results JSON, equal to lm-eval's on an in-memory EdlLM."""
    out = tmp_path / "results.json"
    main(
        [
            "eval",
            "--model",
            str(model_dir),
            "--tasks",
            "edl_tiny_mc",
            "--include-path",
            str(task_dir),
            "--batch-size",
            "4",
            "--limit",
            "4",
            "--output",
            str(out),
        ]
    )
    written = json.loads(out.read_text(encoding="utf-8"))["results"]["edl_tiny_mc"]
    lm = EdlLM(model=edl.from_pretrained(model_dir), tokenizer=load_tokenizer(model_dir))
    manager = task_manager(task_dir, ["edl_tiny_mc"])
    results = evaluate(lm, ["edl_tiny_mc"], manager=manager, limit=4)
    expected = results["results"]["edl_tiny_mc"]
    assert written["acc,none"] == expected["acc,none"]
    assert written["acc_norm,none"] == expected["acc_norm,none"]
    assert "|edl_tiny_mc" in capsys.readouterr().out  # lm-eval's table
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]  # no temporary left


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tasks", " , "], "argument --tasks: no task names given"),
        (["--tasks", "x", "--batch-size", "0"], "argument --batch-size: must be >= 1, got 0"),
        (["--tasks", "x", "--limit", "0"], "argument --limit: must be > 0, got 0.0"),
        (["--tasks", "x", "--include-path", "/nonexistent"], "/nonexistent is not a directory"),
    ],
)
def test_edl_eval_checks_its_options_first(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["eval", "--model", "/nonexistent", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_an_unknown_task_is_named(model_dir, task_dir):
    lm = EdlLM(pretrained=str(model_dir))
    manager = task_manager(task_dir, ["edl_tiny_mc"])  # the local tasks alone: no 15k index
    with pytest.raises(ValueError, match=r"unknown task\(s\) \['nope_task'\]"):
        evaluate(lm, ["edl_tiny_mc", "nope_task"], manager=manager)


@pytest.mark.slow  # ~40 s: a fresh process importing lm-eval and indexing its 15k tasks
def test_python_m_edl_eval_is_lm_evals_cli_with_model_edl(model_dir, task_dir, both, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_DATASETS_OFFLINE": "1"}
    args = ["--model", "edl", "--model_args", f"pretrained={model_dir}", "--tasks"]
    args += ["edl_tiny_mc", "--include_path", str(task_dir), "--batch_size", "4"]
    args += ["--output_path", str(tmp_path / "out")]
    done = subprocess.run(
        [sys.executable, "-m", "edl.eval", *args], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (written,) = (tmp_path / "out").rglob("results_*.json")
    acc = json.loads(written.read_text())["results"]["edl_tiny_mc"]["acc,none"]
    assert acc == both["edl"]["results"]["edl_tiny_mc"]["acc,none"]


@pytest.mark.slow  # ~10 s: a train step compiled, three lm-eval runs
def test_lm_eval_callback_scores_the_live_params_every_n_steps(
    model_dir, task_dir, tmp_path, monkeypatch
):
    """Metrics at steps 2 and 3 (the last) only; the model scored holds the state's own
    arrays (no copy); the values are lm-eval's on the trained parameters."""
    tokenizer = load_tokenizer(model_dir)
    model = edl.from_pretrained(model_dir)
    tx = optax.sgd(0.5)
    loss_fn = lambda m, b: m.compute_loss(b["input_ids"])
    ids = np.asarray(tokenizer.hf(CORPUS[2] * 2)["input_ids"][:16], np.int32)[None]
    data = iter([{"input_ids": ids}] * 3)
    seen = []
    real_evaluate = callback_module.evaluate

    def spying(lm, tasks, **kw):
        state = seen_states[-1]
        leaves = jax.tree.leaves(lm.model)
        own = jax.tree.leaves(edl.merge(state.params, state.other))
        seen.append(all(a is b for a, b in zip(leaves, own, strict=True)))
        return real_evaluate(lm, tasks, **kw)

    seen_states = []
    real_metrics = LMEval.metrics

    def metrics(self, info):
        seen_states.append(info.state)
        return real_metrics(self, info)

    monkeypatch.setattr(callback_module, "evaluate", spying)
    monkeypatch.setattr(LMEval, "metrics", metrics)
    evaluator = LMEval(tokenizer, ["edl_tiny_mc"], every=2, include_path=task_dir, batch_size=4)
    state, _ = train(
        edl.create_state(model, tx),
        make_train_step(loss_fn, tx),
        data,
        RunConfig.from_options({"steps": 3, "output_dir": tmp_path, "progress": False}),
        callbacks=[evaluator],
    )
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [("lm_eval/edl_tiny_mc/acc" in m) for m in lines] == [False, True, True]
    assert seen == [True, True]
    final = EdlLM(model=edl.merge(state.params, state.other), tokenizer=tokenizer, batch_size=4)
    expected = task_metrics(
        evaluate(final, ["edl_tiny_mc"], manager=task_manager(task_dir, ["edl_tiny_mc"])),
        prefix="lm_eval/",
    )
    assert expected == {k: v for k, v in lines[2].items() if k.startswith("lm_eval/")}
    assert set(expected) == {"lm_eval/edl_tiny_mc/acc", "lm_eval/edl_tiny_mc/acc_norm"}


def _served(model_dir: Path):
    """``edl serve``'s app over the real engine for ``model_dir`` on a free loopback port:
    a generator that yields the port and stops the server when closed."""
    uvicorn = pytest.importorskip("uvicorn")
    from edl.serve import Engine
    from edl.serve.server import create_app

    tokenizer = load_tokenizer(model_dir)
    engine = Engine(edl.from_pretrained(model_dir), max_batch=8, max_model_len=64, page_size=8)
    app = create_app(
        engine, tokenizer, model_name="tiny", max_model_len=64, stop_token_ids=[tokenizer.eos_id]
    )
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.mark.slow  # ~30 s: edl serve's app over the real engine, lm-eval's own HTTP client
def test_local_completions_against_edl_serve_equals_the_hf_backend(model_dir, task_dir, both):
    """lm-eval's ``local-completions`` model pointed at ``edl serve``'s app (the real
    engine; echo + logprobs for the log-likelihoods, stop strings for generation): the same
    acc / acc_norm as the ``hf`` backend, each choice's log-likelihood within 1e-4 and
    is_greedy equal, and hf's greedy generations."""
    server = _served(model_dir)
    port = next(server)
    tasks = ["edl_tiny_mc", "edl_tiny_gen"]
    args = {
        "model": "tiny",
        "base_url": f"http://127.0.0.1:{port}/v1/completions",
        "tokenizer_backend": "huggingface",
        "tokenizer": str(model_dir),
        "max_length": 64,
        "max_retries": 1,
        # hf's backend encodes with the tokenizer's own BOS (this one adds <s>); the API
        # models add none unless told.
        "add_bos_token": True,
    }
    try:
        served = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=args,
            tasks=tasks,
            task_manager=task_manager(task_dir, tasks),
            batch_size=4,
            log_samples=True,
        )
    finally:
        server.close()
    hf, got = both["hf"]["results"]["edl_tiny_mc"], served["results"]["edl_tiny_mc"]
    assert (got["acc,none"], got["acc_norm,none"]) == (hf["acc,none"], hf["acc_norm,none"])
    hf_resps, served_resps = (_responses(r, "edl_tiny_mc") for r in (both["hf"], served))
    assert len(served_resps) == len(hf_resps) == 8
    for hf_doc, doc in zip(hf_resps, served_resps, strict=True):
        for [(hf_ll, hf_greedy)], [(ll, greedy)] in zip(hf_doc, doc, strict=True):
            assert abs(ll - hf_ll) < 1e-4 and greedy == hf_greedy
    assert _responses(served, "edl_tiny_gen") == _responses(both["hf"], "edl_tiny_gen")


CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


@pytest.mark.slow  # ~30 s: two lm-eval runs (hf, and local-chat-completions over edl serve)
def test_local_chat_completions_against_edl_serve_equals_the_hf_backend(
    model_dir, task_dir, tmp_path
):
    """lm-eval's ``local-chat-completions`` against ``edl serve`` (the prompts rendered by
    the server's chat template) generates what lm-eval's ``hf`` backend does greedily with
    ``apply_chat_template`` on the same template."""
    import shutil

    chat_dir = tmp_path / "chat"
    shutil.copytree(model_dir, chat_dir)
    hf_tok = transformers.AutoTokenizer.from_pretrained(chat_dir)
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(chat_dir)
    server = _served(chat_dir)
    port = next(server)
    tasks = ["edl_tiny_gen"]
    manager = task_manager(task_dir, tasks)
    common = dict(tasks=tasks, task_manager=manager, apply_chat_template=True, log_samples=True)
    try:
        served = lm_eval.simple_evaluate(
            model="local-chat-completions",
            model_args={
                "model": "tiny",
                "base_url": f"http://127.0.0.1:{port}/v1/chat/completions",
                "max_retries": 1,
            },
            **common,
        )
    finally:
        server.close()
    hf = lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": str(chat_dir), "dtype": "float32", "device": "cpu"},
        batch_size=4,
        **common,
    )
    want = _responses(hf, "edl_tiny_gen")
    assert len(want) == len(CORPUS) and any(text for [text] in want)  # something generated
    assert _responses(served, "edl_tiny_gen") == want

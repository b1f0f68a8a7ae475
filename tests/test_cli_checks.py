"""Checks before work (``edl.cli.checks``): each mistake of ``edl train`` is one line and an
exit code, before any model loads (the loaders are replaced by ones that fail the test)."""

from __future__ import annotations

import json

import jax
import pytest

import edl._hub
from edl.cli import main


@pytest.fixture(autouse=True)
def no_model_loads(monkeypatch):
    """Loading a model (fine-tuning's, or the embedded job's) fails the test."""
    import edl.cli.finetune
    import edl.cli.post
    import edl.cli.train

    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the checks")

    monkeypatch.setattr(edl.cli.finetune, "load_for_finetuning", loaded)
    monkeypatch.setattr(edl.cli.post, "load_for_finetuning", loaded)
    monkeypatch.setattr(edl.cli.train, "_model", loaded)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "train.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    (tmp_path / "pairs.jsonl").write_text(
        json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}) + "\n"
    )
    return tmp_path


def _fails(argv, capsys, code):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--output-dir", "out", *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == code, err
    assert len(err.strip().splitlines()) == 1, err  # one line, no traceback
    assert err.startswith("edl train: error: "), err
    return err


def test_mesh_larger_than_the_devices_exits_2_naming_both_counts(workdir, capsys):
    present = jax.device_count()
    err = _fails(["--mesh", f"{present + 1},1,1,1"], capsys, code=2)
    assert f"asks for {present + 1} devices, {present} present" in err
    err = _fails([f"--mesh=-1,{present + 1},1,1"], capsys, code=2)
    assert f"needs a multiple of {present + 1} devices, {present} present" in err


def test_mesh_across_more_slices_than_present_exits_2_naming_both(workdir, capsys):
    err = _fails(["--mesh", "1,-1,1,1/2"], capsys, code=2)
    assert "--mesh 1,-1,1,1/2 spans 2 slices, the devices are in 1 process" in err
    err = _fails(["--mesh", "1,-1,1,1/x"], capsys, code=2)
    assert "--mesh: mesh '1,-1,1,1/x': expected DP,FSDP,TP,SP" in err


def test_mesh_with_post_training_exits_2(workdir, capsys):
    argv = ["--method", "dpo", "--model", "model", "--data", "pairs.jsonl", "--mesh", "1,1,1,1"]
    assert "--mesh is for --method sft, not dpo" in _fails(argv, capsys, code=2)


@pytest.mark.parametrize("model", [[], ["--model", "model"]], ids=["embedded", "finetune"])
def test_missing_data_file_fails_at_once_without_the_hub(workdir, capsys, monkeypatch, model):
    import edl.cli.data

    def no_hub(*args, **kwargs):
        raise AssertionError("the hub was asked")

    monkeypatch.setattr(edl.cli.data, "hf_dataset", no_hub)
    err = _fails([*model, "--data", "nope.jsonl"], capsys, code=1)
    assert "--data nope.jsonl: no such file or directory" in err
    err = _fails([*model, "--data", "train.jsonl", "--eval-data", "held/out.txt"], capsys, code=1)
    assert "--eval-data held/out.txt: no such file or directory" in err


def test_missing_model_path_fails_at_once(workdir, capsys):
    err = _fails(["--model", "runs/x/final", "--data", "train.jsonl"], capsys, code=1)
    assert "--model runs/x/final: no such file or directory" in err


def test_first_record_in_the_wrong_format_fails_before_the_model(workdir, capsys):
    err = _fails(["--model", "model", "--data", "train.jsonl", "--format", "chat"], capsys, 1)
    assert "train.jsonl:1: format 'chat' needs field(s) ['messages']" in err
    err = _fails(["--method", "dpo", "--model", "model", "--data", "train.jsonl"], capsys, 1)
    assert "format 'preference' needs field(s)" in err
    argv = ["--method", "grpo", "--reward", "m:f", "--model", "model", "--data", "pairs.jsonl"]
    assert "'prompt' field" not in _fails(argv, capsys, 1)  # pairs have a prompt: reward next


def test_unimportable_reward_fails_before_the_model(workdir, capsys):
    (workdir / "prompts.jsonl").write_text(json.dumps({"prompt": "p"}) + "\n")
    argv = ["--method", "grpo", "--model", "model", "--data", "prompts.jsonl"]
    err = _fails([*argv, "--reward", "no_such_module_xyz:score"], capsys, code=1)
    assert "--reward no_such_module_xyz:score: cannot import" in err


@pytest.mark.parametrize("method", ["sft", "dpo"])
def test_earlier_run_in_the_output_dir_fails_before_the_model(workdir, capsys, method):
    (workdir / "out").mkdir()
    (workdir / "out" / "metrics.jsonl").write_text("{}\n")
    data = "train.jsonl" if method == "sft" else "pairs.jsonl"
    argv = ["--method", method, "--model", "model", "--data", data]
    assert "holds an earlier run" in _fails(argv, capsys, code=1)


@pytest.fixture
def closed_endpoint(monkeypatch):
    """``HF_ENDPOINT`` at a local port nothing listens on: the hub is unreachable at once."""
    import socket

    with socket.socket() as s:  # a free port, closed again: connecting is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    edl._hub._ANSWERS.clear()
    yield f"http://127.0.0.1:{port}"
    edl._hub._ANSWERS.clear()


def test_unreachable_hub_fails_at_once_naming_the_repo_and_the_cache(
    workdir, capsys, monkeypatch, closed_endpoint
):
    """A repo id with the hub unreachable: one request, one line (not the hub libraries'
    minute of retries), saying whether the repo is cached and how to read it from there."""
    import huggingface_hub.constants

    import edl.cli.data

    def no_hub(*args, **kwargs):
        raise AssertionError("the hub was asked")

    monkeypatch.setattr(edl.cli.data, "hf_dataset", no_hub)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(workdir / "hub"))
    (workdir / "hub" / "models--someone--cached").mkdir(parents=True)
    err = _fails(["--model", "someone/missing", "--data", "train.jsonl"], capsys, code=1)
    assert f"--model someone/missing: a hub model repo id, but {closed_endpoint} cannot" in err
    assert "not in the local Hugging Face cache" in err
    err = _fails(["--model", "someone/cached", "--data", "train.jsonl"], capsys, code=1)
    assert "rerun with HF_HUB_OFFLINE=1" in err
    err = _fails(["--data", "someone/prefs:test"], capsys, code=1)
    assert "--data someone/prefs: a hub dataset repo id, but" in err
    # Offline, the hub is not asked at all: the loaders read the cache (and say so on a miss).
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(edl._hub, "_ask", no_hub)
    from edl.cli.checks import check_model_path

    check_model_path("someone/missing")


def test_a_reachable_hub_is_asked_once(monkeypatch):
    """Any HTTP answer (404 included) means reachable; the answer is kept per endpoint."""
    import http.server
    import threading

    class NotFound(http.server.BaseHTTPRequestHandler):
        requests = 0

        def do_HEAD(self):
            type(self).requests += 1
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        edl._hub._ANSWERS.clear()
        assert edl._hub.hub_unreachable() is None
        assert edl._hub.hub_unreachable() is None
        assert NotFound.requests == 1
    finally:
        server.shutdown()
        edl._hub._ANSWERS.clear()

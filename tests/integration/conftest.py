from __future__ import annotations

import pytest

from tests.integration.workers import running_worker


@pytest.fixture(scope="module")
def worker(tiny_llama, tmp_path_factory):
    with running_worker(tiny_llama, tmp_path_factory.mktemp("worker") / "worker.log") as process:
        yield process

from __future__ import annotations

import pytest

from tandem.launch import free_port
from tests.integration.workers import running_worker


@pytest.fixture(scope="module")
def worker(tiny_llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    with running_worker(tiny_llama, log, "--metrics-port", str(free_port())) as process:
        yield process

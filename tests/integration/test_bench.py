"""`tandem bench` against real workers and a router on 127.0.0.1 (tiny model)."""

from __future__ import annotations

import json

import pytest

from tandem.bench.live import main as bench_main
from tests.integration.workers import SERVING, RouterProcess, running_worker

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory):
    logs = tmp_path_factory.mktemp("bench-stack")
    with running_worker(tiny_llama, logs / "cpu.log", "--max-active", "4") as cpu, \
            running_worker(tiny_llama, logs / "gpu.log", "--max-active", "4", module_kind="gpu") as gpu:
        router = RouterProcess(tiny_llama, logs / "router.log", [f"cpu=cpu@{cpu.address}", f"gpu=gpu@{gpu.address}"])
        try:
            router.wait_for_health(SERVING)
            router.wait_for_backends({"cpu", "gpu"})
            yield router, cpu, gpu
        finally:
            router.close()


def test_seed_burst_through_the_router_records_every_request_and_decision(stack, tmp_path):
    router, _, _ = stack
    output = tmp_path / "burst.json"
    assert bench_main(["--router", router.address, "--requests", "6", "--prompt-tokens", "100", "--prefix-tokens", "80",
                       "--max-new-tokens", "16", "--policy", "cost", "gpu_only", "--output", str(output)]) == 0
    for policy in ("cost", "gpu_only"):
        result = json.loads((tmp_path / f"burst-{policy}.json").read_text())
        assert result["outcomes"] == {"OK": 6} and result["output_tokens"] == 6 * 16
        assert result["makespan_s"] > 0 and result["ttft_p50_s"] <= result["e2e_p50_s"]
        assert [d["request_id"] for d in result["decisions"]] == [f"burst-{i:05d}" for i in range(6)]
        assert all(d["policy"] == policy for d in result["decisions"])
        assert all(r["cached_tokens"] == 80 for r in result["requests"])  # the prefix was warmed on both
        assert sum(result["requests_per_worker"].values()) == 6
        assert (tmp_path / f"burst-{policy}-timeline.png").stat().st_size > 1000
    gpu_only = json.loads((tmp_path / "burst-gpu_only.json").read_text())
    assert gpu_only["requests_per_worker"] == {"cpu": 0, "gpu": 6}
    assert (tmp_path / "burst-cdf.png").stat().st_size > 1000


def test_poisson_outputs_end_at_their_drawn_length_below_the_budget(stack, tmp_path):
    _, cpu, _ = stack
    output = tmp_path / "poisson.json"
    assert bench_main(["--worker", cpu.address, "--workload", "poisson", "--requests", "12", "--rate", "20",
                       "--prompt-tokens-mean", "60", "--prefix-tokens", "32", "--output-tokens-mean", "6",
                       "--max-new-tokens", "64", "--output", str(output)]) == 0
    result = json.loads(output.read_text())
    assert result["outcomes"] == {"OK": 12} and result["decisions"] == []
    assert result["requests_per_worker"] == {"worker": 12}
    assert all(r["output_tokens"] < 64 for r in result["requests"])


def test_bad_workload_flags_are_usage_errors(stack, capsys):
    router, _, _ = stack
    with pytest.raises(SystemExit):
        bench_main(["--router", router.address, "--prefix-tokens", "600"])
    assert "prefix_tokens" in capsys.readouterr().err

"""The simulator: real policy and scheduler, linear step times, deterministic and fast."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from simulator.cli import main as sim_main
from simulator.profiles import StepTimeModel, seed_m2
from simulator.simulator import simulate
from tandem.loadgen.workloads import long_context, seed_burst
from tandem.engine.config import SchedulerConfig
from tandem.engine.utils import cdiv


def test_profile_rates_become_step_times_that_report_the_same_rates():
    profile = seed_m2()
    for worker, (prefill, decode) in ((profile.cpu, (73, 45)), (profile.gpu, (2551, 293))):
        rates = worker.step.fitted_rates(worker.scheduler)
        assert rates.prefill_tok_s == pytest.approx(prefill) and rates.decode_tok_s == pytest.approx(decode)
        # batch 4 decode step = 4 / rate, of which 21% is the fixed cost
        assert worker.step.seconds(0, 4) == pytest.approx(4 / decode)
        assert worker.step.step_base_s == pytest.approx(0.21 * 4 / decode)


def test_a_worker_with_small_steps_reports_both_lines_of_its_step_model():
    step = StepTimeModel(0.020, 1e-4, 4e-4, small_step_rows=12, small_step_base_s=0.008, small_step_per_row_s=0.0015)
    rates = step.fitted_rates(SchedulerConfig(max_active_requests=32, max_num_batched_tokens=256))
    assert (rates.small_step_rows, rates.small_step_base_s, rates.small_step_per_row_s) == (
        12, pytest.approx(0.008), pytest.approx(0.0015))
    assert (rates.step_base_s, rates.step_per_decode_s) == (pytest.approx(0.020), pytest.approx(4e-4))
    assert step.seconds(0, 12) == pytest.approx(0.008 + 12 * 0.0015) and step.seconds(0, 13) == pytest.approx(0.0252)


def test_step_model_rejects_a_chunk_cheaper_than_the_fixed_cost():
    with pytest.raises(ValueError, match="prefill chunk"):
        StepTimeModel.from_rates(1e9, 1.0, 512, 4, 0.5)


def test_seed_burst_reproduces_the_articles_first_offload_at_request_8():
    result = simulate(seed_m2().workers(), seed_burst(8, 32000), "cost", keep_decisions=True)
    chosen = [decision.chosen for _, decision in result.decisions]
    assert chosen == ["gpu-0"] * 7 + ["cpu-0"]
    cpu_score = next(s.score for s in result.decisions[0][1].scores if s.worker == "cpu-0")
    assert cpu_score == pytest.approx(20 / 73 + 128 / 45)  # the idle CPU's 3.118 s
    summary = result.summary()
    assert summary["offloaded_to_cpu"] == 1 and summary["outcomes"] == {"OK": 8}
    assert summary["output_tokens"] == 8 * 128
    assert all(r.cached_tokens == 496 for r in result.records)


def test_gpu_only_never_offloads_and_four_requests_stay_on_the_gpu():
    assert simulate(seed_m2().workers(), seed_burst(48, 32000), "gpu_only").summary()["offloaded_to_cpu"] == 0
    assert simulate(seed_m2().workers(), seed_burst(4, 32000), "cost").summary()["offloaded_to_cpu"] == 0


def test_the_simulation_is_deterministic():
    def run():
        return simulate(seed_m2().workers(cpu_workers=2), seed_burst(48, 32000, output_fraction=0.5), "finish_time")

    first, second = run(), run()
    assert first.records == second.records
    assert first.summary() == second.summary()


def test_kv_capacity_caps_concurrency_as_in_the_real_scheduler():
    profile = seed_m2(gpu_kv_bytes=3 * 2200 * 12288)  # room for three 2048 + 128 token requests
    blocks_per_request = cdiv(2048 + 128, 16)
    assert 3 * blocks_per_request <= profile.gpu.num_kv_blocks < 4 * blocks_per_request
    result = simulate(profile.workers(cpu_workers=0, gpu_max_active=16), long_context(12, 32000, context_tokens=2048),
                      "gpu_only")
    stats = result.summary()["workers"]["gpu-0"]
    assert stats["max_running"] <= 4 and stats["max_running"] < 16
    assert result.summary()["outcomes"] == {"OK": 12}


def test_worker_names_and_counts_follow_the_options():
    workers = seed_m2().workers(cpu_workers=3, gpu_max_active=8)
    assert list(workers) == ["gpu-0", "cpu-0", "cpu-1", "cpu-2"]
    assert workers["gpu-0"].scheduler.max_active_requests == 8
    assert workers["cpu-0"].scheduler == SchedulerConfig(max_active_requests=4, max_num_batched_tokens=512,
                                                         max_prefill_step_tokens=512)


def test_cli_prints_the_documented_json(capsys):
    assert sim_main(["--profile", "seed-m2", "--workload", "seed-burst", "--requests", "48", "--policy", "cost",
                     "--json", "--cpu-workers", "2", "--gpu-max-active", "8", "--seed", "1"]) == 0
    payload = json.loads(capsys.readouterr().out)
    for key in ("makespan_s", "output_tok_s", "ttft_p50_s", "ttft_p95_s"):
        assert payload[key] > 0
    assert set(payload["requests_per_worker"]) == {"gpu-0", "cpu-0", "cpu-1"}
    assert sum(payload["requests_per_worker"].values()) == 48


def test_cli_rejects_bad_options_with_their_names(capsys):
    with pytest.raises(SystemExit):
        sim_main(["--gpu-max-active", "0"])
    assert "--gpu-max-active" in capsys.readouterr().err


def test_a_reader_that_stops_early_gets_no_traceback():
    command = [sys.executable, "-m", "tandem.cli", "sim", "--requests", "5", "--json"]
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout buffered, as usual
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environment)
    process.stdout.close()  # before the simulator writes a byte
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 1
    assert b"Traceback" not in stderr and b"BrokenPipeError" not in stderr


def test_finish_time_moves_waiting_requests_that_another_worker_finishes_first_and_each_completes_once():
    # cached 8k histories: the GPU queue grows long while the CPU, holding the histories, frees up
    workload = long_context(48, 32000, context_tokens=8192, warmed=True)
    result = simulate(seed_m2().workers(gpu_max_active=4), workload, "finish_time")
    summary = result.summary()
    assert summary["outcomes"] == {"OK": 48} and sorted(r.req_id for r in result.records) == \
        sorted(r.req_id for r in workload.requests)
    assert summary["moves"] > 0 and all(move.to_s < move.from_s for _, move in result.moves)
    assert all(sum(1 for req_id, _ in result.moves if req_id == r.req_id) <= 2 for r in workload.requests)
    unmoved = simulate(seed_m2().workers(gpu_max_active=4), workload, "cost").summary()
    assert unmoved["moves"] == 0 and summary["makespan_s"] < unmoved["makespan_s"]

"""The rows up to which a CPU step reads the decode copy of the weights: timed on whole steps once per machine and
combination, recorded, and read back by the next runner."""

from __future__ import annotations

import json
import time

import pytest
import torch

from tandem.engine.config import CacheConfig
from tandem.engine.model import cpu_kernels, crossover
from tandem.engine.model.factory import build_engine


@pytest.fixture
def home(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    return tmp_path


def sleeping_steps(decode_copy_ms_per_row: float, batched_ms: float, timed: list):
    """Steps that take ``decode_copy_ms_per_row`` per row on the decode copy and ``batched_ms`` on the batched
    weights, as sleeps; ``timed`` collects each (rows, decode_copy)."""
    def step(rows: int, decode_copy: bool) -> None:
        timed.append((rows, decode_copy))
        time.sleep((rows * decode_copy_ms_per_row if decode_copy else batched_ms) / 1000)
    return step


def test_the_crossover_is_the_largest_step_the_decode_copy_wins_and_timing_stops_at_the_first_it_loses(home):
    timed = []
    rows = crossover.measured_decode_rows({"cpu": "a"}, sleeping_steps(2, 20, timed), max_rows=64)
    assert rows == 8  # 16 ms against 20 at 8 rows, 24 against 20 at 12
    assert {size for size, _ in timed} == {1, 2, 4, 8, 12}
    assert timed.count((12, True)) == timed.count((12, False)) == 1 + crossover.REPEATS
    assert json.loads((home / "kernels" / "decode-rows.json").read_text()) == {json.dumps({"cpu": "a"}): 8}


def test_a_recorded_crossover_is_read_back_and_another_combination_is_timed_beside_it(home):
    crossover.measured_decode_rows({"cpu": "a"}, sleeping_steps(2, 20, []), max_rows=64)

    def untimed(rows: int, decode_copy: bool) -> None:
        raise AssertionError("a recorded combination is not timed again")

    assert crossover.measured_decode_rows({"cpu": "a"}, untimed, max_rows=64) == 8
    assert crossover.measured_decode_rows({"cpu": "b"}, sleeping_steps(1, 0, []), max_rows=64) == 0
    assert len(json.loads((home / "kernels" / "decode-rows.json").read_text())) == 2


def test_prompt_chunks_climb_a_ladder_of_their_own_recorded_beside_the_decode_steps(home):
    timed = []
    # 0.02 ms a row on the copy against 5 ms: summed over the ladder, 7.68 ms against 10 up to 256 rows, 17.92
    # against 15 up to 512
    rows = crossover.measured_prompt_rows({"cpu": "a"}, sleeping_steps(0.02, 5, timed))
    assert rows == 256 and {size for size, _ in timed} == set(crossover.PROMPT_LADDER)
    crossover.measured_decode_rows({"cpu": "a"}, sleeping_steps(2, 20, []), max_rows=64)
    recorded = json.loads((home / "kernels" / "decode-rows.json").read_text())
    assert recorded == {json.dumps({"cpu": "a", "path": "prompt layer"}): 256, json.dumps({"cpu": "a"}): 8}


def test_one_prompt_chunk_size_lost_by_a_little_does_not_stop_the_copy_at_the_sizes_it_wins(home):
    def layer(rows: int, decode_copy: bool) -> None:
        per_row_ms = 0.011 if rows == 256 else 0.008  # the copy loses at 256 rows alone, against 0.01 ms a row
        time.sleep(rows * (per_row_ms if decode_copy else 0.01) / 1000)

    assert crossover.measured_prompt_rows({"cpu": "a"}, layer) == crossover.PROMPT_LADDER[-1]


def test_the_ladder_stops_at_the_rows_the_cache_can_hold(home):
    timed = []
    assert crossover.measured_decode_rows({"cpu": "a"}, sleeping_steps(0, 5, timed), max_rows=10) == 8
    assert max(size for size, _ in timed) == 8


def test_prompt_chunks_are_timed_where_the_copy_won_every_decode_step_or_its_layers_are_uint4():
    assert crossover.copy_may_win_prompts(crossover.LADDER[-1], "int8")
    assert not crossover.copy_may_win_prompts(crossover.LADDER[-2], "int8")
    assert not crossover.copy_may_win_prompts(crossover.LADDER[-2], "float16")
    assert crossover.copy_may_win_prompts(crossover.LADDER[-2], "uint4+int8")
    assert crossover.copy_may_win_prompts(0, "uint4+int8")


@pytest.mark.skipif(cpu_kernels.load() is None or not torch.backends.mkldnn.is_available(),
                    reason="needs the CPU kernels and oneDNN")
def test_a_runner_with_a_decode_copy_times_real_steps_once_and_the_next_runner_reads_the_figure(home, tiny_model,
                                                                                               monkeypatch):
    def build():
        return build_engine(str(tiny_model), "cpu", "float32", cache=CacheConfig(num_kv_blocks=64), calibrate=False,
                            decode_weights="int8").executor

    first = build()
    assert first.model.decode_rows in (0, *crossover.LADDER)
    recorded = {json.loads(key).get("path", "decode steps"): rows
                for key, rows in json.loads((home / "kernels" / "decode-rows.json").read_text()).items()}
    assert recorded["decode steps"] == first.model.decode_rows
    # prompt chunks of an int8 copy are timed only where it won every decode step
    assert recorded.get("prompt layer", 0) == first.model.prompt_rows
    assert ("prompt layer" in recorded) == (first.model.decode_rows == crossover.LADDER[-1])
    assert first.model.prompt_rows in (0, *crossover.PROMPT_LADDER)

    def untimed(*args):
        raise AssertionError("the recorded figure is read, not timed again")

    monkeypatch.setattr(crossover, "step_seconds", untimed)
    assert build().model.decode_rows == first.model.decode_rows
    without_copy = build_engine(str(tiny_model), "cpu", "float32", cache=CacheConfig(num_kv_blocks=64),
                                calibrate=False, decode_weights="float32").executor
    assert without_copy.model.decode_rows == 0  # nothing to time: every step reads the float32 weights


@pytest.mark.skipif(cpu_kernels.load() is None or not torch.backends.mkldnn.is_available(),
                    reason="needs the CPU kernels and oneDNN")
def test_a_timed_prompt_chunk_runs_a_whole_layer_on_a_scratch_cache_and_leaves_the_runners_alone(tiny_model, home):
    runner = build_engine(str(tiny_model), "cpu", "float32", cache=CacheConfig(num_kv_blocks=4), calibrate=False,
                          decode_weights="int8").executor
    chosen, k_cache, v_cache = runner.model.prompt_rows, runner.k_cache.clone(), runner.v_cache.clone()
    linears = []
    for linear in (runner.model.layers[0].self_attn.qkv_proj, runner.model.layers[0].mlp.down_proj):
        linear.register_forward_hook(lambda module, args, out: linears.append(module.reads_copy(len(args[0]))))
    rows = 4 * runner.block_size + 1  # more than the runner's cache holds
    runner.prompt_layer(rows, True)
    runner.prompt_layer(rows, False)
    assert linears == [True, True, False, False]  # the decode copy, then the batched weights
    assert runner.model.prompt_rows == chosen
    assert torch.equal(runner.k_cache, k_cache) and torch.equal(runner.v_cache, v_cache)


@pytest.mark.skipif(cpu_kernels.load() is None or not torch.backends.mkldnn.is_available(),
                    reason="needs the CPU kernels and oneDNN")
def test_the_engine_prices_the_steps_on_the_decode_copy_on_a_line_of_their_own(tiny_model, home):
    engine = build_engine(str(tiny_model), "cpu", "float32", cache=CacheConfig(num_kv_blocks=64), calibrate=True,
                          decode_weights="int8")
    rates = engine.current_rates()
    assert rates.small_step_rows == engine.executor.small_step_rows > 0
    assert rates.small_step_base_s > 0 and rates.small_step_per_row_s >= 0

"""The asyncio front: streaming, cancellation that frees blocks at once, and engine faults."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap

import pytest

from tandem.engine.async_engine import AsyncEngine
from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.errors import EngineDeadError
from tandem.engine.request import FinishReason
from tests.engine.helpers import assert_no_leaks, greedy_request, hf_greedy, make_engine, random_prompt


@pytest.fixture
async def engine(tiny_llama):
    running = AsyncEngine(make_engine(tiny_llama))
    running.start()
    yield running
    running.stop()


async def collect(engine: AsyncEngine, request):
    return [output async for output in engine.generate(request)]


async def wait_until(predicate, timeout=10.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling classes")
async def test_the_engine_thread_runs_as_batch_work_only_when_asked(engine, tiny_llama):
    await collect(engine, greedy_request("normal", [5, 6, 7], 2))
    assert os.sched_getscheduler(engine._thread.native_id) == os.SCHED_OTHER
    batch = AsyncEngine(make_engine(tiny_llama), priority="batch")
    batch.start()
    try:
        await collect(batch, greedy_request("batch", [5, 6, 7], 2))
        assert os.sched_getscheduler(batch._thread.native_id) == os.SCHED_BATCH
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the event loop's thread keeps its class
    finally:
        batch.stop()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux threads")
def test_starting_the_engine_hands_back_the_starting_threads_openmp_team(tiny_llama):
    # In a fresh interpreter, so that the thread count is this thread's team alone.
    script = textwrap.dedent(f"""
        import os, time, torch
        from tandem.engine.async_engine import AsyncEngine
        from tests.engine.helpers import make_engine
        torch.set_num_threads(2)
        engine = AsyncEngine(make_engine({str(tiny_llama)!r}))
        torch.ones(1 << 24).sum()  # a parallel region on this thread, which gets a team of one more thread
        before = len(os.listdir("/proc/self/task"))
        engine.start()  # adds the engine thread
        deadline = time.monotonic() + 2  # an ended thread may linger in /proc for a moment
        while len(os.listdir("/proc/self/task")) > before and time.monotonic() < deadline:
            time.sleep(0.01)
        print(len(os.listdir("/proc/self/task")) - before)
        engine.stop()
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.split() == ["0"], result.stderr


def test_an_unknown_engine_priority_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="priority must be one of normal, batch"):
        AsyncEngine(make_engine(tiny_llama), priority="realtime")


async def test_concurrent_streams_match_reference(engine, tiny_llama):
    prompts = {f"r{i}": random_prompt(engine.engine, 10 + 7 * i, seed=i) for i in range(5)}
    results = await asyncio.gather(*(collect(engine, greedy_request(k, p, 20)) for k, p in prompts.items()))
    for (req_id, prompt), outputs in zip(prompts.items(), results):
        assert [t for o in outputs for t in o.token_ids] == hf_greedy(tiny_llama, prompt, 20)
        assert all(len(o.token_ids) == 1 for o in outputs)
        final = outputs[-1]
        assert final.finish_reason is FinishReason.LENGTH
        assert final.stats.num_output_tokens == 20 and final.stats.ttft_s <= final.stats.total_time_s
    assert_no_leaks(engine.engine)


async def test_closing_the_stream_aborts_and_frees_blocks(engine):
    stream = engine.generate(greedy_request("long", random_prompt(engine.engine, 30, seed=1), 500))
    first = await stream.__anext__()
    assert first.token_ids
    assert engine.state().load.num_used_blocks > 0
    await stream.aclose()
    await wait_until(lambda: engine.state().load.num_used_blocks == 0)  # by the end of the step in flight
    state = engine.state()
    assert (state.load.num_running, state.load.num_waiting) == (0, 0)


async def test_cancelling_the_consumer_task_aborts(engine):
    async def consume():
        async for _ in engine.generate(greedy_request("c", random_prompt(engine.engine, 30, seed=2), 500)):
            pass

    task = asyncio.create_task(consume())
    await wait_until(lambda: engine.state().load.num_running == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: engine.state().load.num_running == 0)
    assert_no_leaks(engine.engine)


async def test_on_queued_runs_once_queued_and_its_failure_aborts_the_request(engine):
    queued = []

    async def on_queued():
        load = engine.state().load
        queued.append(load.num_running + load.num_waiting)
        raise ConnectionError("the caller went away")

    request = greedy_request("q", random_prompt(engine.engine, 30, seed=3), 500)
    with pytest.raises(ConnectionError):
        async for _ in engine.generate(request, on_queued=on_queued):
            pass
    assert queued == [1]
    await wait_until(lambda: engine.state().load.num_running + engine.state().load.num_waiting == 0)
    assert_no_leaks(engine.engine)


async def test_cancelling_the_consumer_inside_on_queued_aborts(engine):
    entered = asyncio.Event()

    async def on_queued():
        entered.set()
        await asyncio.Event().wait()  # an acknowledgement that never completes

    async def consume():
        async for _ in engine.generate(greedy_request("stuck", random_prompt(engine.engine, 30, seed=4), 500),
                                       on_queued=on_queued):
            pass

    task = asyncio.create_task(consume())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: engine.state().load.num_running + engine.state().load.num_waiting == 0)
    assert_no_leaks(engine.engine)


async def test_cancellation_storm_leaves_no_state(engine):
    async def consume(i):
        count = 0
        async for _ in engine.generate(greedy_request(f"s{i}", random_prompt(engine.engine, 5 + i, seed=i), 200)):
            count += 1
            if count == 1 + i % 7:
                break

    await asyncio.wait_for(asyncio.gather(*(consume(i) for i in range(40))), timeout=60)
    await wait_until(lambda: engine.state().load.num_running == 0)
    assert_no_leaks(engine.engine)


async def test_on_step_sees_every_executed_step_with_its_batch(tiny_llama):
    """Three requests queued before the engine starts run as one batch: a prefill step, then four decode steps."""
    steps = []
    engine = AsyncEngine(make_engine(tiny_llama), on_step=lambda output: steps.append(len(output.scheduled)))
    tasks = [asyncio.create_task(collect(engine, greedy_request(f"b{i}", random_prompt(engine.engine, 10, seed=i), 5)))
             for i in range(3)]
    await wait_until(lambda: engine.state().load.num_waiting == 3)
    engine.start()
    try:
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
    finally:
        engine.stop()  # joins the engine thread: the last step's callback, which follows its outputs, has run
    assert all(outputs[-1].stats.num_output_tokens == 5 for outputs in results)
    assert steps == [3] * 5


async def test_model_fault_fails_every_request_and_marks_unhealthy(tiny_llama):
    inner = make_engine(tiny_llama)
    execute = inner.executor.execute
    calls = {"n": 0}

    def failing_execute(output):
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("injected device fault")
        return execute(output)

    inner.executor.execute = failing_execute
    engine = AsyncEngine(inner)
    engine.start()
    try:
        prompts = [random_prompt(inner, 12, seed=i) for i in range(4)]
        results = await asyncio.wait_for(
            asyncio.gather(*(collect(engine, greedy_request(f"f{i}", p, 50)) for i, p in enumerate(prompts))),
            timeout=30,
        )
        for outputs in results:
            assert outputs[-1].finish_reason is FinishReason.ERROR
            assert "injected device fault" in outputs[-1].error
        assert not engine.healthy and not engine.state().healthy
        with pytest.raises(EngineDeadError):
            await collect(engine, greedy_request("late", prompts[0], 4))
        assert inner.scheduler.pool.num_used_blocks == 0
    finally:
        engine.stop()


def test_detokenizer_handles_multibyte_characters_split_across_tokens(tiny_llama):
    from tandem.engine.model.factory import load_tokenizer

    tokenizer = load_tokenizer(tiny_llama)
    text = " 你好，世界 🙂🚀 crème brûlée ✨"
    token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = [tokenizer.decode([t]) for t in token_ids]
    assert any("\ufffd" in piece for piece in pieces), "the text must split characters across tokens"
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer("prompt:", add_special_tokens=False)["input_ids"])
    deltas = [detokenizer.add_token(t) for t in token_ids]
    deltas.append(detokenizer.flush())
    assert "".join(deltas) == text
    assert not any("\ufffd" in delta for delta in deltas)


async def test_abort_while_the_step_runs_waits_for_the_step(tiny_llama):
    """A cancel that lands while the model executes a step must not pull the blocks from under it."""
    engine = AsyncEngine(make_engine(tiny_llama))
    execute = engine.engine.executor.execute
    aborted_mid_step = []

    def execute_then_abort(output):
        decoding = [item.request.req_id for item in output.scheduled if item.num_new_tokens == 1]
        if decoding and not aborted_mid_step:
            aborted_mid_step.append(decoding[0])
            engine.abort(decoding[0])  # as the gRPC thread would, while this step still runs
        return execute(output)

    engine.engine.executor.execute = execute_then_abort
    engine.start()
    try:
        tasks = {f"r{i}": asyncio.create_task(collect(engine, greedy_request(f"r{i}", random_prompt(engine.engine, 20, i), 8)))
                 for i in range(1, 3)}
        await wait_until(lambda: aborted_mid_step and engine.state().load.num_running == 0)
        assert engine.healthy
        survivor = next(task for req_id, task in tasks.items() if req_id != aborted_mid_step[0])
        assert (await survivor)[-1].finish_reason is FinishReason.LENGTH
        tasks[aborted_mid_step[0]].cancel()  # its stream was dropped by the abort; nothing more arrives
        assert_no_leaks(engine.engine)
    finally:
        engine.stop()

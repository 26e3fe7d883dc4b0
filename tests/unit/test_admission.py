"""The router's bounded admission queue."""

from __future__ import annotations

import asyncio

import pytest

from router_svc.admission import Admission, AdmissionRefused


async def test_slots_then_a_bounded_fifo_queue_then_refusal():
    admission = Admission(max_inflight=2, max_queued=2, queue_timeout_s=5)
    await admission.acquire()
    await admission.acquire()
    order = []

    async def wait(name):
        await admission.acquire()
        order.append(name)

    first, second = asyncio.create_task(wait("first")), asyncio.create_task(wait("second"))
    await asyncio.sleep(0.01)
    assert admission.queued == 2
    with pytest.raises(AdmissionRefused, match="at capacity"):
        await admission.acquire()
    admission.release()
    admission.release()
    await asyncio.gather(first, second)
    assert order == ["first", "second"] and admission.inflight == 2 and admission.queued == 0
    admission.release()
    admission.release()
    assert admission.inflight == 0


async def test_a_wait_past_the_timeout_is_refused_and_leaves_the_queue():
    admission = Admission(max_inflight=1, max_queued=4, queue_timeout_s=0.05)
    await admission.acquire()
    with pytest.raises(AdmissionRefused, match="waited 0.05 s"):
        await admission.acquire()
    assert admission.queued == 0
    admission.release()
    await asyncio.wait_for(admission.acquire(), 1)  # the slot went back to the pool, not to the gone waiter


async def test_a_cancelled_waiter_leaves_the_queue():
    admission = Admission(max_inflight=1, max_queued=4, queue_timeout_s=5)
    await admission.acquire()
    waiter = asyncio.create_task(admission.acquire())
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert admission.queued == 0
    admission.release()
    assert admission.inflight == 0


def test_limits_are_validated():
    with pytest.raises(ValueError):
        Admission(0, 1, 1.0)

"""The re-placement check as the router runs it: one round every interval while any request waits, over the
workers' latest snapshots and their prefix indexes, asking no worker (``router_svc.replacement`` has the rule)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from router_svc.policies import RouteInput
from router_svc.prefix_index import PromptBlocks
from router_svc.replacement import Waiting, candidates, plan_moves
from router_svc.workers import WorkerRegistry

logger = logging.getLogger(__name__)


@dataclass
class _Entry:
    waiting: Waiting
    prompt: PromptBlocks
    priced: Callable[[], RouteInput]
    moved: asyncio.Future


class Replacer:
    """Watches the requests waiting on their workers and hands each the move the check decides for it."""

    def __init__(self, registry: WorkerRegistry, interval_s: float):
        self.registry = registry
        self.interval_s = interval_s
        self._entries: dict[str, _Entry] = {}
        self._task: asyncio.Task | None = None

    async def first_response_or_move(self, call, waiting: Waiting, prompt: PromptBlocks,
                                     priced: Callable[[], RouteInput]):
        """Waits for the call's first response while the request is a candidate for moves. Returns
        ([the first response], None), ([], None) when the call ended without one, or ([], the move) with
        the call still unanswered.

        Args:
            priced: the request as the policies price it at each round (learned output lengths change).
        """
        moved = asyncio.get_running_loop().create_future()
        self._entries[waiting.request_id] = _Entry(waiting, prompt, priced, moved)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="replacement-check")
        first = asyncio.ensure_future(_next_response(call))
        try:
            await asyncio.wait({first, moved}, return_when=asyncio.FIRST_COMPLETED)
            if first.done():
                response = first.result()
                return ([] if response is None else [response]), None
            return [], moved.result()
        finally:
            self._entries.pop(waiting.request_id, None)
            first.cancel()
            moved.cancel()

    async def _run(self) -> None:
        while self._entries:
            await asyncio.sleep(self.interval_s)
            try:
                self.check()
            except Exception:
                logger.exception("re-placement check failed; trying again in %.2f s", self.interval_s)

    def check(self) -> None:
        """One round: the candidates by the workers' latest reports, their prompts looked up in the prefix
        indexes of the workers they may move to, the moves."""
        entries = {rid: dataclasses.replace(e.waiting, request=e.priced())
                   for rid, e in self._entries.items()}
        backends = self.registry.healthy()
        reports = {b.name: b.report(b.state) for b in backends}
        considered = candidates(entries, reports)
        if not considered:
            return
        cached = {(entry.request_id, b.name): b.prefix_index.cached(self._entries[entry.request_id].prompt,
                                                                    reports[b.name].block_size)
                  for b in backends if b.prefix_index.synced
                  for entry in considered if entry.worker != b.name and b.name not in entry.excluded}
        credits = {b.name: list(b.credits.values()) for b in backends}
        for entry, move in plan_moves(considered, reports, credits, cached, time.monotonic()):
            waiting = self._entries.get(entry.request_id)
            if waiting is not None and not waiting.moved.done():
                waiting.moved.set_result(move)


async def _next_response(call):
    """The call's next response, None at its end."""
    try:
        return await call.__anext__()
    except StopAsyncIteration:
        return None

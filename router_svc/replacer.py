"""The re-placement check as the router runs it: one round every interval while any request waits, with
one ``EstimatePrompts`` call per worker however many requests wait (``router_svc.replacement`` has the rule)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from router_svc.backends import Backend, BackendRegistry
from router_svc.policy import RouteInput
from router_svc.replacement import Waiting, candidates, plan_moves

logger = logging.getLogger(__name__)

MAX_PROMPTS_PER_CALL = 1024  # the worker's limit
MAX_TOKENS_PER_CALL = 500_000  # about 1.5 MB of token ids, well inside a worker's default 4 MiB message limit


@dataclass
class _Entry:
    waiting: Waiting
    prompt_token_ids: list[int]
    priced: Callable[[], RouteInput]
    moved: asyncio.Future


class Replacer:
    """Watches the requests waiting on their workers and hands each the move the check decides for it."""

    def __init__(self, registry: BackendRegistry, interval_s: float):
        self.registry = registry
        self.interval_s = interval_s
        self._entries: dict[str, _Entry] = {}
        self._task: asyncio.Task | None = None

    async def first_response_or_move(self, call, waiting: Waiting, prompt_token_ids: list[int],
                                     priced: Callable[[], RouteInput]):
        """Waits for the call's first response while the request is a candidate for moves. Returns
        ([the first response], None), ([], None) when the call ended without one, or ([], the move) with
        the call still unanswered.

        Args:
            priced: the request as the policies price it at each round (learned output lengths change).
        """
        moved = asyncio.get_running_loop().create_future()
        self._entries[waiting.request_id] = _Entry(waiting, prompt_token_ids, priced, moved)
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
                await self.check()
            except Exception:
                logger.exception("re-placement check failed; trying again in %.2f s", self.interval_s)

    async def check(self) -> None:
        """One round: the candidates by the workers' latest reports, one call per worker, the moves."""
        entries = {rid: dataclasses.replace(e.waiting, request=e.priced())
                   for rid, e in self._entries.items()}
        backends = [b for b in self.registry.healthy() if b.state is not None]
        considered = candidates(entries, {b.name: b.report(b.state) for b in backends})
        if not considered:
            return
        asked = [[entry for entry in considered if entry.worker != b.name and b.name not in entry.excluded]
                 for b in backends]
        answers = await asyncio.gather(*(self._cached(b, [self._entries[e.request_id].prompt_token_ids for e in ask])
                                         for b, ask in zip(backends, asked)))
        reports, cached = {}, {}
        for backend, ask, answer in zip(backends, asked, answers):
            if answer is None:
                continue
            reports[backend.name] = backend.report(backend.state)
            cached.update({(entry.request_id, backend.name): prefix for entry, prefix in zip(ask, answer)})
        credits = {b.name: list(b.credits.values()) for b in backends}
        for entry, move in plan_moves(considered, reports, credits, cached, time.monotonic()):
            waiting = self._entries.get(entry.request_id)
            if waiting is not None and not waiting.moved.done():
                waiting.moved.set_result(move)

    async def _cached(self, backend: Backend, prompts: list[list[int]]) -> list[tuple[int, int]] | None:
        """Each prompt's (cached, evictable) tokens on ``backend``, in calls within the message limits."""
        answers: list[tuple[int, int]] = []
        for batch in _batches(prompts) or [[]]:  # no prompts: one call all the same, for the fresh state
            answer = await backend.estimate_prompts(batch, self.interval_s)
            if answer is None:
                return None
            answers += answer
        return answers


def _batches(prompts: list[list[int]]) -> list[list[list[int]]]:
    batches: list[list[list[int]]] = []
    tokens = 0
    for prompt in prompts:
        if not batches or len(batches[-1]) == MAX_PROMPTS_PER_CALL or tokens + len(prompt) > MAX_TOKENS_PER_CALL:
            batches.append([])
            tokens = 0
        batches[-1].append(prompt)
        tokens += len(prompt)
    return batches


async def _next_response(call):
    """The call's next response, None at its end."""
    try:
        return await call.__anext__()
    except StopAsyncIteration:
        return None

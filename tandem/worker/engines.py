"""The engines a worker can run (``--engine``), and what the servicer needs from each.

``tandem`` is Tandem's own engine (``AsyncEngine`` over ``LLMEngine``); ``vllm`` is vLLM's ``AsyncLLM``
(``tandem.vllm_engine``). Both answer the same calls, so a router tells them apart only by the engine name
the worker reports.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Protocol

from tandem.engine.block_pool import CacheFeed, CachedPrefix
from tandem.engine.engine import EngineState, RequestOutput
from tandem.engine.request import Request
from tandem.step_time import step_budget
from tandem.worker.config import WorkerConfig, default_threads

ENGINES = ("tandem", "vllm")


class WorkerEngine(Protocol):
    """What ``WorkerServicer`` calls, all from the worker's event loop."""

    def generate(self, request: Request,
                 on_queued: Callable[[], Awaitable[None]] | None = None) -> AsyncIterator[RequestOutput]: ...

    def state(self) -> EngineState: ...

    async def wait_for_change(self, seq: int, timeout: float) -> None: ...

    def cached_prefix(self, token_ids: Sequence[int]) -> CachedPrefix: ...

    def follow_prefix_cache(self) -> CacheFeed: ...

    def prefix_cache_changes(self, feed: CacheFeed) -> tuple[bool, dict[bytes, str]]: ...

    def unfollow_prefix_cache(self, feed: CacheFeed) -> None: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class WorkerIdentity:
    """What GetInfo reports besides live state."""

    kind: str
    model_id: str
    model_fingerprint: str
    dtype: str
    max_waiting_requests: int
    max_num_batched_tokens: int
    max_prefill_step_tokens: int
    context_length: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    version: str
    engine: str
    engine_version: str


@dataclass(frozen=True)
class OpenedEngine:
    engine: WorkerEngine
    identity: WorkerIdentity
    tokenizer: object
    rates_line: str


def load(config: WorkerConfig, on_failure: Callable[[str], None]) -> Callable[[], Awaitable[OpenedEngine]]:
    """Load ``config``'s engine (slow; runs off the event loop). Returns what starts it on the event loop."""
    import torch

    from tandem.model_files import DEFAULT_MODEL_NAME, model_fingerprint, resolve_model
    from tandem.tokenizer import load_tokenizer

    torch.set_num_threads(config.threads or default_threads())
    model_dir = resolve_model(config.model)
    tokenizer = load_tokenizer(model_dir)
    facts = dict(kind=config.kind, model_id=config.model or DEFAULT_MODEL_NAME,
                 model_fingerprint=model_fingerprint(model_dir),
                 max_waiting_requests=config.scheduler.max_waiting_requests, version=version("tandem"))
    loader = _load_vllm if config.engine == "vllm" else _load_tandem
    return loader(config, model_dir, tokenizer, facts, on_failure)


def _load_tandem(config: WorkerConfig, model_dir: Path, tokenizer, facts: dict, on_failure):
    from tandem.engine.async_engine import AsyncEngine
    from tandem.engine.model.factory import build_engine
    from tandem.worker import metrics

    engine = build_engine(str(model_dir), config.device, config.dtype, config.scheduler, config.cache,
                          decode_weights=config.decode_weights, cuda_graphs=config.cuda_graphs,
                          batched_weights=config.batched_weights)
    runner = engine.executor
    identity = WorkerIdentity(
        **facts, engine="tandem", engine_version=version("tandem"), dtype=str(runner.dtype).removeprefix("torch."),
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        max_prefill_step_tokens=step_budget(config.scheduler, decoding=False, used=0), context_length=runner.max_model_len,
        vocab_size=runner.vocab_size, eos_token_ids=tuple(sorted(runner.eos_token_ids)))

    async def start() -> OpenedEngine:
        async_engine = AsyncEngine(engine, on_failure=on_failure,
                                   on_step=lambda output: metrics.record_step(len(output.scheduled)),
                                   priority=config.engine_priority)
        async_engine.start()
        return OpenedEngine(async_engine, identity, tokenizer, _rates_line(engine.rates.rates()))

    return start


def _load_vllm(config: WorkerConfig, model_dir: Path, tokenizer, facts: dict, on_failure):
    from transformers import AutoConfig

    from tandem.model_files import eos_token_ids
    from tandem.vllm_engine.engine import VllmEngine, VllmSettings
    from tandem.worker import metrics

    engine = VllmEngine(VllmSettings(
        model_dir=model_dir, device=config.device, dtype=config.dtype,
        max_num_seqs=config.scheduler.max_active_requests,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        max_waiting_requests=config.scheduler.max_waiting_requests, block_size=config.scheduler.block_size,
        kv_cache_bytes=config.cache.kv_cache_bytes, num_kv_blocks=config.cache.num_kv_blocks,
        cpu_threads=config.threads, extra_args=config.vllm_args,
    ), on_failure=on_failure, on_step=metrics.record_step)
    eos = eos_token_ids(AutoConfig.from_pretrained(model_dir), model_dir)
    identity = WorkerIdentity(
        **facts, engine=engine.name, engine_version=engine.version, dtype=engine.dtype,
        max_num_batched_tokens=engine.max_num_batched_tokens, max_prefill_step_tokens=engine.max_num_batched_tokens,
        context_length=engine.max_model_len,
        vocab_size=engine.vocab_size, eos_token_ids=tuple(sorted(eos)))

    async def start() -> OpenedEngine:
        await engine.start()
        return OpenedEngine(engine, identity, tokenizer, _rates_line(engine.rates.rates()))

    return start


def _rates_line(rates) -> str:
    return f"prefill {rates.prefill_tok_s:.0f} tok/s, decode {rates.decode_tok_s:.0f} tok/s"

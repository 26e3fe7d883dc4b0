"""Build a ready engine from a model name: resolve files, load weights, size the cache, calibrate."""

from __future__ import annotations

from tandem.engine.config import DEFAULT_BATCHED_WEIGHTS, DEFAULT_DECODE_WEIGHTS, CacheConfig, SchedulerConfig
from tandem.engine.engine import LLMEngine
from tandem.model_files import resolve_model
from tandem.engine.model.runner import ModelRunner
from tandem.tokenizer import load_tokenizer


def build_engine(
    model: str | None = None,
    device: str = "cpu",
    dtype: str | None = None,
    scheduler: SchedulerConfig = SchedulerConfig(),
    cache: CacheConfig = CacheConfig(),
    max_model_len: int | None = None,
    calibrate: bool = True,
    decode_weights: str = DEFAULT_DECODE_WEIGHTS,
    cuda_graphs: bool | None = None,
    batched_weights: str = DEFAULT_BATCHED_WEIGHTS,
) -> LLMEngine:
    """Load ``model`` (see ``resolve_model``) on ``device`` and return its engine, calibrated by default."""
    model_dir = resolve_model(model)
    runner = ModelRunner(model_dir, device, dtype, cache, scheduler.block_size, max_model_len, decode_weights,
                         cuda_graphs, batched_weights)
    engine = LLMEngine(runner, load_tokenizer(model_dir), scheduler)
    if calibrate:
        engine.calibrate()
    return engine

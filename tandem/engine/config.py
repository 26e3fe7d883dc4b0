"""Engine configuration: frozen, validated, and independent of any model."""

from __future__ import annotations

from dataclasses import dataclass

# How the engine thread is scheduled: "batch" puts it in Linux's SCHED_BATCH class (see AsyncEngine).
# "normal" by default: ahead of "batch" in four alternating pairs of bench-peers runs, with the router's
# added TTFT no better under "batch" (docs/benchmarks.md, `--engine-priority`).
ENGINE_PRIORITIES = ("normal", "batch")
DEFAULT_ENGINE_PRIORITY = "normal"
# The weights that the decode steps of a float32 CPU model read (see PackedLinear): "int8" (a scale per 32
# columns) reads a quarter of float32's bytes, "float16" half; "auto" reads each weight that lies on a 4-bit grid
# (a model dequantized from a Q4_1 GGUF file, as the default model is) in those 4 bits, exactly, and the others
# in int8. All pass the teacher-forced quality gate against float32 (tests/engine/test_quality.py); auto, the
# fastest, is the default.
DECODE_WEIGHTS = ("auto", "int8", "float16", "float32")
DEFAULT_DECODE_WEIGHTS = "auto"
# The weights that the steps of many rows of a float32 CPU model (prefill chunks, wide batches) read:
# "bfloat16" where the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX), through oneDNN, at about
# 1.8x float32's speed on an AVX-512 EPYC; "auto" picks it there unless the decode weights are float32, so a
# float32 worker stays float32 throughout. It passes the same quality gate, on prefill-shaped steps.
BATCHED_WEIGHTS = ("auto", "bfloat16", "float32")
DEFAULT_BATCHED_WEIGHTS = "auto"
# --cuda-graphs: whether steps of decodes replay from CUDA graphs; None leaves it to the device (on CUDA)
CUDA_GRAPHS = {"auto": None, "on": True, "off": False}


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one engine's scheduler.

    Args:
        max_active_requests: requests in the running batch at once.
        max_waiting_requests: bound of the waiting queue; a request beyond it is rejected.
        max_num_batched_tokens: tokens computed in one step (prefill chunks plus decodes): it bounds how long
            a prefill chunk makes the decoding streams wait.
        max_prefill_step_tokens: tokens the first request of a step may compute by itself where no running
            request decodes, so that the longer step delays no stream: a prompt alone runs in fewer, larger
            chunks, whose matrix products run faster per row. Requests after it share what is left of
            ``max_num_batched_tokens``, so that a burst sharing a prompt prefix still waits one step for the
            first to cache it. Never fewer than ``max_num_batched_tokens``. A prompt whose log-probabilities
            are asked for still runs ``max_num_batched_tokens`` at a time, bounding its logits.
        block_size: tokens per KV block.
    """

    max_active_requests: int = 8
    max_waiting_requests: int = 256
    max_num_batched_tokens: int = 512
    max_prefill_step_tokens: int = 4096
    block_size: int = 16

    def __post_init__(self) -> None:
        _require_positive("max_active_requests", self.max_active_requests)
        _require_positive("max_waiting_requests", self.max_waiting_requests)
        _require_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _require_positive("max_prefill_step_tokens", self.max_prefill_step_tokens)
        _require_positive("block_size", self.block_size)
        if self.max_num_batched_tokens < self.max_active_requests:
            raise ValueError(
                "max_num_batched_tokens must be at least max_active_requests, "
                "so that every running request can decode in one step"
            )


@dataclass(frozen=True)
class CacheConfig:
    """Size of the paged KV cache.

    Args:
        num_kv_blocks: exact number of blocks; when None, ``kv_cache_bytes`` decides.
        kv_cache_bytes: memory for keys and values of all layers together.
    """

    num_kv_blocks: int | None = None
    kv_cache_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if self.num_kv_blocks is not None:
            _require_positive("num_kv_blocks", self.num_kv_blocks)
        _require_positive("kv_cache_bytes", self.kv_cache_bytes)


def _require_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")

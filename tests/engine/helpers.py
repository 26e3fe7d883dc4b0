from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest
import torch

from tandem.engine.config import CacheConfig, SchedulerConfig
from tandem.engine.engine import LLMEngine, RequestOutput
from tandem.engine.model.factory import build_engine
from tandem.engine.model.runner import native_bfloat16
from tandem.engine.request import Request
from tandem.sampling import SamplingParams
from tests.device import TEST_DEVICE

GREEDY = SamplingParams(temperature=0)


def make_engine(model_dir: Path, num_kv_blocks: int = 256, cuda_graphs: bool | None = None, **scheduler) -> LLMEngine:
    """An uncalibrated fp32 engine on the test device, token for token comparable with ``hf_greedy``."""
    scheduler = {"max_num_batched_tokens": 64, **scheduler}
    scheduler.setdefault("max_prefill_step_tokens", scheduler["max_num_batched_tokens"])  # one budget unless set
    config = SchedulerConfig(**scheduler)
    return build_engine(str(model_dir), TEST_DEVICE, "float32", scheduler=config,
                        cache=CacheConfig(num_kv_blocks=num_kv_blocks), calibrate=False, decode_weights="float32",
                        cuda_graphs=cuda_graphs)


def skip_without_native_bfloat16() -> None:
    if not native_bfloat16():
        pytest.skip("bfloat16 batched weights need a CPU that multiplies bfloat16")


def random_prompt(engine: LLMEngine, length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, engine.executor.vocab_size) for _ in range(length)]


def greedy_request(req_id: str, prompt: list[int], max_new_tokens: int, **kwargs) -> Request:
    return Request(req_id, prompt, max_new_tokens, GREEDY, ignore_eos=True, **kwargs)


def run_to_completion(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    """Step the engine until idle; every request's outputs in order."""
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(100_000):
        if not engine.has_work():
            return outputs
        for output in engine.step():
            outputs.setdefault(output.req_id, []).append(output)
    raise AssertionError("engine did not finish")


def output_tokens(outputs: list[RequestOutput]) -> list[int]:
    return [token for output in outputs for token in output.token_ids]


@functools.lru_cache(maxsize=4)
def _hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(TEST_DEVICE).eval()
    model.generation_config.eos_token_id = None  # never stop at EOS, as ``ignore_eos``
    return model


def hf_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Reference output: transformers' own generate, greedy, never stopping at EOS (as ``ignore_eos``)."""
    with torch.inference_mode():
        out = _hf_model(str(model_dir)).generate(
            torch.tensor([prompt], device=TEST_DEVICE), do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0
        )
    return out[0, len(prompt):].tolist()


def hf_logprobs(model_dir, token_ids: list[int]) -> torch.Tensor:
    """transformers' log-probabilities of the next token at every position of ``token_ids``."""
    with torch.inference_mode():
        logits = _hf_model(str(model_dir))(torch.tensor([token_ids], device=TEST_DEVICE)).logits[0]
    return torch.log_softmax(logits.float(), dim=-1).cpu()


def assert_no_leaks(engine: LLMEngine) -> None:
    load = engine.scheduler.load()
    assert (load.num_running, load.num_waiting) == (0, 0)
    assert engine.scheduler.pool.num_used_blocks == 0
    assert not engine._requests and not engine._detokenizers

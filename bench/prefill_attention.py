"""A prefill chunk's attention, one layer of the default model's heads (9 query heads over 3 key-value heads of
64): the CPU kernels' ``prefill_attention`` in float32, and in bfloat16 products where the build has them
(AVX512-BF16), against torch's float32 ``scaled_dot_product_attention`` as the engine called it without the
kernel (causal for a first chunk; after a cached prefix, the context gathered from the cache and an additive
mask). Each case timed in turns, the median of ``--repeats``. Writes bench/results/prefill-attention.json.

    .venv/bin/python bench/prefill_attention.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from weights import loaded_kernels

RESULTS = Path(__file__).resolve().parent / "results"
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
CASES = ((512, 0), (512, 512), (512, 3584), (4096, 0))  # (chunk tokens, cached positions before them)


def timed(function, repeats: int) -> float:
    function()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = loaded_kernels()
    scale, results = HEAD_DIM ** -0.5, []
    for tokens, prefix in CASES:
        context = prefix + tokens
        torch.manual_seed(context)
        k_cache, v_cache = torch.randn(context + 64, KV_HEADS, HEAD_DIM), torch.randn(context + 64, KV_HEADS, HEAD_DIM)
        slots = torch.randperm(context + 64)[:context]
        qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
        q = qkv[:, :HEADS * HEAD_DIM].view(tokens, HEADS, HEAD_DIM)
        out = torch.empty(tokens, HEADS, HEAD_DIM)
        out_bf16 = torch.empty(tokens, HEADS, HEAD_DIM, dtype=torch.bfloat16)
        hidden = torch.arange(context)[None, :] > torch.arange(prefix, context)[:, None]
        mask = torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf"))[None, None]

        def kernel():
            kernels.prefill_attention(q, k_cache, v_cache, slots, scale, out)

        def kernel_bf16():
            kernels.prefill_attention(q, k_cache, v_cache, slots, scale, out_bf16)

        own_keys, own_values = k_cache[slots], v_cache[slots]  # a first chunk's: the projection's own rows

        def torch_sdpa():
            keys, values = (k_cache.index_select(0, slots), v_cache.index_select(0, slots)) if prefix \
                else (own_keys, own_values)
            return F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                attn_mask=mask if prefix else None, is_causal=not prefix, scale=scale, enable_gqa=True)

        cases = {"kernel": kernel, "torch": torch_sdpa}
        expected = torch_sdpa()[0].transpose(0, 1)
        kernel()
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
        if kernels.attends_prefills(HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16):
            cases["kernel_bf16"] = kernel_bf16
            kernel_bf16()
            torch.testing.assert_close(out_bf16.float(), expected, rtol=0.02, atol=0.01)
        times = {name: [] for name in cases}
        for _ in range(3):
            for name, case in cases.items():
                times[name].append(timed(case, args.repeats))
        flops = 4 * HEAD_DIM * HEADS * sum(prefix + i + 1 for i in range(tokens))
        row = {"tokens": tokens, "prefix": prefix}
        for name, seconds in times.items():
            median = statistics.median(seconds)
            row[f"{name}_ms"], row[f"{name}_gflops"] = median * 1e3, flops / median / 1e9
        results.append(row)
        print(f"{tokens} tokens after {prefix}: " + ", ".join(
            f"{name} {row[f'{name}_ms']:.2f} ms ({row[f'{name}_gflops']:.0f} GFLOP/s)" for name in times))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "prefill-attention.json").write_text(json.dumps(
        {"isa": kernels.isa, "threads": args.threads, "cases": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()

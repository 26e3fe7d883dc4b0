"""What each weight format costs a CPU decode step: every linear layer of the default model's shape
(30 layers and the output head, each with its own weights, so nothing stays in cache), multiplied by
1 to 32 rows, as oneDNN's packed fp32, float16 through Tandem's kernel (tandem/engine/model/cpu_kernels.c;
the widest build this CPU runs, and beside it each narrower one: AVX2 on an AVX-512 CPU), int8 through
the same kernel with a scale per row, per 64 columns and per 32 columns (``INT8_GROUP``; per 32
columns through each narrower build too: AVX-512 and AVX2 on an AMX CPU), the default model's default decode
copy (``auto``: the layers in uint4, the output head in int8 in groups of 32), bf16 through F.linear and, in the
AMX build, through Tandem's tiles (the batched path there), and int8 through torch's int8 kernel.

It reports the most rows at which the default decode copy beats packed fp32.
Then whole decode steps of the default model: 1 to 64 rows on its default decode copy through the one-call
kernel against the same step layer by layer on each kind of batched weights (float32, and bfloat16 where
the CPU multiplies it), and the crossover a worker uses here (``tandem/engine/model/crossover.py``); where
the copy may win prompt chunks too (``crossover.copy_may_win_prompts``), chunks of 128 to 4096 rows through one
whole decoder layer on both, and ``prompt_rows``.
Writes bench/results/weights.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tandem.engine.config import CacheConfig
from tandem.engine.model import cpu_kernels, crossover
from tandem.engine.model.runner import ModelRunner, native_bfloat16
from tandem.model_files import resolve_model

RESULTS = Path(__file__).resolve().parent / "results"
# (out, in) of one SmolLM2-135M layer's fused projections: qkv, o, gate_up, down; then the output head.
LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)
INT8_GROUPS = (None, 64, cpu_kernels.INT8_GROUP)  # columns per int8 scale; None: one per row


def timed_ms(step, repeats: int) -> float:
    step()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    return (time.perf_counter() - start) / repeats * 1000


def loaded_kernels() -> cpu_kernels.CpuKernels:
    """The widest build of the CPU kernels this machine runs; exits where none does."""
    kernels = cpu_kernels.load()
    if kernels is None:
        raise SystemExit("the CPU kernels cannot run here (see the log above)")
    return kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    kernels = loaded_kernels()
    narrower = [cpu_kernels.load(isa) for isa in cpu_kernels.usable_isas()[1:]]  # beside the widest
    shapes = LAYER * args.layers + [HEAD]
    weights = [torch.randn(shape) * 0.02 for shape in shapes]
    f16 = [kernels.pack(w, torch.float16) for w in weights]
    f16_narrower = {other: [other.pack(w, torch.float16) for w in weights] for other in narrower}
    int8_narrower = {other: [other.pack(w, torch.int8) for w in weights] for other in narrower}
    int8_kernel = {group: [kernels.pack(w, torch.int8, group) for w in weights] for group in INT8_GROUPS}
    auto = [kernels.pack(w, torch.uint4) for w in weights[:-1]] + int8_kernel[cpu_kernels.INT8_GROUP][-1:]
    bf16 = [w.bfloat16() for w in weights]
    bf16_tiles = [kernels.pack_bfloat16(w) for w in weights] if kernels.tiles_bfloat16(LAYER[0][1]) else []
    scales = [w.abs().amax(1) / 127 for w in weights]
    int8 = [torch.round(w / s[:, None]).to(torch.int8) for w, s in zip(weights, scales)]
    report = {"threads": args.threads, "weight_bytes_fp32": sum(w.numel() * 4 for w in weights), "isa": kernels.isa,
              "ms_per_step": {}}
    for rows in (1, 2, 4, 8, 16, 32):
        inputs = {size: torch.randn(rows, size) for size in {shape[1] for shape in shapes}}
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
        formats = {
            "fp32_packed": lambda: [torch.ops.mkldnn._linear_pointwise(inputs[s[1]], w, None, "none", [], "")
                                    for w, s in zip(packed, shapes)],
            "f16_kernel": lambda: [kernels.linear(inputs[w.in_features], w, None) for w in f16],
            **{f"f16_kernel_{other.isa}": lambda other=other: [other.linear(inputs[w.in_features], w, None)
                                                               for w in f16_narrower[other]]
               for other in narrower},
            **{f"int8_kernel_{'row' if group is None else f'g{group}'}":
               lambda group=group: [kernels.linear(inputs[w.in_features], w, None) for w in int8_kernel[group]]
               for group in INT8_GROUPS},
            **{f"int8_kernel_g{cpu_kernels.INT8_GROUP}_{other.isa}":
               lambda other=other: [other.linear(inputs[w.in_features], w, None) for w in int8_narrower[other]]
               for other in narrower},
            "auto_kernel": lambda: [kernels.linear(inputs[w.in_features], w, None) for w in auto],
            "bf16": lambda: [F.linear(inputs[s[1]].bfloat16(), w).float() for w, s in zip(bf16, shapes)],
            **({"bf16_tiles": lambda: [kernels.linear_bfloat16(inputs[w.in_features].bfloat16(), w, None, torch.float32)
                                       for w in bf16_tiles]} if bf16_tiles else {}),
            "int8": lambda: [torch._weight_int8pack_mm(inputs[s[1]], w, scale) for w, s, scale in zip(int8, shapes, scales)],
        }
        report["ms_per_step"][rows] = {name: timed_ms(step, args.repeats) for name, step in formats.items()}
        print(rows, "rows:", ", ".join(f"{name} {ms:.1f} ms" for name, ms in report["ms_per_step"][rows].items()), flush=True)
        del packed
    report["decode_steps"] = {batched: whole_decode_steps(batched) for batched in batched_weights()}
    report["default_kernel_faster_up_to_rows"] = max((rows for rows, ms in report["ms_per_step"].items()
                                                      if ms["auto_kernel"] < ms["fp32_packed"]), default=0)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "weights.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"the default decode copy is faster than packed fp32 up to {report['default_kernel_faster_up_to_rows']} rows; "
          f"wrote {RESULTS / 'weights.json'}")


def batched_weights() -> list[str]:
    return ["float32", "bfloat16"] if native_bfloat16() else ["float32"]


def whole_decode_steps(batched: str) -> dict:
    """Step times of the default model on both paths at every size the crossover considers, and the rows up to
    which a worker here reads the decode copy (as recorded, or measured now); where the copy may win prompt
    chunks, one decoder layer over them on both paths, and the rows up to which chunks read it."""
    runner = ModelRunner(resolve_model(None), batched_weights=batched,
                         cache=CacheConfig(num_kv_blocks=max(crossover.LADDER)))
    copy = runner.decode_weights
    ms = {}
    for rows in crossover.LADDER:
        decode_copy_s, batched_s = crossover.step_seconds(runner.decode_step, rows)
        ms[rows] = {f"{copy}_one_call": decode_copy_s * 1000, f"{batched}_layer_by_layer": batched_s * 1000}
        print(f"decode step of {rows} rows: {copy} decode copy {decode_copy_s * 1000:.1f} ms, {batched} batched "
              f"weights {batched_s * 1000:.1f} ms", flush=True)
    print(f"with {batched} batched weights, steps of up to {runner.model.decode_rows} rows read the decode copy here")
    prompt_ms = {}
    if crossover.copy_may_win_prompts(runner.model.decode_rows, copy):
        for rows in crossover.PROMPT_LADDER:
            decode_copy_s, batched_s = crossover.step_seconds(runner.prompt_layer, rows)
            prompt_ms[rows] = {copy: decode_copy_s * 1000, batched: batched_s * 1000}
            print(f"a prompt chunk of {rows} rows through one decoder layer: {copy} decode copy "
                  f"{decode_copy_s * 1000:.1f} ms, {batched} batched weights {batched_s * 1000:.1f} ms", flush=True)
        print(f"prompt chunks of up to {runner.model.prompt_rows} rows read the decode copy here")
    return {"ms_per_step": ms, "decode_rows": runner.model.decode_rows, "ms_per_prompt_layer": prompt_ms,
            "prompt_rows": runner.model.prompt_rows}


if __name__ == "__main__":
    main()

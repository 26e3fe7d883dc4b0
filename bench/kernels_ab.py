"""Two builds of the CPU kernels side by side: this tree's cpu_kernels.c against the one at a git
revision, both in one instruction set (the widest this CPU runs, or --isa), each with the cpu_kernels.py of its
tree (which packs the weights in its layout), loaded into one process and timed in turns, so that a change to the
kernels is measured against the code before it under the same load.

Timed: every linear layer of the default model's shape (30 layers and the output head, each with its
own weights) at 1 and 8 rows, in float16, int8 and uint4 (the default's decode weights on the default model's
layers), the 30 layers in uint4 over a prompt chunk of 512 rows (rounded to int8 for their kernel), and decode
attention
over 30 layers (each with its own cache) for one sequence of 600 positions and for 8 sequences of about 600
sharing a 496-token prefix, as in the burst.
Writes bench/results/kernels-ab.json.

    .venv/bin/python bench/kernels_ab.py --baseline HEAD~1
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tandem.engine.model import cpu_kernels
from tandem.engine.model.cpu_kernels import BlockTables, CpuKernels
from weights import HEAD, LAYER

RESULTS = Path(__file__).resolve().parent / "results"
SOURCE = "tandem/engine/model/cpu_kernels.c"
MODULE = "tandem/engine/model/cpu_kernels.py"
LAYERS, BLOCK_SIZE, HEADS, KV_HEADS, HEAD_DIM = 30, 16, 9, 3, 64
PROMPT_ROWS = 512
FORMATS = {torch.float16: "float16", torch.int8: "int8", torch.uint4: "uint4"}


def build(revision: str | None, isa: str, directory: Path, name: str) -> CpuKernels:
    """The kernels of ``revision`` (None: this tree), built into ``directory`` and loaded through that revision's
    cpu_kernels.py."""
    module_path, source = directory / f"{name}_cpu_kernels.py", directory / f"{name}.c"
    for path, tracked in ((module_path, MODULE), (source, SOURCE)):
        path.write_text(Path(tracked).read_text() if revision is None else git_show(revision, tracked))
    spec = importlib.util.spec_from_file_location(f"{name}_cpu_kernels", module_path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # where its dataclasses look it up
    spec.loader.exec_module(module)
    library = directory / f"{name}.so"
    subprocess.run(["cc", *module._flags(isa), str(source), "-o", str(library)], check=True)
    return module.CpuKernels(library, isa)


def git_show(revision: str, path: str) -> str:
    return subprocess.run(["git", "show", f"{revision}:{path}"], capture_output=True, text=True, check=True).stdout


def block_tables(batch: int) -> BlockTables:
    if batch == 1:
        return BlockTables([torch.arange(38, dtype=torch.int64)], [600], BLOCK_SIZE)
    prefix_blocks = list(range(31))  # 496 positions
    rows, lengths = [], []
    for seq in range(batch):
        own = list(range(31 + 7 * seq, 38 + 7 * seq))
        rows.append(torch.tensor(prefix_blocks + own, dtype=torch.int64))
        lengths.append(496 + 7 * BLOCK_SIZE - seq % 5)
    return BlockTables(rows, lengths, BLOCK_SIZE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="HEAD~1", help="git revision of the baseline cpu_kernels.c and .py")
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--isa", choices=cpu_kernels.usable_isas(), help="the build to time (default: the widest)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    isa = args.isa or cpu_kernels.usable_isas()[0]
    with tempfile.TemporaryDirectory() as scratch:
        builds = {"baseline": build(args.baseline, isa, Path(scratch), "baseline"),
                  "current": build(None, isa, Path(scratch), "current")}
        weights = [torch.randn(out, width) * 0.02 for _ in range(LAYERS) for out, width in LAYER]
        weights.append(torch.randn(*HEAD) * 0.02)
        packed = {(name, dtype): [kernels.pack(w, dtype) for w in weights]
                  for name, kernels in builds.items() for dtype in FORMATS}
        slots = 2048
        caches = [(torch.randn(slots, KV_HEADS, HEAD_DIM), torch.randn(slots, KV_HEADS, HEAD_DIM))
                  for _ in range(LAYERS)]

        def linears(name: str, dtype: torch.dtype, rows: int, head: bool = True) -> float:
            inputs = {width: torch.randn(rows, width) for width in {w.shape[1] for w in weights}}
            start = time.perf_counter()
            for weight in packed[name, dtype][:None if head else LAYERS * len(LAYER)]:
                builds[name].linear(inputs[weight.in_features], weight, None)
            return time.perf_counter() - start

        def attention(name: str, tables: BlockTables, queries: torch.Tensor) -> float:
            start = time.perf_counter()
            for keys, values in caches:
                builds[name].decode_attention(queries, keys, values, tables, HEAD_DIM ** -0.5)
            return time.perf_counter() - start

        times: dict[str, dict[str, list[float]]] = {}
        for batch in (1, 8):
            tables, queries = block_tables(batch), torch.randn(batch, HEADS, HEAD_DIM)
            for _ in range(args.repeats):
                for name in builds:
                    for dtype in FORMATS:
                        times.setdefault(f"linears_{FORMATS[dtype]}_{batch}_rows_ms", {}).setdefault(name, []).append(
                            linears(name, dtype, batch))
                    times.setdefault(f"attention_batch_{batch}_ms", {}).setdefault(name, []).append(
                        attention(name, tables, queries))
        for _ in range(args.repeats):
            for name in builds:  # the output head multiplies a prompt's last row only
                times.setdefault(f"uint4_layers_{PROMPT_ROWS}_rows_ms", {}).setdefault(name, []).append(
                    linears(name, torch.uint4, PROMPT_ROWS, head=False))
    report = {"baseline": args.baseline, "isa": isa, "threads": args.threads, "repeats": args.repeats,
              "median_ms": {probe: {name: statistics.median(runs) * 1000 for name, runs in by_build.items()}
                            for probe, by_build in times.items()}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "kernels-ab.json").write_text(json.dumps(report, indent=2) + "\n")
    for probe, medians in report["median_ms"].items():
        print(f"{probe}: baseline {medians['baseline']:.2f}, current {medians['current']:.2f} "
              f"({medians['baseline'] / medians['current']:.2f}x)")


if __name__ == "__main__":
    main()

"""The builds of the CPU kernels wider than the CPU runs, compiled to run on it with their instructions carried
out in others: their arithmetic, not their speed.

- ``avx512-on-avx2``: the AVX512-BF16 build (the AVX-512 build and its bfloat16 prefill attention), its AVX-512
  intrinsics carried out in AVX2 ones by SIMDe (avx512_on_avx2.h), at -O1: SIMDe's operations, inlined and
  unrolled at -O3, take over a minute to compile.
- ``amx-emulated``: the AMX build, its tile instructions carried out in C (amx_tiles.h), its others natively
  where the CPU runs the AVX512-BF16 build, else through SIMDe.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import simde_py

from tandem.engine.model import cpu_kernels

AVX512 = "avx512-on-avx2"
AMX = "amx-emulated"
HERE = Path(__file__).parent


def wanted(native: list[str]) -> list[str]:
    """The emulated builds to test beside the ``native`` ones, the builds the CPU runs."""
    if "avx2" not in native:
        return []
    return ([AVX512] if "avx512" not in native else []) + ([AMX] if "amx" not in native else [])


def build(name: str, native: list[str], directory: Path) -> cpu_kernels.CpuKernels | None:
    """The emulated build ``name``, compiled into ``directory``; None without a C compiler."""
    compiler = cpu_kernels.c_compiler()
    if compiler is None:
        return None
    simde = ("-O1", "-Wno-psabi", f"-I{simde_py.get_include()}", "-include", str(HERE / "avx512_on_avx2.h"))
    if name == AVX512:
        arguments, isa = simde, "avx512bf16"
    else:
        others = cpu_kernels.ISAS["avx512bf16"][1] if "avx512bf16" in native else simde
        arguments, isa = (*others, "-include", str(HERE / "amx_tiles.h")), "amx"
    library = directory / f"{name}.so"
    subprocess.run([compiler, *cpu_kernels.FLAGS, *arguments, str(cpu_kernels.SOURCE), "-o", str(library)],
                   check=True, capture_output=True, text=True)
    return cpu_kernels.CpuKernels(library, isa)


def serve_amx(directory: Path) -> None:
    """``cpu_kernels.load`` serves the emulated AMX build where it would serve the AMX or the widest build: the
    engines of a test run then compute through the AMX build (``pytest --emulated-amx``)."""
    kernels = build(AMX, cpu_kernels.usable_isas(), directory)
    native = cpu_kernels.load

    def load(isa: str | None = None) -> cpu_kernels.CpuKernels | None:
        return kernels if isa in (None, "amx") else native(isa)
    load.cache_clear = native.cache_clear
    cpu_kernels.load = load

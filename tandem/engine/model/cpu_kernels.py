"""CPU kernels for the decode steps of a float32 model (``cpu_kernels.c``), built on first use.

- ``linear_f16``: rows times a float16 weight, in float32 arithmetic (half the bytes of a float32 weight);
- ``decode_attention``: one query per sequence against its context, read in place from the paged cache.

The C source ships with the package. It is compiled with the system C compiler into
``$TANDEM_HOME/kernels`` once per source and flags (``tandem provision`` does it ahead of time, so a
machine without a compiler can run a library built there), then loaded with ctypes, which releases the
GIL for the call. ``load()`` returns None, and says why in the log, where the kernels cannot run: not
an x86-64 Linux CPU with AVX2, FMA and F16C, or neither a built library nor a working C compiler.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from tandem.engine.model.loader import tandem_home

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-lm")
CPU_FLAGS = frozenset({"avx2", "fma", "f16c"})


class CpuKernels:
    def __init__(self, library: Path):
        c = ctypes.CDLL(str(library))
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._linear_f16 = c.tandem_linear_f16
        self._linear_f16.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, ctypes.c_int]
        self._linear_f16.restype = None
        self._decode_attention = c.tandem_decode_attention
        self._decode_attention.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float,
                                           ptr, ctypes.c_int]
        self._decode_attention.restype = ctypes.c_int

    def linear_f16(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x · weightᵀ + bias`` for float32 rows ``x`` [rows, k] and a float16 ``weight`` [n, k]."""
        if x.dtype != torch.float32 or weight.dtype != torch.float16 or x.shape[-1] != weight.shape[1]:
            raise ValueError(f"linear_f16 needs float32 rows and a float16 weight of matching width, got "
                             f"{x.dtype} {tuple(x.shape)} and {weight.dtype} {tuple(weight.shape)}")
        x = x.contiguous()
        out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
        self._linear_f16(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), weight.shape[0],
                         None if bias is None else bias.data_ptr(), out.data_ptr(), torch.get_num_threads())
        return out

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                         scale: float) -> torch.Tensor:
        """Attention of ``q`` [seqs, heads, head_dim] (one token per sequence) over each sequence's
        first ``context_lens[i]`` cached positions, found through ``block_tables`` [seqs, max_blocks];
        ``k_cache``, ``v_cache``: one layer's [slots, kv_heads, head_dim]. All float32 and int64."""
        seqs, heads, head_dim = q.shape
        if (q.dtype, k_cache.dtype, v_cache.dtype) != (torch.float32,) * 3 or block_tables.dtype != torch.int64 \
                or context_lens.dtype != torch.int64 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("decode_attention needs contiguous float32 q and caches and int64 tables")
        q, block_tables, context_lens = q.contiguous(), block_tables.contiguous(), context_lens.contiguous()
        out = torch.empty_like(q)
        status = self._decode_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                        block_tables.data_ptr(), context_lens.data_ptr(), seqs, block_tables.shape[1],
                                        block_size, heads, k_cache.shape[1], head_dim, scale, out.data_ptr(),
                                        torch.get_num_threads())
        if status != 0:
            raise ValueError(f"decode_attention does not take {heads} heads over {k_cache.shape[1]} key-value "
                             f"heads of size {head_dim}")
        return out

    @staticmethod
    def supports_attention(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        """Whether ``decode_attention`` takes this head layout (see ``tandem_decode_attention``)."""
        return head_dim % 8 == 0 and head_dim <= 256 and num_heads % num_kv_heads == 0 \
            and num_heads // num_kv_heads <= 16


@functools.cache
def load() -> CpuKernels | None:
    """The kernels, compiled if this machine has not compiled this version yet; None where they cannot run."""
    missing = CPU_FLAGS - _cpu_flags()
    if platform.machine() != "x86_64" or missing:
        logger.warning("the CPU kernels need an x86-64 CPU with %s (missing: %s); decode steps use torch's ops",
                       ", ".join(sorted(CPU_FLAGS)), ", ".join(sorted(missing)) or platform.machine())
        return None
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *FLAGS]).encode()).hexdigest()[:16]
    library = tandem_home() / "kernels" / f"cpu_kernels-{key}.so"
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    try:
        if not library.exists():
            if compiler is None:
                logger.warning("the CPU kernels need a C compiler (cc, gcc or $CC); decode steps use torch's ops")
                return None
            _build(compiler, library)
        return CpuKernels(library)
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", None) or error
        logger.warning("could not build the CPU kernels with %s (%s); decode steps use torch's ops", compiler, detail)
        return None


def _cpu_flags() -> frozenset[str]:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def _build(compiler: str, library: Path) -> None:
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        built = Path(scratch) / library.name
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built)], capture_output=True, text=True, check=True)
        os.replace(built, library)
    logger.info("built the CPU kernels: %s", library)

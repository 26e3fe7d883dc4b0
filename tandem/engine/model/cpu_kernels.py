"""CPU kernels for the steps of a float32 model (``cpu_kernels.c``), built on first use.

- ``linear``: rows times a float16 weight (half the bytes of a float32 weight), an int8 weight with a
  scale per group of ``INT8_GROUP`` columns (a quarter, plus the scales), or a uint4 weight with a step and a
  minimum per group of ``UINT4_GROUP`` columns (an eighth, plus those), packed by ``pack``; float16 rows in
  float32 arithmetic, int8 and uint4 rows rounded to int16 in each ``INTEGER_ROW_GROUP`` columns and multiplied
  in integers (the rows of uint4 steps of ``uint4_int8_rows`` or more, prompt chunks and the decodes beside
  them, rounded to int8); in the AMX build, int8 weights in a layout of their own, in float32 arithmetic, and
  steps of ``amx_min_rows`` rows or more in AMX tiles, in bfloat16 with float32 sums;
- ``linear_bfloat16`` (the AMX build): bfloat16 rows times a bfloat16 weight packed by ``pack_bfloat16``, in
  AMX tiles with float32 sums, for steps of many rows; for a gate and up projection, silu(gate) ⊙ up of the sums;
- ``decode_attention``: one query per sequence against its context, read in place from the paged cache;
- ``prefill_attention``: a prefill chunk's causal attention over its context, read from the paged cache by
  slot, in float32 FMAs, or where the CPU has AVX512-BF16 in bfloat16 products with float32 sums (in AMX tiles
  in the AMX build);
- ``rms_norm`` (with the residual add), ``rope_and_cache`` and ``silu_and_mul``: each one call where
  torch's ops take several, the dispatch of which dominates a decode step's non-matmul time;
- ``decode_layers``: all the decoder layers of a small step in one call.

The C source ships with the package. It is compiled with the system C compiler into
``$TANDEM_HOME/kernels`` once per source and instruction set (``ISAS``: AVX2, or AVX-512 with VNNI where the
CPU has it, with AVX512-BF16 too where it has that, or AMX where it has AMX tiles; ``tandem provision`` builds
every one this CPU runs ahead of time, so a machine without a compiler can run a library built there), then
loaded with ctypes, which releases the GIL for the call. ``load()`` returns None, and says why in the log, where
the kernels cannot run: not an x86-64 Linux CPU with AVX2, FMA and F16C, or neither a built library nor a
working C compiler.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from tandem.model_files import tandem_home

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-lm")
CPU_FLAGS = frozenset({"avx2", "fma", "f16c"})
# Columns of a weight row that share one int8 scale, as llama.cpp's Q8_0 groups them. Against the
# teacher-forced quality gate (tests/engine/test_quality.py), a scale per row fails (top-1 agreement) and
# per 64 columns passes with less margin; `make bench-weights` times all three alike.
INT8_GROUP = 32
UINT4_GROUP = 32  # columns of a row that share a uint4 step and minimum (Q4_1's groups)
# Columns of a row of x the kernels round to integers with one scale (INTEGER_ROW_GROUP in cpu_kernels.c too; the
# AMX layout's depth): an int8 weight's rows and scale groups are a multiple of it.
INTEGER_ROW_GROUP = 32
UINT4_SAMPLE_GROUPS = 4096  # groups of a weight checked first, so that one off the grid (an int8 head) fails fast
# Builds of the same source, widest first: each needs these CPU flags beyond CPU_FLAGS, and compiles with
# these flags beyond FLAGS.
_AVX512 = (frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}),
           ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"))
_AVX512_BF16 = (_AVX512[0] | {"avx512_bf16"}, (*_AVX512[1], "-mavx512bf16"))
ISAS = {"amx": (_AVX512_BF16[0] | {"amx_tile", "amx_bf16"}, (*_AVX512_BF16[1], "-mamx-tile", "-mamx-bf16")),
        "avx512bf16": _AVX512_BF16,
        "avx512": _AVX512,
        "avx2": (frozenset(), ())}


class CpuKernels:
    def __init__(self, library: Path, isa: str):
        self.library = library
        self.isa = isa
        c = ctypes.CDLL(str(library))
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._linear = c.tandem_linear
        self._linear.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, i64, ptr, ptr, ctypes.c_int]
        self._linear.restype = ctypes.c_int
        self.tile_rows = c.tandem_linear_tile_rows()  # float16 weight rows a tile
        self.integer_tile_rows = c.tandem_linear_integer_tile_rows()  # the same for int8 and uint4 weights
        self.uint4_int8_rows = c.tandem_linear_int4_int8_rows()
        self.chunk = c.tandem_linear_chunk()  # floats per vector: the packed float16 weights' chunk width
        # weight rows per block of the AMX build's int8 and bfloat16 layout (0: no AMX build; int8 is tiled as
        # uint4 is), and the fewest rows it multiplies int8 weights by in AMX tiles, in bfloat16 (0: none; fewer
        # rows stay float32)
        self.amx_block_rows = c.tandem_linear_amx_block_rows()
        self.amx_min_rows = c.tandem_linear_amx_min_rows()
        self.prefill_attention_in_bfloat16 = bool(c.tandem_prefill_attention_in_bfloat16())
        self._linear_bf16 = None
        if self.amx_block_rows:
            if c.tandem_amx_init() != 0:
                raise OSError("Linux did not grant this process the AMX tile state")
            self._linear_bf16 = c.tandem_linear_bf16
            self._linear_bf16.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, ctypes.c_int, ctypes.c_int, ctypes.c_int]
            self._linear_bf16.restype = ctypes.c_int
        self._index_range = c.tandem_index_range
        self._index_range.argtypes = [ptr, ptr, i64, i64, ptr]
        self._index_range.restype = None
        self._decode_attention = c.tandem_decode_attention
        self._decode_attention.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float,
                                           ptr, ctypes.c_int]
        self._decode_attention.restype = ctypes.c_int
        self._rms_norm = {torch.float32: c.tandem_rms_norm, torch.bfloat16: c.tandem_rms_norm_bf16}
        for function in self._rms_norm.values():
            function.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_float, ptr, ctypes.c_int]
            function.restype = None
        self._rope_and_cache = c.tandem_rope_and_cache
        self._rope_and_cache.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_int]
        self._rope_and_cache.restype = None
        self._silu_and_mul = c.tandem_silu_and_mul
        self._silu_and_mul.argtypes = [ptr, i64, i64, ptr, ctypes.c_int]
        self._silu_and_mul.restype = None
        self._silu_and_mul_bf16 = c.tandem_silu_and_mul_bf16
        self._silu_and_mul_bf16.argtypes = [ptr, i64, i64, ptr, ctypes.c_int]
        self._silu_and_mul_bf16.restype = None
        self._decode_layers = c.tandem_decode_layers
        self._decode_layers.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr,
                                        i64, ptr, i64, ptr, ctypes.c_int]
        self._decode_layers.restype = ctypes.c_int
        # by the dtype of their output: bfloat16 in the builds with AVX512-BF16, float32 in every build
        self._prefill_attention = {torch.bfloat16: c.tandem_prefill_attention,
                                   torch.float32: c.tandem_prefill_attention_float32}
        for function in self._prefill_attention.values():
            function.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float, ptr, ctypes.c_int]
            function.restype = ctypes.c_int

    def pack(self, weight: torch.Tensor, dtype: torch.dtype, group: int | None = INT8_GROUP) -> "PackedWeight":
        """``weight`` [n, k] in the tiled layout ``linear`` reads: as float16 (k a multiple of ``chunk``), as int8
        with each ``group`` columns of a row (None: the whole row) scaled to ±127 (round to nearest), or as uint4
        (``_pack_uint4``)."""
        rows, width = weight.shape
        if dtype not in (torch.float16, torch.int8, torch.uint4):
            raise ValueError(f"pack makes float16, int8 or uint4 weights, not {dtype}")
        if not self.packs(width, dtype, group):
            step = self._step(dtype)
            raise ValueError(f"pack needs rows a multiple of {step} wide, and int8 scale groups a multiple of "
                             f"{step} that divides them; got rows {width} wide, groups of {group}")
        if dtype == torch.uint4:
            return self._pack_uint4(weight)
        if dtype == torch.int8:
            return self._pack_int8_blocks(weight, group) if self.amx_block_rows else self._pack_int8(weight, group)
        padded = _padded_rows(weight.half(), self.tile_rows)
        data = padded.view(-1, self.tile_rows, width // self.chunk, self.chunk).transpose(1, 2).contiguous()
        return PackedWeight(data, None, rows, width)

    def _pack_int8(self, weight: torch.Tensor, group: int | None) -> "PackedWeight":
        """Laid out as ``integer_linear`` in cpu_kernels.c reads int8 weights: per tile of ``integer_tile_rows``
        rows, 2 bytes per row and 2 columns, [tiles, width / 2, rows of the tile, 2]; the scales per tile, group
        and row."""
        rows, width = weight.shape
        tile = self.integer_tile_rows
        padded = _padded_rows(weight.float(), tile)
        groups = width // (group or width)
        quantized, scales = _quantize_int8(padded.view(len(padded), groups, width // groups))
        tiles = len(padded) // tile
        data = quantized.view(tiles, tile, width // 2, 2).transpose(1, 2).contiguous()
        return PackedWeight(data, _per_tile(scales, tile), rows, width, group)

    def _pack_uint4(self, weight: torch.Tensor) -> "PackedWeight":
        """Each ``UINT4_GROUP`` columns of a row as 16 levels from its minimum to its maximum (round to nearest),
        its float16 step and minimum kept: llama.cpp's Q4_1 grid, exact for a weight that lies on one. Laid out
        as ``integer_linear`` in cpu_kernels.c reads it: per tile of ``integer_tile_rows`` rows, 16 bytes per 4
        columns and 8 rows, byte j holding row j // 2's columns j % 2 (low nibble) and 2 + j % 2 (high nibble);
        the steps and the minimums per tile, group and row."""
        rows, width = weight.shape
        tile = self.integer_tile_rows
        padded = _padded_rows(weight.float(), tile)
        levels, scales, minimums = _quantize_uint4(padded.view(len(padded), width // UINT4_GROUP, UINT4_GROUP))
        tiles = len(padded) // tile
        # [tiles, vectors, rows of a vector, fours of columns, low or high nibble, column of a pair]
        nibbles = levels.view(tiles, 2, tile // 2, width // 4, 2, 2)
        data = (nibbles[:, :, :, :, 0] | nibbles[:, :, :, :, 1] << 4).permute(0, 3, 1, 2, 4).contiguous()
        return PackedWeight(data, _per_tile(scales, tile), rows, width, UINT4_GROUP,
                            minimums=_per_tile(minimums, tile))

    def _pack_int8_blocks(self, weight: torch.Tensor, group: int | None) -> "PackedWeight":
        """The AMX build's int8 layout (``_amx_blocks``), and a scale per row and 32 columns."""
        rows, width = weight.shape
        group = group or width
        padded = self._amx_padded(weight.float())
        quantized, scales = _quantize_int8(padded.view(len(padded), width // group, group))
        passes, per_pass, depth = len(padded) // self.amx_block_rows, self.amx_block_rows // 16, width // 32
        per_depth = scales.repeat_interleave(group // 32, dim=1)  # [rows, width / 32]
        scales = per_depth.view(passes, per_pass, 16, depth).permute(0, 3, 1, 2).contiguous()
        return PackedWeight(self._amx_blocks(quantized.view(len(padded), width)), scales, rows, width, group)

    def _amx_padded(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` with rows of zeros up to a whole number of the AMX layout's blocks."""
        return _padded_rows(weight, self.amx_block_rows)

    def _amx_blocks(self, padded: torch.Tensor) -> torch.Tensor:
        """The AMX build's weight layout (see ``amx_linear`` in cpu_kernels.c): blocks of ``amx_block_rows``
        weight rows, each group of 32 columns as tiles of [16 column pairs][16 rows][2]."""
        rows, width = padded.shape
        passes, per_pass, depth = rows // self.amx_block_rows, self.amx_block_rows // 16, width // 32
        return padded.view(passes, per_pass, 16, depth, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()

    def tiles_bfloat16(self, width: int) -> bool:
        """Whether ``pack_bfloat16`` and ``linear_bfloat16`` take weights of rows ``width`` wide (the AMX build)."""
        return self._linear_bf16 is not None and width % 32 == 0

    def pack_bfloat16(self, weight: torch.Tensor, gated: bool = False) -> "PackedWeight":
        """``weight`` [n, k] rounded to bfloat16 in the AMX build's layout, for ``linear_bfloat16``. ``gated``: the
        weight is a gate projection's rows then its up projection's (n a multiple of 32), and each block of the
        layout takes 16 gate rows and their 16 up rows, for ``linear_bfloat16(..., gated=True)``."""
        rows, width = weight.shape
        if not self.tiles_bfloat16(width) or (gated and rows % 32):
            raise ValueError(f"pack_bfloat16 needs the AMX build, rows a multiple of 32 wide and, gated, a multiple "
                             f"of 32 of them; got {rows} rows {width} wide")
        weight = weight.to(torch.bfloat16)
        if gated:
            weight = weight.view(2, rows // 32, 16, width).transpose(0, 1).reshape(rows, width)
        return PackedWeight(self._amx_blocks(self._amx_padded(weight)), None, rows, width, gated=gated)

    def linear_bfloat16(self, x: torch.Tensor, weight: "PackedWeight", bias: torch.Tensor | None,
                        out_dtype: torch.dtype) -> torch.Tensor:
        """``x · weightᵀ + bias`` for bfloat16 rows ``x`` [rows, k] and ``weight`` from ``pack_bfloat16``, in AMX
        tiles with float32 sums; ``out_dtype`` float32 or bfloat16 (rounded to nearest even). For a gated
        ``weight``, silu(gate) ⊙ up of those sums [rows, n / 2] instead, in bfloat16; ``bias`` then in the
        weight's rows' order (gate, then up)."""
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != weight.in_features:
            raise ValueError(f"linear_bfloat16 needs bfloat16 rows {weight.in_features} wide, "
                             f"got {x.dtype} {tuple(x.shape)}")
        if out_dtype not in (torch.float32, torch.bfloat16) or (weight.gated and out_dtype != torch.bfloat16):
            raise ValueError(f"linear_bfloat16 writes float32 or bfloat16 (a gated weight: bfloat16), not {out_dtype}")
        if bias is not None:
            _check_float32(bias)
            if weight.gated:
                bias = bias.view(2, -1, 16).transpose(0, 1).contiguous()
        x = x.contiguous()
        columns = weight.out_features // 2 if weight.gated else weight.out_features
        out = torch.empty(x.shape[0], columns, dtype=out_dtype)
        status = self._linear_bf16(x.data_ptr(), x.shape[0], x.shape[1], weight.data.data_ptr(), weight.out_features,
                                   None if bias is None else bias.data_ptr(), out.data_ptr(),
                                   out_dtype == torch.bfloat16, weight.gated, torch.get_num_threads())
        if status:
            raise MemoryError("linear_bfloat16 could not allocate its working memory")
        return out

    def decode_dtype(self, weight: torch.Tensor, decode_weights: str) -> torch.dtype | None:
        """The dtype of ``weight``'s decode copy for ``--decode-weights`` (float16, int8 or auto): auto is uint4
        where that keeps the weight exactly (``on_uint4_grid``), else int8. None where ``pack`` does not take it."""
        dtype = torch.int8 if decode_weights == "auto" else getattr(torch, decode_weights)
        width = weight.shape[1]
        if decode_weights == "auto" and self.packs(width, torch.uint4) and on_uint4_grid(weight):
            dtype = torch.uint4
        return dtype if self.packs(width, dtype) else None

    def packs(self, width: int, dtype: torch.dtype, group: int | None = INT8_GROUP) -> bool:
        """Whether ``pack`` takes a weight of rows ``width`` wide into ``dtype`` (int8 in scale groups of ``group``)."""
        step = self._step(dtype)
        return width % step == 0 and (dtype != torch.int8 or group is None
                                      or (group % step == 0 and width % group == 0))

    def _step(self, dtype: torch.dtype) -> int:
        """The columns of a row that ``pack`` keeps together for ``dtype``: its rows' width and its int8 scale
        groups are a multiple of it (uint4: a scale group)."""
        if dtype == torch.uint4:
            return UINT4_GROUP
        return INTEGER_ROW_GROUP if dtype == torch.int8 else self.chunk

    def linear(self, x: torch.Tensor, weight: "PackedWeight", bias: torch.Tensor | None) -> torch.Tensor:
        """``x · weightᵀ + bias`` for float32 rows ``x`` [rows, k] and ``weight`` from ``pack``."""
        if x.dtype != torch.float32 or x.shape[-1] != weight.in_features:
            raise ValueError(f"linear needs float32 rows {weight.in_features} wide, got {x.dtype} {tuple(x.shape)}")
        x = x.contiguous()
        out = torch.empty(x.shape[0], weight.out_features, dtype=torch.float32)
        status = self._linear(x.data_ptr(), x.shape[0], x.shape[1], weight.data.data_ptr(), weight.scales_pointer,
                              weight.minimums_pointer, weight.group or 0, weight.out_features,
                              None if bias is None else bias.data_ptr(), out.data_ptr(), torch.get_num_threads())
        if status:
            raise MemoryError("linear could not allocate its working memory")
        return out

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: "BlockTables", scale: float) -> torch.Tensor:
        """Attention of ``q`` [seqs, heads, head_dim] (one token per sequence; each sequence's heads
        contiguous) over each sequence's cached positions, found through ``block_tables``; ``k_cache``,
        ``v_cache``: one layer's [slots, kv_heads, head_dim], float32."""
        seqs, heads, head_dim = q.shape
        if q.dtype != torch.float32 or q.stride()[1:] != (head_dim, 1) or len(block_tables) != seqs:
            raise ValueError("decode_attention needs float32 q with each sequence's heads contiguous, and a block "
                             "table per sequence")
        self._check_cache_reads("decode_attention", k_cache, v_cache, head_dim, block_tables=block_tables)
        out = torch.empty(q.shape, dtype=torch.float32)
        status = self._decode_attention(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                                        block_tables.pointers.data_ptr(), block_tables.context_lens.data_ptr(), seqs,
                                        block_tables.block_size, heads, k_cache.shape[1], head_dim, scale,
                                        out.data_ptr(), torch.get_num_threads())
        _check_attention_status(status, "decode_attention", heads, k_cache.shape[1], head_dim)
        return out

    def rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """RMSNorm of the float32 rows of ``x`` [rows, size], in float32 or rounded to bfloat16 (``out_dtype``);
        with ``residual``, ``residual += x`` first (in place) and the sum is normalized."""
        _check_float32(x, weight, *(() if residual is None else (residual,)))
        if out_dtype not in self._rms_norm:
            raise ValueError(f"rms_norm writes float32 or bfloat16, not {out_dtype}")
        out = torch.empty(x.shape, dtype=out_dtype)
        self._rms_norm[out_dtype](x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                                  x.shape[0], x.shape[1], eps, out.data_ptr(), torch.get_num_threads())
        return out

    def rope_and_cache(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, positions: torch.Tensor,
                       cos_table: torch.Tensor, sin_table: torch.Tensor, slot_mapping: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Rotate the query and key heads of the fused projection ``qkv`` [tokens, (heads + 2 kv_heads) ·
        head_dim] in place, and write each token's keys and values to its slot of one layer's caches."""
        head_dim = cos_table.shape[1]
        _check_float32(qkv, cos_table, sin_table)
        if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or positions.dtype != torch.int64 \
                or slot_mapping.dtype != torch.int64 or not len(positions) == len(qkv) == len(slot_mapping) \
                or not (positions.is_contiguous() and slot_mapping.is_contiguous()):
            raise ValueError("rope_and_cache needs a fused projection of the heads' width and contiguous int64 "
                             "positions and slots, one per token")
        self._check_positions("rope_and_cache", positions, cos_table)
        self._check_cache_reads("rope_and_cache", k_cache, v_cache, head_dim, (slot_mapping,))
        self._rope_and_cache(qkv.data_ptr(), qkv.shape[0], num_heads, num_kv_heads, head_dim, positions.data_ptr(),
                             cos_table.data_ptr(), sin_table.data_ptr(), slot_mapping.data_ptr(), k_cache.data_ptr(),
                             v_cache.data_ptr(), torch.get_num_threads())

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up`` [rows, 2 · size], gate then up in each row: float32, or
        bfloat16 computed in float32 and rounded back."""
        rows, size = gate_up.shape[0], gate_up.shape[1] // 2
        if gate_up.dtype == torch.bfloat16 and gate_up.is_contiguous() and gate_up.is_cpu:
            out = torch.empty(rows, size, dtype=torch.bfloat16)
            self._silu_and_mul_bf16(gate_up.data_ptr(), rows, size, out.data_ptr(), torch.get_num_threads())
            return out
        _check_float32(gate_up)
        out = torch.empty(rows, size, dtype=torch.float32)
        self._silu_and_mul(gate_up.data_ptr(), rows, size, out.data_ptr(), torch.get_num_threads())
        return out

    def decode_layers(self, layers: "DecodeLayers", x: torch.Tensor, positions: torch.Tensor,
                      cos_table: torch.Tensor, sin_table: torch.Tensor, slot_mapping: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: "BlockTables | None",
                      chunks: Sequence[tuple[int, int, torch.Tensor]] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """Every decoder layer of a small step in one call: the last layer's output and the residual stream
        before it, from the embeddings ``x`` [rows, hidden]. ``k_cache``, ``v_cache``: [layers, slots, kv_heads,
        head_dim]. The first rows attend as decodes, one block table each; then each of ``chunks`` (first row,
        tokens, int64 slots of its context, its own last), one after another to the last row, attends as a
        prefill chunk, as ``prefill_attention`` does."""
        shape = layers.shape
        rows = x.shape[0]
        decodes = len(block_tables) if block_tables is not None else 0
        _check_float32(x, cos_table, sin_table)
        if x.shape[1] != shape.hidden or not len(positions) == len(slot_mapping) == rows \
                or positions.dtype != torch.int64 or slot_mapping.dtype != torch.int64 \
                or not (positions.is_contiguous() and slot_mapping.is_contiguous()) \
                or k_cache.dim() != 4 or k_cache.shape[0] != len(layers):
            raise ValueError("decode_layers needs one position and slot per row of the model's width, and caches "
                             "of its layers")
        ends = [decodes] + [first + tokens for first, tokens, _ in chunks]
        if [first for first, _, _ in chunks] != ends[:-1] or ends[-1] != rows \
                or any(slots.dtype != torch.int64 or not slots.is_contiguous() or len(slots) < tokens
                       for _, tokens, slots in chunks):
            raise ValueError("decode_layers needs a block table per decode row, then chunks one after another to "
                             "the last row, each with contiguous int64 slots of its whole context")
        if chunks and not self.attends_prefills(shape.num_heads, shape.num_kv_heads, shape.head_dim, torch.bfloat16):
            raise ValueError("decode_layers attends prompt chunks only where prefill_attention runs in bfloat16")
        self._check_positions("decode_layers", positions, cos_table)
        self._check_cache_reads("decode_layers", k_cache, v_cache, shape.head_dim,
                                (slot_mapping, *(slots for _, _, slots in chunks)), block_tables)
        x = x.clone()
        residual = torch.zeros_like(x)
        scratch = torch.empty(rows * layers.scratch_per_row, dtype=torch.float32)
        chunk_table = (_Chunk * len(chunks))(*(_Chunk(first, tokens, len(slots), slots.data_ptr())
                                               for first, tokens, slots in chunks))
        status = self._decode_layers(layers.table, len(layers), ctypes.byref(shape), rows, x.data_ptr(),
                                     residual.data_ptr(), positions.data_ptr(), cos_table.data_ptr(),
                                     sin_table.data_ptr(), slot_mapping.data_ptr(), k_cache.data_ptr(),
                                     v_cache.data_ptr(), k_cache[0].numel(),
                                     block_tables.pointers.data_ptr() if decodes else None,
                                     block_tables.context_lens.data_ptr() if decodes else None,
                                     block_tables.block_size if decodes else 0, chunk_table, len(chunks),
                                     scratch.data_ptr(), torch.get_num_threads())
        _check_attention_status(status, "decode_layers", shape.num_heads, shape.num_kv_heads, shape.head_dim)
        return x, residual

    def attends_prefills(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
        """Whether ``prefill_attention`` runs here for this head layout in ``dtype``: float32 in every build,
        bfloat16 in the builds with AVX512-BF16."""
        if num_heads % num_kv_heads or head_dim > 256:
            return False
        if dtype == torch.bfloat16:
            return self.prefill_attention_in_bfloat16 and head_dim % 32 == 0
        return dtype == torch.float32 and head_dim % 16 == 0

    def prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                          scale: float, out: torch.Tensor) -> None:
        """Causal attention of a prefill chunk's queries ``q`` [tokens, heads, head_dim] (float32, each token's
        heads contiguous) over the positions in ``slots`` [context] of one layer's caches [slots, kv_heads,
        head_dim] (float32), the chunk's own last, into ``out`` [tokens, heads, head_dim]: float32 in float32
        FMAs, or bfloat16 in bfloat16 products with float32 sums."""
        tokens, heads, head_dim = q.shape
        if q.dtype != torch.float32 or q.stride()[1:] != (head_dim, 1) or out.dtype not in self._prefill_attention \
                or not out.is_contiguous() or out.shape != q.shape or slots.dtype != torch.int64 \
                or not slots.is_contiguous():
            raise ValueError("prefill_attention needs float32 queries with each token's heads contiguous, a "
                             "contiguous float32 or bfloat16 output of their shape and contiguous int64 slots")
        if not 0 < tokens <= len(slots):
            raise ValueError(f"prefill_attention needs 1 to len(slots) query tokens, the chunk's own positions last "
                             f"in slots; got {tokens} tokens and {len(slots)} slots")
        self._check_cache_reads("prefill_attention", k_cache, v_cache, head_dim, (slots,))
        status = self._prefill_attention[out.dtype](q.data_ptr(), q.stride(0), k_cache.data_ptr(),
                                                    v_cache.data_ptr(), slots.data_ptr(), heads, k_cache.shape[1],
                                                    head_dim, tokens, len(slots), scale, out.data_ptr(),
                                                    torch.get_num_threads())
        _check_attention_status(status, "prefill_attention", heads, k_cache.shape[1], head_dim)

    def _check_cache_reads(self, kernel: str, k_cache: torch.Tensor, v_cache: torch.Tensor, head_dim: int,
                           slots: Sequence[torch.Tensor] = (), block_tables: "BlockTables | None" = None) -> None:
        """That the caches ([..., slots, kv_heads, head_dim]) are contiguous float32 ones of one shape, and that every
        slot of ``slots`` and every block of ``block_tables`` that ``kernel`` would reach lies inside them."""
        _check_float32(k_cache, v_cache)
        if k_cache.shape != v_cache.shape or k_cache.dim() < 3 or k_cache.shape[-1] != head_dim:
            raise ValueError(f"{kernel} needs key and value caches of one shape [..., slots, kv_heads, {head_dim}], "
                             f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
        reached = [self._reach(ids) for ids in slots]
        if block_tables is not None and len(block_tables):
            first, last = self._reach_rows(block_tables.pointers.data_ptr(), block_tables.context_lens.data_ptr(),
                                           len(block_tables), block_tables.block_size)
            reached.append((first * block_tables.block_size, (last + 1) * block_tables.block_size - 1))
        if any(low < 0 or high >= k_cache.shape[-3] for low, high in reached):
            raise ValueError(f"{kernel} would reach slots outside the caches' {k_cache.shape[-3]}")

    def _check_positions(self, kernel: str, positions: torch.Tensor, cos_table: torch.Tensor) -> None:
        low, high = self._reach(positions)
        if low < 0 or high >= len(cos_table):
            raise ValueError(f"{kernel} needs positions below the rotary tables' {len(cos_table)}")

    def _reach(self, ids: torch.Tensor) -> tuple[int, int]:
        """The smallest and the largest of the contiguous int64 ``ids`` (0 and -1 where there are none)."""
        return self._reach_rows(ctypes.byref(ctypes.c_void_p(ids.data_ptr())), ctypes.byref(ctypes.c_int64(len(ids))),
                                1, 1)

    def _reach_rows(self, rows, lengths, num_rows: int, per: int) -> tuple[int, int]:
        reached = (ctypes.c_int64 * 2)()
        self._index_range(rows, lengths, num_rows, per, reached)
        return reached[0], reached[1]

    def supports_attention(self, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        """Whether ``decode_attention`` takes this head layout (see ``tandem_decode_attention``)."""
        return head_dim % self.chunk == 0 and head_dim <= 256 and num_heads % num_kv_heads == 0 \
            and num_heads // num_kv_heads <= 16


@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A weight [out_features, in_features] as ``CpuKernels.pack`` lays it out for ``linear``: ``data``
    float16, or int8 with float16 ``scales``, one per ``group`` columns of a row (None: per row), tile by
    tile."""

    data: torch.Tensor
    scales: torch.Tensor | None
    out_features: int
    in_features: int
    group: int | None = None
    gated: bool = False  # bfloat16 in the AMX layout, 16 gate rows and their 16 up rows a block
    minimums: torch.Tensor | None = None  # uint4: each group's float16 minimum (data: two weights a byte)

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint4 if self.minimums is not None else self.data.dtype

    @property
    def nbytes(self) -> int:
        return sum(tensor.nbytes for tensor in (self.data, self.scales, self.minimums) if tensor is not None)

    @property
    def scales_pointer(self) -> int | None:
        return None if self.scales is None else self.scales.data_ptr()

    @property
    def minimums_pointer(self) -> int | None:
        return None if self.minimums is None else self.minimums.data_ptr()


class _Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in (
        "input_norm", "post_attention_norm", "qkv", "o", "gate_up", "down", "qkv_scales", "o_scales",
        "gate_up_scales", "down_scales", "qkv_mins", "o_mins", "gate_up_mins", "down_mins", "qkv_bias", "o_bias",
        "gate_up_bias", "down_bias")]


class _Chunk(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("first_row", "tokens", "context")] + [("slots", ctypes.c_void_p)]


class _LayerShape(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate",
                                                    "group")] + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]


class DecodeLayers:
    """Where ``decode_layers`` finds every decoder layer's weights: per layer, the two norms' float32
    weights, and the packed weights (``PackedWeight``) and float32 biases (or None) of its linears ``qkv``
    (query, key and value heads fused), ``o``, ``gate_up`` (gate, then up) and ``down``. The tensors stay
    the caller's, who keeps them alive."""

    LINEARS = ("qkv", "o", "gate_up", "down")

    def __init__(self, layers: list[dict[str, torch.Tensor | None]], hidden: int, num_heads: int,
                 num_kv_heads: int, head_dim: int, intermediate: int, eps: float, scale: float):
        entries, groups = [], set()
        for layer in layers:
            _check_float32(layer["input_norm"], layer["post_attention_norm"],
                           *(layer[f"{name}_bias"] for name in self.LINEARS if layer[f"{name}_bias"] is not None))
            if not all(isinstance(layer[name], PackedWeight) for name in self.LINEARS):
                raise ValueError("decode_layers reads weights packed by CpuKernels.pack")
            groups.update(layer[name].group for name in self.LINEARS)
            norms_and_biases = {name: None if tensor is None else tensor.data_ptr()
                                for name, tensor in layer.items() if name not in self.LINEARS}
            entries.append(_Layer(**norms_and_biases,
                                  **{name: layer[name].data.data_ptr() for name in self.LINEARS},
                                  **{f"{name}_scales": layer[name].scales_pointer for name in self.LINEARS},
                                  **{f"{name}_mins": layer[name].minimums_pointer for name in self.LINEARS}))
        self.layers = layers
        self.table = (_Layer * len(entries))(*entries)
        if len(groups) != 1:
            raise ValueError(f"decode_layers needs every linear's int8 scales in groups of one size, got {groups}")
        self.shape = _LayerShape(hidden, num_heads, num_kv_heads, head_dim, intermediate, groups.pop() or 0, eps, scale)
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.scratch_per_row = hidden + (q_size + 2 * kv_size) + q_size + 3 * intermediate

    def __len__(self) -> int:
        return len(self.layers)


class BlockTables:
    """Where ``decode_attention`` finds each sequence's context: per sequence, an int64 tensor of (at
    least) its blocks' ids and the number of positions attended. The rows stay the caller's (who keeps
    them alive); the kernel reads them in place through their addresses."""

    def __init__(self, rows: list[torch.Tensor], context_lens: list[int], block_size: int):
        for row, length in zip(rows, context_lens, strict=True):
            if row.dtype is not torch.int64 or not row.is_contiguous() or length < 1 \
                    or len(row) * block_size < length:
                raise ValueError(f"a block table row must be a contiguous int64 tensor covering its {length} "
                                 f"positions, got {row.dtype} {tuple(row.shape)}")
        self.rows = rows
        self.block_size = block_size
        self.pointers = torch.tensor([row.data_ptr() for row in rows], dtype=torch.int64)
        self.context_lens = torch.tensor(context_lens, dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.rows)


def _check_attention_status(status: int, kernel: str, heads: int, kv_heads: int, head_dim: int) -> None:
    if status == -2:
        raise MemoryError(f"{kernel} could not allocate its working memory")
    if status != 0:
        raise ValueError(f"{kernel} does not take {heads} heads over {kv_heads} key-value heads of size {head_dim}")


def _quantize_int8(grouped: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group (the last dimension) scaled to ±127 and rounded to nearest: the int8 values, and the
    float16 scales they stand for multiples of."""
    scales = (grouped.abs().amax(dim=-1) / 127).half()
    quantized = torch.round(grouped / scales.float()[..., None].clamp_min(torch.finfo(torch.float32).tiny))
    return quantized.clamp(-127, 127).to(torch.int8), scales


def _padded_rows(weight: torch.Tensor, multiple: int) -> torch.Tensor:
    """``weight`` [rows, width] with rows of zeros up to a multiple of ``multiple`` rows."""
    padded = torch.zeros(-(-len(weight) // multiple) * multiple, weight.shape[1], dtype=weight.dtype)
    padded[:len(weight)] = weight
    return padded


def _per_tile(values: torch.Tensor, tile: int) -> torch.Tensor:
    """Per-row, per-group ``values`` [rows, groups] (rows a multiple of ``tile``) as [tiles, groups, tile]."""
    return values.view(-1, tile, values.shape[1]).transpose(1, 2).contiguous()


def _quantize_uint4(grouped: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each group (the last dimension) as 16 levels from its float16 minimum in float16 steps (round to nearest):
    the levels (uint8, 0 to 15), the steps and the minimums."""
    minimums = grouped.amin(dim=-1).half()
    scales = ((grouped.amax(dim=-1) - minimums.float()) / 15).half()
    levels = torch.round((grouped - minimums.float()[..., None])
                         / scales.float()[..., None].clamp_min(torch.finfo(torch.float32).tiny))
    return levels.clamp(0, 15).to(torch.uint8), scales, minimums


def on_uint4_grid(weight: torch.Tensor) -> bool:
    """Whether ``pack(weight, torch.uint4)`` keeps ``weight`` exactly: each ``UINT4_GROUP`` columns of a row already
    lie on 16 levels of a float16 step from a float16 minimum, as the weights of a model dequantized from a 4-bit
    GGUF file (Q4_1) do."""
    if weight.shape[-1] % UINT4_GROUP:
        return False
    grouped = weight.detach().float().reshape(-1, UINT4_GROUP)
    return _on_uint4_grid(grouped[:UINT4_SAMPLE_GROUPS]) and _on_uint4_grid(grouped[UINT4_SAMPLE_GROUPS:])


def _on_uint4_grid(grouped: torch.Tensor) -> bool:
    levels, scales, minimums = _quantize_uint4(grouped)
    return torch.equal(levels.float() * scales.float()[:, None] + minimums.float()[:, None], grouped)


def _check_float32(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        if tensor.dtype is not torch.float32 or not tensor.is_contiguous() or not tensor.is_cpu:
            raise ValueError(f"the CPU kernels take contiguous float32 CPU tensors, got {tensor.dtype} "
                             f"{tuple(tensor.shape)} on {tensor.device}")


@functools.cache
def load(isa: str | None = None) -> CpuKernels | None:
    """The kernels for ``isa``, compiled if this machine has not compiled this version yet; by default
    the widest build this CPU runs, or, without a compiler, the widest one built earlier (an image
    provisioned on a narrower CPU). None where they cannot run."""
    usable = usable_isas()
    if not usable:
        logger.warning("the CPU kernels need an x86-64 CPU with %s (missing: %s); decode steps use torch's ops",
                       ", ".join(sorted(CPU_FLAGS)),
                       ", ".join(sorted(CPU_FLAGS - _cpu_flags())) or platform.machine())
        return None
    if isa is not None and isa not in usable:
        raise ValueError(f"this CPU cannot run the {isa} kernels (it runs: {', '.join(usable)})")
    candidates = [isa] if isa else usable
    compiler = c_compiler()
    built = [name for name in candidates if _library(name).exists()]
    if compiler is None and not built:
        logger.warning("the CPU kernels need a C compiler (cc, gcc or $CC); decode steps use torch's ops")
        return None
    for chosen in candidates if compiler is not None else built:  # the widest that builds and loads
        try:
            if not _library(chosen).exists():
                _build(compiler, _flags(chosen), _library(chosen))
            return CpuKernels(_library(chosen), chosen)
        except (OSError, subprocess.CalledProcessError) as error:
            detail = getattr(error, "stderr", None) or error
            logger.warning("could not build or load the %s CPU kernels with %s (%s)", chosen, compiler, detail)
    logger.warning("no build of the CPU kernels loads here; decode steps use torch's ops")
    return None


def c_compiler() -> str | None:
    """``$CC``, else ``cc`` or ``gcc`` on the PATH; None where there is none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _flags(isa: str) -> tuple[str, ...]:
    return (*FLAGS, *ISAS[isa][1])


def _library(isa: str) -> Path:
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *_flags(isa)]).encode()).hexdigest()[:16]
    return tandem_home() / "kernels" / f"cpu_kernels-{isa}-{key}.so"


def usable_isas() -> list[str]:
    """The kernels' instruction sets this CPU runs, widest first."""
    if platform.machine() != "x86_64":
        return []
    cpu = _cpu_flags()
    return [name for name, (needs, _) in ISAS.items() if CPU_FLAGS | needs <= cpu]


def build_all() -> None:
    """Build every variant this CPU runs (``tandem provision``), so that an image built here serves a
    narrower CPU too."""
    for isa in usable_isas():
        load(isa)


def _cpu_flags() -> frozenset[str]:
    return frozenset(cpu_info("flags").split())


def cpu_info(field: str) -> str:
    """The first value of ``field`` in /proc/cpuinfo ("model name", "flags"); "" where there is none."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == field:
            return value.strip()
    return ""


def _build(compiler: str, flags: tuple[str, ...], library: Path) -> None:
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        built = Path(scratch) / library.name
        subprocess.run([compiler, *flags, str(SOURCE), "-o", str(built)], capture_output=True, text=True, check=True)
        os.replace(built, library)
    logger.info("built the CPU kernels: %s", library)

"""The CPU kernels (built here with the machine's C compiler, as a worker builds them) against torch's
own ops; PackedLinear: oneDNN's packed weight or the AMX build's bfloat16 tiles, and the float16 or int8 copy that
steps of few rows read; and
a step of decodes run through all the layers in one call against the same step one op at a time."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.config import CacheConfig, SchedulerConfig
from tandem.engine.model import cpu_kernels
from tandem.engine.model.cpu_kernels import INT8_GROUP
from tandem.engine.model.factory import build_engine
from tandem.engine.model.llama import MLP_PRODUCT_BYTES, PackedLinear
from tandem.engine.model.runner import native_bfloat16
from tests.engine import emulated_kernels
from tests.engine.helpers import greedy_request, random_prompt, run_to_completion, skip_without_native_bfloat16
from tests.models import on_q4_1_grid

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


BUILDS = cpu_kernels.usable_isas()
EMULATED = emulated_kernels.wanted(BUILDS)


@pytest.fixture(scope="module", params=BUILDS or ["none"])
def native_kernels(request):
    """Each build this CPU runs: AVX2, AVX-512 where the CPU has it, AVX-512 with AVX512-BF16 where it has that,
    and AMX where it has AMX tiles."""
    return loaded(request.param)


def loaded(isa: str) -> cpu_kernels.CpuKernels:
    built = None if isa == "none" else cpu_kernels.load(isa)
    if built is None:
        pytest.skip("the CPU kernels cannot run here (see the log for why)")
    return built


@pytest.fixture(scope="module", params=BUILDS + EMULATED or ["none"])
def kernels(request):
    """Each build this CPU runs, and each wider one emulated (emulated_kernels.py)."""
    if request.param in EMULATED:
        return request.getfixturevalue("emulated")(request.param)
    return loaded(request.param)


@pytest.fixture(scope="session")
def emulated(tmp_path_factory):
    """The emulated builds, each compiled once a session."""
    built = {}

    def build(name: str) -> cpu_kernels.CpuKernels:
        if name not in built:
            built[name] = emulated_kernels.build(name, BUILDS, tmp_path_factory.mktemp(name))
        if built[name] is None:
            pytest.skip("no C compiler here")
        return built[name]
    return build


@torch.inference_mode()
def test_few_row_steps_read_the_float16_copy_and_larger_steps_the_fp32_weight(kernels):
    torch.manual_seed(0)
    linear = nn.Linear(80, 45)  # 45 outputs: the last tile padded
    packed = PackedLinear(linear, kernels, decode_rows=32)
    for rows in (1, 3, 32, 33, 40):
        x = torch.randn(rows, 80)
        if rows <= packed.decode_rows:
            expected = F.linear(x, linear.weight.half().float(), linear.bias)
        else:
            expected = linear(x)
        torch.testing.assert_close(packed(x), expected, rtol=1e-5, atol=1e-5)
        assert packed(x).dtype == torch.float32


@torch.inference_mode()
def test_few_row_steps_read_the_int8_copy_with_a_scale_per_group(kernels):
    torch.manual_seed(0)
    linear = nn.Linear(64, 7)
    packed = PackedLinear(linear, kernels, torch.int8, decode_rows=3)
    assert packed.decode_weight.group == INT8_GROUP == 32
    padded = kernels.amx_block_rows or kernels.integer_tile_rows  # rows of zeros up to a whole block or tile
    assert packed.decode_weight.dtype == torch.int8 and packed.decode_weight.nbytes == padded * (64 + 2 * 2)
    groups = linear.weight.view(7, 2, 32)
    scales = (groups.abs().amax(dim=2, keepdim=True) / 127).half().float()
    dequantized = (torch.round(groups / scales).clamp(-127, 127) * scales).view(7, 64)
    x = torch.randn(3, 64)
    expected = F.linear(int8_rows_as_multiplied(kernels, x).double(), dequantized.double(), linear.bias.double())
    torch.testing.assert_close(packed(x), expected.float(), rtol=1e-5, atol=1e-5)
    assert (packed(x) - linear(x)).abs().max() < 0.02  # within int8 rounding of the float32 weights


def int8_rows_as_multiplied(kernels, x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``linear`` multiplies it by int8 weights: in float32 in the AMX build (below ``amx_min_rows``), in
    the others rounded to int16 in each ``INTEGER_ROW_GROUP`` columns."""
    if kernels.amx_block_rows:
        return x.double()
    grouped = x.view(len(x), -1, cpu_kernels.INTEGER_ROW_GROUP)
    top = grouped.abs().amax(dim=2, keepdim=True)
    inverse = torch.full_like(top, 32767) / top  # divided as the kernel divides
    return ((grouped * inverse).round().double() * (top / 32767).double()).view(x.shape)


def unpacked(packed):
    """The [out, in] weight that ``pack`` laid out in tiles (or the AMX build's blocks), scaled back where it is
    int8."""
    if packed.data.dim() == 6:  # [passes][groups of 32 columns][blocks][column pairs][16 rows][2]
        passes, depth, blocks = packed.data.shape[:3]
        rows = packed.data.permute(0, 2, 4, 1, 3, 5).reshape(-1, packed.in_features).double()
        scales = packed.scales.permute(0, 2, 3, 1).reshape(-1, depth)
        return (rows * scales.double().repeat_interleave(32, dim=1))[:packed.out_features]
    rows = packed.data.transpose(1, 2).reshape(-1, packed.in_features).double()
    if packed.scales is not None:
        groups = packed.scales.shape[1]
        scales = packed.scales.transpose(1, 2).reshape(-1, groups).double()
        rows = rows * scales.repeat_interleave(packed.in_features // groups, dim=1)
    return rows[:packed.out_features]


@torch.inference_mode()
@pytest.mark.parametrize("dtype, group, rows, width, outputs", [
    (dtype, group, *shape)
    for dtype, group in [(torch.float16, None), (torch.int8, None), (torch.int8, 32), (torch.int8, 64)]
    for shape in [(1, 16, 1), (1, 576, 7), (1, 1536, 64), (1, 2176, 5), (2, 32, 3), (5, 576, 7), (9, 1536, 64),
                  (20, 576, 40), (49, 64, 33), (70, 96, 17), (133, 96, 17)]
    if group is None or shape[1] % group == 0])
def test_linear_computes_every_tile_and_remainder_in_float32(kernels, dtype, group, rows, width, outputs):
    """In float32, but for int8 weights: in the AMX build, steps of ``amx_min_rows`` rows or more multiply the
    rows and the scaled weights rounded to bfloat16 in tiles, summing in float32; in the others, the rows are
    rounded to int16 in each group of 32 columns, their products summed in int32 (int8_rows_as_multiplied)."""
    if not kernels.packs(width, dtype, group):
        pytest.skip(f"the {kernels.isa} build packs no {dtype} weights {width} wide in groups of {group}")
    torch.manual_seed(rows)
    x, weight, bias = torch.randn(rows, width), torch.randn(outputs, width), torch.randn(outputs)
    packed = kernels.pack(weight.half() if dtype == torch.float16 else weight, dtype, group)
    assert packed.dtype == dtype
    if dtype == torch.float16:
        torch.testing.assert_close(unpacked(packed).float(), weight.half().float())
    else:  # every group rounded to 255 levels of its own scale, kept as a float16
        grouped = weight.view(outputs, -1, group or width)
        error = (unpacked(packed).float() - weight).view(grouped.shape).abs()
        assert packed.scales.dtype == torch.float16
        assert (error <= (grouped.abs().amax(dim=2, keepdim=True) / 127).half().float() / 2 + 1e-6).all()
    weight_used, x_used = unpacked(packed), x.double()
    if dtype == torch.int8 and kernels.amx_min_rows and rows >= kernels.amx_min_rows:
        weight_used, x_used = weight_used.bfloat16().double(), x.bfloat16().double()
    elif dtype == torch.int8:
        x_used = int8_rows_as_multiplied(kernels, x)
    expected = F.linear(x_used, weight_used, bias.double()).float()
    torch.testing.assert_close(kernels.linear(x, packed, bias), expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(kernels.linear(x, packed, None), expected - bias, rtol=1e-5, atol=1e-4)


@torch.inference_mode()
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 9, 70, 128, 133])
@pytest.mark.parametrize("width, outputs", [(32, 1), (64, 17), (96, 5), (576, 40), (1536, 9)])
def test_uint4_keeps_a_weight_on_its_grid_exactly_and_multiplies_rows_rounded_in_each_group(kernels, rows, width,
                                                                                            outputs):
    """Rows in and beyond the kernel's passes of 4 and its blocks of 64, and a prompt chunk's rows, which the threads
    split (an odd number of them too); outputs in and beyond its tiles of 16.
    Each row is rounded in each group of 32 columns, to int16 (the groups' minimums multiply its exact sums) or, in
    steps of ``uint4_int8_rows`` rows or more, to int8 (the minimums multiply the rounded row's sums)."""
    assert kernels.uint4_int8_rows == 128
    levels = 127 if rows >= kernels.uint4_int8_rows else 32767
    torch.manual_seed(width + rows)
    weight = on_q4_1_grid(torch.randn(outputs, width))
    assert cpu_kernels.on_uint4_grid(weight) and not cpu_kernels.on_uint4_grid(torch.randn(outputs, width))
    packed = kernels.pack(weight, torch.uint4)
    padded_rows = -(-outputs // kernels.integer_tile_rows) * kernels.integer_tile_rows
    assert packed.dtype == torch.uint4 and packed.nbytes == padded_rows * (width // 2 + 2 * 2 * width // 32)
    grouped = weight.view(outputs, -1, 32)
    minimums = grouped.amin(dim=2, keepdim=True)
    x, bias = torch.randn(rows, width), torch.randn(outputs)
    x_groups = x.view(rows, -1, 32)
    top = x_groups.abs().amax(dim=2, keepdim=True)
    inverse = torch.full_like(top, levels) / top  # divided as the kernel divides (levels / top rounds otherwise)
    x_rounded = ((x_groups * inverse).round().double() * (top / levels).double()).view(x.shape)
    levels_term = F.linear(x_rounded, (grouped - minimums).view(weight.shape).double())
    summed = x_rounded if levels == 127 else x.double()
    minimums_term = F.linear(summed, minimums.expand_as(grouped).reshape(weight.shape).double())
    # the two terms, each up to about 100 here, cancel: a few dozen float32 roundings of their size
    tolerance = 32 * torch.finfo(torch.float32).eps * (levels_term.abs() + minimums_term.abs()).max().item()
    expected = (levels_term + minimums_term + bias.double()).float()
    torch.testing.assert_close(kernels.linear(x, packed, bias), expected, rtol=0, atol=tolerance)


@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.uint4, torch.int8])
def test_the_avx512_build_sums_integer_weights_to_the_bit_as_the_avx2_build_does(emulated, dtype):
    """Its vpdpwssd and vpdpbusd (uint4 weights, rows rounded to int8, from ``uint4_int8_rows`` rows) sum the very
    int32 products that vpmaddwd and vpmaddubsw sum in the AVX2 build, and it scales them with the same float32
    operations: what the quality gate measured on one build holds on the other."""
    if "avx2" not in BUILDS:
        pytest.skip("the CPU kernels cannot run here (see the log for why)")
    avx2 = loaded("avx2")
    avx512 = loaded("avx512") if "avx512" in BUILDS else emulated(emulated_kernels.AVX512)
    torch.manual_seed(3)
    weight = on_q4_1_grid(torch.randn(45, 320))
    bias = torch.randn(45)
    for rows in (1, 3, 4, 9, 64, 128, 133):
        x = torch.randn(rows, 320)
        assert torch.equal(avx512.linear(x, avx512.pack(weight, dtype), bias),
                           avx2.linear(x, avx2.pack(weight, dtype), bias))


@torch.inference_mode()
def test_auto_decode_weights_are_uint4_where_that_is_exact_and_int8_elsewhere(kernels):
    torch.manual_seed(0)
    on_grid, off_grid = on_q4_1_grid(torch.randn(6, 128)), torch.randn(6, 128)
    assert kernels.decode_dtype(on_grid, "auto") == torch.uint4
    assert kernels.decode_dtype(off_grid, "auto") == torch.int8
    assert kernels.decode_dtype(on_grid, "float16") == torch.float16
    linear = nn.Linear(128, 6)
    with torch.no_grad():
        linear.weight.copy_(on_grid)
    packed = PackedLinear(linear, kernels, kernels.decode_dtype(linear.weight, "auto"), decode_rows=4)
    x = torch.randn(4, 128)
    # the weight exactly: off only by the rows' rounding to int16, at most half a step of each group's
    half_steps = (x.view(4, -1, 32).abs().amax(dim=2, keepdim=True) / 32767 / 2).expand(4, 4, 32).reshape(4, 128)
    assert ((packed(x) - linear(x)).abs() <= half_steps @ linear.weight.abs().T + 1e-5).all()


def test_a_step_without_rows_gets_an_empty_output(kernels):
    """As the output head of a step whose prefill chunks end no prompt."""
    for dtype in (torch.float16, torch.int8, torch.uint4):
        packed = kernels.pack(torch.randn(64, 64), dtype)
        assert kernels.linear(torch.empty(0, 64), packed, None).shape == (0, 64)


def test_linear_and_pack_name_what_they_were_given_wrong(kernels):
    with pytest.raises(ValueError, match="float32 rows 16 wide"):
        kernels.linear(torch.randn(1, 8), kernels.pack(torch.randn(4, 16), torch.float16), None)
    with pytest.raises(ValueError, match="float32 rows"):
        kernels.linear(torch.randn(1, 64).double(), kernels.pack(torch.randn(4, 64), torch.int8), None)
    with pytest.raises(ValueError, match=f"multiple of {kernels.chunk} wide"):
        kernels.pack(torch.randn(4, 12), torch.float16)
    with pytest.raises(ValueError, match="groups of 32"):
        kernels.pack(torch.randn(4, 48), torch.int8, 32)
    with pytest.raises(ValueError, match="multiple of 32 wide"):
        kernels.pack(torch.randn(4, 80), torch.uint4)
    with pytest.raises(ValueError, match="float16, int8 or uint4"):
        kernels.pack(torch.randn(4, 16), torch.bfloat16)


@torch.inference_mode()
def test_without_a_low_precision_copy_every_step_reads_the_fp32_weight(kernels):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=False)
    for packed in (PackedLinear(linear), PackedLinear(linear, kernels, None)):
        assert packed.decode_weight is None
        x = torch.randn(1, 64)
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_bfloat16_batched_weights_serve_steps_of_many_rows_and_leave_few_rows_to_the_decode_copy(kernels):
    skip_without_native_bfloat16()
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    packed = PackedLinear(linear, kernels, torch.int8, torch.bfloat16, decode_rows=8)
    assert packed.packed_weight.dtype == torch.bfloat16
    many, few = torch.randn(9, 64), torch.randn(8, 64)
    output = packed(many)
    assert output.dtype == torch.float32
    torch.testing.assert_close(output, linear(many), rtol=2e-2, atol=2e-2)  # bfloat16's 8-bit mantissa
    torch.testing.assert_close(packed(few), PackedLinear(linear, kernels, torch.int8, decode_rows=8)(few),
                               rtol=0, atol=0)


@torch.inference_mode()
def test_a_long_chunk_passes_the_decode_copys_mlp_in_blocks_and_gets_what_one_pass_gives(tiny_llama):
    model = build_engine(str(tiny_llama), "cpu", "float32", cache=CacheConfig(num_kv_blocks=16), calibrate=False,
                         decode_weights="int8").executor.model
    mlp = model.layers[0].mlp
    product_bytes = 2 * mlp.intermediate_size * 4  # a row's float32 gate and up products
    assert product_bytes * mlp.copy_block_rows <= MLP_PRODUCT_BYTES < 2 * product_bytes * mlp.copy_block_rows
    torch.manual_seed(0)
    x = torch.randn(40, model.config.hidden_size)
    model.prompt_rows = 64
    whole = mlp(x)
    passes = []
    mlp.down_proj.register_forward_hook(lambda module, args, out: passes.append(len(args[0])))
    mlp.copy_block_rows = 16
    torch.testing.assert_close(mlp(x), whole, rtol=1e-6, atol=1e-6)
    assert passes == [16, 16, 8]
    model.decode_rows = model.prompt_rows = 0
    passes.clear()
    mlp(x)
    assert passes == [40]  # the batched weights take the chunk in one pass


def skip_without_bfloat16_tiles(kernels):
    if not kernels.tiles_bfloat16(64):
        assert not kernels.amx_block_rows  # only the AMX build has them
        pytest.skip("bfloat16 tiles are the AMX build's")


@torch.inference_mode()
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40, 300])  # a short tile, one, one and a row, two passes of rows
def test_bfloat16_tiles_give_the_float32_sums_of_the_rounded_operands(kernels, rows):
    skip_without_bfloat16_tiles(kernels)
    torch.manual_seed(rows)
    weight, bias = torch.randn(45, 96), torch.randn(45)  # 45: a block of 32 weight rows and a short one
    x = torch.randn(rows, 96).bfloat16()
    packed = kernels.pack_bfloat16(weight)
    out = kernels.linear_bfloat16(x, packed, bias, torch.float32)
    expected = x.double() @ weight.bfloat16().double().T + bias.double()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(kernels.linear_bfloat16(x, packed, bias, torch.bfloat16), out.bfloat16())
    torch.testing.assert_close(kernels.linear_bfloat16(x, packed, None, torch.float32), out - bias, rtol=0, atol=1e-5)


@torch.inference_mode()
def test_gated_bfloat16_tiles_give_silu_of_each_gate_times_its_up(kernels):
    skip_without_bfloat16_tiles(kernels)
    torch.manual_seed(0)
    weight, bias = torch.randn(64, 96), torch.randn(64)  # 32 gate rows, then their 32 up rows
    x = torch.randn(37, 96).bfloat16()
    out = kernels.linear_bfloat16(x, kernels.pack_bfloat16(weight, gated=True), bias, torch.bfloat16)
    sums = x.double() @ weight.bfloat16().double().T + bias.double()
    expected = F.silu(sums[:, :32]) * sums[:, 32:]
    assert out.dtype == torch.bfloat16 and out.shape == (37, 32)
    torch.testing.assert_close(out.double(), expected, rtol=8e-3, atol=1e-2)  # one rounding to bfloat16
    with pytest.raises(ValueError, match="multiple of 32 of them"):
        kernels.pack_bfloat16(torch.randn(48, 96), gated=True)
    with pytest.raises(ValueError, match="a gated weight: bfloat16"):
        kernels.linear_bfloat16(x, kernels.pack_bfloat16(weight, gated=True), bias, torch.float32)
    with pytest.raises(ValueError, match="rows a multiple of 32 wide"):
        kernels.pack_bfloat16(torch.randn(64, 80))
    with pytest.raises(ValueError, match="bfloat16 rows 96 wide"):
        kernels.linear_bfloat16(x.float(), kernels.pack_bfloat16(weight), bias, torch.float32)


@torch.inference_mode()
def test_packed_linears_multiply_steps_of_many_rows_in_bfloat16_tiles(kernels):
    skip_without_bfloat16_tiles(kernels)
    torch.manual_seed(0)
    linear, gate_up = nn.Linear(64, 48), nn.Linear(64, 64)
    packed = PackedLinear(linear, kernels, torch.int8, torch.bfloat16, decode_rows=8, batched_kernels=kernels)
    gated = PackedLinear(gate_up, kernels, torch.int8, torch.bfloat16, decode_rows=8, batched_kernels=kernels,
                         gated=True)
    assert packed.tiled_weight is not None and packed.packed_weight is None and not packed.gated_tiles
    assert gated.gated_tiles
    many, few = torch.randn(9, 64), torch.randn(8, 64)
    rounded = many.bfloat16()
    torch.testing.assert_close(packed(many), kernels.linear_bfloat16(rounded, packed.tiled_weight, linear.bias,
                                                                     torch.float32), rtol=0, atol=0)
    torch.testing.assert_close(packed(many), linear(many), rtol=2e-2, atol=2e-2)
    assert packed.product(many).dtype == torch.bfloat16
    sums = gate_up(many)
    torch.testing.assert_close(gated.silu_and_mul(many, kernels).float(), F.silu(sums[:, :32]) * sums[:, 32:],
                               rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(gated.silu_and_mul(few, kernels), kernels.silu_and_mul(gated.product(few)),
                               rtol=0, atol=0)  # few rows: the decode copy, then the activation
    with pytest.raises(ValueError, match="through silu_and_mul"):
        gated.product(many)


def test_auto_batched_weights_are_bfloat16_only_where_native_and_never_beside_float32_decode_weights(tiny_model):
    def batched(decode_weights: str, batched_weights: str) -> torch.dtype:
        return build_engine(str(tiny_model), "cpu", "float32", calibrate=False, decode_weights=decode_weights,
                            batched_weights=batched_weights).executor.batched_dtype

    assert batched("int8", "auto") == (torch.bfloat16 if native_bfloat16() else torch.float32)
    assert batched("float32", "auto") == torch.float32
    if native_bfloat16():
        assert batched("float32", "bfloat16") == torch.bfloat16
    else:
        with pytest.raises(ValueError, match="batched_weights bfloat16 needs a CPU that multiplies bfloat16"):
            batched("int8", "bfloat16")
    with pytest.raises(ValueError, match="batched_weights must be one of auto, bfloat16, float32"):
        batched("int8", "float16")


@pytest.fixture
def fresh_load():
    cpu_kernels.load.cache_clear()
    yield cpu_kernels.load
    cpu_kernels.load.cache_clear()


def test_a_machine_that_cannot_build_them_runs_on_torch_ops(native_kernels, fresh_load, monkeypatch, tmp_path,
                                                            caplog):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert fresh_load(native_kernels.isa) is None
    assert f"could not build or load the {native_kernels.isa} CPU kernels" in caplog.text


@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
def test_every_build_compiles(isa, tmp_path):
    """The kernel tests skip a build that does not load, as a process refused the AMX tile state must; a
    build that does not compile would hide behind that skip, and workers would run a narrower one. Each build
    compiles on any x86-64 machine, whether or not its CPU runs it."""
    compiler = cpu_kernels.c_compiler()
    if platform.machine() != "x86_64" or compiler is None:
        pytest.skip("no x86-64 compiler here")
    cpu_kernels._build(compiler, cpu_kernels._flags(isa), tmp_path / f"{isa}.so")


def test_a_build_that_does_not_load_leaves_the_next_widest(fresh_load, monkeypatch):
    """As where Linux refuses a process the AMX tile state."""
    usable = cpu_kernels.usable_isas()
    if len(usable) < 2:
        pytest.skip("this CPU runs one build of the kernels")
    loads = cpu_kernels.CpuKernels

    def refusing_the_widest(library, isa):
        if isa == usable[0]:
            raise OSError("Linux did not grant this process the AMX tile state")
        return loads(library, isa)

    monkeypatch.setattr(cpu_kernels, "CpuKernels", refusing_the_widest)
    assert fresh_load().isa == usable[1]


def test_a_library_built_ahead_loads_without_a_compiler(native_kernels, fresh_load, monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(cpu_kernels.shutil, "which", lambda name: None)
    assert fresh_load(native_kernels.isa).isa == native_kernels.isa


def test_without_a_compiler_the_widest_build_made_earlier_serves(native_kernels, fresh_load, monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))  # holds only the narrowest build, as if made elsewhere
    narrowest = cpu_kernels.usable_isas()[-1]
    assert fresh_load(narrowest) is not None
    fresh_load.cache_clear()
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(cpu_kernels.shutil, "which", lambda name: None)
    assert fresh_load().isa == narrowest


def test_the_widest_build_the_cpu_runs_is_the_default(native_kernels, fresh_load, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    assert cpu_kernels.usable_isas() == ["avx2"]
    assert fresh_load().isa == "avx2" and fresh_load().chunk == 8
    with pytest.raises(ValueError, match="cannot run the avx512 kernels"):
        fresh_load("avx512")


def reference_attention(q, k_cache, v_cache, rows, lengths, block_size):
    outputs = []
    for row, length in enumerate(lengths):
        slots = (rows[row][:, None] * block_size + torch.arange(block_size)).view(-1)[:length]
        keys, values = k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1)
        outputs.append(F.scaled_dot_product_attention(q[row][:, None].double(), keys.double(), values.double(),
                                                      enable_gqa=True).squeeze(1).float())
    return torch.stack(outputs)


@torch.inference_mode()
@pytest.mark.parametrize("heads, kv_heads, head_dim, lengths, shared_blocks", [
    (9, 3, 64, [1, 17, 600], 0),        # the default model's layout; one position, a block and one more, long
    (4, 4, 32, [16, 33], 0),            # no grouping
    (8, 1, 128, [5], 0),                # one key-value head for all
    (9, 3, 64, [600], 0),               # a lone sequence: its context cut into pieces for the threads
    (9, 3, 64, [520, 600, 530], 31),    # a shared prefix read once for all, then each sequence's own
    (9, 3, 64, [600, 70, 599], 31),     # one context ends inside the shared blocks
    (5, 1, 32, [200, 300], 4),          # rows of the shared pass not a multiple of three
])
def test_decode_attention_reads_each_context_through_its_block_table(kernels, heads, kv_heads, head_dim, lengths,
                                                                     shared_blocks):
    torch.manual_seed(head_dim)
    block_size, num_blocks = 16, 64
    k_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim) * 2
    v_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim)
    rows = [torch.randperm(num_blocks)[:-(-length // block_size)] for length in lengths]  # each its own length
    if shared_blocks:  # a common prefix's blocks lead every table
        prefix = rows[0][:shared_blocks]
        rows = [torch.cat([prefix, row[~torch.isin(row, prefix)]])[:len(row)] for row in rows]
    qkv = torch.randn(len(lengths), (heads + 2 * kv_heads) * head_dim)  # queries read in place from a projection
    q = qkv[:, :heads * head_dim].view(len(lengths), heads, head_dim)
    block_tables = cpu_kernels.BlockTables(rows, lengths, block_size)
    out = kernels.decode_attention(q, k_cache, v_cache, block_tables, head_dim ** -0.5)
    expected = reference_attention(q, k_cache, v_cache, rows, lengths, block_size)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-5)


@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, prefix, heads, kv_heads, head_dim, rising", [
    (512, 0, 9, 3, 64, False),  # the default model's first chunk
    (37, 100, 9, 3, 64, False),  # a chunk after a prefix, neither a whole number of blocks
    (5, 0, 4, 4, 32, False),
    (70, 33, 8, 2, 128, False),
    (1, 700, 9, 3, 64, False),
    # scores that rise along the context, so that rows' running maxima move and their outputs are rescaled
    (200, 300, 9, 3, 64, True),
    (40, 200, 6, 2, 96, True),
])
def test_prefill_attention_is_causal_attention_over_the_slots(kernels, dtype, tokens, prefix, heads, kv_heads,
                                                              head_dim, rising):
    if not kernels.attends_prefills(heads, kv_heads, head_dim, dtype):
        assert dtype == torch.bfloat16 and not kernels.prefill_attention_in_bfloat16
        pytest.skip("bfloat16 prefill attention is the AVX512-BF16 builds'")
    torch.manual_seed(tokens)
    context, num_slots = tokens + prefix, tokens + prefix + 50
    k_cache, v_cache = torch.randn(num_slots, kv_heads, head_dim), torch.randn(num_slots, kv_heads, head_dim)
    slots = torch.randperm(num_slots)[:context]
    if rising:  # every key leans towards one direction, more the later it comes; the queries lean the same way
        lean = torch.randn(kv_heads, head_dim)
        k_cache[slots] += torch.linspace(0, 4, context)[:, None, None] * lean
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)  # rows as a fused projection leaves them
    if rising:
        q += lean.repeat_interleave(heads // kv_heads, 0)
    out = torch.empty(tokens, heads, head_dim, dtype=dtype)
    kernels.prefill_attention(q, k_cache, v_cache, slots, head_dim ** -0.5, out)

    # the reference: the same inputs (rounded to bfloat16 for the tiles), in float32 throughout
    q, k, v = (t.to(dtype).float().transpose(0, 1)[None] for t in (q, k_cache[slots], v_cache[slots]))
    causal = torch.ones(tokens, context, dtype=torch.bool).tril(prefix)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=head_dim ** -0.5, enable_gqa=True)
    # float32: rounding alone; bfloat16 probabilities and output: a few units of bfloat16's last place
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 0.02, "atol": 0.01}
    torch.testing.assert_close(out.float(), expected[0].transpose(0, 1), **tolerance)


def test_attention_refuses_a_layout_it_does_not_take(kernels):
    assert not kernels.supports_attention(4, 4, 12)
    assert not kernels.attends_prefills(4, 4, 24, torch.float32)  # head_dim not a multiple of 16
    assert not kernels.attends_prefills(6, 4, 64, torch.float32)  # query heads not a multiple of key-value heads
    q, slots = torch.randn(3, 4, 24), torch.arange(3)
    with pytest.raises(ValueError, match="4 heads over 4 key-value heads of size 24"):
        kernels.prefill_attention(q, torch.randn(3, 4, 24), torch.randn(3, 4, 24), slots, 0.2, torch.empty(3, 4, 24))
    with pytest.raises(ValueError, match="does not take 4 heads"):
        kernels.decode_attention(torch.randn(1, 4, 12), torch.randn(16, 4, 12), torch.randn(16, 4, 12),
                                 cpu_kernels.BlockTables([torch.zeros(1, dtype=torch.long)], [3], 16), 0.3)


def test_attention_refuses_to_read_outside_the_caches(kernels):
    q, out, cache = torch.randn(2, 4, 16), torch.empty(2, 4, 16), torch.randn(8, 2, 16)
    for slots in ([3, 8], [-1, 2]):
        with pytest.raises(ValueError, match="prefill_attention would reach slots outside the caches' 8"):
            kernels.prefill_attention(q, cache, cache.clone(), torch.tensor(slots), 0.25, out)
    with pytest.raises(ValueError, match="caches of one shape"):
        kernels.prefill_attention(q, cache, torch.randn(7, 2, 16), torch.tensor([3, 4]), 0.25, out)
    with pytest.raises(ValueError, match=r"caches of one shape \[\.\.\., slots, kv_heads, 32\]"):
        kernels.prefill_attention(torch.randn(2, 4, 32), cache, cache.clone(), torch.tensor([3, 4]), 0.25,
                                  torch.empty(2, 4, 32))
    with pytest.raises(ValueError, match="got 2 tokens and 1 slots"):
        kernels.prefill_attention(q, cache, cache.clone(), torch.tensor([3]), 0.25, out)
    one_block_past = cpu_kernels.BlockTables([torch.tensor([0, 1])], [20], 16)  # slots 16-31 of 24
    with pytest.raises(ValueError, match="decode_attention would reach slots outside the caches' 24"):
        kernels.decode_attention(q[:1], torch.randn(24, 2, 16), torch.randn(24, 2, 16), one_block_past, 0.25)
    kernels.decode_attention(q[:1], torch.randn(32, 2, 16), torch.randn(32, 2, 16), one_block_past, 0.25)
    qkv, tables = torch.randn(1, 8 * 16), torch.randn(10, 16)
    with pytest.raises(ValueError, match="rope_and_cache would reach slots outside the caches' 8"):
        kernels.rope_and_cache(qkv, 4, 2, torch.tensor([3]), tables, tables, torch.tensor([8]), cache, cache.clone())
    with pytest.raises(ValueError, match="rope_and_cache needs positions below the rotary tables' 10"):
        kernels.rope_and_cache(qkv, 4, 2, torch.tensor([10]), tables, tables, torch.tensor([7]), cache, cache.clone())


@torch.inference_mode()
def test_the_one_call_refuses_to_write_outside_the_caches(tiny_model):
    runner = build_engine(str(tiny_model), "cpu", "float32", cache=CacheConfig(num_kv_blocks=8), calibrate=False,
                          decode_weights="int8").executor
    model, slots = runner.model, 8 * runner.block_size
    x, first_block = model.embed_tokens(torch.tensor([5])), cpu_kernels.BlockTables([torch.tensor([0])], [1],
                                                                                    runner.block_size)
    for slot in (slots, -1):
        with pytest.raises(ValueError, match=f"decode_layers would reach slots outside the caches' {slots}"):
            model.cpu_kernels.decode_layers(model.decode_layers, x, torch.tensor([0]), runner.cos_table,
                                            runner.sin_table, torch.tensor([slot]), runner.k_cache, runner.v_cache,
                                            first_block)
    with pytest.raises(ValueError, match="decode_layers needs positions below the rotary tables'"):
        model.cpu_kernels.decode_layers(model.decode_layers, x, torch.tensor([len(runner.cos_table)]),
                                        runner.cos_table, runner.sin_table, torch.tensor([0]), runner.k_cache,
                                        runner.v_cache, first_block)
    model.cpu_kernels.decode_layers(model.decode_layers, x, torch.tensor([0]), runner.cos_table, runner.sin_table,
                                    torch.tensor([0]), runner.k_cache, runner.v_cache, first_block)


def test_a_block_table_must_cover_its_context():
    with pytest.raises(ValueError, match="covering its 40 positions"):
        cpu_kernels.BlockTables([torch.zeros(2, dtype=torch.long)], [40], 16)
    with pytest.raises(ValueError, match="contiguous int64"):
        cpu_kernels.BlockTables([torch.zeros(3, dtype=torch.int32)], [40], 16)


@torch.inference_mode()
@pytest.mark.parametrize("rows, size", [(1, 576), (40, 576), (17, 100)])  # 100: a tail past the last 8
def test_rms_norm_adds_the_residual_in_place_and_normalizes_the_sum(kernels, rows, size):
    torch.manual_seed(rows)
    x, residual, weight = torch.randn(rows, size), torch.randn(rows, size), torch.randn(size)
    total = x + residual

    def norm(t):
        return weight * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5))

    torch.testing.assert_close(kernels.rms_norm(x, None, weight, 1e-5), norm(x))
    rounded = kernels.rms_norm(x, None, weight, 1e-5, torch.bfloat16)
    assert rounded.dtype == torch.bfloat16
    assert torch.equal(rounded, kernels.rms_norm(x, None, weight, 1e-5).to(torch.bfloat16))
    torch.testing.assert_close(kernels.rms_norm(x, residual, weight, 1e-5), norm(total))
    torch.testing.assert_close(residual, total)


@torch.inference_mode()
@pytest.mark.parametrize("tokens", [1, 20])
def test_rope_and_cache_rotates_queries_and_keys_and_writes_the_slots(kernels, tokens):
    torch.manual_seed(tokens)
    heads, kv_heads, head_dim, num_slots = 9, 3, 64, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    cos, sin = torch.randn(100, head_dim), torch.randn(100, head_dim)
    positions, slots = torch.randint(0, 100, (tokens,)), torch.randperm(num_slots)[:tokens]
    k_cache, v_cache = torch.zeros(num_slots, kv_heads, head_dim), torch.zeros(num_slots, kv_heads, head_dim)
    q, k, v = (part.reshape(tokens, -1, head_dim) for part in qkv.split([576, 192, 192], dim=-1))
    rows_cos, rows_sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    def rotate(t):
        return t * rows_cos + torch.cat((-t[..., head_dim // 2:], t[..., :head_dim // 2]), dim=-1) * rows_sin

    expected_q, expected_k = rotate(q), rotate(k)
    kernels.rope_and_cache(qkv, heads, kv_heads, positions, cos, sin, slots, k_cache, v_cache)
    rotated_q, rotated_k, kept_v = (part.reshape(tokens, -1, head_dim) for part in qkv.split([576, 192, 192], dim=-1))
    torch.testing.assert_close(rotated_q, expected_q)
    torch.testing.assert_close(rotated_k, expected_k)
    torch.testing.assert_close(kept_v, v)
    torch.testing.assert_close(k_cache[slots], expected_k)
    torch.testing.assert_close(v_cache[slots], v)
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


@torch.inference_mode()
@pytest.mark.parametrize("rows, size", [(1, 1536), (17, 13)])
def test_silu_and_mul_matches_torch_over_the_whole_range(kernels, rows, size):
    torch.manual_seed(size)
    gate_up = torch.randn(rows, 2 * size) * 30  # far into both tails of the sigmoid
    gate, up = gate_up.split(size, dim=-1)
    torch.testing.assert_close(kernels.silu_and_mul(gate_up), F.silu(gate) * up, rtol=2e-6, atol=1e-5)


@torch.inference_mode()
@pytest.mark.parametrize("rows, size", [(1, 1536), (17, 13)])
def test_silu_and_mul_on_bfloat16_rounds_the_float32_result_as_torch_does(kernels, rows, size):
    torch.manual_seed(size)
    gate_up = (torch.randn(rows, 2 * size) * 30).bfloat16()
    widened = kernels.silu_and_mul(gate_up.float())
    rounded = kernels.silu_and_mul(gate_up)
    assert rounded.dtype == torch.bfloat16
    assert torch.equal(rounded, widened.bfloat16())


def test_the_kernels_name_a_tensor_they_do_not_take(kernels):
    with pytest.raises(ValueError, match="contiguous float32"):
        kernels.silu_and_mul(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous float32"):
        kernels.rms_norm(torch.randn(8, 4).t(), None, torch.randn(8), 1e-5)


def _run_each_small_step_both_ways(engine, rows: int, lengths: tuple[int, ...], monkeypatch) -> list[tuple]:
    """Runs requests of ``lengths`` to the end, every step of up to ``rows`` rows on the decode copy in one
    kernel call and again layer by layer (which writes the same keys and values), asserting the same logits;
    returns each one-call step's rows, decode rows and prompt chunks."""
    model = engine.executor.model
    model.decode_rows = rows  # whatever was measured here
    fused = model.decode_layers
    assert fused is not None and len(fused) == model.config.num_hidden_layers
    one_op_at_a_time = model.forward
    in_one_call = model.cpu_kernels.decode_layers
    compared = []

    def recorded(layers, x, positions, cos, sin, slots, k_cache, v_cache, block_tables, chunks=()):
        compared.append((len(x), len(block_tables) if block_tables is not None else 0, len(chunks)))
        return in_one_call(layers, x, positions, cos, sin, slots, k_cache, v_cache, block_tables, chunks)

    def both_ways(input_ids, positions, k_cache, v_cache, meta, *rest):
        logits = one_op_at_a_time(input_ids, positions, k_cache, v_cache, meta, *rest)
        if len(input_ids) <= rows:
            model.decode_layers = None
            try:
                assert torch.equal(one_op_at_a_time(input_ids, positions, k_cache, v_cache, meta, *rest), logits)
            finally:
                model.decode_layers = fused
        return logits

    monkeypatch.setattr(model.cpu_kernels, "decode_layers", recorded)
    model.forward = both_ways
    for index, length in enumerate(lengths):
        engine.add_request(greedy_request(f"r{index}", random_prompt(engine, length, seed=index), 12))
    run_to_completion(engine)
    return compared


@torch.inference_mode()
@pytest.mark.parametrize("decode_weights", ["float16", "int8"])
def test_a_step_of_decodes_runs_every_layer_in_one_call_exactly_as_one_op_at_a_time(tiny_model, decode_weights,
                                                                                    monkeypatch):
    _one_call_matches_one_op_at_a_time(tiny_model, decode_weights, decode_weights, monkeypatch)


@torch.inference_mode()
def test_auto_decode_weights_on_a_q4_1_model_run_every_layer_in_one_call_in_uint4(tiny_llama_q4_1, monkeypatch):
    _one_call_matches_one_op_at_a_time(tiny_llama_q4_1, "auto", "uint4", monkeypatch)


def _one_call_matches_one_op_at_a_time(model, decode_weights: str, copy: str, monkeypatch) -> None:
    if cpu_kernels.load() is None:
        pytest.skip("the CPU kernels cannot run here (see the log for why)")
    engine = build_engine(str(model), "cpu", "float32",
                          SchedulerConfig(max_num_batched_tokens=32, max_prefill_step_tokens=32),
                          CacheConfig(num_kv_blocks=64), calibrate=False, decode_weights=decode_weights)
    assert engine.executor.decode_weights == copy
    compared = _run_each_small_step_both_ways(engine, 4, (3, 17, 40, 70), monkeypatch)
    decode_steps = [rows for rows, decodes, chunks in compared if rows == decodes]
    assert max(decode_steps) == 4 and min(decode_steps) == 1  # decode steps of all four and of the last alone


@torch.inference_mode()
def test_a_small_step_with_prompt_chunks_attends_them_as_chunks_in_the_same_one_call(tiny_llama_64, monkeypatch):
    """Where the CPU kernels attend prefill chunks in bfloat16 (AVX512-BF16), a small step's prompt chunks, beside
    its decodes or alone, attend as prefill chunks inside the one call, exactly as layer by layer."""
    skip_without_native_bfloat16()
    engine = build_engine(str(tiny_llama_64), "cpu", "float32",
                          SchedulerConfig(max_num_batched_tokens=16, max_prefill_step_tokens=16),
                          CacheConfig(num_kv_blocks=64), calibrate=False, decode_weights="int8",
                          batched_weights="bfloat16")
    if not engine.executor.model.attends_prefills_in_bfloat16:
        pytest.skip("needs the bfloat16 prefill attention of the builds with AVX512-BF16")
    compared = _run_each_small_step_both_ways(engine, 16, (3, 20, 45), monkeypatch)
    assert any(decodes and chunks for rows, decodes, chunks in compared)  # decodes beside a chunk
    assert any(not decodes and chunks > 1 for rows, decodes, chunks in compared)  # chunks alone, one after another


@torch.inference_mode()
def test_a_small_step_attends_its_prompt_tokens_as_decodes_do(tiny_model, monkeypatch):
    """A step small enough for the decode copy runs its prompt tokens as decode rows: each attends its own
    positions in place through the block table (the cached prefix read once for all of them), and the decoder
    layers run in one call. Its logits are those of the same tokens as a prefill chunk (float16 decode weights,
    whose rows are multiplied in float32: int8's, rounded to int16, could round the two attentions' outputs, a float32
    rounding apart, to neighbouring integers)."""
    if cpu_kernels.load() is None:
        pytest.skip("the CPU kernels cannot run here (see the log for why)")
    engine = build_engine(str(tiny_model), "cpu", "float32", cache=CacheConfig(num_kv_blocks=16), calibrate=False,
                          decode_weights="float16", batched_weights="float32")
    runner, chunk = engine.executor, 16
    runner.model.decode_rows = chunk
    calls = []
    in_one_call = runner.model.cpu_kernels.decode_layers
    monkeypatch.setattr(runner.model.cpu_kernels, "decode_layers", lambda *args: calls.append(1) or in_one_call(*args))
    tokens = random_prompt(engine, 6 * chunk, seed=9)
    for start in range(0, 5 * chunk, chunk):
        runner.teacher_forced_logits(tokens, start, chunk)
    as_decodes = runner.teacher_forced_logits(tokens, 5 * chunk, chunk)
    assert len(calls) == 6

    monkeypatch.setattr(runner, "_attends_as_decodes", lambda rows: False)
    as_a_chunk = runner.teacher_forced_logits(tokens, 5 * chunk, chunk)
    assert len(calls) == 6
    torch.testing.assert_close(as_decodes, as_a_chunk, rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_rows_for_bfloat16_batched_weights_are_rounded_where_they_are_made_with_the_same_logits(tiny_model):
    """With bfloat16 batched weights, a large step's norms write their rows in bfloat16 and its attention
    output stays bfloat16: the very rounding each linear would do to float32 rows, done once, earlier."""
    if cpu_kernels.load() is None:
        pytest.skip("the CPU kernels cannot run here (see the log for why)")
    skip_without_native_bfloat16()
    engine = build_engine(str(tiny_model), "cpu", "float32", cache=CacheConfig(num_kv_blocks=16), calibrate=False,
                          decode_weights="int8", batched_weights="bfloat16")
    runner, chunk = engine.executor, 40
    runner.model.decode_rows = 8
    tokens = random_prompt(engine, 2 * chunk, seed=4)
    rounded_early = [runner.teacher_forced_logits(tokens, start, chunk) for start in (0, chunk)]
    runner.model._batched_activations = None
    rounded_by_each_linear = [runner.teacher_forced_logits(tokens, start, chunk) for start in (0, chunk)]
    for early, late in zip(rounded_early, rounded_by_each_linear):
        assert torch.equal(early, late)


def test_decode_layers_take_only_packed_weights():
    layer = {"input_norm": torch.ones(8), "post_attention_norm": torch.ones(8),
             **{name: torch.zeros(8, 8) for name in cpu_kernels.DecodeLayers.LINEARS},
             **{f"{name}_bias": None for name in cpu_kernels.DecodeLayers.LINEARS}}
    with pytest.raises(ValueError, match="packed by CpuKernels.pack"):
        cpu_kernels.DecodeLayers([layer], 8, 1, 1, 8, 8, 1e-5, 0.3)


@torch.inference_mode()
def test_a_prompt_chunk_of_up_to_prompt_rows_multiplies_the_layers_by_the_uint4_copy(tiny_llama_q4_1, monkeypatch):
    """Past ``decode_rows``, a chunk still reads the decoder layers' uint4 copy where ``prompt_rows`` reaches it
    (the output head keeps to ``decode_rows``), with the logits of the batched float32 weights: on the Q4_1 grid
    the copy holds those weights, and only the rows' rounding to int16 differs."""
    if cpu_kernels.load() is None:
        pytest.skip("the CPU kernels cannot run here (see the log for why)")
    engine = build_engine(str(tiny_llama_q4_1), "cpu", "float32", cache=CacheConfig(num_kv_blocks=16), calibrate=False,
                          decode_weights="auto", batched_weights="float32")
    runner, chunk = engine.executor, 40
    tokens = random_prompt(engine, 2 * chunk, seed=5)
    runner.model.decode_rows, runner.model.prompt_rows = 8, 0
    batched = [runner.teacher_forced_logits(tokens, start, chunk) for start in (0, chunk)]
    linears = runner.model.cpu_kernels.linear
    products = []
    monkeypatch.setattr(runner.model.cpu_kernels, "linear",
                        lambda x, weight, bias: products.append((len(x), weight.dtype)) or linears(x, weight, bias))
    runner.model.prompt_rows = chunk
    from_copy = [runner.teacher_forced_logits(tokens, start, chunk) for start in (0, chunk)]
    layers = len(runner.model.layers)
    assert products == [(chunk, torch.uint4)] * (2 * 4 * layers)  # not the head: its 40 rows read the batched weights
    for copy, weights in zip(from_copy, batched):
        # logits up to about 6 here; the rounding moves them by a few thousandths, a wrong weight by whole units
        torch.testing.assert_close(copy, weights, rtol=0, atol=1e-2)

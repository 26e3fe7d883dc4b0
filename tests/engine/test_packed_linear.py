"""PackedLinear: oneDNN's packed fp32 weight, and the bf16 copy that steps of few rows read when asked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.model.llama import FEW_ROWS, PackedLinear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


@torch.inference_mode()
def test_few_row_steps_read_the_bf16_copy_and_larger_steps_the_fp32_weight():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    packed = PackedLinear(linear, torch.bfloat16)
    for rows in (1, FEW_ROWS, FEW_ROWS + 1, 16):
        x = torch.randn(rows, 64)
        if rows <= FEW_ROWS:
            expected = F.linear(x.bfloat16(), linear.weight.bfloat16()).float() + linear.bias
        else:
            expected = linear(x)
        torch.testing.assert_close(packed(x), expected, rtol=1e-5, atol=1e-5)
        assert packed(x).dtype == torch.float32


@torch.inference_mode()
def test_without_a_low_precision_copy_every_step_reads_the_fp32_weight():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=False)
    for packed in (PackedLinear(linear), PackedLinear(linear, torch.float32)):
        assert packed.few_rows_weight is None
        x = torch.randn(1, 64)
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)

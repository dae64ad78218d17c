"""The DiT's FP8 token linears (diffusion/fp8.py) on the CPU, where torch's _scaled_mm runs the
same e4m3 arithmetic: against their fp32 reference, the linears they replace, and the small
DiT's velocity."""

import pytest
import torch
from torch import nn

from auk_triton.diffusion import fp8
from auk_triton.diffusion.fp8 import Float8Linear, check_fp8_support, use_fp8_linears
from auk_triton.diffusion.synthetic import synthetic_transformer


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture
def linear():
    torch.manual_seed(0)
    return nn.Linear(64, 96)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_an_fp8_linear_is_its_fp32_reference_arithmetic_to_the_output_rounding(linear, out_dtype):
    layer = Float8Linear(linear, out_dtype)
    x = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(1))
    out = layer(x)
    assert out.shape == (3, 7, 96) and out.dtype == out_dtype
    tolerance = 1e-2 if out_dtype == torch.bfloat16 else 1e-5  # bf16 keeps 8 bits
    torch.testing.assert_close(out.float(), layer.reference_forward(x).float(), rtol=tolerance, atol=tolerance)


def test_an_fp8_linear_stays_within_e4m3s_rounding_of_the_linear_it_replaces(linear):
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
    error = rel_l2(Float8Linear(linear, torch.float32)(x), linear(x).detach())
    assert 1e-3 < error < 0.06, f"relative L2 {error:.2e}"  # rounded, to within 1/16 per operand


def test_a_padded_all_zero_row_gives_the_bias_alone_and_a_large_value_leaves_its_rows_neighbours(linear):
    layer = Float8Linear(linear, torch.float32)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(3))
    x[0] = 0.0
    x[1, 0] = 1e4  # one row's scale: the other row is quantized on its own
    out = layer(x)
    torch.testing.assert_close(out[0], linear.bias.detach(), rtol=0, atol=0)
    y = torch.randn(1, 64, generator=torch.Generator().manual_seed(4))
    # Each row on its own scale: stacked or alone, the same products (to the float rounding a
    # CPU's matrix kernel gives another row count; scaled as one tensor, y would lose its digits).
    torch.testing.assert_close(layer(torch.cat([y, x[1:]])), torch.cat([layer(y), layer(x[1:])]),
                               rtol=1e-6, atol=1e-5)


def test_widths_that_are_not_multiples_of_16_are_refused_by_name():
    with pytest.raises(ValueError, match="multiples of 16, not 64 -> 40"):
        Float8Linear(nn.Linear(64, 40))


def test_the_blocks_token_linears_become_fp8_and_their_modulation_linears_do_not():
    model = synthetic_transformer("small", seed=0)
    assert use_fp8_linears(model) == 2 * 8 + 2 * 4  # per double block 8 token linears, per single block 4
    for stack in (model.transformer_blocks, model.single_transformer_blocks):
        for block in stack:
            for name, module in block.named_modules():
                if isinstance(module, (nn.Linear, Float8Linear)):
                    modulation = name.startswith("attn_norm")  # an AdaLN's linear: looked up per grid time
                    assert type(module) is (nn.Linear if modulation else Float8Linear), name
    assert type(model.txt_proj) is nn.Linear and type(model.proj_out) is nn.Linear


@torch.no_grad()
def test_the_small_dits_velocity_with_fp8_linears_stays_near_its_own():
    model = synthetic_transformer("small", seed=0)
    text = torch.randn(2, 5, 2048, generator=torch.Generator().manual_seed(5))
    x = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(6))
    ctx = model.prepare(text, 12)
    expected = model.step(x, torch.tensor(0.3), ctx)
    use_fp8_linears(model, torch.float32)
    error = rel_l2(model.step(x, torch.tensor(0.3), ctx), expected)
    print(f"small DiT, fp32: FP8 linears' velocity against its own: relative L2 {error:.2e}")
    assert 1e-4 < error < 3e-2


def test_fp8_is_refused_on_a_gpu_without_fp8_tensor_cores_or_outside_bf16(monkeypatch):
    check_fp8_support(torch.device("cpu"), torch.float32)  # the CPU runs it (slowly): tests, references
    monkeypatch.setattr(fp8.torch.cuda, "get_device_name", lambda device: "NVIDIA A100")
    monkeypatch.setattr(fp8.torch.cuda, "get_device_capability", lambda device: (8, 0))
    with pytest.raises(ValueError, match=r"compute capability 8.9 or newer\); NVIDIA A100 is 8.0"):
        check_fp8_support(torch.device("cuda:0"), torch.bfloat16)
    monkeypatch.setattr(fp8.torch.cuda, "get_device_capability", lambda device: (9, 0))
    check_fp8_support(torch.device("cuda:0"), torch.bfloat16)
    with pytest.raises(ValueError, match="needs the DiT in bfloat16, not torch.float32"):
        check_fp8_support(torch.device("cuda:0"), torch.float32)

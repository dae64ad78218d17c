"""FP8 token linears for the DiT: an option (`fp8_linears`), off by default.

The linears the tokens go through in every block (q/k/v, the attention outputs, the
feed-forward's two) are most of the step's matrix work. Here each keeps its weight in
float8 e4m3 with a scale per output channel, and each call scales every token row of its
input to e4m3 with a scale of its own (the row's largest magnitude to e4m3's largest);
`torch._scaled_mm` multiplies the two on FP8 tensor cores (compute capability 8.9 and
up), accumulates in fp32 and writes bf16. The AdaLN linears (looked up once per grid
time), the text embedding and the output projection stay as they are.

Numerics: e4m3 keeps 3 mantissa bits, so each operand is rounded to within 1/16 of
itself (relative) before the fp32 accumulation; with a scale per row and per channel, a
large value flattens only its own row or channel toward zero, not the whole tensor. What
that does to the velocity and to whole
runs is measured against the bf16 step (benchmarks/bench_dit_step.py --fp8), not
assumed. `reference_forward` is the same arithmetic in plain fp32, the check of the
fused path.
"""

from __future__ import annotations

import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
# The smallest scale: an all-zero row (a padded one) stays zero instead of dividing by zero.
MIN_SCALE = 1e-12
# The AdaLN linears of a block: its modulation, not its tokens (looked up per grid time).
MODULATION_LINEARS = ("attn_norm",)


def _to_e4m3(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """values / scale in e4m3, clamped to its range (a cast does not saturate)."""
    return (values.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


class Float8Linear(nn.Module):
    """An nn.Linear's weights in e4m3 with a scale per output channel; inputs scaled per row."""

    def __init__(self, linear: nn.Linear, out_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.in_features, self.out_features, self.out_dtype = linear.in_features, linear.out_features, out_dtype
        if self.in_features % 16 or self.out_features % 16:
            raise ValueError(f"an FP8 linear needs widths in multiples of 16, not {self.in_features} -> "
                             f"{self.out_features}")
        weight = linear.weight.detach().float()
        scale = (weight.abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp(min=MIN_SCALE)  # [out, 1]
        self.register_buffer("weight", _to_e4m3(weight, scale))  # [out, in]
        self.register_buffer("weight_scale", scale.t().contiguous())  # [1, out], fp32
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().to(out_dtype))

    def _quantized_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = x.reshape(-1, self.in_features)
        scale = (rows.abs().amax(dim=1, keepdim=True).float() / E4M3_MAX).clamp(min=MIN_SCALE)  # [rows, 1]
        return _to_e4m3(rows, scale), scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, scale = self._quantized_rows(x)
        # The weight's transpose is the column-major operand _scaled_mm takes second.
        out = torch._scaled_mm(rows, self.weight.t(), scale_a=scale, scale_b=self.weight_scale,
                               out_dtype=self.out_dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The same arithmetic in fp32: the quantized operands scaled back and multiplied."""
        rows, scale = self._quantized_rows(x)
        out = (rows.float() * scale) @ (self.weight.float() * self.weight_scale.t()).t()
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(self.out_dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, e4m3 weights and rows, {self.out_dtype} out"


def check_fp8_support(device: torch.device, dtype: torch.dtype) -> None:
    """Refuse, naming why, what _scaled_mm cannot run: a GPU before compute capability 8.9, or a
    GPU step not in bf16 (its row-scaled FP8 products write bf16 there)."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise ValueError(f"fp8_linears needs FP8 tensor cores (compute capability 8.9 or newer); "
                         f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}")
    if dtype != torch.bfloat16:
        raise ValueError(f"fp8_linears on a GPU needs the DiT in bfloat16, not {dtype}")


def use_fp8_linears(model: nn.Module, out_dtype: torch.dtype = torch.bfloat16) -> int:
    """Replace the token linears of `model`'s blocks with Float8Linear, in place; how many."""
    replaced = 0
    for stack in (model.transformer_blocks, model.single_transformer_blocks):
        for block in stack:
            for name, module in list(block.named_modules()):
                if not isinstance(module, nn.Linear) or name.startswith(MODULATION_LINEARS):
                    continue
                parent_name, _, leaf = name.rpartition(".")
                parent = block.get_submodule(parent_name) if parent_name else block
                setattr(parent, leaf, Float8Linear(module, out_dtype))
                replaced += 1
    return replaced

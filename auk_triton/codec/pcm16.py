"""PCM16: the int16 form of the decoded waveform, for clients that play or store 16-bit audio.

Clip to [-1, 1], scale by 32767, round half to even. The product is taken in
float64, where every float32 sample times 32767 is exact, so the rounding is the
same on any device and equals the client's numpy conversion (`auk_client.to_pcm16`)
sample for sample.
"""

import torch


def to_pcm16(wave: torch.Tensor) -> torch.Tensor:
    """Float samples in [-1, 1] to int16, on wave's device."""
    return torch.round(wave.clamp(-1.0, 1.0).double() * 32767.0).to(torch.int16)

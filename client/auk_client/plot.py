"""`--plot`: waveform and spectrogram of the decoded clip, tile boundaries marked.

matplotlib is optional (the client's `plot` extra: `pip install "./client[plot]"`);
`require_matplotlib()` is called before any audio is requested, so a missing
install fails fast.
"""

from __future__ import annotations

import numpy as np

from .stream import AuKClientError


def require_matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise AuKClientError(
            "--plot needs matplotlib, which is not installed; "
            "install it with: pip install matplotlib (or, from the repository, pip install './client[plot]')"
        ) from None
    return plt


def save_plot(path: str, samples: np.ndarray, sample_rate: int, tile_starts: list[int], title: str = "") -> None:
    plt = require_matplotlib()
    samples = np.asarray(samples, dtype=np.float32)
    t = np.arange(samples.size) / sample_rate
    fig, (ax_wave, ax_spec) = plt.subplots(2, 1, figsize=(12, 6), sharex=True, constrained_layout=True)
    ax_wave.plot(t, samples, linewidth=0.5, color="tab:blue")
    ax_wave.set_ylim(-1.05, 1.05)
    ax_wave.set_ylabel("amplitude")
    ax_wave.set_title(title or "decoded audio")
    if samples.size >= 512:
        ax_spec.specgram(samples, NFFT=512, Fs=sample_rate, noverlap=384, cmap="magma")
    ax_spec.set_ylabel("frequency (Hz)")
    ax_spec.set_xlabel("time (s)")
    boundaries = sorted(set(int(s) for s in tile_starts if s > 0))
    for i, s in enumerate(boundaries):
        for ax in (ax_wave, ax_spec):
            ax.axvline(s / sample_rate, color="tab:green", linewidth=0.8, linestyle="--",
                       label="tile boundary" if (i == 0 and ax is ax_wave) else None)
    if boundaries:
        ax_wave.legend(loc="upper right", fontsize="small")
    ax_wave.set_xlim(0, max(samples.size / sample_rate, 1.0 / sample_rate))
    fig.savefig(path, dpi=100)
    plt.close(fig)

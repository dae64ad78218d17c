"""Shape buckets for the DiT's sampler runs: a few padded shapes, each captured before the first request.

A CUDA graph (and a compiled step) serves one shape: rows, text tokens, target
frames, reference frames. Requests come in every length, so a run is padded up
to a bucket in each: its text to the smallest of `text` that holds its longest
prompt, its target to the smallest of `frames`, its reference to the smallest of
`ref` (a run without a reference has none). Padding is masked as any batch's is
(key masks, squeezed rotary positions, re-zeroed conv padding), so a padded row
gives its request's own velocity.

A run holds as many requests as fit `max_tokens` (its rows, guided rows twice,
times its bucket's tokens) and at most `max_requests`; at least one. That bounds
a run's memory and step time, and the graphs a bucket needs: one per request
count from 1 to what fits, so large buckets cost few captures.

A request past the largest bucket of any list has no bucket: it runs alone at
its own shape, as every request did before buckets.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class RunShape:
    """A bucket: the padded sizes of a run."""

    text: int  # text tokens
    frames: int  # target frames
    ref: int  # reference frames; 0: no reference

    @property
    def tokens(self) -> int:
        """Tokens of one model row: the single-stream sequence."""
        return self.text + self.ref + self.frames


def _fit(size: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest of `sizes` (sorted) that holds `size`, or None past the largest."""
    index = bisect.bisect_left(sizes, size)
    return sizes[index] if index < len(sizes) else None


@dataclass(frozen=True)
class ShapeBuckets:
    """The sizes runs are padded up to, and how many requests a run of each may hold."""

    text: tuple[int, ...]
    frames: tuple[int, ...]
    ref: tuple[int, ...]
    max_tokens: int  # rows (guided: two per request) x bucket tokens, in one run
    max_requests: int  # requests in one run, whatever their size

    def __post_init__(self):
        for name in ("text", "frames", "ref"):
            sizes = tuple(sorted(set(int(s) for s in getattr(self, name))))
            if any(s <= 0 for s in sizes):
                raise ValueError(f"{name} buckets must be positive, got {sizes}")
            object.__setattr__(self, name, sizes)
        if not self.text or not self.frames:
            raise ValueError("shape buckets need at least one text and one target size")
        if self.max_tokens < 1 or self.max_requests < 1:
            raise ValueError("a run must be allowed at least one request")

    def shape(self, text: int, frames: int, ref: int = 0) -> RunShape | None:
        """The bucket of a request (or a run, by its longest prompt, target and reference), or
        None when one of them is past its largest bucket."""
        text_bucket, frames_bucket = _fit(text, self.text), _fit(frames, self.frames)
        ref_bucket = 0 if ref == 0 else _fit(ref, self.ref)
        if text_bucket is None or frames_bucket is None or ref_bucket is None:
            return None
        return RunShape(text_bucket, frames_bucket, ref_bucket)

    def requests(self, shape: RunShape, guided: bool) -> int:
        """The most requests a run of this bucket holds (at least one)."""
        rows_per_request = 2 if guided else 1
        return max(1, min(self.max_requests, self.max_tokens // (rows_per_request * shape.tokens)))

    def shapes(self) -> list[RunShape]:
        """Every bucket: each text size with each target size, without a reference and with each
        reference size."""
        return [RunShape(t, f, r) for r in (0, *self.ref) for f in self.frames for t in self.text]

    def graphs(self, guided_modes=(False, True)) -> int:
        """How many step graphs the buckets take: one per bucket, guidance mode and request count."""
        return sum(self.requests(shape, guided) for shape in self.shapes() for guided in guided_modes)

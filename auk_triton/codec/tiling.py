"""Halo tiling: a long clip as overlapping decode windows that stitch into the whole-clip decode."""

from typing import Sequence


def plan_tiles(
    frames: int,
    tile: int,
    left: int,
    right: int,
    sizes: Sequence[int] = (),
    first_tile: int | None = None,
) -> list[tuple[int, int, int, int]]:
    """Split a clip into decode windows: (window_start, window_frames, emit_start, emit_end).

    Windows are `tile` frames wide. A window emits the frames that are at least
    `left` frames after its start and `right` frames before its end, unless that
    edge is the clip's own edge, so every emitted frame has its full decoder
    context inside its window. The last window is pinned to the clip's end and
    shrinks to the smallest of `sizes` that still holds the remaining frames plus
    the left context. A clip that fits in one tile is one window of its own length.
    `first_tile`, for a clip longer than it, makes the first window that short, so
    the first audio comes after one small decode; a clip of up to a tile then
    needs a second window for the rest (one small window's work more in all, and
    under load first windows of many requests batch, while full tiles hardly do).
    """
    if frames <= 0:
        raise ValueError(f"a clip needs at least one frame, got {frames}")
    split_first = first_tile is not None and first_tile < min(frames, tile)
    if frames <= tile and not split_first:
        return [(0, frames, 0, frames)]
    if tile <= left + right:
        raise ValueError(f"tile of {tile} frames does not exceed the decode context {left} + {right}")
    windows = []
    emitted = 0
    if split_first:
        if first_tile <= right:
            raise ValueError(f"first tile of {first_tile} frames does not exceed the right context {right}")
        windows.append((0, first_tile, 0, first_tile - right))
        emitted = first_tile - right
    while True:
        start = max(0, emitted - left)
        if frames - start <= tile:
            need = frames - emitted + left
            fitting = [s for s in sizes if need <= s <= tile]
            size = min(min(fitting, default=tile), frames)
            windows.append((frames - size, size, emitted, frames))
            return windows
        end = start + tile - right
        windows.append((start, tile, emitted, end))
        emitted = end

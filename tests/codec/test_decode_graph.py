"""Tiling and the graph wrapper on the CPU, where every tier runs eager."""

import itertools

import pytest
import torch

from auk_triton.codec.decode_graph import DEFAULT_COMPILE_SHAPES, AuKVAEDecodeGraph, PendingGraph, _Graph, plan_tiles
from auk_triton.codec.synthetic import write_synthetic_checkpoint
from auk_triton.codec.vae import AuKVAE


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return AuKVAE.from_pretrained(write_synthetic_checkpoint(tmp_path_factory.mktemp("small"), "small"))


def check_plan(plan, frames, tile, left, right, first_tile=None):
    emitted = 0
    previous_start = -1
    for index, (start, size, emit_start, emit_end) in enumerate(plan):
        assert 0 <= start and start + size <= frames, "window inside the clip"
        # In order; the window after a short first one may start at 0 too (its left context).
        assert start > previous_start or (index == 1 and start == 0), "windows in order"
        previous_start = start
        assert emit_start == emitted and emit_end > emit_start, "emitted ranges tile the clip exactly once"
        emitted = emit_end
        limit = first_tile if index == 0 and first_tile and frames > first_tile else tile
        assert size <= limit
        if start > 0:
            assert emit_start - start >= left, "full left context"
        if start + size < frames:
            assert start + size - emit_end >= right, "full right context"
    assert emitted == frames


PLAN_CASES = list(
    itertools.product(
        [1, 63, 128, 129, 500, 512, 513, 700, 1200, 4097],
        [64, 128, 512],
        [(), (128, 256, 512), (64, 100)],
        [None, 64, 128],
    )
)


@pytest.mark.parametrize("frames, tile, sizes, first_tile", PLAN_CASES)
def test_plan_tiles_covers_the_clip_with_full_context(frames, tile, sizes, first_tile):
    left, right = 53, 9
    plan = plan_tiles(frames, tile, left, right, sizes, first_tile)
    check_plan(plan, frames, tile, left, right, first_tile)


def test_a_clip_that_fits_one_tile_is_one_window():
    assert plan_tiles(300, 512, 53, 9, DEFAULT_COMPILE_SHAPES) == [(0, 300, 0, 300)]
    assert plan_tiles(512, 512, 53, 9, DEFAULT_COMPILE_SHAPES) == [(0, 512, 0, 512)]


def test_a_clip_of_one_tile_longer_than_the_first_tile_starts_with_the_short_first_window():
    plan = plan_tiles(500, 512, 53, 9, DEFAULT_COMPILE_SHAPES, first_tile=32)
    # 23 frames first; the rest with their left context (which reaches back to 0) in the 512 bucket.
    assert plan == [(0, 32, 0, 23), (0, 500, 23, 500)]
    assert plan_tiles(32, 512, 53, 9, DEFAULT_COMPILE_SHAPES, first_tile=32) == [(0, 32, 0, 32)]


def test_the_last_window_shrinks_to_the_smallest_bucket_that_holds_the_rest():
    plan = plan_tiles(600, 512, 53, 9, (128, 256, 512))
    assert plan[0] == (0, 512, 0, 503)
    # 97 frames remain; with 53 frames of left context they need 150: the 256 bucket.
    assert plan[1] == (600 - 256, 256, 503, 600)
    assert plan_tiles(600, 512, 53, 9, ())[-1][1] == 512


def test_a_short_first_tile_comes_first_and_the_rest_are_full_tiles():
    plan = plan_tiles(3000, 512, 53, 9, (128, 256, 512), first_tile=128)
    assert plan[0] == (0, 128, 0, 119)
    assert all(size == 512 for _, size, _, _ in plan[1:-1])


def test_a_tile_not_larger_than_the_context_raises():
    with pytest.raises(ValueError, match="does not exceed the decode context"):
        plan_tiles(1000, 62, 53, 9)
    with pytest.raises(ValueError, match="does not exceed the decode context"):
        AuKVAEDecodeGraph(AuKVAE.from_config({"upsample_initial_channel": 64}), tile_frames=60)


def test_a_first_tile_not_longer_than_the_right_context_raises_only_where_clips_are_tiled():
    vae = AuKVAE.from_config({"upsample_initial_channel": 64})
    right = vae.decode_context_frames()[1]
    with pytest.raises(ValueError, match=f"first_tile_frames={right} .*right context of {right} frames"):
        AuKVAEDecodeGraph(vae, compile_shapes=(right, 512), first_tile_frames=right)
    untiled = AuKVAEDecodeGraph(vae, compile_shapes=(right, 512), tile_frames=0, first_tile_frames=right)
    assert untiled.tile_frames == 0


@pytest.mark.parametrize("frames, tile", [(150, 70), (300, 128), (517, 128), (517, 200), (700, 512)])
def test_tiles_stitch_into_the_whole_clip_decode(small, frames, tile):
    latents = torch.randn(1, frames, 64, generator=torch.Generator().manual_seed(frames + tile))
    graph = AuKVAEDecodeGraph(small, tile_frames=tile)
    tiles = list(graph.decode_tiles(latents))
    assert len(tiles) > 1
    hop = small.hop_size
    assert [start for start, _ in tiles] == list(
        itertools.accumulate([0] + [w.shape[1] // hop for _, w in tiles[:-1]])
    )
    stitched = torch.cat([wave for _, wave in tiles], dim=1)
    whole = small.decode(latents)
    assert stitched.shape == whole.shape
    torch.testing.assert_close(stitched, whole, atol=1e-5, rtol=0)
    assert graph.last_mode == "eager"
    torch.testing.assert_close(graph(latents), whole, atol=1e-5, rtol=0)


@pytest.mark.parametrize("look_ahead", [False, True])
def test_host_tiles_are_host_copies_of_the_decoded_tiles_converted_as_asked(small, look_ahead):
    latents = torch.randn(1, 300, 64, generator=torch.Generator().manual_seed(8))
    graph = AuKVAEDecodeGraph(small, tile_frames=128)
    expected = [(start, wave[0].clone()) for start, wave in graph.decode_tiles(latents)]
    tiles = list(graph.host_tiles(latents, look_ahead=look_ahead))
    assert [tile.start_frame for tile in tiles] == [start for start, _ in expected]
    for tile, (_, wave) in zip(tiles, expected):
        assert tile.mode == "eager" and tile.seconds > 0
        torch.testing.assert_close(tile.samples, wave, atol=0, rtol=0)
    halved = list(graph.host_tiles(latents, convert=lambda wave: wave.half(), look_ahead=look_ahead))
    assert all(tile.samples.dtype == torch.float16 for tile in halved)
    torch.testing.assert_close(torch.cat([t.samples for t in halved]), torch.cat([w for _, w in expected]).half())


def test_look_ahead_decodes_the_next_window_before_a_tile_is_handed_over(small, monkeypatch):
    latents = torch.randn(1, 300, 64, generator=torch.Generator().manual_seed(9))
    graph = AuKVAEDecodeGraph(small, tile_frames=128)
    windows = []
    decode_window = graph._decode_window
    monkeypatch.setattr(graph, "_decode_window", lambda window: windows.append(window.shape[1]) or decode_window(window))
    seen = [len(windows) for _ in graph.host_tiles(latents, look_ahead=True)]
    count = len(windows)
    assert count > 2
    assert seen == [min(i + 2, count) for i in range(count)], "window k+1 decoded before tile k is yielded"
    windows.clear()
    assert [len(windows) for _ in graph.host_tiles(latents)] == list(range(1, count + 1)), "without: one at a time"


def test_while_decoding_runs_once_after_the_first_launch_and_what_it_raises_ends_the_tiles(small, monkeypatch):
    latents = torch.randn(1, 300, 64, generator=torch.Generator().manual_seed(10))
    graph = AuKVAEDecodeGraph(small, tile_frames=128)
    events = []
    decode_window = graph._decode_window
    monkeypatch.setattr(graph, "_decode_window", lambda window: events.append("launch") or decode_window(window))
    tiles = [events.append("tile") for _ in graph.host_tiles(latents, while_decoding=lambda: events.append("check"))]
    assert events[:3] == ["launch", "check", "tile"] and events.count("check") == 1
    assert len(tiles) == events.count("launch") > 1

    def refuse():
        raise ValueError("refused")

    events.clear()
    with pytest.raises(ValueError, match="refused"):
        for _ in graph.host_tiles(latents, look_ahead=True, while_decoding=refuse):
            events.append("tile")
    assert events == ["launch"], "nothing is handed over once the check refuses"


def test_on_the_cpu_every_call_is_the_eager_decode(small):
    latents = torch.randn(1, 90, 64, generator=torch.Generator().manual_seed(5))
    graph = AuKVAEDecodeGraph(small)
    graph.warmup("cpu")
    assert graph.compiled_bucket(90) is None
    assert torch.equal(graph(latents), small.decode(latents))
    assert graph.last_mode == "eager"
    assert graph.captures == 0


def test_a_deferred_warm_up_builds_the_first_tile_s_bucket_and_the_largest_before_ready(small):
    graph = AuKVAEDecodeGraph(small, compile_shapes=(32, 128, 256, 512))
    assert graph.ready_buckets() == {32, 512}
    graph = AuKVAEDecodeGraph(small, compile_shapes=(32, 128, 256, 512), first_tile_frames=100)
    assert graph.ready_buckets() == {128, 512}, "the first tile's own bucket, not the smallest"
    assert AuKVAEDecodeGraph(small, compile_shapes=()).ready_buckets() == set()


def test_a_plan_without_the_short_first_window_is_the_clip_s_tiles_alone(small):
    graph = AuKVAEDecodeGraph(small, compile_shapes=(32, 128, 256, 512), first_tile_frames=32)
    left, right = graph.context_frames
    for frames in (20, 500, 1000, 3000):
        assert graph.plan(frames, short_first=False) == plan_tiles(frames, 512, left, right, (32, 128, 256, 512))
        assert graph.plan(frames) == plan_tiles(frames, 512, left, right, (32, 128, 256, 512), 32)
    assert graph.plan(500)[0] == (0, 32, 0, 32 - right) and graph.plan(500, short_first=False)[0][:2] == (0, 500)


def test_on_the_cpu_a_deferred_warm_up_leaves_nothing_to_build(small):
    graph = AuKVAEDecodeGraph(small, compile_shapes=(32, 512), batch_sizes=(1, 2, 4))
    assert graph.warmup("cpu", defer=True) == []
    graph.start_deferred([], "cpu")
    graph.stop_deferred()
    assert graph.deferred_pending == 0 and graph.pending_fallbacks == 0


def test_a_graph_still_being_built_leaves_its_windows_to_another_tier_and_is_taken_over_once_built(
    small, monkeypatch
):
    """The policy, with stand-in graphs that only record their replays (the real ones need a GPU)."""
    graph = AuKVAEDecodeGraph(small, compile_shapes=(32, 128, 512), batch_sizes=(1, 2), batch_frames=512)
    replayed = []

    def stand_in(frames, rows=1):
        replay = type("Replay", (), {"replay": lambda self: replayed.append(f"{frames}x{rows}")})()
        return _Graph(replay, torch.zeros(rows, frames, 64), torch.zeros(rows, frames * small.hop_size))

    def no_capture(*args, **kwargs):
        raise AssertionError("a graph captured at request time")

    monkeypatch.setattr(graph, "_replayable", lambda window: True)  # as on a GPU
    monkeypatch.setattr(graph, "_capture", no_capture)
    graph._buckets = {32: stand_in(32), 512: stand_in(512)}  # what a deferred warm-up builds
    graph._pending = {PendingGraph(128, 1), PendingGraph(32, 2), PendingGraph(128, 2)}
    window, pair = torch.zeros(1, 100, 64), [torch.zeros(1, 32, 64), torch.zeros(1, 30, 64)]

    assert graph.decode_rows([window])[0].shape == (100 * small.hop_size,)
    assert replayed == ["512x1"], "the next larger bucket built"
    graph.decode_rows(pair)
    assert replayed[1:] == ["32x1", "32x1"] and graph.last_mode == "compiled", "one window at a time"
    assert graph.pending_fallbacks == 3

    for item in graph._pending:  # the builder hands them over
        graph._builder.hand_over(item, stand_in(item.frames, item.rows))
    replayed.clear()
    graph.decode_rows([window])
    graph.decode_rows(pair)
    assert replayed == ["128x1", "32x2"] and graph.last_mode == "batched"
    assert graph.pending_fallbacks == 3 and graph.deferred_pending == 0


def test_tiling_off_decodes_in_one_window(small):
    latents = torch.randn(1, 600, 64, generator=torch.Generator().manual_seed(6))
    tiles = list(AuKVAEDecodeGraph(small, tile_frames=0).decode_tiles(latents))
    assert len(tiles) == 1 and tiles[0][0] == 0
    assert torch.equal(tiles[0][1], small.decode(latents))


def test_default_tile_is_the_largest_bucket(small):
    graph = AuKVAEDecodeGraph(small, compile_shapes=(256, 128, 0))
    assert graph.compile_shapes == [128, 256]
    assert graph.tile_frames == 256


@pytest.mark.parametrize(
    "latents", [torch.zeros(2, 10, 64), torch.zeros(1, 10, 32), torch.zeros(10, 64), torch.zeros(1, 0, 64)]
)
def test_decode_tiles_rejects_anything_but_one_clip(small, latents):
    with pytest.raises(ValueError):
        next(AuKVAEDecodeGraph(small).decode_tiles(latents))

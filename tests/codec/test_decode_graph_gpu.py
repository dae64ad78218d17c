"""The graph tiers on a CUDA GPU: exactness, tolerance, retirement and memory. Skipped without CUDA."""

import threading
import time

import pytest
import torch

from auk_triton.codec.decode_graph import AuKVAEDecodeGraph, PendingGraph
from auk_triton.codec.synthetic import write_synthetic_checkpoint
from auk_triton.codec.vae import AuKVAE
from auk_triton.cuda_graph import priority_stream

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

COMPILED_TOLERANCE = 1e-3


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm()).item()


def latents(frames: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, frames, 64, generator=generator).cuda()


@pytest.fixture(scope="module")
def vae(tmp_path_factory):
    checkpoint = write_synthetic_checkpoint(tmp_path_factory.mktemp("small"), "small")
    return AuKVAE.from_pretrained(checkpoint, device="cuda")


@pytest.fixture(scope="module")
def warm(vae):
    graph = AuKVAEDecodeGraph(vae, compile_shapes=(128, 512))
    graph.warmup("cuda")
    assert graph.compiled_bucket(100) == 128 and graph.compiled_bucket(512) == 512
    return graph


@pytest.mark.parametrize("frames", [1, 37, 128, 300, 777])
def test_a_plain_graph_replay_is_bit_identical_with_eager(vae, frames):
    graph = AuKVAEDecodeGraph(vae, compile_shapes=())
    for seed in (0, 1):  # the first call captures, the second replays the same graph
        clip = latents(frames, seed)
        out = graph(clip)
        assert graph.last_mode == "graph"
        assert torch.equal(out, vae.decode(clip))
    assert graph.captures == 1


def test_a_decode_graph_for_a_priority_stream_captures_its_graphs_at_that_priority(vae, monkeypatch):
    import auk_triton.codec.decode_graph as decode_graph

    asked, real_capture = [], decode_graph.capture

    def recording_capture(*args, priority=None, **kwargs):
        asked.append(priority)
        return real_capture(*args, priority=priority, **kwargs)

    monkeypatch.setattr(decode_graph, "capture", recording_capture)
    stream = priority_stream(torch.device("cuda"), first=True)
    graph = AuKVAEDecodeGraph(vae, compile_shapes=(), stream_priority=stream.priority)
    clip = latents(37, 3)
    with torch.cuda.stream(stream):
        out = graph(clip)  # every tier's graph is captured through `_capture`: here a plain one
    torch.cuda.synchronize()
    assert graph.last_mode == "graph" and asked == [stream.priority]
    assert torch.equal(out, vae.decode(clip))


@pytest.mark.parametrize("frames", [128, 512])
def test_a_compiled_bucket_is_close_to_eager(warm, vae, frames):
    clip = latents(frames, 2)
    out = warm(clip)
    assert warm.last_mode == "compiled"
    assert rel_l2(out, vae.decode(clip)) < COMPILED_TOLERANCE


def test_a_padded_clip_differs_from_eager_only_in_its_last_frames(warm, vae):
    frames, hop = 100, vae.hop_size
    _, right = vae.decode_context_frames()
    clip = latents(frames, 3)
    out, expected = warm(clip), vae.decode(clip)
    assert warm.last_mode == "compiled" and out.shape == expected.shape
    settled = (frames - right - 1) * hop
    assert rel_l2(out[:, :settled], expected[:, :settled]) < COMPILED_TOLERANCE


def test_after_max_graphs_lengths_the_generation_is_retired_and_results_stay_right(vae):
    graph = AuKVAEDecodeGraph(vae, compile_shapes=(), max_graphs=4)
    lengths = list(range(20, 30)) + [20, 21]
    for seed, frames in enumerate(lengths):
        clip = latents(frames, seed)
        assert torch.equal(graph(clip), vae.decode(clip))
    assert graph.generations_retired == 2
    assert graph.captures == 12


def test_a_ten_minute_clip_decodes_in_tiles_within_one_tiles_memory(warm, vae):
    frames = 30000
    clip = latents(frames, 4)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    vae.decode(clip[:, :512])
    torch.cuda.synchronize()
    one_tile = torch.cuda.max_memory_allocated() - base

    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = warm(clip)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert warm.last_mode == "tiled"
    output_bytes = out.numel() * out.element_size()
    assert peak <= one_tile + output_bytes, (peak, one_tile, output_bytes)
    assert rel_l2(out, vae.decode(clip)) < COMPILED_TOLERANCE


def test_inside_an_outer_capture_the_wrapper_decodes_eager(vae):
    graph = AuKVAEDecodeGraph(vae, compile_shapes=())
    clip = latents(40, 5)
    expected = vae.decode(clip)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        vae.decode(clip)  # warm the eager kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    outer = torch.cuda.CUDAGraph()
    with torch.cuda.graph(outer):
        out = graph(clip)
    outer.replay()
    torch.cuda.synchronize()
    assert graph.captures == 0 and graph.last_mode == "eager"
    assert torch.equal(out, expected)


def test_a_window_whose_plain_graph_cannot_be_captured_is_decoded_eager(vae, monkeypatch):
    graph = AuKVAEDecodeGraph(vae, compile_shapes=())

    def fail_capture(frames, decode, pool):
        raise torch.cuda.OutOfMemoryError("no memory for the graph")

    monkeypatch.setattr(graph, "_capture", fail_capture)
    clip = latents(45, 6)
    out = graph(clip)
    assert graph.last_mode == "eager"
    assert torch.equal(out, vae.decode(clip))


def test_latents_on_another_device_than_the_vae_are_never_replayed(tmp_path):
    cpu_vae = AuKVAE.from_pretrained(write_synthetic_checkpoint(tmp_path / "small", "small"), device="cpu")
    graph = AuKVAEDecodeGraph(cpu_vae, compile_shapes=())
    with pytest.raises(RuntimeError):  # eager, on mismatched devices: torch refuses
        graph(latents(20, 7))
    assert graph.last_mode == "eager" and graph.captures == 0


@pytest.fixture(scope="module")
def batched(vae):
    graph = AuKVAEDecodeGraph(vae, compile_shapes=(32, 128), batch_sizes=(1, 2, 4), batch_frames=512)
    graph.warmup("cuda")
    return graph


def test_batched_rows_are_the_windows_decoded_alone_within_the_compiled_tolerance(batched, vae):
    rows = [latents(frames, seed) for seed, frames in enumerate((128, 100, 77))]
    assert batched.batch_key(100, torch.device("cuda")) == 128 and batched.batch_capacity(128) == 4
    with torch.no_grad():
        together = [wave.clone() for wave in batched.decode_rows(rows)]
        assert batched.last_mode == "batched"
        alone = [batched.decode_rows([row])[0].clone() for row in rows]  # the compiled bucket
        eager = [vae.decode(row)[0] for row in rows]
    right = vae.decode_context_frames()[1] * vae.hop_size
    for row, batch_wave, alone_wave, eager_wave in zip(rows, together, alone, eager):
        assert batch_wave.shape == alone_wave.shape == (row.shape[1] * vae.hop_size,)
        # All but the last `right` frames, which the bucket's padding can reach.
        settled = slice(0, batch_wave.numel() - right)
        assert rel_l2(batch_wave[settled], alone_wave[settled]) < COMPILED_TOLERANCE
        # The eager kernels, batched: TF32 convolutions of another batch size round differently.
        assert rel_l2(batch_wave[settled], eager_wave[settled]) < COMPILED_TOLERANCE


def test_rows_of_a_batch_do_not_change_each_other(batched):
    base = [latents(128, 10), latents(128, 11)]
    changed = [base[0], latents(128, 12)]
    with torch.no_grad():
        first = batched.decode_rows(base)[0].clone()
        again = batched.decode_rows(changed)[0].clone()
    torch.testing.assert_close(first, again, rtol=0, atol=0)


def test_graphs_built_after_ready_leave_requests_served_by_another_tier_meanwhile_and_never_captured(vae):
    graph = AuKVAEDecodeGraph(vae, compile_shapes=(32, 128, 512), batch_sizes=(1, 2), batch_frames=512)
    pending = graph.warmup("cuda", defer=True)
    assert set(pending) == {PendingGraph(128, 1), PendingGraph(32, 2), PendingGraph(128, 2)}
    assert graph.compiled_bucket(100) == 512, "the 128-frame bucket comes after READY"
    clip, pair = latents(100, 3), [latents(32, 4), latents(30, 5)]
    right = vae.decode_context_frames()[1] * vae.hop_size
    settled = slice(0, 100 * vae.hop_size - right)
    with torch.no_grad():
        expected = vae.decode(clip)[0]
        expected_pair = [vae.decode(row)[0] for row in pair]

        def check():
            wave = graph.decode_rows([clip])[0]
            assert rel_l2(wave[settled], expected[settled]) < COMPILED_TOLERANCE
            for row, want in zip(graph.decode_rows(pair), expected_pair):
                cut = slice(0, want.numel() - right)
                assert rel_l2(row[cut], want[cut]) < COMPILED_TOLERANCE

        check()
        assert graph.last_mode == "compiled", "rows one at a time while their batched graph is pending"
        assert graph.pending_fallbacks == 1 + 2
        done = threading.Event()
        graph.start_deferred(pending, "cuda", on_done=lambda report: done.set())
        served, deadline = 0, time.monotonic() + 600
        while not done.is_set() and time.monotonic() < deadline:  # beside the builder: what is built so far
            check()
            served += 1
        graph.stop_deferred()
        assert done.is_set(), "the deferred graphs were not built within 10 minutes"
        check()
    assert graph.deferred_pending == 0 and graph.compiled_bucket(100) == 128
    assert graph.last_mode == "batched"
    assert graph.captures == 0, "no plain graph captured at request time"
    assert served > 0


def test_a_restart_loads_the_saved_decode_traces_nothing_and_decodes_bit_identically(vae, tmp_path, monkeypatch):
    from torch._dynamo.utils import counters

    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)  # as the served fp16 decoder runs
    path = tmp_path / "decode.bin"
    first = AuKVAEDecodeGraph(vae, compile_shapes=(32, 128), precompiled=path)
    first.warmup("cuda")
    assert first.compile_note.startswith(f"traced and saved to {path}") and path.exists()
    traced = counters["stats"]["unique_graphs"]
    restarted = AuKVAEDecodeGraph(vae, compile_shapes=(32, 128), precompiled=path)  # the next start's
    restarted.warmup("cuda")
    # Loaded on a thread of its own while the eager decode had cuDNN time the buckets' convolutions.
    assert restarted.compile_note.startswith(f"loaded {path}: nothing traced in ")
    assert "cuDNN timed the convolutions of buckets [32, 128]" in restarted.compile_note
    assert counters["stats"]["unique_graphs"] == traced, "no Dynamo trace on the restart"
    for frames, seed in ((128, 20), (100, 21), (32, 22)):
        clip = latents(frames, seed)
        out = restarted(clip)
        assert restarted.last_mode == "compiled"
        assert torch.equal(out, first(clip)), "the same compiled decode, bit for bit"
        assert rel_l2(out, vae.decode(clip)) < COMPILED_TOLERANCE

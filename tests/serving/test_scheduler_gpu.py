"""The tile scheduler on CUDA (skipped without a GPU), with the stand-in decode of
`test_scheduler.py`: a job handed over while another stream still makes its latents; streams
while the look-ahead is held and let go in turns."""

from __future__ import annotations

import itertools

import pytest
import torch

from auk_triton.serving import scheduler as scheduler_module
from auk_triton.serving.scheduler import Job, TileScheduler

from test_scheduler import HOP, RecordingSink, StandInDecoder, clip, expected_waveform  # beside this file

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SPIN_CYCLES = 200_000_000  # about 0.1 s of one SM's clock: the producer is still busy when the job arrives


def test_a_job_handed_over_before_its_latents_are_made_decodes_them_once_made_on_the_gpu():
    device = torch.device("cuda", 0)
    scheduler = TileScheduler(StandInDecoder(), device, sample_rate=1000, hop_size=HOP, max_active=8, max_queued=0)
    scheduler.start()
    try:
        producer = torch.cuda.Stream(device)
        with torch.cuda.stream(producer):
            latents = torch.zeros(1, 30, 2, device=device)
            final = clip(30, 1.0).pin_memory().to(device, non_blocking=True)
            torch.cuda._sleep(SPIN_CYCLES)  # the step still running when the decoder takes the job
            latents.copy_(final)
            ready = torch.cuda.Event()
            ready.record()
        del final
        assert not ready.query(), "the producer finished before the job was handed over"
        sink = RecordingSink([], 1.0)
        scheduler.submit(Job(latents, sink, ready=ready, verify=lambda: None))
        del latents  # the scheduler keeps them, recorded on its own stream
        assert sink.ended.wait(30) and sink.ending == "complete", sink.ending
        torch.testing.assert_close(sink.waveform(), expected_waveform(30), rtol=0, atol=0)
    finally:
        scheduler.close(drain_s=5)


def test_every_stream_stays_exact_and_in_order_while_the_look_ahead_is_held_and_let_go_in_turns(monkeypatch):
    # As auk_pipeline's DiT takes and ends requests: held for two iterations of every three, so
    # the scheduler switches between handing tiles over first and launching ahead, on a GPU where
    # the look-ahead's host copies are asynchronous. The stand-in's windows hold 40 ms of audio:
    # every later window would be due soon, and look ahead. Each replay holds all six streams.
    monkeypatch.setattr(scheduler_module, "DUE_SOON_S", -1e9)
    device = torch.device("cuda", 0)
    scheduler = TileScheduler(StandInDecoder(capacity=6), device, sample_rate=1000, hop_size=HOP, max_active=8,
                              max_queued=0)
    turns = itertools.count()
    scheduler.hold_look_ahead = lambda: next(turns) % 3 != 0
    assert scheduler.look_ahead, "a GPU decodes ahead"
    scheduler.start()
    try:
        sinks = [RecordingSink([], float(tag)) for tag in range(1, 7)]
        for sink in sinks:
            scheduler.submit(Job(clip(200, sink.tag).to(device), sink))
        for sink in sinks:
            assert sink.ended.wait(30) and sink.ending == "complete", sink.ending
            starts = [start for start, _ in sink.tiles]
            assert starts == sorted(starts) and len(starts) == 20, starts
            torch.testing.assert_close(sink.waveform(), expected_waveform(200), rtol=0, atol=0)
        assert next(turns) > 20, "the hold was asked at each iteration"
    finally:
        scheduler.close(drain_s=5)

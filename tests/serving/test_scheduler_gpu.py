"""The tile scheduler on CUDA (skipped without a GPU), with the stand-in decode of
`test_scheduler.py`: a job handed over while another stream still makes its latents."""

from __future__ import annotations

import pytest
import torch

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

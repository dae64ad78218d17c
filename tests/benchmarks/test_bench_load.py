"""benchmarks/bench_load.py: what a pipeline request expects back, and how the open loop
counts its backlog."""

from __future__ import annotations

import argparse
import re
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bench_load import (  # noqa: E402
    PIPELINE_MODEL,
    SAMPLES_PER_FRAME,
    Clip,
    RequestOutcome,
    Workload,
    backlog_trend,
    decoder_busy,
    open_arrivals,
    pipeline_frames,
    poisson_arrivals,
    server_numbers,
    served_repository,
)
from common import DEFAULT_COMPILE_SHAPES, REPO_ROOT, recipes  # noqa: E402

from auk_triton.diffusion import AuKDiTSampler  # noqa: E402
from auk_triton.serving.requests import dit_plan  # noqa: E402

# Durations whose FP32 is not the decimal (0.1, 0.3, 10.01) and whole ones.
SECONDS = (0.1, 0.3, 0.5, 2.02, 10.0, 10.01, 29.99, 60.0)


class TargetFramesOnly:
    """auk_dit's sampler as far as a request's length goes: its own `target_frames`, at 24 kHz
    and 480 samples a frame; planning a request gives its target frames."""

    variant = "base"
    sample_rate, hop, frame_rate, max_frames = 24000, 480, 50.0, None
    target_frames = AuKDiTSampler.target_frames

    def plan(self, request) -> int:
        return self.target_frames(request.gen_seconds, 0)


def sent_arrays(clip: Clip) -> dict[str, np.ndarray]:
    """The arrays a clip's request carries, read back from its serialized InferInputs."""
    import tritonclient.grpc as grpcclient

    types = {"FP32": np.float32, "INT64": np.int64, "INT32": np.int32}
    return {tensor.name(): np.frombuffer(tensor._get_content(), types[tensor.datatype()]).reshape(tensor.shape()).copy()
            for tensor in clip.inputs(grpcclient)}


@pytest.mark.parametrize("recipe", ["flash", "base"])
def test_a_pipeline_request_expects_the_samples_of_the_frames_auk_dit_plans_for_its_duration(recipe):
    workload = Workload(PIPELINE_MODEL, "WAVEFORM", SECONDS, tuple(recipes()[recipe].items()), tokens=4)
    for seconds, clip in workload.clips().items():
        arrays = sent_arrays(clip)
        frames = dit_plan(TargetFramesOnly(), arrays.get, max_steps=64)
        assert clip.samples == frames * SAMPLES_PER_FRAME == pipeline_frames(seconds) * SAMPLES_PER_FRAME
        assert arrays["PROMPT_EMBEDS"].shape == (4, 2048)
        knobs = {"NUM_STEPS", "GUIDANCE", "SWAY"} if recipe == "base" else set()
        assert set(arrays) == {"PROMPT_EMBEDS", "GEN_SECONDS", "SEED"} | knobs
    assert pipeline_frames(0.3) == 15 and pipeline_frames(0.1) == 5  # not ceil() of the FP32's excess


def test_a_backlog_growing_by_two_requests_a_second_has_a_slope_of_two():
    trend = backlog_trend([3 + 2 * second for second in range(1, 11)])
    assert trend.slope == pytest.approx(2.0)
    assert (trend.start, trend.end) == (pytest.approx(6.0), pytest.approx(22.0))  # first and last two counts


def test_a_steady_backlog_has_no_slope_and_ends_where_it_starts():
    trend = backlog_trend([6, 6, 5, 7, 6, 6, 7, 5, 6, 6])
    assert abs(trend.slope) < 0.05
    assert trend.start == trend.end == 6.0


def test_fewer_than_two_counts_make_no_trend():
    assert backlog_trend([]) is None and backlog_trend([4]) is None


class HeldStream:
    """A stream whose requests end once the test lets them."""

    def __init__(self, release: threading.Event):
        self.release = release

    def request(self, clip: Clip, due: float | None = None) -> RequestOutcome:
        self.release.wait()
        return RequestOutcome(clip.seconds, ended=time.perf_counter())


class OnePool:
    def __init__(self, stream):
        self.stream = stream

    def take(self, count: int) -> list:
        return [self.stream]


def test_the_open_loop_counts_every_arrival_in_flight_until_it_ends_started_or_not():
    release = threading.Event()
    clip = Clip(1.0, 50 * SAMPLES_PER_FRAME, lambda grpc: [])
    start_at = time.perf_counter() + 0.1
    timer = threading.Timer(2.6, release.set)  # after the last count, at 2.1 s
    timer.start()
    share = open_arrivals(OnePool(HeldStream(release)), (clip,), rate=20.0, duration=2.0, streams=1, seed=[1],
                          start_at=start_at, label="test")
    arrivals = [at for at, _ in poisson_arrivals(20.0, 2.0, 1, np.random.default_rng([1]))]
    # One stream, held: the first arrival runs, the others find it busy; none has ended at either count.
    assert share.in_flight == [sum(at <= 1.0 for at in arrivals), len(arrivals)]
    assert share.not_started == len(arrivals) - 1 and len(share.outcomes) == 1


def test_the_first_audio_phases_come_from_each_request_s_own_stamps_and_skip_what_was_not_traced():
    from bench_load import phase_percentiles

    ms = 1_000_000
    traced = [
        {"REQUEST_START": 0, "auk_dit COMPUTE_START": 2 * ms, "auk_dit COMPUTE_END": 22 * ms,
         "auk_vae_decode REQUEST_START": 23 * ms, "INFER_RESPONSE_COMPLETE": 27 * ms},
        {"REQUEST_START": 100 * ms, "auk_dit COMPUTE_START": 140 * ms, "auk_dit COMPUTE_END": 200 * ms,
         "auk_vae_decode REQUEST_START": 201 * ms, "INFER_RESPONSE_COMPLETE": 209 * ms},
        {"REQUEST_START": 300 * ms},  # not traced past its start: in no phase
    ]
    phases = phase_percentiles(traced)
    assert phases["waiting for auk_dit"] == pytest.approx((21.0, 36.2, 39.62))
    assert phases["auk_dit's execute (its batch)"][0] == pytest.approx(40.0)
    assert phases["decode to the first tile"][0] == pytest.approx(6.0)
    assert phases["the server's first audio"][2] == pytest.approx(27 + 0.99 * (109 - 27))


def test_dit_executes_are_told_apart_by_their_start_and_grouped_by_the_requests_they_held():
    from bench_load import dit_executes

    ms = 1_000_000

    def request(start, end):
        return {"REQUEST_START": 0, "auk_dit COMPUTE_START": start * ms, "auk_dit COMPUTE_END": end * ms}

    traced = [request(10, 30), request(10, 31), request(50, 70), request(90, 140), request(90, 139),
              {"REQUEST_START": 0}]  # never reached auk_dit
    assert dit_executes(traced) == {1: [20.0], 2: [21.0, 50.0]}


def test_the_server_numbers_of_a_run_are_what_its_counters_grew_by_and_the_decoder_s_busy_shares_of_its_time():
    before = {"auk_vae_windows_per_replay_count": 10, "auk_vae_windows_per_replay_sum": 20,
              "auk_vae_first_audio_seconds_count": 2, "auk_vae_first_audio_seconds_sum": 0.1,
              "auk_vae_first_audio_seconds_bucket:0.05": 2, "auk_vae_first_audio_seconds_bucket:0.1": 2,
              "auk_vae_underruns_total": 1, "auk_vae_decode_seconds_total": 3.0, "auk_vae_send_seconds_total": 1.0}
    after = {"auk_vae_windows_per_replay_count": 30, "auk_vae_windows_per_replay_sum": 100,
             "auk_vae_first_audio_seconds_count": 102, "auk_vae_first_audio_seconds_sum": 5.1,
             "auk_vae_first_audio_seconds_bucket:0.05": 52, "auk_vae_first_audio_seconds_bucket:0.1": 102,
             "auk_vae_underruns_total": 4, "auk_vae_decode_seconds_total": 9.0, "auk_vae_send_seconds_total": 2.5}
    numbers = server_numbers(before, after, wall_s=20.0)
    assert numbers["replays"] == 20 and numbers["windows_per_replay"] == 4.0
    assert numbers["first_audio_mean_ms"] == pytest.approx(50.0) and numbers["first_audio_p99_le_ms"] == 100.0
    assert numbers["underruns"] == 3 and numbers["first_tiles"] == 100
    assert numbers["decode_share"] == pytest.approx(0.3) and numbers["send_share"] == pytest.approx(0.075)
    assert decoder_busy(numbers) == ", decoder thread 30% decoding (launch and wait), 8% sending"
    assert decoder_busy(server_numbers(before, after)) == "", "without the run's time, no shares"


def served_options(**given):
    options = dict(model="decode", buckets=list(DEFAULT_COMPILE_SHAPES), batch_sizes=None, batch_frames=None,
                   max_active=None, first_tile_frames=None, no_first_tile_under_load=False,
                   decode_yields_to_dit=False, no_decode_look_ahead_during_dit=False, first_tile_at_saturation=False)
    return argparse.Namespace(**{**options, **given})


def parameter(config: Path, key: str) -> str:
    return re.search(rf'key: "{key}", value: \{{ string_value: "([^"]*)"', config.read_text()).group(1)


@pytest.mark.parametrize("model, decoding, other", [("pipeline", PIPELINE_MODEL, "auk_vae_decode"),
                                                    ("decode", "auk_vae_decode", PIPELINE_MODEL)])
def test_the_decoder_options_configure_the_model_that_decodes_and_leave_the_other_as_it_was(tmp_path, model,
                                                                                              decoding, other):
    args = served_options(model=model, buckets=[32, 512], batch_sizes=[1, 4], first_tile_frames=0,
                          no_first_tile_under_load=True, no_decode_look_ahead_during_dit=model == "pipeline",
                          first_tile_at_saturation=model == "pipeline")
    repository = served_repository(args, tmp_path / "model_repository")
    configs = [repository / decoding / "config.pbtxt", repository / decoding / "configs" / "gpu.pbtxt"]
    for config in configs:
        keys = ("compile_shapes", "batch_sizes", "first_tile_frames", "first_tile_under_load")
        assert [parameter(config, key) for key in keys] == ["32,512", "1,4", "0", "false"]
    if model == "pipeline":
        assert parameter(configs[0], "decode_look_ahead_during_dit") == "false"
        assert parameter(configs[0], "first_tile_at_saturation") == "true"
    for config in (repository / other).glob("**/*.pbtxt"):
        assert config.read_text() == (REPO_ROOT / "model_repository" / other
                                      / config.relative_to(repository / other)).read_text()


@pytest.mark.parametrize("options, error", [
    (["--revision", "HEAD"], "--revision serves that revision through its own launcher: add --front-door"),
    (["--revision", "no-such-revision", "--front-door"], "--revision no-such-revision: no such commit"),
])
def test_a_revision_to_serve_needs_the_front_door_and_a_commit_of_this_repository(monkeypatch, capsys, options, error):
    from bench_load import parse_args

    monkeypatch.setattr(sys, "argv", ["bench_load.py", "--device", "cpu", "--model", "pipeline", *options])
    with pytest.raises(SystemExit) as exited:
        parse_args()
    assert exited.value.code == 2
    assert error in capsys.readouterr().err

"""Every setting the Triton models read, each with its one default: their config
parameters (read once at load) and the AUK_* variables they read (AUK_CHECKPOINT,
AUK_CACHE_DIR, AUK_ARTIFACTS_DIR, AUK_PRESET, and AUK_SERVER_HTTP_PORT, which the launcher
sets). The launcher's and the front door's own settings are in
auk_triton/front_door/settings.py.

A parameter left out of a config.pbtxt, or given as "", takes the default below.
Nothing here needs the Triton stub or torch, so it can be imported and tested anywhere
(the front door reads the models' limits through it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

DEFAULT_MAX_FRAMES = 30000  # ten minutes at 50 frames per second
SAMPLES_PER_FRAME = 480  # the released codec's hop (24 kHz, 50 frames per second)
DEFAULT_PRESET = "auk"  # the synthetic preset served without a checkpoint
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "auk_triton"
DEFAULT_PROMPT_TOKENS = 512  # auk_dit's longest text condition, in tokens
# A KServe gRPC stream's response has an error message and no status. For a stream whose
# client asks for statuses (the header `triton_grpc_error: true`, whose handling in
# Triton 2.51 itself crashed the server), the front door sets this request parameter (a
# header of this name, which tritonserver forwards to each request of the stream) and
# the models open each error message with its status ("[INVALID_ARGUMENT] ..."): the front
# door ends the stream with that status and the message without it.
STATUS_IN_MESSAGE_PARAMETER = "auk_status_in_error_message"
STATUS_NAMES = ("INVALID_ARGUMENT", "CANCELLED", "UNAVAILABLE", "INTERNAL")
# Triton 2.51's Python backend cannot cancel a request one model forwards to another (BLS).
# The offline model gives each request it forwards to the decode model a token in this
# parameter, and cancels it with a request that carries the token in the second one.
CALL_TOKEN_PARAMETER = "auk_call_token"
CANCEL_CALL_PARAMETER = "auk_cancel_call"
DIT_DTYPES = ("auto", "bfloat16", "float32")
# The decoder's precision on a GPU: fp16 weights and signals (fp32 accumulation and activations),
# or tf32 (fp32 storage, TF32 convolutions). A CPU decodes in fp32 either way.
DECODE_PRECISIONS = ("fp16", "tf32")
GPU_DECODE_PRECISION = "fp16"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


# ---- config parameters ----------------------------------------------------------------------


def config_parameters(model_config: Mapping) -> dict[str, str]:
    """The `parameters` of a Triton model config (the dict `args["model_config"]` holds), as text."""
    return {
        key: str(value.get("string_value", "")).strip()
        for key, value in (model_config.get("parameters") or {}).items()
    }


def int_parameter(params: Mapping[str, str], name: str, default: int | None, minimum: int) -> int | None:
    """Parameter `name` as an integer of at least `minimum`; `default` when it is empty."""
    value = params.get(name, "")
    if value == "":
        return default
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"config parameter {name} is {value!r}; it must be an integer") from None
    if number < minimum:
        raise ValueError(f"config parameter {name} is {number}; it must be at least {minimum}")
    return number


def bool_parameter(params: Mapping[str, str], name: str, default: bool) -> bool:
    """Parameter `name` as a boolean (1/true/yes/on or 0/false/no/off); `default` when it is empty."""
    value = params.get(name, "")
    if value == "":
        return default
    if value.lower() not in _TRUE | _FALSE:
        raise ValueError(f"config parameter {name} is {value!r}; use true or false")
    return value.lower() in _TRUE


def choice_parameter(
    params: Mapping[str, str], name: str, default: str | None, choices: tuple[str, ...]
) -> str | None:
    """Parameter `name`, one of `choices`; `default` when it is empty."""
    value = params.get(name, "")
    if value == "":
        return default
    if value not in choices:
        raise ValueError(f"config parameter {name} is {value!r}; use one of {', '.join(choices)}")
    return value


def path_parameter(params: Mapping[str, str], name: str, model_dir: str | Path) -> str:
    """Parameter `name` as a path: a relative one is taken relative to the model's folder."""
    value = params.get(name, "")
    return str(Path(model_dir) / value) if value and not os.path.isabs(value) else value


def list_parameter(params: Mapping[str, str], name: str, default: tuple[int, ...], example: str) -> tuple[int, ...]:
    """Parameter `name`: comma-separated positive integers; "none" for an empty list."""
    text = params.get(name, "").replace(" ", "")
    if text == "":
        return default
    if text.lower() == "none":
        return ()
    try:
        numbers = tuple(int(s) for s in text.split(",") if s)
    except ValueError:
        raise ValueError(
            f"config parameter {name} is {text!r}; it must be a comma-separated list such as \"{example}\", or none"
        ) from None
    if not numbers or any(n <= 0 for n in numbers):
        raise ValueError(f"config parameter {name} is {text!r}; its numbers must be positive")
    return numbers


def checkpoint_path(params: Mapping[str, str], model_dir: str | Path, environ: Mapping[str, str] = os.environ) -> str:
    """The checkpoint to load: AUK_CHECKPOINT, else the `checkpoint` parameter; "" when neither is set.

    AUK_CHECKPOINT is a path relative to the directory the server started in (the
    model process inherits it; the launcher also makes it absolute); only the
    parameter is relative to the model's folder.
    """
    configured = environ.get("AUK_CHECKPOINT", "").strip()
    if configured:
        return os.path.abspath(configured)
    return path_parameter(params, "checkpoint", model_dir)


def cache_dir_path(params: Mapping[str, str], model_dir: str | Path, environ: Mapping[str, str] = os.environ) -> Path:
    """Where synthetic checkpoints and compile caches go: the `cache_dir` parameter, else
    `environment_cache_dir`."""
    configured = path_parameter(params, "cache_dir", model_dir)
    return Path(configured).absolute() if configured else environment_cache_dir(environ)


def artifacts_dir_path(
    params: Mapping[str, str], model_dir: str | Path, cache_dir: Path, environ: Mapping[str, str] = os.environ
) -> Path:
    """The start-up artifacts, the Inductor and Triton compile caches of each GPU, torch and code
    (serving/artifacts.py): AUK_ARTIFACTS_DIR, else the `artifacts_dir` parameter, else `artifacts`
    in the cache folder. `make artifacts` fills it ahead of serving."""
    configured = environ.get("AUK_ARTIFACTS_DIR", "").strip() or path_parameter(params, "artifacts_dir", model_dir)
    return Path(configured).absolute() if configured else Path(cache_dir) / "artifacts"


@dataclass(frozen=True)
class DecodeSettings:
    """`auk_vae_decode`'s config parameters; the field defaults are the documented defaults."""

    checkpoint: str = ""
    compile_shapes: tuple[int, ...] | None = None  # None: the codec's buckets (buckets())
    tile_frames: int | None = None  # None: the largest compile shape; 0: no tiling
    first_tile_frames: int | None = None  # None: the smallest compile shape; 0: off
    # False: no short first window while another request has a window waiting to decode
    # (scheduler.plan_under_load).
    first_tile_under_load: bool = True
    max_graphs: int = 32
    frame_alignment: int = 1
    enable_cuda_graphs: bool = True
    # One symbolic trace of the decode for every bucket, not one per bucket; and only the
    # first tile's and the largest bucket built before READY, the rest after it.
    compile_dynamic: bool = True
    defer_graphs: bool = True
    fused_activation: bool = True
    channels_last: bool = True
    precision: str | None = None  # None: GPU_DECODE_PRECISION on a GPU, fp32 on a CPU
    max_frames: int = DEFAULT_MAX_FRAMES
    # The tile scheduler: rows per batched replay, frames per replay (None: one tile's worth),
    # the requests it decodes at once, and how many more wait in its queue (past them a
    # request is refused, UNAVAILABLE). Poisson arrivals at 0.8 of the GPU's rate have more
    # than 32 streams in at times, and a request waiting for a place misses its first audio by
    # hundreds of ms, so the limit is for overload only; each active request keeps its latents
    # on the device (at most max_frames x 64 x 4 bytes, 7.7 MB).
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    batch_frames: int | None = None
    max_active_requests: int = 128
    max_queued_requests: int = 64
    cache_dir: Path = DEFAULT_CACHE_DIR
    artifacts_dir: Path | None = None  # the compile caches (artifacts_dir_path); None: `artifacts` in cache_dir

    @classmethod
    def from_model_config(
        cls, model_config: Mapping, model_dir: str | Path, environ: Mapping[str, str] = os.environ
    ) -> "DecodeSettings":
        """Parse `parameters` of a Triton model config (the dict `args["model_config"]` holds).

        Relative paths in parameters are taken relative to the model's directory.
        """
        params = config_parameters(model_config)
        default = cls()
        cache_dir = cache_dir_path(params, model_dir, environ)
        return cls(
            checkpoint=checkpoint_path(params, model_dir, environ),
            compile_shapes=list_parameter(params, "compile_shapes", default.compile_shapes, "128,256,512"),
            tile_frames=int_parameter(params, "tile_frames", default.tile_frames, 0),
            first_tile_frames=int_parameter(params, "first_tile_frames", default.first_tile_frames, 0),
            first_tile_under_load=bool_parameter(params, "first_tile_under_load", default.first_tile_under_load),
            max_graphs=int_parameter(params, "max_graphs", default.max_graphs, 1),
            frame_alignment=int_parameter(params, "frame_alignment", default.frame_alignment, 1),
            enable_cuda_graphs=bool_parameter(params, "enable_cuda_graphs", default.enable_cuda_graphs),
            compile_dynamic=bool_parameter(params, "compile_dynamic", default.compile_dynamic),
            defer_graphs=bool_parameter(params, "defer_graphs", default.defer_graphs),
            fused_activation=bool_parameter(params, "fused_activation", default.fused_activation),
            channels_last=bool_parameter(params, "channels_last", default.channels_last),
            precision=choice_parameter(params, "precision", default.precision, DECODE_PRECISIONS),
            max_frames=int_parameter(params, "max_frames", default.max_frames, 1),
            batch_sizes=list_parameter(params, "batch_sizes", default.batch_sizes, "1,2,4,8,16") or (1,),
            batch_frames=int_parameter(params, "batch_frames", default.batch_frames, 1),
            max_active_requests=int_parameter(params, "max_active_requests", default.max_active_requests, 1),
            max_queued_requests=int_parameter(params, "max_queued_requests", default.max_queued_requests, 0),
            cache_dir=cache_dir,
            artifacts_dir=artifacts_dir_path(params, model_dir, cache_dir, environ),
        )

    def buckets(self) -> tuple[int, ...]:
        """The compiled buckets: `compile_shapes`, else the codec's own default. The codec is
        imported here, not at the top: the front door reads these settings without torch."""
        if self.compile_shapes is not None:
            return self.compile_shapes
        from auk_triton.codec import DEFAULT_COMPILE_SHAPES

        return DEFAULT_COMPILE_SHAPES

    def first_window_frames(self) -> int | None:
        """The first decode window of a long clip: `first_tile_frames`, else the smallest
        compile shape (one small replay before the first audio); 0 turns it off."""
        if self.first_tile_frames is not None:
            return self.first_tile_frames or None
        return min(self.buckets(), default=None)


@dataclass(frozen=True)
class OfflineSettings:
    """`auk_vae_decode_offline`'s config parameters; the field defaults are the documented defaults.

    The offline model decodes nothing itself: it forwards each request to `decode_model`
    (whose settings, `max_frames` among them, apply) and gathers the tiles into one response.
    """

    decode_model: str = "auk_vae_decode"
    # Requests forwarded at once; the rest wait, and past max_queued_requests more a request is
    # refused (UNAVAILABLE). Each forwarded request holds its whole waveform on the host until
    # its response is out (a 10-minute clip: 57.6 MB of float32), and a thread of the Python
    # backend's BLS pool (thread-pool-size, 32) until its first tile: fewer than the streaming
    # model's 128, and fewer than that pool, so the model's own cancellations find a thread.
    max_active_requests: int = 16
    max_queued_requests: int = 64

    @classmethod
    def from_model_config(cls, model_config: Mapping) -> "OfflineSettings":
        params = config_parameters(model_config)
        default = cls()
        return cls(
            decode_model=params.get("decode_model") or default.decode_model,
            max_active_requests=int_parameter(params, "max_active_requests", default.max_active_requests, 1),
            max_queued_requests=int_parameter(params, "max_queued_requests", default.max_queued_requests, 0),
        )


def forwarded_model(model_config: Mapping) -> str | None:
    """The model a config's model forwards its requests to (the offline model's
    `decode_model`), or None for a model that serves its requests itself."""
    if "decode_model" not in config_parameters(model_config):
        return None
    return OfflineSettings.from_model_config(model_config).decode_model


@dataclass(frozen=True)
class DiTSettings:
    """`auk_dit`'s config parameters; the field defaults are the documented defaults."""

    checkpoint: str = ""
    dtype: str = "auto"  # auto: bfloat16 on a GPU, float32 on a CPU
    max_steps: int = 1000
    max_frames: int = DEFAULT_MAX_FRAMES  # reference + target, the decoder's own limit
    max_prompt_tokens: int = DEFAULT_PROMPT_TOKENS
    enable_cuda_graphs: bool = True
    # One graph per batch size of one request shape (1 to max_batch_requests rows); their
    # one memory pool holds about the largest graph's memory, not the sum.
    max_graphs: int = 16
    # Requests in one sampler run (of those Triton's dynamic batcher hands over together,
    # at most max_batch_size); 1: one request at a time, no batching.
    max_batch_requests: int = 16
    # GPU, with CUDA graphs: the step runs through torch.compile (its blocks, dynamic shapes)
    # before each bucket's graphs are captured at load; the start-up artifacts keep the
    # generated code and the blocks' traces across restarts. A CPU steps eagerly whatever this says.
    compile_step: bool = True
    # The blocks' token linears in FP8 (diffusion/fp8.py): e4m3 weights scaled per output
    # channel, inputs per row, on FP8 tensor cores (compute capability 8.9+, the DiT in bf16).
    # Off by default: its quality against bf16 is measured, not a given.
    fp8_linears: bool = False
    # GPU, with CUDA graphs: each run is padded up to the smallest of these sizes that holds its
    # longest prompt (tokens), target and reference (frames), and every bucket's graphs (one per
    # request count it holds) are captured at load (before READY, or after: defer_graphs). 10 s of audio with up to 64
    # tokens lands on (64, 512); a request past the largest size of any list runs alone, its
    # graph captured at request time (logged and counted as a fallback). Empty text or target
    # lists: no buckets (a graph per exact run shape, as max_graphs keeps them).
    text_buckets: tuple[int, ...] = (64, 256, 512)
    frame_buckets: tuple[int, ...] = (256, 512, 1024, 2048)
    ref_buckets: tuple[int, ...] = (512, 2048)
    # The most row tokens in one bucketed run: requests (two rows each when guided) x the
    # bucket's text + reference + target; at least one request. 16 guided requests of 10 s
    # and 64 tokens, 16 x 2 x (64 + 512). It bounds a run's memory, its step time and the
    # graphs a large bucket needs.
    max_batch_tokens: int = 18432
    # GPU, with buckets: only the largest bucket of each reference size (for each guidance mode)
    # is captured before READY; the others after it, on a thread beside serving: every bucket's
    # single-request graph first (smallest first), then the batched ones, what a run lacked
    # first of all. Meanwhile a run takes the smallest built bucket that holds it
    # (auk_dit_fallback_runs_total, kind="larger_bucket"), or its requests run one at a time
    # on their own bucket (kind="split"). False: every bucket before READY.
    defer_graphs: bool = True
    # Requests join the runs in progress between Euler steps and leave them when done, each row
    # at its own time (diffusion/joined.py), on a sampling thread beside execute; false: each
    # execute samples its requests in whole runs, and a request waits for the runs before it.
    join_between_steps: bool = True
    cache_dir: Path = DEFAULT_CACHE_DIR
    artifacts_dir: Path | None = None  # the compile caches (artifacts_dir_path); None: `artifacts` in cache_dir

    @classmethod
    def from_model_config(
        cls, model_config: Mapping, model_dir: str | Path, environ: Mapping[str, str] = os.environ
    ) -> "DiTSettings":
        params = config_parameters(model_config)
        default = cls()
        cache_dir = cache_dir_path(params, model_dir, environ)
        return cls(
            checkpoint=checkpoint_path(params, model_dir, environ),
            dtype=choice_parameter(params, "dtype", default.dtype, DIT_DTYPES),
            max_steps=int_parameter(params, "max_steps", default.max_steps, 1),
            max_frames=int_parameter(params, "max_frames", default.max_frames, 1),
            max_prompt_tokens=int_parameter(params, "max_prompt_tokens", default.max_prompt_tokens, 1),
            enable_cuda_graphs=bool_parameter(params, "enable_cuda_graphs", default.enable_cuda_graphs),
            max_graphs=int_parameter(params, "max_graphs", default.max_graphs, 0),
            max_batch_requests=int_parameter(params, "max_batch_requests", default.max_batch_requests, 1),
            compile_step=bool_parameter(params, "compile_step", default.compile_step),
            fp8_linears=bool_parameter(params, "fp8_linears", default.fp8_linears),
            text_buckets=list_parameter(params, "text_buckets", default.text_buckets, "64,256,512"),
            frame_buckets=list_parameter(params, "frame_buckets", default.frame_buckets, "256,512,1024,2048"),
            ref_buckets=list_parameter(params, "ref_buckets", default.ref_buckets, "512,2048"),
            max_batch_tokens=int_parameter(params, "max_batch_tokens", default.max_batch_tokens, 1),
            defer_graphs=bool_parameter(params, "defer_graphs", default.defer_graphs),
            join_between_steps=bool_parameter(params, "join_between_steps", default.join_between_steps),
            cache_dir=cache_dir,
            artifacts_dir=artifacts_dir_path(params, model_dir, cache_dir, environ),
        )

    def shape_buckets(self):
        """The buckets runs are padded up to (a diffusion.ShapeBuckets); None when the text or
        target list is empty. Imported here: the front door reads these settings without torch."""
        from auk_triton.diffusion import ShapeBuckets

        if not self.text_buckets or not self.frame_buckets:
            return None
        return ShapeBuckets(self.text_buckets, self.frame_buckets, self.ref_buckets, self.max_batch_tokens,
                            self.max_batch_requests)


@dataclass(frozen=True)
class PipelineSettings:
    """`auk_pipeline`'s own config parameters, besides the DiT's and the decoder's that it reads."""

    # While the DiT holds requests, each stream's later windows wait for it a little
    # (scheduler.yields): a new request's steps then do not queue behind other clips' decoding
    # (first windows never wait). Off by default: served at today's slack it lowered the open
    # loop's median first audio, not its p99, and streams underran at saturation
    # (benchmarks/studies/pipeline-open-loop-tail.md).
    decode_yields_to_dit: bool = False
    # The decoder launches its next replay before the last one's tiles are handed over while
    # the DiT holds requests too. False: then it hands them over first and picks the next batch
    # after (scheduler.TileScheduler.hold_look_ahead), so the first windows the DiT's requests
    # bring are picked as they come, not queued behind a later window already launched. Served,
    # that lowered the open loop's first audio p99, but at saturation a few streams fell behind
    # their audio (benchmarks/studies/pipeline-open-loop-tail.md).
    decode_look_ahead_during_dit: bool = True
    # False: while the DiT holds requests back for want of room in the decoder, a request's short
    # first window is planned away (scheduler.TileScheduler.saturated): at saturation the decoder
    # does each clip's work once, and serves more requests a second with no stream behind its
    # audio; below saturation the short window stays. True keeps it at saturation too
    # (benchmarks/studies/pipeline-open-loop-tail.md).
    first_tile_at_saturation: bool = False

    @classmethod
    def from_model_config(cls, model_config: Mapping) -> "PipelineSettings":
        params = config_parameters(model_config)
        default = cls()
        return cls(
            decode_yields_to_dit=bool_parameter(params, "decode_yields_to_dit", default.decode_yields_to_dit),
            decode_look_ahead_during_dit=bool_parameter(params, "decode_look_ahead_during_dit",
                                                        default.decode_look_ahead_during_dit),
            first_tile_at_saturation=bool_parameter(params, "first_tile_at_saturation",
                                                    default.first_tile_at_saturation),
        )


@dataclass(frozen=True)
class EncodeSettings:
    """`auk_vae_encode`'s config parameters; the field defaults are the documented defaults."""

    checkpoint: str = ""
    max_frames: int = DEFAULT_MAX_FRAMES  # the longest clip, in whole frames (the decoder's own limit)
    # GPU: replay the encoder as CUDA graphs, one per sample count. Off: a request of a new
    # length pays warm-ups and a capture, and served lengths rarely repeat (docs/pipeline.md).
    enable_cuda_graphs: bool = False
    max_graphs: int = 8
    cache_dir: Path = DEFAULT_CACHE_DIR

    @classmethod
    def from_model_config(
        cls, model_config: Mapping, model_dir: str | Path, environ: Mapping[str, str] = os.environ
    ) -> "EncodeSettings":
        params = config_parameters(model_config)
        default = cls()
        return cls(
            checkpoint=checkpoint_path(params, model_dir, environ),
            max_frames=int_parameter(params, "max_frames", default.max_frames, 1),
            enable_cuda_graphs=bool_parameter(params, "enable_cuda_graphs", default.enable_cuda_graphs),
            max_graphs=int_parameter(params, "max_graphs", default.max_graphs, 1),
            cache_dir=cache_dir_path(params, model_dir, environ),
        )


def input_row_limits(model_config: Mapping) -> dict[str, int]:
    """The most rows (the first, variable dimension) each variable-length input of a
    model takes, by the model's own settings: what the front door bounds requests by.

    The project's tensor names tell the models apart: LATENTS is a decoder's input,
    PROMPT_EMBEDS and REF_LATENTS are auk_dit's, AUDIO is the encoder's (max_frames frames of
    the released codec's hop). An ensemble's limits are its steps', and a model's that
    forwards its requests (`forwarded_model`) are those of the model it forwards them to: the
    front door reads both there (request_limits.py)."""
    names = {tensor["name"] for tensor in model_config.get("input", [])}
    if "AUDIO" in names and "ensemble_scheduling" not in model_config:
        frames = EncodeSettings.from_model_config(model_config, "", environ={}).max_frames
        return {"AUDIO": frames * SAMPLES_PER_FRAME}
    if "LATENTS" in names:
        return {"LATENTS": DecodeSettings.from_model_config(model_config, "", environ={}).max_frames}
    if "PROMPT_EMBEDS" in names:
        dit = DiTSettings.from_model_config(model_config, "", environ={})
        return {"PROMPT_EMBEDS": dit.max_prompt_tokens, "REF_LATENTS": dit.max_frames}
    return {}


def use_compile_cache(folder: Path, environ=os.environ) -> None:
    """Point Inductor's, Triton's, FlashAttention 4's and quack's compile caches into `folder` (a
    model's artifacts_dir) unless already set."""
    environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(folder) / "inductor"))
    environ.setdefault("TRITON_CACHE_DIR", str(Path(folder) / "triton"))
    environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(Path(folder) / "flash4"))
    environ.setdefault("QUACK_CACHE_DIR", str(Path(folder) / "quack"))  # read when quack is imported


# ---- AUK_* environment variables ------------------------------------------------------------


def environment_cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """AUK_CACHE_DIR, else DEFAULT_CACHE_DIR: the backend directory, synthetic checkpoints and
    compile caches. The launcher and the models read it alike."""
    return Path(environ.get("AUK_CACHE_DIR") or DEFAULT_CACHE_DIR).absolute()


SERVER_HTTP_PORT_VARIABLE = "AUK_SERVER_HTTP_PORT"  # set by the launcher, not by hand


def server_http_port(environ: Mapping[str, str] = os.environ) -> int | None:
    """AUK_SERVER_HTTP_PORT: tritonserver's own HTTP port, which the launcher gives the models so
    that their graph builders can ask whether the whole server is READY; None when unset."""
    value = environ.get(SERVER_HTTP_PORT_VARIABLE, "").strip()
    if not value:
        return None
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise ValueError(f"{SERVER_HTTP_PORT_VARIABLE} is {value!r}; it must be a port number")
    return int(value)


def synthetic_preset(environ: Mapping[str, str] = os.environ) -> str:
    """AUK_PRESET: the synthetic preset served when no checkpoint is configured."""
    return environ.get("AUK_PRESET", "").strip() or DEFAULT_PRESET

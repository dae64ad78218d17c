"""auk-client: decode AuK latents on a Triton server and write the audio.

    auk-client latents.npy -o out.wav                 # gRPC stream, PCM16 WAV
    auk-client --seconds 10 --seed 0 -o out.wav       # seeded random latents
    auk-client latents.npy --raw | aplay -f S16_LE -r 24000 -c 1
    auk-client latents.npy --http -o out.wav          # whole clip over HTTP

Progress, the summary and errors go to stderr, so stdout carries only the
raw PCM of `--raw`. Exit status: 0 on success, 2 for bad input (arguments,
latents file), 1 for anything the server or the network did (unreachable,
model error, timeout).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import ExitStack, contextmanager
from typing import Callable, Iterator

from . import stream as st
from .stream import AuKClientError, BadInput
from .wavio import FLOAT32, PCM16, RawPcm16Stream, WavWriter

PROG = "auk-client"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Decode AuK latents (24 kHz mono) on Triton: streams tiles over gRPC from "
            f"{st.STREAM_MODEL} by default, or the whole clip over HTTP from {st.OFFLINE_MODEL} "
            "with --http, and writes a WAV as the tiles arrive."
        ),
    )
    src = p.add_argument_group("latents (one of)")
    src.add_argument("latents", nargs="?", help=".npy file of shape [frames, dim] or [1, frames, dim]")
    src.add_argument(
        "--seconds", type=float,
        help="instead of a file, seeded random latents for this many seconds of audio "
             "(50 frames per second): a stand-in for the diffusion model's output, "
             "not meaningful sound",
    )
    src.add_argument("--seed", type=int, default=0, help="seed for --seconds (default 0)")
    src.add_argument(
        "--latent-dim", type=int, default=None,
        help="latent width for --seconds (default: what the served model declares, else 64)",
    )

    srv = p.add_argument_group("server")
    srv.add_argument("--url", default=st.DEFAULT_GRPC_URL, help=f"gRPC endpoint (default {st.DEFAULT_GRPC_URL})")
    srv.add_argument("--http", action="store_true", help="one HTTP request to the offline (non-streaming) model")
    srv.add_argument("--http-url", default=st.DEFAULT_HTTP_URL, help=f"HTTP endpoint (default {st.DEFAULT_HTTP_URL})")
    srv.add_argument(
        "--model", default=None,
        help=f"model name (default {st.STREAM_MODEL}, or {st.OFFLINE_MODEL} with --http)",
    )
    srv.add_argument(
        "--timeout", type=float, default=st.DEFAULT_TIMEOUT_S,
        help=f"seconds allowed for the whole request, and for connecting (default {st.DEFAULT_TIMEOUT_S:g})",
    )

    out = p.add_argument_group("output")
    out.add_argument("-o", "--output", default=None, help="WAV file to write (default auk.wav unless --raw)")
    out.add_argument("--float32", action="store_true", help="write 32-bit IEEE float WAV instead of PCM16")
    out.add_argument(
        "--raw", action="store_true",
        help="stream raw PCM16 little-endian mono 24 kHz to stdout as tiles arrive "
             "(a WAV is still written if -o is given)",
    )
    out.add_argument("--plot", metavar="PNG", help="save waveform + spectrogram with tile boundaries (needs matplotlib)")
    out.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no summary")
    return p


def _fail(message: str, prog: str = PROG) -> None:
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)


def run_reporting_errors(run: Callable[[argparse.Namespace], int], args: argparse.Namespace, prog: str = PROG) -> int:
    """`run(args)`, with a failure or Ctrl-C reported as one line on stderr and returned as the exit status."""
    try:
        return run(args)
    except AuKClientError as exc:
        _fail(str(exc), prog)
        return exc.exit_code
    except KeyboardInterrupt:
        _fail("interrupted", prog)
        return 130


@contextmanager
def written_wav(path: str, fmt: str) -> Iterator[WavWriter]:
    """A WavWriter on `path`, closed at the end of the block and removed if the block fails,
    so that no half-written WAV is left behind."""
    try:
        wav = WavWriter(path, fmt=fmt, sample_rate=st.SAMPLE_RATE)
    except OSError as exc:
        raise BadInput(f"cannot write {path}: {exc.strerror or exc}") from None
    ok = False
    try:
        yield wav
        ok = True
    finally:
        wav.close()
        if not ok:
            try:
                os.remove(path)
            except OSError:
                pass


def _progress(total_seconds: float, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    # disable=None: no bar when stderr is not a terminal (pipes, logs, tests).
    return tqdm(
        total=round(total_seconds, 3), unit="s", desc="audio", file=sys.stderr, disable=None, leave=True,
        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.2f}/{total:.2f} s [{elapsed}<{remaining}]",
    )


def run(args: argparse.Namespace) -> int:
    if (args.latents is None) == (args.seconds is None):
        raise BadInput("give either a latents .npy file or --seconds (not both)")
    if args.timeout <= 0:
        raise BadInput("--timeout must be positive")
    if args.seed < 0:
        raise BadInput(f"--seed must be 0 or more, got {args.seed}")
    if args.latent_dim is not None and args.latent_dim < 1:
        raise BadInput(f"--latent-dim must be at least 1, got {args.latent_dim}")
    if args.seconds is not None:
        st.frames_for_seconds(args.seconds)  # bad input is reported before the server is asked anything
    if args.raw and args.float32 and not args.output:
        raise BadInput("--float32 applies to the WAV file; --raw always streams PCM16 (add -o FILE.wav)")
    if args.raw and args.output == "-":
        raise BadInput("-o - is not supported; use --raw for stdout")
    output = args.output if args.output else (None if args.raw else "auk.wav")
    if args.plot:
        from .plot import require_matplotlib

        require_matplotlib()  # fail before decoding, not after

    model = args.model or (st.OFFLINE_MODEL if args.http else st.STREAM_MODEL)
    url = args.http_url if args.http else args.url
    transport = "HTTP" if args.http else "gRPC stream"

    latents = st.load_latents(args.latents) if args.latents is not None else None
    # Ask the server about the model first: it tells a dead server or a missing
    # model apart from a failing request, and gives the latent width for --seconds.
    declared_dim = st.model_latent_dim(model, url, http=args.http, timeout=args.timeout)
    source = args.latents
    if latents is None:
        dim = args.latent_dim or declared_dim or st.DEFAULT_LATENT_DIM
        latents = st.random_latents(args.seconds, args.seed, dim)
        source = f"random latents (seed {args.seed}), a stand-in for the diffusion model's output"

    frames = latents.shape[0]
    total_samples = frames * st.HOP
    total_seconds = total_samples / st.SAMPLE_RATE
    fmt = FLOAT32 if args.float32 else PCM16

    tiles: list[st.Tile] = []
    covered = 0  # highest sample end seen, for the progress bar
    with ExitStack() as outputs:
        sinks = []
        if output:
            sinks.append(outputs.enter_context(written_wav(output, fmt)))
        if args.raw:
            sinks.append(RawPcm16Stream(sys.stdout.buffer))
        bar = _progress(total_seconds, enabled=not args.quiet)
        started = time.perf_counter()
        try:
            # PCM16 output (the default WAV, and --raw) asks the server for WAVEFORM_PCM16:
            # the same conversion done there, and half the bytes on the wire.
            pcm16 = fmt == PCM16
            if args.http:
                incoming = iter([st.decode_offline(latents, url=url, model=model, timeout=args.timeout, pcm16=pcm16)])
            else:
                incoming = st.stream_decode(latents, url=url, model=model, timeout=args.timeout, pcm16=pcm16)
            for tile in incoming:
                for sink in sinks:
                    sink.place(tile.start_sample, tile.waveform)
                tiles.append(tile)
                if bar is not None and tile.end_sample > covered:
                    bar.update(round((min(tile.end_sample, total_samples) - min(covered, total_samples)) / st.SAMPLE_RATE, 3))
                covered = max(covered, tile.end_sample)
        except BrokenPipeError:
            raise AuKClientError("stdout was closed before the audio was complete") from None
        finally:
            elapsed = time.perf_counter() - started
            if bar is not None:
                bar.close()
        if not tiles:  # inside the block: the header-only WAV is removed
            raise AuKClientError(f"{model} at {url} finished without sending any audio")

    received_samples = max(t.end_sample for t in tiles)
    if received_samples < total_samples:
        print(
            f"{PROG}: warning: received {received_samples} samples, expected {total_samples} "
            f"({frames} frames x {st.HOP}); the rest is silence",
            file=sys.stderr,
        )

    if args.plot:
        from .plot import save_plot

        audio = st.assemble(tiles, total_samples)
        save_plot(
            args.plot, audio, st.SAMPLE_RATE, [t.start_sample for t in tiles],
            title=f"{model} via {transport}: {len(tiles)} tiles",
        )

    if not args.quiet:
        first = min(t.arrived_s for t in tiles)
        audio_s = max(received_samples, total_samples) / st.SAMPLE_RATE
        lines = [
            f"{PROG}: decoded {audio_s:.3f} s of audio with {model} over {transport} at {url}",
            f"  latents               {source} [{frames} x {latents.shape[1]}]",
            f"  time to first audio   {first * 1000:.1f} ms",
            f"  total time            {elapsed * 1000:.1f} ms",
            f"  audio                 {audio_s:.3f} s ({max(received_samples, total_samples)} samples at {st.SAMPLE_RATE} Hz)",
            f"  speed                 {audio_s / elapsed:.1f}x real time" if elapsed > 0 else "  speed                 -",
            f"  tiles received        {len(tiles)}",
        ]
        if output:
            lines.append(f"  wrote                 {output} ({'32-bit float' if fmt == FLOAT32 else 'PCM16'} WAV)")
        if args.raw:
            lines.append("  stdout                raw PCM16 little-endian, mono, 24000 Hz")
        if args.plot:
            lines.append(f"  plot                  {args.plot}")
        print("\n".join(lines), file=sys.stderr, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["pipeline"]:  # `auk-client pipeline ...`: text-to-audio through auk_pipeline
        from .pipeline import main as pipeline_main

        return pipeline_main(argv[1:])
    return run_reporting_errors(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

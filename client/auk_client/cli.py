"""auk-client: decode AuK latents, generate audio through the pipeline, or encode and edit audio, on a Triton server.

    auk-client decode latents.npy -o out.wav          # gRPC stream, PCM16 WAV
    auk-client latents.npy -o out.wav                 # the same: without a command, auk-client decodes
    auk-client --seconds 10 --seed 0 -o out.wav       # seeded random latents
    auk-client latents.npy --raw | aplay -f S16_LE -r 24000 -c 1
    auk-client latents.npy --http -o out.wav          # whole clip over HTTP
    auk-client pipeline --random-tokens 32 --seconds 10 -o out.wav   # text condition -> DiT -> decoder
    auk-client encode source.wav -o latents.npy       # a WAV's latents (any rate and channels)
    auk-client edit --audio source.wav --prompt-embeds p.npy --seconds 10 -o out.wav   # edit a clip

Progress, the summary and errors go to stderr, so stdout carries only the
raw PCM of `--raw`. Exit status: 0 on success, 2 for bad input (arguments,
latents file), 1 for anything the server or the network did (unreachable,
model error, timeout).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from contextlib import ExitStack, contextmanager
from typing import Callable, Iterator

from . import stream as st
from .edit import EDIT_MODEL, ENCODE_MODEL, encode_audio, stream_edit
from .pipeline import (
    DEFAULT_PIPELINE_TIMEOUT_S,
    PIPELINE_MODEL,
    TEXT_DIM,
    load_prompt_embeds,
    random_prompt_embeds,
    stream_pipeline,
)
from .source import SourceAudio, load_source
from .stream import AuKClientError, BadInput
from .wavio import FLOAT32, PCM16, RawPcm16Stream, WavWriter

PROG = "auk-client"
COMMANDS = ("decode", "pipeline", "encode", "edit")
DECODE_DESCRIPTION = (
    "Decode AuK latents (24 kHz mono) on Triton: streams tiles over gRPC from "
    f"{st.STREAM_MODEL} by default, or the whole clip over HTTP from {st.OFFLINE_MODEL} "
    "with --http, and writes a WAV as the tiles arrive."
)
PIPELINE_DESCRIPTION = "Generate audio with the AuK pipeline (DiT -> decoder) on Triton, streamed over gRPC."
SOURCE_NOTE = (
    "The WAV (PCM16 or 32-bit float, any sample rate and channel count) is mixed down to mono "
    "and resampled to 24 kHz (soxr) first; the server cuts it to whole 20 ms frames."
)
ENCODE_DESCRIPTION = f"Encode a WAV to normalized AuK latents with {ENCODE_MODEL} on Triton (gRPC). {SOURCE_NOTE}"
EDIT_DESCRIPTION = (
    f"Edit audio with AuK on Triton: {EDIT_MODEL} encodes the source WAV, the DiT generates with its "
    f"latents as the reference, and the decoder streams the result over gRPC. {SOURCE_NOTE}"
)


# -- parsers ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """`auk-client COMMAND ...`: decode (latents to audio) or pipeline (a text condition to audio)."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Decode AuK latents, generate audio through the AuK pipeline, or encode and edit audio, on a Triton server.",
        epilog=(
            f"Without a command, {PROG} decodes: `{PROG} latents.npy -o out.wav` is "
            f"`{PROG} decode latents.npy -o out.wav`. `{PROG} COMMAND --help` lists a command's options."
        ),
    )
    commands = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    decode = commands.add_parser(
        "decode", description=DECODE_DESCRIPTION,
        help="latents to audio through the decoder (the default command)",
    )
    add_decode_arguments(decode).set_defaults(run=run_decode, prog=decode.prog)
    pipeline = commands.add_parser(
        "pipeline", description=PIPELINE_DESCRIPTION,
        help="a text condition to audio through the DiT and the decoder",
    )
    add_pipeline_arguments(pipeline).set_defaults(run=run_pipeline, prog=pipeline.prog)
    encode = commands.add_parser("encode", description=ENCODE_DESCRIPTION, help="a WAV to its latents through the encoder")
    add_encode_arguments(encode).set_defaults(run=run_encode, prog=encode.prog)
    edit = commands.add_parser(
        "edit", description=EDIT_DESCRIPTION,
        help="a source WAV and a text condition to audio through the encoder, the DiT and the decoder",
    )
    add_edit_arguments(edit).set_defaults(run=run_edit, prog=edit.prog)
    return p


def build_decode_parser() -> argparse.ArgumentParser:
    """The bare form's parser: `auk-client ARGS` decodes, with the usage and error lines
    it had before there were commands."""
    p = add_decode_arguments(argparse.ArgumentParser(prog=PROG, description=DECODE_DESCRIPTION))
    p.set_defaults(run=run_decode, prog=PROG)
    return p


def add_decode_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
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


def add_text_condition_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("text condition (one of)")
    src.add_argument("--prompt-embeds", metavar="NPY", help=f".npy of shape [tokens, {TEXT_DIM}] from AuK's encoder stage")
    src.add_argument(
        "--random-tokens", type=int, metavar="N",
        help="instead, N seeded random prompt tokens: a stand-in for the encoder stage (no meaningful sound)",
    )


def add_sampling_arguments(gen) -> None:
    """The sampler's options a generation and an edit share; unset, the server's defaults hold."""
    gen.add_argument("--seed", type=int, default=0, help="noise seed (and the stand-in prompt's); default 0")
    gen.add_argument("--steps", type=int, default=None, help="Euler steps (server default 32; flash: locked to 4)")
    gen.add_argument("--guidance", type=float, default=None, help="CFG scale (server default 2.0)")
    gen.add_argument("--sway", type=float, default=None, help="time-grid sway (server default -1.0)")


def add_server_arguments(p: argparse.ArgumentParser, model: str, kind: str, timeout_s: float) -> None:
    srv = p.add_argument_group("server")
    srv.add_argument("--url", default=st.DEFAULT_GRPC_URL, help=f"gRPC endpoint (default {st.DEFAULT_GRPC_URL})")
    srv.add_argument("--model", default=model, help=f"{kind} name (default {model})")
    srv.add_argument("--timeout", type=float, default=timeout_s, help="seconds for the whole request")


def add_pipeline_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_text_condition_arguments(p)
    gen = p.add_argument_group("generation")
    gen.add_argument("--seconds", type=float, required=True, help="duration of audio to generate")
    add_sampling_arguments(gen)
    gen.add_argument("--ref-latents", metavar="NPY", help="a source clip's normalized latents [frames, 64], for editing")
    add_server_arguments(p, PIPELINE_MODEL, "model", DEFAULT_PIPELINE_TIMEOUT_S)
    out = p.add_argument_group("output")
    out.add_argument("-o", "--output", default="auk_pipeline.wav", help="WAV file, written as tiles arrive")
    out.add_argument("--float32", action="store_true", help="32-bit float WAV instead of PCM16")
    out.add_argument("-q", "--quiet", action="store_true", help="no summary")
    return p


def add_encode_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("audio", help="source WAV file")
    p.add_argument(
        "--seed", type=int, default=None,
        help="sample the posterior with this request seed (default: the posterior mean)",
    )
    add_server_arguments(p, ENCODE_MODEL, "model", st.DEFAULT_TIMEOUT_S)
    out = p.add_argument_group("output")
    out.add_argument("-o", "--output", default="latents.npy", help="the latents [frames, 64] as .npy (default latents.npy)")
    out.add_argument("-q", "--quiet", action="store_true", help="no summary")
    return p


def add_edit_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--audio", required=True, metavar="WAV", help="the source clip to edit")
    add_text_condition_arguments(p)
    gen = p.add_argument_group("generation")
    gen.add_argument(
        "--seconds", type=float, default=None,
        help="duration of the edited audio (default: as long as the source)",
    )
    add_sampling_arguments(gen)
    gen.add_argument(
        "--encode-seed", type=int, default=None,
        help="encode the source as a posterior sample with this seed (the reference's vae_sample: "
             "pass the same value as --seed); default: the posterior mean",
    )
    add_server_arguments(p, EDIT_MODEL, "ensemble", DEFAULT_PIPELINE_TIMEOUT_S)
    out = p.add_argument_group("output")
    out.add_argument("-o", "--output", default="auk_edit.wav", help="WAV file, written as tiles arrive")
    out.add_argument("--float32", action="store_true", help="32-bit float WAV instead of PCM16")
    out.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no summary")
    return p


# -- shared by the commands -------------------------------------------------------------------


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


# -- decode -----------------------------------------------------------------------------------


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


def run_decode(args: argparse.Namespace) -> int:
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


# -- pipeline ---------------------------------------------------------------------------------


def run_pipeline(args: argparse.Namespace) -> int:
    if (args.prompt_embeds is None) == (args.random_tokens is None):
        raise BadInput("give either --prompt-embeds FILE.npy or --random-tokens N (not both)")
    if args.seed < 0:
        raise BadInput(f"--seed must be 0 or more, got {args.seed}")
    st.frames_for_seconds(args.seconds)  # a bad duration is reported before the server is asked
    if args.prompt_embeds is not None:
        embeds, source = load_prompt_embeds(args.prompt_embeds), args.prompt_embeds
    else:
        embeds = random_prompt_embeds(args.random_tokens, args.seed)
        source = f"{args.random_tokens} random tokens (seed {args.seed}), a stand-in for the encoder stage"
    ref = st.load_latents(args.ref_latents) if args.ref_latents else None
    started = time.perf_counter()
    first, samples, tiles = None, 0, 0
    with written_wav(args.output, FLOAT32 if args.float32 else PCM16) as writer:
        for tile in stream_pipeline(
            embeds, args.seconds, args.seed, num_steps=args.steps, guidance=args.guidance, sway=args.sway,
            ref_latents=ref, url=args.url, model=args.model, timeout=args.timeout,
        ):
            writer.place(tile.start_sample, tile.waveform)
            first = tile.arrived_s if first is None else first
            samples, tiles = max(samples, tile.end_sample), tiles + 1
        if not tiles:  # inside the block: the header-only WAV is removed
            raise AuKClientError(f"{args.model} at {args.url} finished without sending any audio")
    if not args.quiet:
        total = time.perf_counter() - started
        print(
            f"prompt: {source}\n"
            f"audio: {samples / st.SAMPLE_RATE:.2f} s in {tiles} tiles -> {args.output}\n"
            f"time to first audio: {first:.3f} s, total {total:.3f} s",
            file=sys.stderr,
        )
    return 0


# -- encode and edit --------------------------------------------------------------------------


def describe_source(path: str, source: SourceAudio) -> str:
    layout = "mono" if source.source_channels == 1 else f"{source.source_channels} channels mixed to mono"
    rate = "" if source.source_rate == st.SAMPLE_RATE else f", resampled from {source.source_rate} Hz"
    return f"{path} ({layout}{rate}; {source.seconds:.3f} s at {st.SAMPLE_RATE} Hz, {source.frames} frames)"


def write_npy(path: str, array) -> None:
    """`array` as .npy at exactly `path` (np.save would add .npy to a name without it)."""
    import numpy as np

    try:
        with open(path, "wb") as f:
            np.save(f, array)
    except OSError as exc:
        raise BadInput(f"cannot write {path}: {exc.strerror or exc}") from None


def run_encode(args: argparse.Namespace) -> int:
    if args.seed is not None and args.seed < 0:
        raise BadInput(f"--seed must be 0 or more, got {args.seed}")
    source = load_source(args.audio)
    started = time.perf_counter()
    latents = encode_audio(source.samples, seed=args.seed, url=args.url, model=args.model, timeout=args.timeout)
    elapsed = time.perf_counter() - started
    write_npy(args.output, latents)
    if not args.quiet:
        kind = "posterior mean" if args.seed is None else f"a posterior sample (seed {args.seed})"
        print("\n".join([
            f"{PROG}: encoded {source.seconds:.3f} s of audio with {args.model} over gRPC at {args.url}",
            f"  source                {describe_source(args.audio, source)}",
            f"  latents               [{latents.shape[0]} x {latents.shape[1]}], {kind}",
            f"  time                  {elapsed * 1000:.1f} ms",
            f"  wrote                 {args.output}",
        ]), file=sys.stderr, flush=True)
    return 0


def run_edit(args: argparse.Namespace) -> int:
    if (args.prompt_embeds is None) == (args.random_tokens is None):
        raise BadInput("give either --prompt-embeds FILE.npy or --random-tokens N (not both)")
    for option, value in (("--seed", args.seed), ("--encode-seed", args.encode_seed)):
        if value is not None and value < 0:
            raise BadInput(f"{option} must be 0 or more, got {value}")
    if args.seconds is not None:
        st.frames_for_seconds(args.seconds)  # a bad duration is reported before the server is asked
    if args.prompt_embeds is not None:
        embeds, prompt = load_prompt_embeds(args.prompt_embeds), args.prompt_embeds
    else:
        embeds = random_prompt_embeds(args.random_tokens, args.seed)
        prompt = f"{args.random_tokens} random tokens (seed {args.seed}), a stand-in for the encoder stage"
    source = load_source(args.audio)
    # The server makes ceil(50 * seconds) frames, or as many as the source has.
    target_s = source.frames * st.HOP / st.SAMPLE_RATE if args.seconds is None else args.seconds
    fmt = FLOAT32 if args.float32 else PCM16
    tiles: list[st.Tile] = []
    with written_wav(args.output, fmt) as writer:
        bar = _progress(target_s, enabled=not args.quiet)
        started = time.perf_counter()
        covered = 0
        try:
            for tile in stream_edit(
                source.samples, embeds, args.seconds, args.seed, num_steps=args.steps, guidance=args.guidance,
                sway=args.sway, encode_seed=args.encode_seed, url=args.url, model=args.model, timeout=args.timeout,
            ):
                writer.place(tile.start_sample, tile.waveform)
                tiles.append(tile)
                if bar is not None and tile.end_sample > covered:
                    bar.update(round((tile.end_sample - covered) / st.SAMPLE_RATE, 3))
                covered = max(covered, tile.end_sample)
        finally:
            elapsed = time.perf_counter() - started
            if bar is not None:
                bar.close()
        if not tiles:  # inside the block: the header-only WAV is removed
            raise AuKClientError(f"{args.model} at {args.url} finished without sending any audio")
    if not args.quiet:
        samples = max(t.end_sample for t in tiles)
        audio_s = samples / st.SAMPLE_RATE
        print("\n".join([
            f"{PROG}: edited {audio_s:.3f} s of audio with {args.model} over gRPC stream at {args.url}",
            f"  source                {describe_source(args.audio, source)}",
            f"  prompt                {prompt}",
            f"  time to first audio   {min(t.arrived_s for t in tiles) * 1000:.1f} ms",
            f"  total time            {elapsed * 1000:.1f} ms",
            f"  audio                 {audio_s:.3f} s ({samples} samples at {st.SAMPLE_RATE} Hz)",
            f"  tiles received        {len(tiles)}",
            f"  wrote                 {args.output} ({'32-bit float' if fmt == FLOAT32 else 'PCM16'} WAV)",
        ]), file=sys.stderr, flush=True)
    return 0


# -- entry point ------------------------------------------------------------------------------


def _starts_with_a_command(argv: list[str]) -> bool:
    """`COMMAND ...`, or the overall help; anything else is the bare form of decode."""
    return bool(argv) and argv[0] in (*COMMANDS, "-h", "--help")


def _reads_as_a_command_name(word: str) -> bool:
    """A first word with no extension and no folder that names no file: a mistyped command
    more likely than latents (those are .npy files), so it gets a usage error of its own."""
    return re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", word) is not None and not os.path.exists(word)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    bare = not _starts_with_a_command(argv)
    if bare and argv and _reads_as_a_command_name(argv[0]):
        build_parser().error(f"{argv[0]!r} is neither a command ({', '.join(COMMANDS)}) nor a latents file")
    args = (build_decode_parser() if bare else build_parser()).parse_args(argv)
    return run_reporting_errors(args.run, args, prog=args.prog)


if __name__ == "__main__":
    sys.exit(main())

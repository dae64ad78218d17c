"""auk-client run as a real subprocess against the real tritonserver of the test fixture,
and the client as a distribution of its own that never needs torch.

Every audio check compares with the library: `AuKVAEDecodeGraph.decode_tiles`
with the server's tile size on the checkpoint the server loaded, converted to
PCM16 the way docs/client.md documents it (clip to [-1, 1], round(x * 32767)),
written out here independently of the client's own conversion code. PCM16 must
match exactly; float32 within 1e-6.
"""

from __future__ import annotations

import ast
import json
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
import wave
from pathlib import Path

import numpy as np
import pytest
from triton_harness import closed_port, documented_pcm16, library_tiles

REPO_ROOT = Path(__file__).resolve().parents[2]
CLIENT_DIR = REPO_ROOT / "client"
HOP = 480
RATE = 24000
CLIP_FRAMES = 300  # 6 s: several tiles at the fixture's tile size


@pytest.fixture(scope="module")
def triton_server(triton):
    """The session's server (conftest's `triton`), under the client contract's name."""
    return triton


def run_client(*args, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(CLIENT_DIR)] + [p for p in [env.get("PYTHONPATH")] if p])
    return subprocess.run(
        [sys.executable, "-m", "auk_client.cli", *map(str, args)],
        capture_output=True, timeout=timeout, env=env, **kwargs,
    )


def assert_pcm16_is_documented_conversion(pcm: np.ndarray, reference: np.ndarray):
    """Exactly documented_pcm16(reference): the server's CPU decode is the library's, sample for sample."""
    expected = documented_pcm16(reference)
    assert pcm.shape == expected.shape
    off = np.flatnonzero(pcm != expected)
    assert off.size == 0, (
        f"{off.size} of {pcm.size} PCM16 samples differ, first at {off[:5].tolist()}: "
        f"got {pcm[off[:5]].tolist()}, want {expected[off[:5]].tolist()} from {reference[off[:5]].tolist()}"
    )


def read_pcm16_wav(path: Path) -> np.ndarray:
    with wave.open(str(path), "rb") as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getcomptype()) == (1, 2, RATE, "NONE")
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")


def read_float32_wav(path: Path) -> np.ndarray:
    """Walk the RIFF chunks by hand (the wave module has no IEEE float support)."""
    blob = path.read_bytes()
    assert blob[:4] == b"RIFF" and blob[8:12] == b"WAVE"
    assert struct.unpack_from("<I", blob, 4)[0] == len(blob) - 8, "RIFF size"
    pos, fmt, data, fact = 12, None, None, None
    while pos < len(blob):
        cid, size = blob[pos:pos + 4], struct.unpack_from("<I", blob, pos + 4)[0]
        body = blob[pos + 8:pos + 8 + size]
        if cid == b"fmt ":
            fmt = struct.unpack_from("<HHIIHH", body)
        elif cid == b"fact":
            fact = struct.unpack_from("<I", body)[0]
        elif cid == b"data":
            data = body
        pos += 8 + size + (size & 1)
    assert fmt == (3, 1, RATE, RATE * 4, 4, 32), f"fmt chunk {fmt}: want IEEE float, mono, 24 kHz, 32 bit"
    samples = np.frombuffer(data, dtype="<f4")
    assert fact == samples.size
    return samples


def library_decode(checkpoint_dir: Path, latents: np.ndarray, server) -> np.ndarray:
    """The library's tiled decode on the checkpoint the server loaded, stitched into one clip."""
    from auk_triton.codec.vae import AuKVAE

    out = np.zeros(latents.shape[0] * HOP, dtype=np.float32)
    for start, piece in library_tiles(AuKVAE.from_pretrained(checkpoint_dir), latents, server):
        out[start:start + piece.size] = piece
    return out


def one_error_line(proc: subprocess.CompletedProcess, prog: str = "auk-client") -> str:
    lines = proc.stderr.decode().strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got: {lines}"
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def latents_file(tmp_path_factory) -> Path:
    """Latents of several tiles saved as [1, frames, 64]; needs no server."""
    path = tmp_path_factory.mktemp("latents") / "latents.npy"
    np.save(path, np.random.default_rng(11).standard_normal((1, CLIP_FRAMES, 64)).astype(np.float32))
    return path


@pytest.fixture(scope="module")
def clip(tmp_path_factory, latents_file, triton_server):
    """The latents file, its latents, and the library's decode of them."""
    latents = np.load(latents_file)[0]
    reference = library_decode(triton_server.checkpoint_dir, latents, triton_server)
    return tmp_path_factory.mktemp("client"), latents_file, latents, reference


@pytest.fixture(scope="module")
def streamed(clip, triton_server):
    """One streamed run writing a PCM16 WAV and raw PCM16 to stdout together."""
    folder, path, _, _ = clip
    wav = folder / "stream.wav"
    proc = run_client(path, "--url", triton_server.grpc_url, "-o", wav, "--raw")
    assert proc.returncode == 0, proc.stderr.decode()
    return proc, wav


def test_the_streamed_pcm16_wav_holds_the_library_decode_converted_as_documented(clip, streamed):
    _, _, latents, reference = clip
    proc, wav = streamed
    pcm = read_pcm16_wav(wav)
    assert pcm.size == CLIP_FRAMES * HOP
    assert_pcm16_is_documented_conversion(pcm, reference)


def test_raw_stdout_carries_exactly_the_samples_of_the_wav(streamed):
    proc, wav = streamed
    raw = np.frombuffer(proc.stdout, dtype="<i2")
    assert raw.size == CLIP_FRAMES * HOP, "stdout holds nothing but the PCM"
    np.testing.assert_array_equal(raw, read_pcm16_wav(wav))


def test_the_summary_reports_first_audio_total_time_audio_seconds_speed_and_several_tiles(streamed):
    proc, _ = streamed
    summary = proc.stderr.decode()
    for label in ("time to first audio", "total time", "real time", "tiles received"):
        assert label in summary, summary
    assert re.search(r"^  audio +6\.000 s \(144000 samples at 24000 Hz\)$", summary, re.MULTILINE), summary
    tiles = int(summary.split("tiles received")[1].split()[0])
    assert tiles >= 3, "a 6 s clip spans several tiles at the fixture's tile size"


def test_float32_wav_matches_the_library_decode_within_1e_6(clip, triton_server, tmp_path):
    _, path, _, reference = clip
    wav = tmp_path / "f32.wav"
    proc = run_client(path, "--url", triton_server.grpc_url, "-o", wav, "--float32", "-q")
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stderr == b"" and proc.stdout == b"", "--quiet prints nothing on success"
    samples = read_float32_wav(wav)
    assert samples.size == CLIP_FRAMES * HOP
    np.testing.assert_allclose(samples, reference, rtol=0, atol=1e-6)


def test_the_pcm16_wav_is_exactly_the_documented_conversion_of_the_float32_wav(clip, triton_server, tmp_path, streamed):
    _, path, _, _ = clip
    wav = tmp_path / "f32.wav"
    assert run_client(path, "--url", triton_server.grpc_url, "-o", wav, "--float32", "-q").returncode == 0
    np.testing.assert_array_equal(read_pcm16_wav(streamed[1]), documented_pcm16(read_float32_wav(wav)))


def test_http_mode_decodes_the_whole_clip_with_the_offline_model_to_the_same_audio(clip, triton_server, tmp_path):
    _, path, _, reference = clip
    wav = tmp_path / "http.wav"
    proc = run_client(path, "--http", "--http-url", triton_server.http_url, "-o", wav)
    assert proc.returncode == 0, proc.stderr.decode()
    assert "auk_vae_decode_offline" in proc.stderr.decode()
    assert "tiles received        1" in proc.stderr.decode()
    assert_pcm16_is_documented_conversion(read_pcm16_wav(wav), reference)


def test_seeded_random_latents_give_the_same_audio_every_run_and_say_they_are_a_stand_in(triton_server, tmp_path):
    a, b, c = tmp_path / "a.wav", tmp_path / "b.wav", tmp_path / "c.wav"
    first = run_client("--seconds", "0.5", "--seed", "3", "--url", triton_server.grpc_url, "-o", a)
    assert first.returncode == 0, first.stderr.decode()
    assert "stand-in for the diffusion model's output" in first.stderr.decode()
    assert run_client("--seconds", "0.5", "--seed", "3", "--url", triton_server.grpc_url, "-o", b, "-q").returncode == 0
    assert run_client("--seconds", "0.5", "--seed", "4", "--url", triton_server.grpc_url, "-o", c, "-q").returncode == 0
    pcm_a = read_pcm16_wav(a)
    assert pcm_a.size == 25 * HOP
    np.testing.assert_array_equal(pcm_a, read_pcm16_wav(b))
    assert not np.array_equal(pcm_a, read_pcm16_wav(c))
    latents = np.random.default_rng(3).standard_normal((25, 64)).astype(np.float32)
    reference = library_decode(triton_server.checkpoint_dir, latents, triton_server)
    assert_pcm16_is_documented_conversion(pcm_a, reference)


def test_plot_saves_a_png_or_says_in_one_line_that_matplotlib_is_missing(triton_server, tmp_path):
    png, wav = tmp_path / "plot.png", tmp_path / "p.wav"
    proc = run_client("--seconds", "0.5", "--url", triton_server.grpc_url, "-o", wav, "--plot", png, "-q")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert proc.returncode != 0
        line = one_error_line(proc)
        assert "pip install matplotlib" in line and "./client[plot]" in line, "names the client's own extra"
        assert not wav.exists(), "fails before decoding anything"
    else:
        assert proc.returncode == 0, proc.stderr.decode()
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- commands ---------------------------------------------------------------------------


def test_the_decode_command_writes_the_same_wav_as_the_bare_form(clip, triton_server, tmp_path, streamed):
    _, path, _, reference = clip
    wav = tmp_path / "decode.wav"
    proc = run_client("decode", path, "--url", triton_server.grpc_url, "-o", wav, "-q")
    assert proc.returncode == 0, proc.stderr.decode()
    assert wav.read_bytes() == streamed[1].read_bytes()
    assert_pcm16_is_documented_conversion(read_pcm16_wav(wav), reference)


def test_a_latents_file_without_an_extension_is_still_decoded_by_the_bare_form(triton_server, tmp_path):
    latents = np.random.default_rng(5).standard_normal((25, 64)).astype(np.float32)
    with open(tmp_path / "latents", "wb") as f:  # a file object: np.save adds no .npy
        np.save(f, latents)
    proc = run_client("latents", "--url", triton_server.grpc_url, "-o", "out.wav", "-q", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr.decode()
    assert read_pcm16_wav(tmp_path / "out.wav").size == 25 * HOP


def test_the_overall_help_lists_both_commands_and_says_that_without_one_auk_client_decodes():
    proc = run_client("--help")
    assert proc.returncode == 0, proc.stderr.decode()
    out = proc.stdout.decode()
    assert out.startswith("usage: auk-client [-h] COMMAND ..."), out
    assert re.search(r"^ +decode +", out, re.MULTILINE) and re.search(r"^ +pipeline +", out, re.MULTILINE), out
    assert "Without a command, auk-client decodes" in out


@pytest.mark.parametrize("command, options", [
    ("decode", ("--raw", "--float32", "--http", "--seconds", "[latents]")),
    ("pipeline", ("--prompt-embeds", "--random-tokens", "--steps", "--guidance")),
    ("encode", ("[-h]", "audio", "--seed", "-o OUTPUT", "soxr")),
    ("edit", ("--audio WAV", "--prompt-embeds", "--seconds", "--encode-seed", "--random-tokens")),
])
def test_each_command_prints_its_own_usage_and_options(command, options):
    proc = run_client(command, "--help")
    assert proc.returncode == 0, proc.stderr.decode()
    out = proc.stdout.decode()
    assert out.startswith(f"usage: auk-client {command} [-h]"), out
    for option in options:
        assert option in out, f"{option} missing from `auk-client {command} --help`"


@pytest.mark.parametrize("word", ["decod", "pipe-line", "help"])
def test_a_first_word_that_is_neither_a_command_nor_a_file_is_a_usage_error_naming_the_commands(tmp_path, word):
    proc = run_client(word, "--url", f"127.0.0.1:{closed_port()}", "-o", "never.wav", cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.decode().strip().splitlines()
    assert lines[0].startswith("usage: auk-client [-h] COMMAND ..."), lines
    assert lines[-1] == (
        f"auk-client: error: '{word}' is neither a command (decode, pipeline, encode, edit) nor a latents file"
    )
    assert not (tmp_path / "never.wav").exists()


@pytest.mark.parametrize("command, prog", [((), "auk-client"), (("decode",), "auk-client decode")])
def test_a_missing_npy_file_is_reported_as_a_missing_latents_file_with_or_without_the_command(tmp_path, command, prog):
    proc = run_client(*command, "nosuch.npy", "--url", f"127.0.0.1:{closed_port()}", cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert one_error_line(proc, prog) == f"{prog}: error: no such latents file: nosuch.npy"


# ---- a distribution of its own, without torch ------------------------------------------


CLIENT_MODULES = (
    "auk_client", "auk_client.cli", "auk_client.edit", "auk_client.pipeline", "auk_client.source",
    "auk_client.stream", "auk_client.wavio",
)


def heavy_modules_after(code: str) -> list[str]:
    """The torch and auk_triton modules loaded once `code` has run in a fresh interpreter
    with the client first on the path."""
    report = 'import json, sys\nprint(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "auk_triton"))))'
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(CLIENT_DIR)] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, "-c", f"{code}\n{report}"], capture_output=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout.decode().strip().splitlines()[-1])


def test_importing_every_client_module_imports_neither_torch_nor_auk_triton():
    imports = "\n".join(f"import {m}" for m in CLIENT_MODULES)
    from_this_tree = (
        "import os\n"
        f"assert os.path.realpath(auk_client.__file__).startswith({os.path.realpath(CLIENT_DIR) + os.sep!r}), "
        "auk_client.__file__"
    )
    assert heavy_modules_after(f"{imports}\n{from_this_tree}") == []


@pytest.mark.parametrize("mode", ["grpc", "http"])
def test_a_whole_decode_through_the_cli_imports_neither_torch_nor_auk_triton(triton_server, tmp_path, mode):
    target = ["--url", triton_server.grpc_url] if mode == "grpc" else ["--http", "--http-url", triton_server.http_url]
    argv = ["decode", "--seconds", "0.2", *target, "-o", str(tmp_path / "out.wav"), "-q"]
    assert heavy_modules_after(f"from auk_client.cli import main\nassert main({argv!r}) == 0") == []
    assert read_pcm16_wav(tmp_path / "out.wav").size == 10 * HOP


def read_toml(path: Path) -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads(path.read_text())


def distribution_name(requirement: str) -> str:
    """`tritonclient[grpc,http]==2.50.0` -> `tritonclient` (PEP 503 normalized)."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement).group(0)).lower()


def client_requirements() -> dict[str, set[str]]:
    """The client distribution's requirements by extra ("" for the required ones)."""
    project = read_toml(CLIENT_DIR / "pyproject.toml")["project"]
    extras = {"": project["dependencies"], **project.get("optional-dependencies", {})}
    return {extra: {distribution_name(r) for r in reqs} for extra, reqs in extras.items()}


def test_the_client_distribution_is_auk_client_with_its_console_script_and_no_torch_in_any_extra():
    metadata = read_toml(CLIENT_DIR / "pyproject.toml")["project"]
    assert metadata["name"] == "auk-client"
    assert metadata["scripts"] == {"auk-client": "auk_client.cli:main"}
    for extra, names in client_requirements().items():
        assert not names & {"torch", "auk-triton", "triton"}, f"extra {extra!r} pulls in {sorted(names)}"


def test_every_third_party_module_the_client_imports_is_declared_by_its_distribution():
    imported = set()
    for source in (CLIENT_DIR / "auk_client").glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.add(node.module.split(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - {"auk_client"}
    declared = set().union(*client_requirements().values())
    assert third_party, "the scan found the client's imports"
    assert {distribution_name(m) for m in third_party} <= declared, sorted(third_party)


def test_the_root_package_carries_neither_the_client_nor_its_script():
    root = read_toml(REPO_ROOT / "pyproject.toml")
    assert "scripts" not in root["project"], "auk-client is the client distribution's script"
    assert root["tool"]["setuptools"]["packages"]["find"]["include"] == ["auk_triton*"]
    assert "client" not in root["project"].get("optional-dependencies", {})


# ---- error paths -----------------------------------------------------------------------


def test_latents_of_the_wrong_rank_are_refused_in_one_line_before_contacting_a_server(tmp_path):
    bad = tmp_path / "bad.npy"
    np.save(bad, np.zeros((2, 10, 64), np.float32))
    wav = tmp_path / "never.wav"
    proc = run_client(bad, "--url", "127.0.0.1:1", "-o", wav)
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert "[frames, dim]" in line and "[2, 10, 64]" in line
    assert not wav.exists()


def test_a_file_that_is_not_npy_is_refused_in_one_line(tmp_path):
    bad = tmp_path / "latents.npy"
    bad.write_text("not numpy")
    proc = run_client(bad, "--url", "127.0.0.1:1")
    assert proc.returncode == 2
    assert "cannot read" in one_error_line(proc)


def test_a_dead_grpc_server_gives_one_line_and_a_non_zero_exit(latents_file, tmp_path):
    proc = run_client(latents_file, "--url", f"127.0.0.1:{closed_port()}", "-o", tmp_path / "x.wav", timeout=60)
    assert proc.returncode == 1
    assert "cannot reach Triton over gRPC" in one_error_line(proc)
    assert not (tmp_path / "x.wav").exists()


def test_a_dead_http_server_gives_one_line_and_a_non_zero_exit(latents_file, tmp_path):
    proc = run_client(latents_file, "--http", "--http-url", f"127.0.0.1:{closed_port()}", timeout=60)
    assert proc.returncode == 1
    assert "cannot reach Triton over HTTP" in one_error_line(proc)


@pytest.mark.parametrize("mode", ["grpc", "http"])
def test_latents_of_the_wrong_width_come_back_as_the_servers_error_in_one_line(triton_server, tmp_path, mode):
    narrow = tmp_path / "narrow.npy"
    np.save(narrow, np.zeros((20, 32), np.float32))
    wav = tmp_path / "never.wav"
    target = ["--url", triton_server.grpc_url] if mode == "grpc" else ["--http", "--http-url", triton_server.http_url]
    proc = run_client(narrow, *target, "-o", wav)
    assert proc.returncode == 1
    line = one_error_line(proc)
    assert "server error" in line and "LATENTS" in line
    assert not wav.exists(), "no half-written WAV is left behind"


def test_an_unknown_model_name_gives_one_line_and_a_non_zero_exit(latents_file, triton_server):
    proc = run_client(latents_file, "--url", triton_server.grpc_url, "--model", "no_such_model")
    assert proc.returncode == 1
    assert "no_such_model" in one_error_line(proc)


@pytest.mark.parametrize("mode", ["grpc", "http"])
def test_a_server_that_never_answers_times_out_in_one_line(latents_file, tmp_path, mode):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    accepted = []
    stop = threading.Event()

    def accept_and_hold():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept_and_hold, daemon=True)
    thread.start()
    url = f"127.0.0.1:{listener.getsockname()[1]}"
    target = ["--url", url] if mode == "grpc" else ["--http", "--http-url", url]
    try:
        started = time.monotonic()
        proc = run_client(latents_file, *target, "--timeout", "2", "-o", tmp_path / "x.wav", timeout=60)
        took = time.monotonic() - started
    finally:
        stop.set()
        thread.join(5)
        for conn in accepted:
            conn.close()
        listener.close()
    assert proc.returncode == 1
    assert "timed out after 2 s" in one_error_line(proc)
    assert took < 30


def test_giving_both_a_file_and_seconds_is_a_usage_error(latents_file):
    proc = run_client(latents_file, "--seconds", "1")
    assert proc.returncode == 2
    assert "either" in one_error_line(proc)


@pytest.mark.parametrize("option, value", [("--seed", "-1"), ("--latent-dim", "0"), ("--latent-dim", "-64")])
def test_a_negative_seed_or_a_latent_dim_below_1_is_a_usage_error_naming_the_option(tmp_path, option, value):
    wav = tmp_path / "never.wav"
    proc = run_client("--seconds", "1", option, value, "--url", f"127.0.0.1:{closed_port()}", "-o", wav, timeout=60)
    assert proc.returncode == 2
    assert option in one_error_line(proc)
    assert not wav.exists()


@pytest.mark.parametrize("seconds", ["-1", "0", "nan"])
def test_seconds_that_are_not_positive_are_a_usage_error_even_with_no_server_to_ask(tmp_path, seconds):
    wav = tmp_path / "never.wav"
    proc = run_client("--seconds", seconds, "--url", f"127.0.0.1:{closed_port()}", "-o", wav, timeout=60)
    assert proc.returncode == 2
    assert "--seconds must be a positive number" in one_error_line(proc)
    assert not wav.exists()


# ---- the sinks, without a server -----------------------------------------------------


def test_tiles_with_a_gap_are_written_at_their_start_sample_with_silence_in_between(tmp_path):
    sys.path.insert(0, str(CLIENT_DIR))
    from auk_client.wavio import RawPcm16Stream, WavWriter

    path = tmp_path / "gap.wav"
    with WavWriter(str(path)) as w:
        w.place(0, np.full(10, 0.5, np.float32))
        w.place(20, np.full(5, -0.25, np.float32))  # gap 10..20
        w.place(5, np.full(3, 1.5, np.float32))  # out of order, overlapping: overwrites, clipped
    pcm = read_pcm16_wav(path)
    expected = np.zeros(25, np.int16)
    expected[:10] = 16384  # round(0.5 * 32767) = round(16383.5) -> 16384 (ties to even)
    expected[5:8] = 32767
    expected[20:] = -8192  # round(-8191.75)
    np.testing.assert_array_equal(pcm, expected)

    class Pipe:
        def __init__(self):
            self.data = b""

        def write(self, b):
            self.data += b

        def flush(self):
            pass

    pipe = Pipe()
    raw = RawPcm16Stream(pipe)
    raw.place(0, np.full(10, 0.5, np.float32))
    raw.place(20, np.full(5, -0.25, np.float32))
    raw.place(22, np.full(6, -1.0, np.float32))  # overlaps what was written: only new samples go out
    got = np.frombuffer(pipe.data, "<i2")
    np.testing.assert_array_equal(got[:25], expected[:5].tolist() + [16384] * 5 + [0] * 10 + [-8192] * 5)
    np.testing.assert_array_equal(got[25:], [-32767] * 3)


def test_the_pcm16_conversion_clips_and_rounds_as_documented():
    sys.path.insert(0, str(CLIENT_DIR))
    from auk_client.wavio import to_pcm16

    x = np.array([0.0, 1.0, -1.0, 2.0, -2.0, 0.5 / 32767, 1.5 / 32767, 0.25, -0.5], np.float32)
    np.testing.assert_array_equal(to_pcm16(x), documented_pcm16(x))
    np.testing.assert_array_equal(to_pcm16(x)[:5], [0, 32767, -32767, 32767, -32767])


def test_server_pcm16_samples_are_written_as_they_are_and_back_to_float_by_the_inverse_scale(tmp_path):
    sys.path.insert(0, str(CLIENT_DIR))
    from auk_client.stream import Tile, assemble
    from auk_client.wavio import FLOAT32, PCM16, WavWriter, read_wav, to_pcm16

    pcm = np.array([0, 32767, -32767, 12345, -1], np.int16)
    np.testing.assert_array_equal(to_pcm16(pcm), pcm)
    for fmt in (PCM16, FLOAT32):
        path = tmp_path / f"{fmt}.wav"
        with WavWriter(str(path), fmt=fmt) as wav:
            wav.place(0, pcm)
        _, samples = read_wav(str(path))
        expected = pcm if fmt == PCM16 else pcm.astype(np.float32) / np.float32(32767)
        np.testing.assert_array_equal(samples, expected)
    np.testing.assert_array_equal(assemble([Tile(2, pcm, 0.0)]), [0, 0, *(pcm.astype(np.float32) / 32767)])


def test_the_auk_client_console_script_is_installed_and_runs_both_commands():
    script = Path(sys.executable).parent / "auk-client"
    if not script.exists():
        pytest.skip("the client is not installed in this environment (pip install -e ./client)")
    overall = subprocess.run([str(script), "--help"], capture_output=True, timeout=60)
    assert overall.returncode == 0
    assert b"decode" in overall.stdout and b"pipeline" in overall.stdout
    decode = subprocess.run([str(script), "decode", "--help"], capture_output=True, timeout=60)
    assert decode.returncode == 0
    assert b"--raw" in decode.stdout and b"--float32" in decode.stdout

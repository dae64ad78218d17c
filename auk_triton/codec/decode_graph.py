"""CUDA-graph replay of the AuK codec decode: three tiers, and windows of several clips batched.

The eager decoder launches thousands of small kernels per window (about 2,500
for 512 frames), so on a GPU it is bound by launch overhead, not by
arithmetic. `AuKVAEDecodeGraph` replays it:

1. Compiled bucket graphs, built by `warmup()` at service start: the decode goes
   through `torch.compile` (Inductor fuses the elementwise chains), and one CUDA
   graph is captured per bucket in `compile_shapes`. A shorter window is
   right-padded to its bucket with the normalized latent that decodes to raw
   zero, which is what the eager decode's own zero padding of `conv_pre` sees;
   only the last `right` frames (the upsamplers' lookahead) can notice the pad.
   Fused kernels round in another order, so these graphs are close to, not
   bit-identical with, eager. With `compile_dynamic` (the default) the time axis
   is traced symbolically: Dynamo traces the decode once for every bucket, not
   once per bucket; with `precompiled` too, that trace is saved and later starts
   load it instead of tracing (precompiled.py), while the eager decode of the buckets
   built first has cuDNN time their convolutions (`_compile_while_priming`).
2. Tiling: a clip longer than `tile_frames` is decoded in windows that overlap
   by the decoder's receptive field (`AuKVAE.decode_context_frames()`); each
   window contributes only frames whose whole context lies inside it, so the
   stitched waveform equals the whole-clip decode up to rounding, and memory
   stays that of one window however long the clip. `decode_tiles()` yields the
   windows as they finish, for streaming.
3. Plain graphs, captured on demand per exact window length, for lengths no
   compiled bucket serves. They replay eager's kernels and are bit-identical with
   it (with `frame_alignment` above 1, a window padded to the aligned length
   differs in its last `right` frames, as in a bucket). They share one
   wrapper-private memory pool and are retired together: when `max_graphs` is
   reached the whole generation and its pool are dropped, so no surviving graph
   can hold an address that a destroyed graph released. A length whose capture
   fails (out of memory, an op that cannot be captured) decodes eager until the
   next retirement, not a failed capture per window.

4. Batched rows (`decode_rows`): windows of several clips that share a bucket
   decode in one replay of a plain graph captured for [B, bucket, latent_dim]
   (B from `batch_sizes`, at most `batch_frames` frames per replay, so one replay
   never takes much longer than one full tile). Rows are independent: each is
   right-padded like a bucket, and a row's samples are those of the same window
   decoded alone through a plain graph, which differs from its compiled bucket at
   the compiled tier's rounding.

5. Deferred graphs (`warmup(defer=True)`): only the compile, the first tile's bucket
   and the largest bucket are built before the service is ready; the other buckets and
   the batched graphs are built after, on a thread of their own (`start_deferred`),
   each handed over to the serving thread at its next decode. Until then a window
   decodes in the next larger bucket built, and batched rows one at a time: served
   at once by another tier, never captured at request time, and counted
   (`pending_fallbacks`).

Off CUDA, while an outer graph is being captured, or with `enabled=False`,
everything runs eager (tiling included in `decode_tiles`; rows batch only with
rows of the same length there, so no padding changes them).

Not thread-safe: the graphs' input and output buffers, `last_mode` and the
graph cache are shared by all calls, so one caller at a time (the Triton
Python backend runs a model instance's `execute` calls one after another).
The deferred builder is the one other thread: it reads no table and changes
none, and hands each graph over through a queue that the caller's decodes drain.
"""

import logging
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Sequence

import torch

from ..cuda_graph import BuildReport, GraphBuilder, capture, short_switch_interval
from .precompiled import precompiled_decode
from .tiling import plan_tiles
from .vae import AuKVAE

logger = logging.getLogger(__name__)

DEFAULT_COMPILE_SHAPES: tuple[int, ...] = (32, 128, 256, 512)


class HostTile(NamedTuple):
    """One decoded tile on the host (`AuKVAEDecodeGraph.host_tiles`)."""

    start_frame: int  # the clip frame of its first sample
    samples: torch.Tensor  # [samples], host memory
    mode: str | None  # the tier that decoded it: compiled, graph, eager
    # Time spent here launching its decode and waiting for its samples on the host; not the
    # caller's time between tiles, during which a look-ahead decode may run on the GPU.
    seconds: float


class PendingGraph(NamedTuple):
    """A graph left to build after the service is ready."""

    frames: int  # its bucket
    rows: int  # 1: the compiled bucket itself; more: that bucket's batched plain graph


class _Graph(NamedTuple):
    """One captured decode: its graph, static input and static output."""

    graph: torch.cuda.CUDAGraph
    static_in: torch.Tensor
    static_out: torch.Tensor


class AuKVAEDecodeGraph:
    """Replay `AuKVAE.decode` for one clip per call."""

    def __init__(
        self,
        vae: AuKVAE,
        *,
        enabled: bool = True,
        frame_alignment: int = 1,
        max_graphs: int = 32,
        compile_shapes: Sequence[int] = DEFAULT_COMPILE_SHAPES,
        tile_frames: int | None = None,
        first_tile_frames: int | None = None,
        batch_sizes: Sequence[int] = (1,),
        batch_frames: int | None = None,
        compile_dynamic: bool = True,
        precompiled: Path | None = None,
        stream_priority: int | None = None,
    ):
        self.vae = vae
        # The priority of the stream its replays queue on (None: the device's default); each graph
        # is captured at it, since a replay keeps the priority of its capture (cuda_graph.capture).
        self.stream_priority = stream_priority
        self.compile_dynamic = bool(compile_dynamic)
        # Where the traced decode is kept across restarts (precompiled.py); None: traced each start.
        self.precompiled = None if precompiled is None else Path(precompiled)
        self.compile_note = ""  # how the compiled decode came: loaded, traced and saved, or traced
        self.enabled = bool(enabled)
        self.frame_alignment = max(1, int(frame_alignment))
        self.max_graphs = max(1, int(max_graphs))
        self.compile_shapes = sorted({int(size) for size in compile_shapes if int(size) > 0})
        self.context_frames = vae.decode_context_frames()
        if tile_frames is None:
            tile_frames = max(self.compile_shapes, default=0)
        self.tile_frames = max(0, int(tile_frames))
        left, right = self.context_frames
        if self.tile_frames and self.tile_frames <= left + right:
            raise ValueError(
                f"tile_frames={self.tile_frames} does not exceed the decode context "
                f"{left} + {right} frames: no tile would emit anything"
            )
        self.first_tile_frames = int(first_tile_frames) if first_tile_frames else None
        if self.tile_frames and self.first_tile_frames is not None and self.first_tile_frames <= right:
            raise ValueError(
                f"first_tile_frames={self.first_tile_frames} (by default the smallest compile shape) does not "
                f"exceed the decoder's right context of {right} frames: the first tile would emit nothing"
            )
        self.batch_sizes = sorted({int(b) for b in batch_sizes if int(b) > 1} | {1})
        # Frames one batched replay may decode; by default one full tile's worth.
        self.batch_frames = int(batch_frames or self.tile_frames or max(self.compile_shapes, default=0))
        self.last_mode: str | None = None
        self.captures = 0
        self.generations_retired = 0
        self._buckets: dict[int, _Graph] = {}
        self._graphs: dict[int, _Graph] = {}
        self._uncapturable: set[int] = set()  # lengths whose capture failed, this generation
        self._pool = None
        self._batched: dict[tuple[int, int], _Graph] = {}  # (bucket, rows) -> graph
        self._batched_pool = None  # one pool: replays run one at a time, outputs copied out first
        self._uncapturable_rows: set[tuple[int, int]] = set()
        self._compiled_decode: Callable | None = None
        self._mark_dynamic = False  # torch.compile's decode: mark each bucket's time axis dynamic
        self._zero_latent = vae.zero_latent()
        # Deferred graphs: what is left to build, what is built and not yet handed over,
        # the builder's thread, and the windows served meanwhile by another tier.
        self._pending: set[PendingGraph] = set()
        self._builder = GraphBuilder("auk-decode-graph-builder")
        self.pending_fallbacks = 0

    # ---- public API ----------------------------------------------------------------------

    def compiled_bucket(self, frames: int) -> int | None:
        """The smallest compiled bucket that holds `frames` latents, or None past the largest."""
        return min((b for b in self._buckets if b >= frames), default=None)

    def plan(self, frames: int, short_first: bool = True) -> list[tuple[int, int, int, int]]:
        """The decode windows of a clip of `frames`: (start, frames, emit_start, emit_end) each;
        `short_first` False leaves out the short first window (`first_tile_frames`)."""
        if not self.tile_frames:
            return [(0, frames, 0, frames)]
        left, right = self.context_frames
        first = self.first_tile_frames if short_first else None
        return plan_tiles(frames, self.tile_frames, left, right, self.compile_shapes, first)

    def batch_key(self, frames: int, device: torch.device) -> int:
        """Windows with the same key can decode together in `decode_rows`: the bucket that
        serves `frames` on a GPU with compiled buckets, else the length itself."""
        if self.enabled and device.type == "cuda":
            return self.compiled_bucket(frames) or frames
        return frames

    def batch_capacity(self, key: int) -> int:
        """The most rows `decode_rows` takes for windows of `key` (`batch_key`)."""
        return max(b for b in self.batch_sizes if b == 1 or b * key <= self.batch_frames)

    def decode_rows(self, rows: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Decode windows ([1, frames_i, latent_dim] each, one `batch_key`, at most its
        `batch_capacity`) together; return each one's waveform [frames_i * hop_size].

        Views into graph buffers where a graph served them: copy them before the next decode.
        """
        self._take_built()
        if len(rows) == 1:
            return [self._decode_window(rows[0])[0]]
        hop = self.vae.hop_size
        first = rows[0]
        with torch.no_grad():
            if not self._replayable(first) or self.compiled_bucket(first.shape[1]) is None:
                # Eager: rows of one length, stacked as they are (batch rows never mix).
                self.last_mode = "eager"
                return list(self.vae(torch.cat(list(rows))))
            bucket = self.compiled_bucket(max(row.shape[1] for row in rows))
            size = min(b for b in self.batch_sizes if b >= len(rows))
            entry = self._batched.get((bucket, size))
            if entry is None and PendingGraph(bucket, size) in self._pending:  # not built yet: never here
                self.pending_fallbacks += len(rows)
                return [self._decode_window(row, count_fallback=False)[0].clone() for row in rows]
            entry = entry or self._capture_rows(bucket, size)
            if entry is None:  # the batched graph cannot be captured: one window at a time
                return [self._decode_window(row)[0].clone() for row in rows]
            for index, row in enumerate(rows):
                self._load(entry.static_in[index : index + 1], row)
            entry.graph.replay()
            self.last_mode = "batched"
            return [entry.static_out[index, : row.shape[1] * hop] for index, row in enumerate(rows)]

    def warmup(self, device, on_bucket: Callable[[int, float, bool], None] | None = None,
               defer: bool = False) -> list[PendingGraph]:
        """Compile the decode and capture every bucket in `compile_shapes`, and a batched graph
        for each of its batch sizes. With `defer`, only the first tile's bucket and the largest
        (which holds any window), and return the rest for `start_deferred`.

        Meant for service start. A bucket that fails logs a warning and leaves its windows to
        plain graphs. `on_bucket(frames, seconds, ok)` is told about each bucket as it finishes.
        """
        device = torch.device(device)
        if device.type != "cuda" or not self.enabled or not torch.cuda.is_available():
            return []
        now = self.ready_buckets() if defer else set(self.compile_shapes)
        pending = []
        with torch.cuda.device(device), torch.no_grad():
            if self._compiled_decode is None:
                self._compile_while_priming(device, sorted(now))
            if self._batched_pool is None:
                self._batched_pool = torch.cuda.graph_pool_handle()
            for frames in self.compile_shapes:
                if frames in self._buckets:
                    continue
                if frames not in now:
                    pending.append(PendingGraph(frames, 1))
                    pending.extend(PendingGraph(frames, rows) for rows in self._batched_rows(frames))
                    continue
                began = time.perf_counter()
                try:
                    self._buckets[frames] = self._build(PendingGraph(frames, 1))
                    ok = True
                except Exception as err:  # a bucket that cannot compile falls back to plain graphs
                    logger.warning("compiled bucket of %d frames failed, plain graphs serve it: %s", frames, err)
                    ok = False
                for rows in self._batched_rows(frames) if ok else ():
                    if defer:
                        pending.append(PendingGraph(frames, rows))
                    else:
                        self._capture_rows(frames, rows)
                seconds = time.perf_counter() - began
                logger.info("bucket %d frames: %s in %.1f s", frames, "ready" if ok else "failed", seconds)
                if on_bucket is not None:
                    on_bucket(frames, seconds, ok)
        self._pending = set(pending)  # from now on their windows take another tier, never a capture
        return sorted(pending, key=lambda item: (item.rows > 1, item.frames, item.rows))

    def _compile_while_priming(self, device: torch.device, buckets: Sequence[int]) -> None:
        """`_compile` on a thread of its own while this thread runs the eager decode of each of
        `buckets`. With `cudnn.benchmark`, cuDNN times its convolution algorithms on a shape's
        first call, on the thread that calls (its choices are kept per thread); the compiled
        decode calls the same convolutions, so the captures that follow here find them timed.
        Loading a saved decode is host work and the timing device work: they overlap."""
        # Only beside a load: a trace compiles on the device too, and a torch.compile is traced
        # on its first call, on this thread.
        loads = self.precompiled is not None and self.compile_dynamic and self.precompiled.exists()
        if not loads or not buckets or not (torch.backends.cudnn.enabled and torch.backends.cudnn.benchmark):
            self._compile(device)
            return
        began = time.perf_counter()
        outcome: dict[str, object] = {}

        def compile_here():
            try:
                with torch.cuda.device(device), torch.no_grad():
                    self._compile(device)
            except BaseException as err:  # raised again on the warm-up's thread
                outcome["error"] = err
            outcome["seconds"] = time.perf_counter() - began

        # The load holds the GIL for long stretches; the eager decode needs it between kernels.
        with short_switch_interval():
            loader = threading.Thread(target=compile_here, name="auk-decode-compile", daemon=True)
            loader.start()
            for frames in buckets:
                self.vae(self._zero_latent.to(device).expand(1, frames, -1).contiguous())
            torch.cuda.current_stream().synchronize()
            primed = time.perf_counter() - began
            loader.join()
        if "error" in outcome:
            raise outcome["error"]
        self.compile_note += (f" in {outcome['seconds']:.1f} s; meanwhile cuDNN timed the convolutions of "
                              f"buckets {list(buckets)} in {primed:.1f} s")

    def _compile(self, device: torch.device) -> None:
        """The compiled decode: loaded or traced ahead of time with `precompiled`, else through
        torch.compile, which traces it on its first call (every start)."""
        if self.precompiled is not None and self.compile_dynamic:
            examples = {frames: self._zero_latent.to(device).expand(1, frames, -1).contiguous()
                        for frames in self.compile_shapes}
            try:
                self._compiled_decode, self.compile_note = precompiled_decode(self.vae, self.precompiled, examples)
                return
            except Exception as err:  # no ahead-of-time compile here, or a graph break: as before
                self.compile_note = f"traced on this start only: {type(err).__name__}: {err}"
        self._compiled_decode = torch.compile(self.vae.forward, dynamic=None if self.compile_dynamic else False)
        self._mark_dynamic = self.compile_dynamic
        self.compile_note = self.compile_note or "traced on this start only"

    def ready_buckets(self) -> set[int]:
        """The buckets a deferred warm-up builds before the service is ready: the first tile's
        (every stream's first audio) and the largest (any window fits it)."""
        if not self.compile_shapes:
            return set()
        first = self.first_tile_frames or self.compile_shapes[0]
        return {min((b for b in self.compile_shapes if b >= first), default=self.compile_shapes[-1]),
                self.compile_shapes[-1]}

    def start_deferred(self, pending: Sequence[PendingGraph], device,
                       on_done: Callable[[BuildReport], None] | None = None,
                       begin_when: Callable[[], bool] | None = None) -> None:
        """Build `pending` (what `warmup(defer=True)` left) on a thread of its own, beside the
        serving thread, which takes each graph over at its next decode; with `begin_when`, once
        it holds. `on_done(report)` is called on the builder's thread at the end (not when
        stopped)."""
        self._pending.update(pending)
        self._builder.start(
            pending, lambda item: self._build(item, beside_serving=True), device,
            describe=lambda item: f"the graph of {item.rows} rows of {item.frames} frames", on_done=on_done,
            begin_when=begin_when,
        )

    def stop_deferred(self, timeout_s: float = 30.0) -> None:
        """Stop building deferred graphs after the one in progress, and wait for that."""
        self._builder.stop(timeout_s)

    @property
    def deferred_pending(self) -> int:
        """Deferred graphs not yet taken over by the serving thread."""
        return len(self._pending)

    def __call__(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode one clip [1, frames, latent_dim] -> [1, frames * hop_size]."""
        self._check_clip(latents)
        if not self._replayable(latents):
            self.last_mode = "eager"
            with torch.no_grad():
                return self.vae(latents)
        frames = latents.shape[1]
        if self.tile_frames and frames > self.tile_frames:
            hop = self.vae.hop_size
            out = torch.empty(1, frames * hop, device=latents.device, dtype=torch.float32)
            for start, wave in self._windows(latents):
                out[:, start * hop : start * hop + wave.shape[1]] = wave
            self.last_mode = "tiled"
            return out
        return self._decode_window(latents).clone()

    def decode_tiles(self, latents: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield (emit_start_frame, waveform) per tile, in order, for a [1, frames, latent_dim] clip.

        Waveforms are views into graph buffers where a graph served the tile: copy
        them before the next tile if they must outlive the iteration.
        """
        self._check_clip(latents)
        return self._windows(latents)

    def _windows(self, latents: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        hop = self.vae.hop_size
        for start, size, emit_start, emit_end in self.plan(latents.shape[1]):
            wave = self._decode_window(latents[:, start : start + size])
            yield emit_start, wave[:, (emit_start - start) * hop : (emit_end - start) * hop]

    def host_tiles(
        self,
        latents: torch.Tensor,
        convert: Callable[[torch.Tensor], torch.Tensor] | None = None,
        look_ahead: bool = False,
        while_decoding: Callable[[], None] | None = None,
    ) -> Iterator["HostTile"]:
        """`decode_tiles`, each tile copied off the graph buffers into host memory (pinned
        where it comes from a GPU, so the copy is a DMA at full bus speed).

        `convert` maps a tile's samples on the device before the copy (to int16 PCM,
        for example). `look_ahead` launches the next window's decode before a tile is
        handed over, so the GPU decodes it while the caller sends that tile: a tile's
        samples are on the host before the next replay can overwrite its buffer. Use
        it only where decodes are asynchronous (CUDA); on a CPU the next decode would
        run before the tile is handed over and delay it by a whole window.

        `while_decoding` is called once, after the first window's decode is launched
        and before its samples are waited for: host work (checking the request, say)
        that a GPU's decode then hides. What it raises ends the iteration.
        """
        tiles = self.decode_tiles(latents)
        began = time.perf_counter()
        item = next(tiles, None)
        launch_seconds = time.perf_counter() - began
        mode = self.last_mode
        if while_decoding is not None:
            while_decoding()
        while item is not None:
            start_frame, wave = item
            began = time.perf_counter()
            samples = wave[0] if convert is None else convert(wave[0])
            host = torch.empty(samples.shape[0], dtype=samples.dtype, pin_memory=samples.is_cuda)
            host.copy_(samples)  # waits for this window's decode
            tile = HostTile(start_frame, host, mode, launch_seconds + time.perf_counter() - began)
            if not look_ahead:
                yield tile
            began = time.perf_counter()
            item = next(tiles, None)  # launches the next window's decode
            launch_seconds = time.perf_counter() - began
            mode = self.last_mode
            if look_ahead:
                yield tile

    # ---- tiers ---------------------------------------------------------------------------

    def _check_clip(self, latents: torch.Tensor) -> None:
        latent_dim = self.vae.latent_dim
        if not isinstance(latents, torch.Tensor) or latents.dim() != 3 or latents.shape[0] != 1:
            shape = list(latents.shape) if isinstance(latents, torch.Tensor) else type(latents).__name__
            raise ValueError(f"expected one clip [1, frames, {latent_dim}], got {shape}")
        if latents.shape[2] != latent_dim or latents.shape[1] == 0:
            raise ValueError(f"expected one clip [1, frames >= 1, {latent_dim}], got {list(latents.shape)}")
        if latents.dtype != torch.float32:
            raise ValueError(f"latents must be float32, got {latents.dtype}")

    def _replayable(self, latents: torch.Tensor) -> bool:
        """Whether a checked clip can replay graphs here (else it decodes eager)."""
        return (
            self.enabled
            and latents.is_cuda
            and latents.device == self.vae.global_mean.device  # a capture records work on the VAE's device
            and not torch.cuda.is_current_stream_capturing()
        )

    def _decode_window(self, window: torch.Tensor, count_fallback: bool = True) -> torch.Tensor:
        with torch.no_grad():
            if not self._replayable(window):
                self.last_mode = "eager"
                return self.vae(window)
            self._take_built()
            frames = window.shape[1]
            bucket = self.compiled_bucket(frames)
            if bucket is not None:
                if count_fallback and self._pending and any(
                        PendingGraph(b, 1) in self._pending for b in self.compile_shapes if frames <= b < bucket):
                    self.pending_fallbacks += 1  # its own bucket is still being built
                entry, self.last_mode = self._buckets[bucket], "compiled"
            else:
                aligned = -(-frames // self.frame_alignment) * self.frame_alignment
                entry = self._plain_graph(aligned, window.device)
                if entry is None:
                    self.last_mode = "eager"
                    return self.vae(window)
                self.last_mode = "graph"
            self._load(entry.static_in, window)
            entry.graph.replay()
            return entry.static_out[:, : frames * self.vae.hop_size]

    def _load(self, static_in: torch.Tensor, window: torch.Tensor) -> None:
        """Copy a window into a graph's input, right-padded with the raw-zero latent."""
        frames = window.shape[1]
        static_in[:, :frames].copy_(window)
        if frames < static_in.shape[1]:
            static_in[:, frames:].copy_(self._zero_latent)

    def _plain_graph(self, frames: int, device: torch.device) -> _Graph | None:
        """The plain graph of `frames`, captured on first use; None where its capture failed."""
        entry = self._graphs.get(frames)
        if entry is None and frames not in self._uncapturable:
            if len(self._graphs) >= self.max_graphs:
                self._retire_generation()
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            try:
                with torch.cuda.device(device):
                    entry = self._capture(frames, self.vae.forward, pool=self._pool)
            except Exception as err:  # out of memory, or an op that cannot be captured
                logger.warning("capturing a %d-frame plain graph failed, that length decodes eager: %s", frames, err)
                self._uncapturable.add(frames)
                return None
            self._graphs[frames] = entry
            self.captures += 1
        return entry

    def _retire_generation(self) -> None:
        torch.cuda.current_stream().synchronize()
        self._graphs.clear()
        self._uncapturable.clear()  # the freed pool may leave room to capture them now
        self._pool = None
        self.generations_retired += 1
        logger.info("retired a generation of %d plain graphs", self.max_graphs)

    def _capture_rows(self, frames: int, rows: int) -> _Graph | None:
        """The plain graph of `rows` windows of `frames` (a bucket's batched rows), captured once;
        None where its capture fails (that batch then decodes one window at a time)."""
        key = (frames, rows)
        if key not in self._batched and key not in self._uncapturable_rows:
            if self._batched_pool is None:
                self._batched_pool = torch.cuda.graph_pool_handle()
            try:
                self._batched[key] = self._build(PendingGraph(frames, rows))
            except Exception as err:  # out of memory, say
                logger.warning("capturing %d rows of %d frames failed, they decode one at a time: %s",
                               rows, frames, err)
                self._uncapturable_rows.add(key)
        return self._batched.get(key)

    def _build(self, item: PendingGraph, beside_serving: bool = False) -> _Graph:
        """A compiled bucket (one row) or a bucket's batched plain graph; raises where it fails."""
        if item.rows == 1:
            return self._capture(item.frames, self._compiled_decode, pool=None, beside_serving=beside_serving)
        return self._capture(item.frames, self.vae.forward, pool=self._batched_pool, rows=item.rows,
                             beside_serving=beside_serving)

    def _take_built(self) -> None:
        """Take over the deferred graphs built since the last decode (on the serving thread,
        the only one that reads or changes the graph tables)."""
        for item, entry in self._builder.take():
            self._pending.discard(item)
            if entry is None:
                if item.rows > 1:
                    self._uncapturable_rows.add((item.frames, item.rows))
            elif item.rows == 1:
                self._buckets[item.frames] = entry
            else:
                self._batched[(item.frames, item.rows)] = entry

    def _batched_rows(self, frames: int) -> list[int]:
        """The batched graphs' row counts for a bucket."""
        return [rows for rows in self.batch_sizes[1:] if rows <= self.batch_capacity(frames)]

    def _capture(self, frames: int, decode: Callable, pool, rows: int = 1, beside_serving: bool = False) -> _Graph:
        device = self.vae.global_mean.device
        static_in = self._zero_latent.to(device).expand(rows, frames, -1).contiguous()
        if decode is self._compiled_decode and self._mark_dynamic:
            torch._dynamo.mark_dynamic(static_in, 1)  # one trace for every bucket's length
        graph, static_out = capture(lambda: decode(static_in), pool=pool, beside_serving=beside_serving,
                                    priority=self.stream_priority)
        return _Graph(graph, static_in, static_out)

"""What a Python gRPC hop costs: ServerLive straight to tritonserver, through the
smallest byte-forwarding proxy grpcio allows, in both of its servers, through an
asyncio splice of the HTTP/2 connection, with and without reading its frames, and
through the front door's own gRPC front (auk_triton/front_door/grpc_front.py, no models).

The front door's gRPC port is a grpc.aio server forwarding bytes to tritonserver.
This measures the floor of that design apart from its checks: a proxy
that only forwards, as a grpc.aio server and channel (that stack) and as a
synchronous grpcio server (thread pool) with a blocking channel. Against it, a proxy
that does not speak gRPC at all: asyncio streams pass the TCP bytes both ways
unchanged, and in its second form read the client's HTTP/2 frames as they pass, and
each gRPC message's length prefix in them (what bounding a message by its size from
its prefix would take, the refusal itself left out). Each proxy runs in its own
process, as the front door does; tritonserver serves an empty model repository.
Rounds alternate the targets; round 0 warms up and is left out.

    PYTHONPATH=.:benchmarks python3 benchmarks/bench_grpc_proxy.py
"""

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent import futures

from common import free_port, heading, say

METHOD = "/inference.GRPCInferenceService/ServerLive"


def serve_aio(port: int, upstream: str) -> None:
    import grpc

    async def main():
        call = grpc.aio.insecure_channel(upstream).unary_unary(METHOD)

        async def forward(data, context):
            return await call(data)

        class Handler(grpc.GenericRpcHandler):
            def service(self, details):
                return grpc.unary_unary_rpc_method_handler(forward)

        server = grpc.aio.server()
        server.add_generic_rpc_handlers((Handler(),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def serve_sync(port: int, upstream: str) -> None:
    import grpc

    call = grpc.insecure_channel(upstream).unary_unary(METHOD)

    class Handler(grpc.GenericRpcHandler):
        def service(self, details):
            return grpc.unary_unary_rpc_method_handler(lambda data, context: call(data))

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    server.add_generic_rpc_handlers((Handler(),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


class MessagePrefixes:
    """Reads a client's HTTP/2 byte stream as it passes: the frames, and in each stream's
    DATA the gRPC messages' 5-byte prefixes (a compressed flag, a 4-byte big-endian
    length), keeping the largest length seen."""

    PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

    def __init__(self):
        # Appended to and consumed in place: a frame that arrives in many small reads
        # costs its bytes once, not once per read.
        self.pending = bytearray()
        self.preface_left = len(self.PREFACE)
        self.streams: dict[int, list] = {}  # stream id -> [bytes left in the message, partial prefix]
        self.largest = 0

    def feed(self, data: bytes) -> None:
        if self.preface_left:
            skip = min(self.preface_left, len(data))
            self.preface_left -= skip
            data = data[skip:]
        buffer = self.pending
        buffer += data
        at = 0
        while len(buffer) - at >= 9:
            length = int.from_bytes(buffer[at:at + 3], "big")
            if len(buffer) - at < 9 + length:
                break
            kind, flags = buffer[at + 3], buffer[at + 4]
            stream = int.from_bytes(buffer[at + 5:at + 9], "big") & 0x7FFFFFFF
            if kind == 0:  # DATA
                payload = buffer[at + 9:at + 9 + length]
                if flags & 0x8:  # PADDED: a pad length byte first, the padding last
                    payload = payload[1:len(payload) - payload[0]]
                self._data(stream, payload)
            at += 9 + length
        del buffer[:at]

    def _data(self, stream: int, payload: bytes) -> None:
        state = self.streams.setdefault(stream, [0, b""])
        at = 0
        while at < len(payload):
            if state[0]:
                step = min(state[0], len(payload) - at)
                state[0] -= step
                at += step
                continue
            need = 5 - len(state[1])
            state[1] += payload[at:at + need]
            at += need
            if len(state[1]) == 5:
                state[0] = int.from_bytes(state[1][1:], "big")
                self.largest = max(self.largest, state[0])
                state[1] = b""


def serve_splice(port: int, upstream: str, read_frames: bool) -> None:
    async def pump(reader, writer, inspect=None):
        try:
            while data := await reader.read(1 << 16):
                if inspect is not None:
                    inspect(data)
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    async def connection(client_reader, client_writer):
        host, upstream_port = upstream.rsplit(":", 1)
        server_reader, server_writer = await asyncio.open_connection(host, int(upstream_port))
        inspect = MessagePrefixes().feed if read_frames else None
        await asyncio.gather(pump(client_reader, server_writer, inspect), pump(server_reader, client_writer),
                             return_exceptions=True)

    async def main():
        server = await asyncio.start_server(connection, "127.0.0.1", port)
        await server.serve_forever()

    asyncio.run(main())


def serve_front_door(port: int, upstream: str) -> None:
    """The front door's own gRPC port (auk_triton/front_door/grpc_front.py), with no models."""
    from auk_triton.front_door.grpc_front import GrpcFront, GrpcUpstream, start_server
    from auk_triton.front_door.settings import GrpcBounds
    from auk_triton.front_door.upstream import UpstreamState

    async def main():
        state = UpstreamState()
        state.running = True
        front = GrpcFront({}, GrpcUpstream(upstream), state)
        server = await start_server(front, {}, GrpcBounds(), "127.0.0.1", port)  # held: a dropped server stops
        await server.wait_for_termination()

    asyncio.run(main())


def wait_live(stub, request, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            stub.ServerLive(request, timeout=1)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


# --serve choice: (the table's name for it, the function that serves it)
PROXIES = {
    "aio": ("grpc.aio proxy", serve_aio),
    "sync": ("synchronous proxy", serve_sync),
    "splice": ("asyncio splice", lambda port, upstream: serve_splice(port, upstream, read_frames=False)),
    "frames": ("asyncio splice reading frames", lambda port, upstream: serve_splice(port, upstream, read_frames=True)),
    "front": ("the front door's gRPC front", serve_front_door),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=300, help="timed calls per target and round")
    parser.add_argument("--rounds", type=int, default=4, help="round 0 warms up and is left out")
    parser.add_argument("--serve", choices=tuple(PROXIES), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--upstream", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be at least 2: round 0 only warms up")
    if args.serve:
        PROXIES[args.serve][1](args.port, args.upstream)
        return

    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    from auk_triton.front_door.launcher import tritonserver_executable

    say(heading("A Python gRPC hop in front of tritonserver (ServerLive)", "cpu"))
    upstream = f"127.0.0.1:{free_port()}"
    processes = [subprocess.Popen(
        [str(tritonserver_executable()), f"--model-repository={tempfile.mkdtemp(prefix='empty-repository-')}",
         "--allow-http=false", "--allow-metrics=false", "--grpc-address=127.0.0.1",
         f"--grpc-port={upstream.rsplit(':', 1)[1]}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    targets = {"direct": upstream}
    for kind, (name, _) in PROXIES.items():
        port = free_port()
        processes.append(subprocess.Popen([sys.executable, __file__, "--serve", kind, "--port", str(port),
                                           "--upstream", upstream]))
        targets[name] = f"127.0.0.1:{port}"
    try:
        request = service_pb2.ServerLiveRequest()
        stubs = {name: service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(url))
                 for name, url in targets.items()}
        for stub in stubs.values():
            wait_live(stub, request)
        times = {name: [] for name in targets}
        for round_index in range(args.rounds):
            for name, stub in stubs.items():
                for _ in range(args.reps):
                    began = time.perf_counter()
                    stub.ServerLive(request)
                    if round_index:
                        times[name].append(time.perf_counter() - began)
        direct = statistics.median(times["direct"]) * 1e3
        say("\n| target | ServerLive p50 ms | p90 ms | over direct ms |\n| --- | --- | --- | --- |")
        for name, samples in times.items():
            p50 = statistics.median(samples) * 1e3
            p90 = statistics.quantiles(samples, n=10)[-1] * 1e3
            say(f"| {name} | {p50:.3f} | {p90:.3f} | {p50 - direct:+.3f} |")
    finally:
        for process in processes:
            process.kill()
            process.wait()


if __name__ == "__main__":
    main()

"""What a Python gRPC hop costs: ServerLive straight to tritonserver, and through the
smallest byte-forwarding proxy grpcio allows, in both of its servers.

The front door (auk_triton/serving/front_door.py) is a grpc.aio server forwarding bytes
to tritonserver. This measures the floor of that design apart from its checks: a proxy
that only forwards, as a grpc.aio server and channel (the front door's stack) and as a
synchronous grpcio server (thread pool) with a blocking channel. Each proxy runs in its
own process, as the front door does; tritonserver serves an empty model repository.
Rounds alternate the three targets; round 0 warms up and is left out.

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=300, help="timed calls per target and round")
    parser.add_argument("--rounds", type=int, default=4, help="round 0 warms up and is left out")
    parser.add_argument("--serve", choices=("aio", "sync"), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--upstream", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        (serve_aio if args.serve == "aio" else serve_sync)(args.port, args.upstream)
        return

    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    from auk_triton.serving.launcher import tritonserver_executable

    say(heading("A Python gRPC hop in front of tritonserver (ServerLive)", "cpu"))
    upstream = f"127.0.0.1:{free_port()}"
    processes = [subprocess.Popen(
        [str(tritonserver_executable()), f"--model-repository={tempfile.mkdtemp(prefix='empty-repository-')}",
         "--allow-http=false", "--allow-metrics=false", "--grpc-address=127.0.0.1",
         f"--grpc-port={upstream.rsplit(':', 1)[1]}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    targets = {"direct": upstream}
    for kind in ("aio", "sync"):
        port = free_port()
        processes.append(subprocess.Popen([sys.executable, __file__, "--serve", kind, "--port", str(port),
                                           "--upstream", upstream]))
        targets[f"grpc.{kind} proxy" if kind == "aio" else "synchronous proxy"] = f"127.0.0.1:{port}"
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

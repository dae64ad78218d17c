"""The least a decode model on Triton's Python backend does per request: the floor
under `bench_request_overhead.py`'s "floor" ways.

It has auk_vae_decode's inputs, outputs and decoupled policy and the same rule
for which waveform a response carries. Per request it reads LATENTS, copies
them to the model's device, waits out the in-process decode's time there, and
copies that many samples into (pinned) host memory. Then it sends them in one
response with the final flag. The samples are zeros.

On a GPU the wait is one sleeping kernel of `wait_ms`, calibrated at load, so
the stub process waits on the GPU in a device-to-host copy as the real model
does. On a CPU it is a sleep. No validation, graphs or metrics: over the wait,
what remains is Triton, the Python backend's hand-offs and the transport.

`bench_request_overhead.py` copies this file into its model repository as
`auk_vae_floor/1/model.py`, so it imports only torch and the Python backend's
utilities. Config parameters: `wait_ms`, `max_frames` (the longest clip), and
`record_to`, a JSON file that `finalize` writes with [request id, seconds] for
each request: its copy in, wait and copy out (the decode model's decode
counter covers the last two).
"""

import json
import time

import torch
import triton_python_backend_utils as pb_utils

SAMPLES_PER_FRAME = 480


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        self.wait_ms = float(params["wait_ms"])
        self.record_to = params.get("record_to") or None
        self.waits: list[tuple[str, float]] = []
        if args["model_instance_kind"] == "GPU":
            self.device = torch.device("cuda", int(args["model_instance_device_id"]))
            torch.cuda.set_device(self.device)
            self.cycles = round(self.wait_ms * self._cycles_per_ms())
        else:
            self.device = torch.device("cpu")
        longest = int(params["max_frames"]) * SAMPLES_PER_FRAME
        self.samples = {
            dtype: torch.zeros(longest, dtype=dtype, device=self.device) for dtype in (torch.float32, torch.int16)
        }

    @staticmethod
    def _cycles_per_ms() -> float:
        """GPU clock cycles per millisecond of `torch.cuda._sleep`, median of five sleeps (about 10 ms each on an H200)."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles, rates = 20_000_000, []
        for _ in range(5):
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            rates.append(cycles / start.elapsed_time(end))
        return sorted(rates)[2]

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            tensor = pb_utils.get_input_tensor_by_name(request, "LATENTS")
            latents = torch.from_dlpack(tensor.to_dlpack())
            count = latents.shape[0] * SAMPLES_PER_FRAME
            names = set(request.requested_output_names())
            pcm16 = "WAVEFORM_PCM16" in names and "WAVEFORM" not in names
            began = time.perf_counter()
            latents.to(self.device)  # the copy a decode needs; the sleep does not read it
            if self.device.type == "cuda":
                torch.cuda._sleep(self.cycles)
            else:
                time.sleep(self.wait_ms / 1e3)
            source = self.samples[torch.int16 if pcm16 else torch.float32][:count]
            host = torch.empty(count, dtype=source.dtype, pin_memory=source.is_cuda)
            host.copy_(source)  # on a GPU, waits for the sleeping kernel
            self.waits.append((request.request_id(), time.perf_counter() - began))
            response = pb_utils.InferenceResponse(
                output_tensors=[
                    pb_utils.Tensor.from_dlpack(
                        "WAVEFORM_PCM16" if pcm16 else "WAVEFORM", torch.utils.dlpack.to_dlpack(host)
                    ),
                    pb_utils.Tensor.from_dlpack(
                        "START_SAMPLE", torch.utils.dlpack.to_dlpack(torch.zeros(1, dtype=torch.int64))
                    ),
                ]
            )
            sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def finalize(self):
        if self.record_to:
            with open(self.record_to, "w") as out:
                json.dump(self.waits, out)

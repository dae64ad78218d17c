"""HTTP /infer through the front door, which answers it over gRPC so that a client that goes
cancels its request: each answer equals the one Triton's own HTTP endpoint gives (the same
server's internal port), status, headers, JSON and binary parts, and tritonclient reads it
as it reads Triton's. The session's front-door server (CPU, small synthetic weights)."""

from __future__ import annotations

import gzip
import json
import urllib.error
import urllib.request
import zlib

import numpy as np
import pytest

from triton_harness import library_tiles

OFFLINE = "auk_vae_decode_offline"
INFER = f"/v2/models/{OFFLINE}/infer"
LATENTS = np.random.default_rng(40).standard_normal((150, 64)).astype(np.float32)  # a short first window, then two


def post(url: str, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(f"http://{url}{path}", data=body, headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def parts(reply) -> tuple[dict, bytes]:
    """An /infer answer's JSON header and binary part, decompressed as its Content-Encoding says."""
    _, headers, body = reply
    body = {"gzip": gzip.decompress, "deflate": zlib.decompress}.get(headers.get("Content-Encoding"), bytes)(body)
    length = int(headers.get("Inference-Header-Content-Length", len(body)))
    return json.loads(body[:length]), body[length:]


def json_input(latents=LATENTS, nested: bool = False) -> dict:
    data = latents.tolist() if nested else latents.ravel().tolist()
    return {"name": "LATENTS", "shape": list(latents.shape), "datatype": "FP32", "data": data}


def binary_request(header: dict, latents=LATENTS) -> tuple[bytes, dict]:
    header = dict(header, inputs=[{"name": "LATENTS", "shape": list(latents.shape), "datatype": "FP32",
                                   "parameters": {"binary_data_size": latents.nbytes}}])
    text = json.dumps(header).encode()
    return text + latents.tobytes(), {"Inference-Header-Content-Length": str(len(text))}


def json_request(header: dict, **options) -> tuple[bytes, dict]:
    return json.dumps(dict(header, inputs=[json_input(**options)])).encode(), {}


CASES = {
    "JSON": json_request({}),
    "JSON nested, with an id": json_request({"id": "clip-7"}, nested=True),
    "binary in, binary_data_output": binary_request({"parameters": {"binary_data_output": True}}),
    "named outputs, one JSON and one binary": binary_request(
        {"outputs": [{"name": "WAVEFORM_PCM16"}, {"name": "START_SAMPLE", "parameters": {"binary_data": True}}]}
    ),
    "classification (BYTES out)": json_request({"outputs": [{"name": "WAVEFORM", "parameters": {"classification": 3}}]}),
    "request parameters": binary_request({"id": "p", "parameters": {"priority": 1, "note": "x", "gain": 0.5, "flag": True}}),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_an_infer_request_through_the_front_door_gets_the_answer_triton_s_http_endpoint_gives(front_door, case):
    body, headers = CASES[case]
    since = len(front_door.log())
    theirs = post(front_door.internal_http_url, INFER, body, headers)
    ours = post(front_door.http_url, INFER, body, headers)
    assert theirs[0] == ours[0] == 200, (theirs[2][:300], ours[2][:300])
    for name in ("Content-Type", "Inference-Header-Content-Length", "Content-Encoding"):
        assert ours[1].get(name) == theirs[1].get(name), name
    assert parts(ours) == parts(theirs)
    assert "over HTTP" not in front_door.log()[since:], "answered by forwarding, not over gRPC"


def test_compressed_requests_and_answers_are_those_triton_s_http_endpoint_takes_and_gives(front_door):
    body, headers = json_request({"id": "z"})
    for request_encoding, compress in (("gzip", gzip.compress), ("deflate", zlib.compress)):
        asked = dict(headers, **{"Content-Encoding": request_encoding, "Accept-Encoding": "deflate;q=0.9, gzip;q=0.5"})
        theirs = post(front_door.internal_http_url, INFER, compress(body), asked)
        ours = post(front_door.http_url, INFER, compress(body), asked)
        assert ours[0] == theirs[0] == 200
        assert ours[1].get("Content-Encoding") == theirs[1].get("Content-Encoding") == "deflate"
        assert parts(ours) == parts(theirs)


ERRORS = {
    # The model's own check: 400, naming the first bad frame.
    "NaN latents": (lambda: binary_request({}, latents=np.where(np.arange(64) == 5, np.nan, LATENTS[:20]).astype(np.float32)),
                    INFER, 400, "LATENTS holds 20 NaN and 0 infinite values (the first in frame 0)"),
    "a decoupled model": (lambda: json_request({}), "/v2/models/auk_vae_decode/infer", 501,
                          "HTTP end point doesn't support models with decoupled transaction policy"),
    "a version not served": (lambda: json_request({}), f"/v2/models/{OFFLINE}/versions/2/infer", 404, "version 2"),
    "an output the model lacks": (lambda: json_request({"outputs": [{"name": "NOPE"}]}), INFER, 400, "NOPE"),
}


@pytest.mark.parametrize("case", ERRORS, ids=list(ERRORS))
def test_an_error_gets_the_status_and_message_triton_s_http_endpoint_gives(front_door, case):
    make, path, status, words = ERRORS[case]
    body, headers = make()
    theirs = post(front_door.internal_http_url, path, body, headers)
    ours = post(front_door.http_url, path, body, headers)
    assert ours[0] == theirs[0] == status, (ours, theirs)
    assert json.loads(ours[2]) == json.loads(theirs[2])
    assert words in json.loads(ours[2])["error"]


def test_a_request_grpc_would_take_differently_is_forwarded_and_triton_answers_it_itself(front_door):
    since = len(front_door.log())
    cases = [
        json.dumps({"inputs": [dict(json_input(), data=[True] + json_input()["data"][1:])]}).encode(),  # a bool as FP32
        json.dumps({"inputs": [json_input()], "parameters": {"triton_x": 1}}).encode(),  # a reserved parameter
    ]
    for body in cases:
        theirs = post(front_door.internal_http_url, INFER, body)
        ours = post(front_door.http_url, INFER, body)
        assert ours[0] == theirs[0] >= 400 and json.loads(ours[2]) == json.loads(theirs[2]), (ours, theirs)
    assert front_door.log()[since:].count(f"forwarding {INFER} over HTTP") == len(cases)


def test_tritonclient_http_reads_the_front_door_s_answers_binary_and_json_compressed_or_not(front_door, reference_vae):
    import tritonclient.http as httpclient

    expected = np.concatenate([wave for _, wave in library_tiles(reference_vae, LATENTS, front_door)])
    client = httpclient.InferenceServerClient(front_door.http_url, network_timeout=120)
    try:
        for binary_in, binary_out, compression in ((True, True, None), (False, False, None), (True, False, "gzip")):
            tensor = httpclient.InferInput("LATENTS", list(LATENTS.shape), "FP32")
            tensor.set_data_from_numpy(LATENTS, binary_data=binary_in)
            outputs = [httpclient.InferRequestedOutput("WAVEFORM", binary_data=binary_out),
                       httpclient.InferRequestedOutput("START_SAMPLE", binary_data=not binary_out)]
            result = client.infer(OFFLINE, [tensor], outputs=outputs, request_id="tc",
                                  request_compression_algorithm=compression, response_compression_algorithm=compression)
            assert result.get_response()["id"] == "tc"
            np.testing.assert_allclose(result.as_numpy("WAVEFORM"), expected, rtol=0, atol=1e-6)
            assert result.as_numpy("START_SAMPLE").tolist() == [0]
    finally:
        client.close()

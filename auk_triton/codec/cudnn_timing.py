"""cuDNN's timing of the decoder's convolutions, with the engines it must not time kept out.

With `torch.backends.cudnn.benchmark`, cuDNN runs every candidate engine once on a new
convolution shape and keeps the fastest. One of them, engine 0 of cuDNN 9's forward
convolutions (a grouped direct kernel), never wins a decoder shape, but each timing run of it
on a batched shape is a single kernel that fills every SM for tens of milliseconds. The
decoder times the batched shapes after READY, beside the requests it serves (decode_graph's
deferred build), and a decode queued behind such a kernel waited for all of it
(benchmarks/studies/startup.md). cuDNN's frontend skips the engines named in its errata file,
`CUDNN_ERRATA_JSON_FILE`; torch reads the file once per process, at its first convolution,
so this is set before any.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

ERRATA_ENV = "CUDNN_ERRATA_JSON_FILE"
# The engine numbers are cuDNN 9's: the file's rule holds only for cuDNN 9.x.
DECODE_ERRATA = Path(__file__).with_name("cudnn_errata.json")


def time_convolutions() -> str:
    """Turn on cuDNN's timing for this process, with `DECODE_ERRATA` keeping engines out of it.

    An errata file the operator named in the environment is kept in its place. Returns the
    file in force. Call it before the process's first convolution: torch reads the file then."""
    os.environ.setdefault(ERRATA_ENV, str(DECODE_ERRATA))
    torch.backends.cudnn.benchmark = True
    return os.environ[ERRATA_ENV]

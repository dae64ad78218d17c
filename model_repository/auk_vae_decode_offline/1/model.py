# The model code lives once, in the auk_triton package. Triton's Python backend starts its
# interpreter without reading PYTHONPATH: its entries go first here, as for any Python process.
import os
import sys

sys.path[:0] = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]

from auk_triton.serving.offline_model import TritonPythonModel  # noqa: E402,F401

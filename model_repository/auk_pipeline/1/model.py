# The model code lives once, in the auk_triton package.
from auk_triton.serving.pipeline_model import TritonPythonModel  # noqa: F401

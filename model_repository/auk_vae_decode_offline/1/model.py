# The model code lives once, in the auk_triton package.
from auk_triton.serving.offline_model import TritonPythonModel  # noqa: F401

# The real-server fixtures (triton, launch_triton, open_stream, ...) live in triton_harness.py.
pytest_plugins = ["triton_harness"]

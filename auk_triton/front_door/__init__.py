"""The front door: the launcher that supervises tritonserver, and the public HTTP and gRPC
ports that check every request before it reaches it. Its process imports no torch."""

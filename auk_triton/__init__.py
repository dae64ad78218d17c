"""AuK audio codec decoder, replayed as CUDA graphs and served on Triton."""

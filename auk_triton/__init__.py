"""AuK latents to audio and back, replayed as CUDA graphs and served on Triton."""

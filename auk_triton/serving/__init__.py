"""Triton Inference Server model code for the AuK decode (see vae_decode_model)."""

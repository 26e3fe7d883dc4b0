"""Tandem GPU worker: the shared worker service on CUDA (or Apple mps), in fp16/bf16 by default."""

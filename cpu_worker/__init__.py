"""Tandem CPU worker: the shared worker service on the CPU, with a pinned thread count."""

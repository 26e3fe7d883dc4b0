"""Tandem: LLM serving across heterogeneous hardware."""

"""Model loading and execution: the only part of the engine that imports torch."""

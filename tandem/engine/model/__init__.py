"""Model execution: the only part of the engine that imports torch. Finding a model's files is ``tandem.model_files``."""

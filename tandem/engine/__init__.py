"""The inference engine shared by every worker.

Everything here is plain Python except ``tandem.engine.model``, the only package that imports torch.
"""

"""Discrete-event simulator: the router's real policies and the engine's real scheduler, with step times
from a linear model instead of a model forward pass."""

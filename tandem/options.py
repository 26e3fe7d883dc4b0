"""Command-line options that can also be set through environment variables, for compose files.

Every option has a flag and an environment variable; the flag wins, then the variable, then the
default. The parser records the variables it reads, so deployment files can be checked against it.
"""

from __future__ import annotations

import argparse
import os
from typing import Any


class EnvArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose ``add_env_argument`` options fall back to environment variables."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.env_vars: dict[str, str] = {}

    def add_env_argument(self, flag: str, env: str, default: Any = None, help: str = "", **kwargs: Any) -> None:
        """Add ``flag``; when absent, its value comes from ``env`` (converted and checked like a flag), else ``default``."""
        raw = os.environ.get(env)
        action = self.add_argument(flag, default=default if raw is None else raw, help=f"{help} [env {env}]", **kwargs)
        self.env_vars[env] = action.dest

    def add_env_list_argument(self, flag: str, env: str, help: str) -> None:
        """Add a repeatable ``flag``; its caller reads ``env`` as a comma-separated list when the flag is absent."""
        action = self.add_argument(flag, action="append", help=f"{help} [env {env}, comma-separated]")
        self.env_vars[env] = action.dest


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def port_number(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in [0, 65535], got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value

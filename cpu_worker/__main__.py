import sys

from tandem.worker.server import main

DEFAULT_PORT = 50061


def resolve_device(device: str | None) -> str:
    return device or "cpu"


if __name__ == "__main__":
    sys.exit(main("cpu", DEFAULT_PORT, resolve_device))

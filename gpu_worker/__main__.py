import sys

from tandem.worker.server import main

DEFAULT_PORT = 50062


def resolve_device(device: str | None) -> str:
    """The requested device, else CUDA, else Apple mps; without either, exit unless --device cpu is given."""
    import torch

    if device:
        return device
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    sys.exit("gpu_worker: no CUDA or mps device found; start it with --device cpu (TANDEM_DEVICE=cpu) to run it on the CPU")


if __name__ == "__main__":
    sys.exit(main("gpu", DEFAULT_PORT, resolve_device))

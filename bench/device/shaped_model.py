"""A model directory with a model's configuration and tokenizer and random weights, for timing on a machine
its weights cannot reach (the default model's file is larger than what travels to the GPU machine).

The engine benchmarks ignore EOS and feed random token ids, so no step depends on the weights' values:
a step takes as long on these weights as on the trained ones of the same shape and dtype.
Usage: python bench/device/shaped_model.py CONFIG_DIR OUT_DIR
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config_dir", type=Path, help="a model directory; only its configuration and tokenizer are read")
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.config_dir), dtype=torch.bfloat16)
    model.save_pretrained(args.out_dir)
    for name in COPIED:
        if (args.config_dir / name).is_file():
            shutil.copy(args.config_dir / name, args.out_dir / name)
    print(f"wrote {args.out_dir}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M random parameters")


if __name__ == "__main__":
    main()

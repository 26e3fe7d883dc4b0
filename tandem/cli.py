"""The ``tandem`` command."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem: LLM serving across CPU and GPU workers")
    commands = parser.add_subparsers(dest="command", required=True)

    provision = commands.add_parser("provision", help="prepare a model's files (converts the default GGUF once)")
    provision.add_argument("--model", default=None, help="model directory, .gguf file or hub id (default: built-in)")

    generate = commands.add_parser("generate", help="run the engine in-process and stream one completion")
    generate.add_argument("prompt")
    generate.add_argument("--model", default=None)
    generate.add_argument("--device", default="cpu")
    generate.add_argument("--dtype", default=None)
    generate.add_argument("--max-new-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--chat", action="store_true", help="render the prompt with the model's chat template")

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "provision":
        from tandem.engine.model.loader import resolve_model

        print(resolve_model(args.model))
        return 0
    return asyncio.run(_generate(args))


async def _generate(args: argparse.Namespace) -> int:
    from tandem.engine.engine import AsyncEngine
    from tandem.engine.model.factory import build_engine
    from tandem.engine.request import Request, SamplingParams

    engine = build_engine(args.model, device=args.device, dtype=args.dtype)
    rates = engine.rates.rates()
    print(f"# {engine.executor.device}: prefill {rates.prefill_tok_s:.0f} tok/s, decode {rates.decode_tok_s:.0f} tok/s",
          file=sys.stderr)
    tokenizer = engine.tokenizer
    if args.chat:
        prompt_ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    else:
        prompt_ids = tokenizer(args.prompt)["input_ids"]
    runner = AsyncEngine(engine)
    runner.start()
    try:
        request = Request("cli", list(prompt_ids), args.max_new_tokens, SamplingParams(temperature=args.temperature))
        async for output in runner.generate(request):
            print(output.text, end="", flush=True)
            if output.finished:
                stats = output.stats
                print(f"\n# finish={output.finish_reason.value} prompt={stats.num_prompt_tokens} "
                      f"output={stats.num_output_tokens} ttft={stats.ttft_s:.3f}s total={stats.total_time_s:.3f}s",
                      file=sys.stderr)
    finally:
        runner.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

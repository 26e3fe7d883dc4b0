"""The ``tandem`` command."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

# Subcommands other installed packages provide, as entry points: name = "module:function taking argv".
# The library imports no service; `tandem sim` comes from router_svc this way (see pyproject.toml).
COMMANDS_GROUP = "tandem.commands"


def main(argv: list[str] | None = None) -> int:
    try:
        code = _run(sys.argv[1:] if argv is None else argv)
        sys.stdout.flush()  # a piped stdout is buffered: a closed pipe shows here, not in a print
        return code
    except BrokenPipeError:  # whoever read the output stopped early, as `tandem sim --json | head` does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so flushing at exit fails no more
        return 1


def _run(argv: list[str]) -> int:
    from tandem.client import DEFAULT_ROUTER

    if argv[:1] == ["bench"]:
        from tandem.loadgen.live import main as bench_main

        return bench_main(argv[1:])
    installed = _installed_commands()
    if argv[:1] and argv[0] in installed:
        return installed[argv[0]].load()(argv[1:])

    parser = argparse.ArgumentParser(prog="tandem", description="Tandem: LLM serving across CPU and GPU workers")
    commands = parser.add_subparsers(dest="command", required=True)

    provision = commands.add_parser("provision", help="prepare a model's files (converts the default GGUF "
                                      "once) and build the CPU kernels")
    provision.add_argument("--model", default=None, help="model directory, .gguf file or hub id (default: built-in)")

    up = commands.add_parser("up", help="start cpu_worker, gpu_worker and the router here; Ctrl-C stops them")
    up.add_argument("--model", default=None)
    up.add_argument("--router-port", type=int, default=50051)
    up.add_argument("--cpu-port", type=int, default=50061)
    up.add_argument("--gpu-port", type=int, default=50062)
    up.add_argument("--http-port", type=int, default=8000, help="the router's OpenAI-compatible HTTP API")
    up.add_argument("--log-dir", type=Path, default=None, help="default: $TANDEM_HOME/logs")

    generate = commands.add_parser("generate", help="stream a completion through the router")
    generate.add_argument("prompt")
    generate.add_argument("--router", default=DEFAULT_ROUTER, help="router address [env TANDEM_ROUTER]")
    generate.add_argument("--max-new-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--policy", default="", help="routing policy for this request (default: the router's)")
    generate.add_argument("--length-key", default="",
                          help="group whose output lengths the router learns together (default: all requests)")
    generate.add_argument("--raw", action="store_true", help="send the prompt as plain text, not as a chat message")
    generate.add_argument("--explain", action="store_true", help="print the routing decision table first")
    generate.add_argument("--dry-run", action="store_true", help="only print the decision (Explain); run nothing")

    backends = commands.add_parser("backends", help="print the workers' live state")
    backends.add_argument("--router", default=DEFAULT_ROUTER, help="router address [env TANDEM_ROUTER]")
    for command in (generate, backends):
        command.add_argument("--tls-ca", default=os.environ.get("TANDEM_TLS_CA"),
                             help="PEM CA of the router's certificate: connect with TLS [env TANDEM_TLS_CA]")
        command.add_argument("--token-file", default=None,
                             help="file holding the bearer token (default: env TANDEM_TOKEN)")

    commands.add_parser("bench", help="drive the router, one worker or any OpenAI-compatible server with a workload "
                                      "(see tandem bench --help)")
    for name, entry_point in installed.items():
        commands.add_parser(name, help=_command_help(name, entry_point))

    args = parser.parse_args(argv)
    if args.command == "provision":
        from tandem.engine.model import cpu_kernels
        from tandem.model_files import resolve_model

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        print(resolve_model(args.model))
        cpu_kernels.build_all()
        return 0
    if args.command == "up":
        from tandem.model_files import tandem_home
        from tandem.stack import run_stack

        return run_stack(args.model, args.router_port, args.cpu_port, args.gpu_port,
                         args.log_dir or tandem_home() / "logs", http_port=args.http_port)
    return _call_router(args)


def _installed_commands() -> dict:
    from importlib.metadata import entry_points

    return {entry_point.name: entry_point for entry_point in entry_points(group=COMMANDS_GROUP)}


def _command_help(name: str, entry_point) -> str:
    """The summary line of the command's module docstring ("`tandem NAME`: summary"), read without importing it."""
    import ast
    import importlib.util

    try:
        origin = importlib.util.find_spec(entry_point.module).origin
        docstring = ast.get_docstring(ast.parse(Path(origin).read_text(encoding="utf-8"))) or ""
    except (ImportError, AttributeError, OSError, SyntaxError, TypeError, ValueError):
        docstring = ""
    summary = docstring.partition("\n")[0].removeprefix(f"`tandem {name}`:").strip().rstrip(".")
    return f"{summary} (see tandem {name} --help)" if summary else f"see tandem {name} --help"


def _call_router(args: argparse.Namespace) -> int:
    import grpc
    from opentelemetry.trace import SpanKind

    from tandem.client import RouterClient, format_backends, format_decision
    from tandem.security import client_tls
    from tandem.telemetry import mark_failed, setup_tracing, tracer

    try:
        tls = client_tls(args.tls_ca)
        token = Path(args.token_file).read_text().strip() if args.token_file else os.environ.get("TANDEM_TOKEN")
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    provider = setup_tracing("tandem-cli")
    client = RouterClient(args.router, tls, token)
    span = tracer("tandem.cli").start_span(f"tandem {args.command}", kind=SpanKind.CLIENT)
    try:
        if args.command == "backends":
            print(format_backends(client.backends()))
            return 0
        request = RouterClient.request(args.prompt, chat=not args.raw, max_new_tokens=args.max_new_tokens,
                                       temperature=args.temperature, policy=args.policy,
                                       length_key=args.length_key)
        if args.dry_run:
            print(format_decision(client.explain(request, span=span)))
            return 0
        for response in client.generate(request, span=span):
            if response.HasField("decision"):
                if args.explain:
                    print(format_decision(response.decision), file=sys.stderr)
                continue
            print(response.text, end="", flush=True)
            if response.HasField("result"):
                result = response.result
                context = span.get_span_context()
                trace_note = f", trace {context.trace_id:032x}" if context.is_valid else ""
                print(f"\n[{response.worker}: {result.usage.output_tokens} tokens, "
                      f"{result.usage.cached_tokens}/{result.usage.prompt_tokens} prompt tokens cached, "
                      f"TTFT {result.timings.ttft_s:.3f} s, total {result.timings.total_time_s:.3f} s{trace_note}]",
                      file=sys.stderr)
        return 0
    except grpc.RpcError as exc:
        mark_failed(span, exc)
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    finally:
        span.end()
        client.close()
        if provider is not None:
            provider.shutdown()


if __name__ == "__main__":
    sys.exit(main())

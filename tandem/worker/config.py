"""Worker settings from flags and TANDEM_* environment variables."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field

from tandem.engine.config import (
    BATCHED_WEIGHTS,
    CUDA_GRAPHS,
    DECODE_WEIGHTS,
    DEFAULT_BATCHED_WEIGHTS,
    DEFAULT_DECODE_WEIGHTS,
    DEFAULT_ENGINE_PRIORITY,
    ENGINE_PRIORITIES,
    CacheConfig,
    SchedulerConfig,
)
from tandem.options import EnvArgumentParser, port_number, positive_float, positive_int
from tandem.protocol import WORKER_KINDS
from tandem.security import ServerTLS, add_server_tls_arguments, server_tls

# Each engine's tokens per KV block unless --block-size says otherwise. vLLM's CPU attention takes
# multiples of 32 only; 32 also suits its GPU kernels and keeps prefix hits fine-grained.
ENGINE_BLOCK_SIZES = {"tandem": 16, "vllm": 32}


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker process needs to start.

    Args:
        kind: "cpu" or "gpu", what the worker was deployed as (reported to the router).
        device: torch device; None lets the worker pick its kind's default.
    """

    kind: str
    engine: str = "tandem"
    host: str = "127.0.0.1"
    port: int = 50061
    model: str | None = None
    device: str | None = None
    dtype: str | None = None
    decode_weights: str = DEFAULT_DECODE_WEIGHTS
    batched_weights: str = DEFAULT_BATCHED_WEIGHTS
    cuda_graphs: bool | None = None  # None: on CUDA
    threads: int | None = None
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    drain_grace_s: float = 30.0
    engine_priority: str = DEFAULT_ENGINE_PRIORITY
    max_message_bytes: int = 4 << 20
    metrics_port: int = 0
    tls: ServerTLS | None = None
    vllm_args: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in WORKER_KINDS:
            raise ValueError(f"kind must be one of {', '.join(WORKER_KINDS)}, got {self.kind!r}")
        if self.engine not in ENGINE_BLOCK_SIZES:
            raise ValueError(f"engine must be one of {', '.join(ENGINE_BLOCK_SIZES)}, got {self.engine!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.drain_grace_s < 0:
            raise ValueError(f"drain_grace_s must be >= 0, got {self.drain_grace_s}")


def build_parser(kind: str, default_port: int) -> EnvArgumentParser:
    parser = EnvArgumentParser(prog=f"python -m {kind}_worker", description=f"Tandem {kind} worker")
    parser.add_env_argument("--engine", "TANDEM_ENGINE", "tandem", choices=list(ENGINE_BLOCK_SIZES),
                            help="what runs the model: tandem (Tandem's own engine) or vllm (vLLM's AsyncLLM, "
                                 "installed beside Tandem: tandem[vllm])")
    parser.add_env_argument("--vllm-args", "TANDEM_VLLM_ARGS", {}, type=_json_object,
                            help="with --engine vllm: more of vLLM's engine arguments, as a JSON object, e.g. "
                                 "'{\"enforce_eager\": true}'")
    parser.add_env_argument("--host", "TANDEM_HOST", "127.0.0.1", help="address to listen on")
    parser.add_env_argument("--port", "TANDEM_PORT", default_port, type=port_number, help="gRPC port")
    parser.add_env_argument(
        "--model", "TANDEM_MODEL", None, help="model directory, .gguf file or hub id (default: SmolLM2-135M-Instruct)"
    )
    parser.add_env_argument(
        "--device", "TANDEM_DEVICE", None,
        help="torch device: cpu, cuda, cuda:N or mps (default: cpu for cpu_worker, cuda or mps for gpu_worker)",
    )
    parser.add_env_argument("--dtype", "TANDEM_DTYPE", "auto", choices=["auto", "float32", "float16", "bfloat16"],
                            help="weights and activations dtype")
    parser.add_env_argument("--decode-weights", "TANDEM_DECODE_WEIGHTS", DEFAULT_DECODE_WEIGHTS,
                            choices=list(DECODE_WEIGHTS),
                            help="float32 models on the CPU: the weights that decode steps (of up to decode_rows rows, "
                                 "measured per machine) read; int8 keeps a second, quarter-size copy for them (a scale "
                                 "per 32 columns), float16 a half-size one, auto each weight that lies on a 4-bit grid "
                                 "(a model converted from a Q4_1 GGUF file, as the default model is) in those 4 bits, "
                                 "exactly, and the others in int8; read by kernels built on first use (AVX2 or "
                                 "AVX-512 CPUs with a C compiler; float32 elsewhere); float32 keeps none. All pass the "
                                 "teacher-forced quality gate against float32")
    parser.add_env_argument("--batched-weights", "TANDEM_BATCHED_WEIGHTS", DEFAULT_BATCHED_WEIGHTS,
                            choices=list(BATCHED_WEIGHTS),
                            help="float32 models on the CPU: the weights that steps of more rows (prefill chunks, "
                                 "wide batches) read; bfloat16 in place of float32 multiplies about 1.8x as fast "
                                 "where the CPU does it natively (AVX512-BF16 or AMX) and passes the same gate; "
                                 "auto: bfloat16 there, unless --decode-weights is float32")
    parser.add_env_argument("--cuda-graphs", "TANDEM_CUDA_GRAPHS", "auto", choices=list(CUDA_GRAPHS),
                            help="replay steps of decodes alone (up to 64 rows) from CUDA graphs, one launch in place "
                                 "of every kernel of the step; auto: on CUDA")
    parser.add_env_argument("--threads", "TANDEM_THREADS", None, type=positive_int,
                            help="torch CPU threads (default: all cores)")
    parser.add_env_argument("--max-active", "TANDEM_MAX_ACTIVE", 8, type=positive_int,
                            help="requests in the running batch at once")
    parser.add_env_argument("--max-waiting", "TANDEM_MAX_WAITING", 256, type=positive_int,
                            help="bound of the waiting queue; beyond it requests get RESOURCE_EXHAUSTED")
    parser.add_env_argument("--max-batched-tokens", "TANDEM_MAX_BATCHED_TOKENS", 512, type=positive_int,
                            help="tokens computed per engine step, prefill chunks and decodes together")
    parser.add_env_argument("--max-prefill-step-tokens", "TANDEM_MAX_PREFILL_STEP_TOKENS", 4096, type=positive_int,
                            help="tokens the first request of a step may compute by itself where none decodes (a "
                                 "prompt alone; never below --max-batched-tokens); the tandem engine's")
    parser.add_env_argument("--block-size", "TANDEM_BLOCK_SIZE", None, type=positive_int,
                            help="tokens per KV block (default: 16 for the tandem engine, 32 for vllm)")
    parser.add_env_argument("--kv-cache-gib", "TANDEM_KV_CACHE_GIB", 1.0, type=positive_float,
                            help="KV cache memory in GiB")
    parser.add_env_argument("--num-kv-blocks", "TANDEM_NUM_KV_BLOCKS", None, type=positive_int,
                            help="exact number of KV blocks (overrides --kv-cache-gib)")
    parser.add_env_argument("--engine-priority", "TANDEM_ENGINE_PRIORITY", DEFAULT_ENGINE_PRIORITY,
                            choices=list(ENGINE_PRIORITIES),
                            help="normal: the default scheduling class; batch: the engine thread runs in Linux's "
                                 "SCHED_BATCH class, for a host where measurement shows it helps")
    parser.add_env_argument("--drain-grace-s", "TANDEM_DRAIN_GRACE_S", 30.0, type=float,
                            help="seconds in-flight streams get to finish after SIGTERM")
    parser.add_env_argument("--max-message-bytes", "TANDEM_MAX_MESSAGE_BYTES", 4 << 20, type=positive_int,
                            help="largest request message accepted; larger ones get RESOURCE_EXHAUSTED")
    parser.add_env_argument("--metrics-port", "TANDEM_METRICS_PORT", 0, type=port_number,
                            help="serve Prometheus metrics on this port (0: off)")
    add_server_tls_arguments(parser)
    return parser


def parse_config(kind: str, default_port: int, argv: list[str] | None = None) -> WorkerConfig:
    parser = build_parser(kind, default_port)
    args = parser.parse_args(argv)
    try:
        return WorkerConfig(
            kind=kind,
            engine=args.engine,
            vllm_args=args.vllm_args,
            host=args.host,
            port=args.port,
            model=args.model,
            device=args.device,
            dtype=None if args.dtype == "auto" else args.dtype,
            decode_weights=args.decode_weights,
            batched_weights=args.batched_weights,
            cuda_graphs=CUDA_GRAPHS[args.cuda_graphs],
            threads=args.threads,
            scheduler=SchedulerConfig(
                max_active_requests=args.max_active,
                max_waiting_requests=args.max_waiting,
                max_num_batched_tokens=args.max_batched_tokens,
                max_prefill_step_tokens=args.max_prefill_step_tokens,
                block_size=args.block_size or ENGINE_BLOCK_SIZES[args.engine],
            ),
            cache=CacheConfig(num_kv_blocks=args.num_kv_blocks, kv_cache_bytes=int(args.kv_cache_gib * (1 << 30))),
            drain_grace_s=args.drain_grace_s,
            engine_priority=args.engine_priority,
            max_message_bytes=args.max_message_bytes,
            metrics_port=args.metrics_port,
            tls=server_tls(args.tls_cert, args.tls_key, args.tls_client_ca),
        )
    except ValueError as exc:
        parser.error(str(exc))


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

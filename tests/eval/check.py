"""`make eval-check`: lm-evaluation-harness against Tandem, beside lm-eval's own transformers model.

Starts the stack on the default model (float32 weights for decode steps too), runs the tasks in
tests/eval/tasks with lm-eval's ``local-completions`` model against the router's /v1/completions (token-id
prompts, echo and logprobs, as lm-eval sends them), then with its ``hf`` model on the same weights, and
compares every loglikelihood and every generation. lm-eval runs from its own environment (``--eval-python``),
whose pins need not match Tandem's. Writes bench/results/eval-check.json; exits 1 if a loglikelihood differs
by more than the tolerance.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from pathlib import Path

from tandem.loadgen.live import wait_for_healthy_backends
from tandem.loadgen.results import write_json
from tandem.model_files import model_name, resolve_model
from tandem.stack import start_stack

ROOT = Path(__file__).resolve().parents[2]
TASKS = ("tandem_choice", "tandem_generate")
RESULTS = ROOT / "bench" / "results"


def run_lm_eval(eval_python: str, model: str, model_args: str, output: Path) -> dict[str, dict[int, list]]:
    """Each task's filtered responses by document, as lm-eval logged them for ``model``."""
    subprocess.run([eval_python, "-m", "lm_eval", "run", "--model", model, "--model_args", model_args,
                    "--tasks", ",".join(TASKS), "--include_path", str(ROOT / "tests" / "eval" / "tasks"),
                    "--batch_size", "1", "--log_samples", "--output_path", str(output)], cwd=ROOT, check=True)
    responses: dict[str, dict[int, list]] = {}
    for task in TASKS:
        for path in output.rglob(f"samples_{task}_*.jsonl"):
            for line in path.read_text().splitlines():
                sample = json.loads(line)
                responses.setdefault(task, {})[sample["doc_id"]] = sample["filtered_resps"]
    return responses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eval-python", required=True, help="python of an environment with lm-eval[hf] 0.4.13")
    parser.add_argument("--tolerance", type=float, default=1e-3)
    args = parser.parse_args()
    model_dir = resolve_model(None)
    work = RESULTS / "eval-check"
    stack = start_stack(None, work / "logs", cpu_args=("--decode-weights", "float32"),
                        gpu_args=("--decode-weights", "float32"))
    try:
        stack.wait_for_health()
        asyncio.run(wait_for_healthy_backends(stack.router.address))
        tandem = run_lm_eval(args.eval_python, "local-completions",
                             f"model={model_name(None)},base_url={stack.http_url}/v1/completions,"
                             f"tokenizer={model_dir},tokenizer_backend=huggingface,tokenized_requests=True",
                             work / "tandem")
    finally:
        stack.stop()
    reference = run_lm_eval(args.eval_python, "hf", f"pretrained={model_dir},dtype=float32", work / "hf")

    differences = [abs(float(ours[0]) - float(theirs[0]))
                   for doc, choices in reference["tandem_choice"].items()
                   for ours, theirs in zip(tandem["tandem_choice"][doc], choices)]
    generations = [(tandem["tandem_generate"][doc], output) for doc, output in reference["tandem_generate"].items()]
    report = {"model": str(model_dir), "loglikelihoods": len(differences), "max_abs_difference": max(differences),
              "tolerance": args.tolerance, "generations": len(generations),
              "generations_equal": sum(ours == theirs for ours, theirs in generations)}
    write_json(RESULTS / "eval-check.json", report)
    print(json.dumps(report, indent=2))
    return 0 if report["max_abs_difference"] <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())

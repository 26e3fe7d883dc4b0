"""The two maintained grammar engines for structured output, side by side: the time to compute one token's
mask, and to compile a spec, at the default model's vocabulary (49,152 tokens) on this CPU.

For each spec, a valid output is tokenized and walked token by token, as a request's decode steps walk it:
each engine computes the mask of allowed next tokens (into a token bitmask, as the sampler uses it), then
accepts the token. xgrammar (Tandem's engine) against llguidance; both keep JSON to one layout. Writes
bench/results/grammar.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from importlib.metadata import version
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REPEATS = 5

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "tags": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}, "maxItems": 5},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "email": "ada@engine.org", "tags": ["admin", "user"],
            "address": {"city": "London", "zip": "W1 4AA"}}
# (name, xgrammar spec kind, spec, llguidance grammar, a valid output)
CASES = [
    ("json_schema", "json_schema", json.dumps(SCHEMA), ("json", SCHEMA),
     json.dumps(DOCUMENT, separators=(", ", ": "))),
    ("json_object", "json_object", "", ("json", {"type": "object"}),
     json.dumps({"id": 7, "items": [1, 2, 3], "ok": True, "note": "a short note"}, separators=(", ", ": "))),
    ("regex", "regex", "[0-9]{3}-[0-9]{4} [A-Z][a-z]+", ("regex", "[0-9]{3}-[0-9]{4} [A-Z][a-z]+"), "555-0199 Smith"),
]


def stats(samples_s: list[float]) -> dict[str, float]:
    us = sorted(1e6 * s for s in samples_s)
    return {"p50_us": us[len(us) // 2], "mean_us": statistics.fmean(us), "p99_us": us[int(len(us) * 0.99)],
            "max_us": us[-1], "tokens": len(us)}


def run_xgrammar(tokenizer, vocab_size: int, eos: list[int], case) -> dict:
    import xgrammar

    from tandem.structured import StructuredOutput, grammar

    _, kind, spec, _, text = case
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos)
    tokens = tokenizer(text, add_special_tokens=False)["input_ids"] + eos[:1]
    masks, compiles = [], []
    for _ in range(REPEATS):
        compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        start = time.perf_counter()
        compiled = compiler.compile_grammar(grammar(StructuredOutput(kind, spec)))
        compiles.append(time.perf_counter() - start)
        matcher = xgrammar.GrammarMatcher(compiled)
        bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
        for token in tokens:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            masks.append(time.perf_counter() - start)
            assert matcher.accept_token(token), (kind, token)
        assert matcher.is_terminated()
    return {"mask": stats(masks), "compile_ms_median": 1000 * statistics.median(compiles)}


def run_llguidance(tokenizer, vocab_size: int, eos: list[int], case, tokenizer_json: Path) -> dict:
    import llguidance
    import llguidance.torch

    _, _, _, (kind, spec), text = case
    ll_tokenizer = llguidance.LLTokenizer(str(tokenizer_json), n_vocab=vocab_size, eos_token=eos)
    if kind == "json":
        source = llguidance.LLMatcher.grammar_from_json_schema(
            spec, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    else:
        source = llguidance.LLMatcher.grammar_from_regex(spec)
    tokens = tokenizer(text, add_special_tokens=False)["input_ids"] + eos[:1]
    masks, compiles = [], []
    for _ in range(REPEATS):
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(ll_tokenizer, source)
        compiles.append(time.perf_counter() - start)
        assert not matcher.is_error(), matcher.get_error()
        bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
        for token in tokens:
            start = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            masks.append(time.perf_counter() - start)
            assert matcher.consume_token(token), (kind, token, matcher.get_error())
        assert matcher.is_stopped() or matcher.is_accepting()
    return {"mask": stats(masks), "compile_ms_median": 1000 * statistics.median(compiles)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=RESULTS / "grammar.json")
    args = parser.parse_args()
    from transformers import AutoConfig

    from tandem.model_files import eos_token_ids, resolve_model
    from tandem.tokenizer import load_tokenizer

    model_dir = resolve_model(None)
    tokenizer = load_tokenizer(model_dir)
    # The GGUF conversion writes its byte-level BPE's decoder as a sequence that llguidance does not read as
    # byte-level (it then takes "Ġ" for two bytes); the plain ByteLevel decoder decodes this vocabulary alike.
    plain = json.loads((model_dir / "tokenizer.json").read_text())
    plain["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    tokenizer_json = RESULTS / "grammar-tokenizer.json"
    RESULTS.mkdir(parents=True, exist_ok=True)
    tokenizer_json.write_text(json.dumps(plain))
    vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
    eos = sorted(eos_token_ids(AutoConfig.from_pretrained(model_dir), model_dir))
    results = {}
    for case in CASES:
        results[case[0]] = {"xgrammar": run_xgrammar(tokenizer, vocab_size, eos, case),
                            "llguidance": run_llguidance(tokenizer, vocab_size, eos, case, tokenizer_json)}
        for engine, result in results[case[0]].items():
            mask = result["mask"]
            print(f"{case[0]:<12} {engine:<11} mask p50 {mask['p50_us']:7.1f} us, mean {mask['mean_us']:7.1f}, "
                  f"p99 {mask['p99_us']:8.1f}, max {mask['max_us']:8.1f}; compile {result['compile_ms_median']:.1f} ms",
                  flush=True)
    report = {"benchmark": "grammar", "vocab_size": vocab_size, "repeats": REPEATS,
              "versions": {"xgrammar": version("xgrammar"), "llguidance": version("llguidance")},
              "machine": {"platform": platform.platform(), "processor": platform.processor()}, "results": results}
    RESULTS.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

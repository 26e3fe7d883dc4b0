"""Dependencies point down: services import the library, never the reverse; the router imports nothing from the
engine (so never torch); the engine and its loop reach no further than the objects they hold."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("router_svc", "simulator", "cpu_worker", "gpu_worker")
# What `python -m router_svc` imports before it serves, and how it loads its tokenizer.
ROUTER_IMPORTS = "import router_svc.__main__, router_svc.frontends.grpc, router_svc.workers, router_svc.policies"


def modules_loaded_after(code: str) -> set[str]:
    """Top-level packages in sys.modules after running ``code`` in a fresh interpreter."""
    script = textwrap.dedent(code) + "\nimport json, sys\nprint(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return set(json.loads(result.stdout.splitlines()[-1]))


def router_tokenizer_script(model_dir: str) -> str:
    return f"""
        {ROUTER_IMPORTS}
        from tandem.tokenizer import load_prompt_tokenizer
        tokenizer = load_prompt_tokenizer({model_dir!r})
        assert tokenizer("Hello there")["input_ids"]
        assert tokenizer.chat_template
        assert tokenizer.apply_chat_template([{{"role": "user", "content": "hi"}}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
    """


def write_plain_tokenizer(directory: Path) -> None:
    """A tokenizer as transformers 5 saves one, built with the tokenizers library alone (no torch here)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["Hello there, general tokenizer.", "hi"], trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "backend": "tokenizers", "tokenizer_class": "TokenizersBackend",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
    }))
    (directory / "chat_template.jinja").write_text(
        "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def test_the_router_loads_its_tokenizer_with_the_torch_free_loader():
    tree = ast.parse((ROOT / "router_svc" / "__main__.py").read_text())
    imported = {(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                for alias in node.names}
    assert ("tandem.tokenizer", "load_prompt_tokenizer") in imported


def test_the_router_imports_no_torch_while_it_tokenizes(tmp_path):
    write_plain_tokenizer(tmp_path)
    assert "torch" not in modules_loaded_after(router_tokenizer_script(str(tmp_path)))


@pytest.mark.model
def test_the_router_imports_no_torch_with_the_default_models_tokenizer():
    from tandem.model_files import resolve_model

    loaded = modules_loaded_after(router_tokenizer_script(str(resolve_model(None))))
    assert "torch" not in loaded


def test_the_library_imports_no_service():
    offenders = []
    for path in sorted((ROOT / "tandem").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} imports {name}"
                          for name in names if name.split(".")[0] in SERVICES]
    assert not offenders, offenders


def test_the_routing_core_imports_neither_grpc_nor_torch():
    loaded = modules_loaded_after("import router_svc.policies, router_svc.worker_view, router_svc.replacement")
    assert not loaded & {"grpc", "torch"}, sorted(loaded & {"grpc", "torch"})


def imported_modules(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def test_the_router_imports_nothing_from_the_engine():
    offenders = [f"{path.relative_to(ROOT)}:{line} imports {name}"
                 for path in sorted((ROOT / "router_svc").rglob("*.py"))
                 for line, name in imported_modules(path) if name == "tandem.engine" or name.startswith("tandem.engine.")]
    assert not offenders, offenders
    loaded = modules_loaded_after(f"{ROUTER_IMPORTS}\nimport sys\n"
                                  "assert not [m for m in sys.modules if m.startswith('tandem.engine')], "
                                  "sorted(m for m in sys.modules if m.startswith('tandem.engine'))")
    assert "router_svc" in loaded


def attribute_chains_from_self(path: Path) -> list[tuple[int, str]]:
    """``self.a.b.c`` chains (three or more names past ``self``), outermost only."""
    chains, inner = [], set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue
        names, value = [node.attr], node.value
        while isinstance(value, ast.Attribute):
            inner.add(id(value))
            names.append(value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id == "self" and len(names) >= 3:
            chains.append((node.lineno, "self." + ".".join(reversed(names))))
    return chains


@pytest.mark.parametrize("module", ["tandem/engine/engine.py", "tandem/engine/async_engine.py"])
def test_the_engine_and_its_loop_reach_one_object_down_at_most(module):
    reaching = attribute_chains_from_self(ROOT / module)
    assert not reaching, reaching


def test_the_reach_check_sees_a_chain(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("class A:\n    def f(self):\n        return self.engine.scheduler.pool.subscribe()\n")
    assert attribute_chains_from_self(sample) == [(3, "self.engine.scheduler.pool.subscribe")]

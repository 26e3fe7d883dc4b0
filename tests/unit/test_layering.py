"""Dependencies point down: services import the library, never the reverse; the router never imports torch."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("router_svc", "cpu_worker", "gpu_worker")
# What `python -m router_svc` imports before it serves, and how it loads its tokenizer.
ROUTER_IMPORTS = "import router_svc.__main__, router_svc.servicer, router_svc.backends, router_svc.policy"


def modules_loaded_after(code: str) -> set[str]:
    """Top-level packages in sys.modules after running ``code`` in a fresh interpreter."""
    script = textwrap.dedent(code) + "\nimport json, sys\nprint(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return set(json.loads(result.stdout.splitlines()[-1]))


def router_tokenizer_script(model_dir: str) -> str:
    return f"""
        {ROUTER_IMPORTS}
        from tandem.engine.model.tokenizer import load_prompt_tokenizer
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
    assert ("tandem.engine.model.tokenizer", "load_prompt_tokenizer") in imported
    assert not any(module == "tandem.engine.model.factory" for module, _ in imported)


def test_the_router_imports_no_torch_while_it_tokenizes(tmp_path):
    write_plain_tokenizer(tmp_path)
    assert "torch" not in modules_loaded_after(router_tokenizer_script(str(tmp_path)))


@pytest.mark.model
def test_the_router_imports_no_torch_with_the_default_models_tokenizer():
    from tandem.engine.model.loader import resolve_model

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
    loaded = modules_loaded_after("import router_svc.routing")
    assert not loaded & {"grpc", "torch"}, sorted(loaded & {"grpc", "torch"})

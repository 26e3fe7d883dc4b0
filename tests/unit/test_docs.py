"""The documentation holds together: README.md and docs/*.md link only to files and headings that exist, the
README stays a short entry point, and docs/configuration.md lists exactly the flags the services accept."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
CONFIGURATION = REPO / "docs" / "configuration.md"

ROUTER_SECTION = "Router (`router_svc`)"
WORKER_SECTION = "Workers (`cpu_worker`, `gpu_worker`)"

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_INLINE_CODE = re.compile(r"`+[^`]*`+")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
_ENV = re.compile(r"\b[A-Z][A-Z0-9]*_[A-Z0-9_]+\b")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: lower case, punctuation dropped but hyphens (and, as GitHub keeps
    them, underscores), each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file; a repeated slug gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    result = set()
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def links(path: Path) -> list[str]:
    """The targets of every inline link and image outside code."""
    targets = []
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        targets.extend(_LINK.findall(_INLINE_CODE.sub("", line)))
    return targets


def broken_links(path: Path) -> list[str]:
    problems = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            problems.append(f"{target}: {linked.relative_to(REPO) if linked.is_relative_to(REPO) else linked} "
                            "does not exist")
        elif anchor and (linked.suffix != ".md" or anchor not in anchors(linked)):
            problems.append(f"{target}: no heading #{anchor} in {linked.name}")
    return problems


# --- the link checker itself, on made-up files -----------------------------------------------------------------


def test_slugs_follow_githubs_rule():
    assert slug("Router gRPC: tandem.v1.Router") == "router-grpc-tandemv1router"
    assert slug("Workers (`cpu_worker`, `gpu_worker`)") == "workers-cpu_worker-gpu_worker"
    assert slug("Soak: `make soak`") == "soak-make-soak"
    assert slug("The finish_time model") == "the-finish_time-model"
    assert slug("A / B") == "a--b"


def test_the_checker_finds_broken_files_and_anchors(tmp_path):
    (tmp_path / "other.md").write_text("# Title\n\n## Part\n\n## Part\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n## Here\n\n"
        "[ok](other.md) [ok](other.md#part) [ok](other.md#part-1) [ok](#here) [web](https://example.com/x#y)\n"
        "[missing file](nowhere.md) [missing anchor](other.md#part-2) [missing here](#there)\n"
        "`[in code](nowhere-either.md)`\n\n```\n[in a block](nor-this.md)\n```\n",
        encoding="utf-8")
    assert anchors(tmp_path / "other.md") == {"title", "part", "part-1"}
    problems = broken_links(page)
    assert len(problems) == 3, problems
    assert any("nowhere.md" in p for p in problems)
    assert any("#part-2" in p for p in problems)
    assert any("#there" in p for p in problems)


# --- the repository's documentation ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(path):
    assert broken_links(path) == []


def test_the_docs_that_the_readme_indexes_exist():
    names = {"architecture.md", "routing.md", "api.md", "configuration.md", "operations.md", "benchmarks.md",
             "engines.md"}
    assert names <= {path.name for path in DOCS}
    linked = {Path(target.partition("#")[0]).name for target in links(README) if target.startswith("docs/")}
    assert names <= linked


def test_the_readme_is_a_short_entry_point():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines"
    long = [(number, len(line)) for number, line in enumerate(lines, 1) if len(line) > 400]
    assert long == [], f"lines over 400 characters (line, length): {long}"


# --- docs/configuration.md against the argument parsers -------------------------------------------------------


def parser_flags(parser: argparse.ArgumentParser) -> dict[str, str | None]:
    """Each long option of ``parser`` (but --help) and the environment variable it falls back to, or None."""
    env_of_dest = {dest: env for env, dest in getattr(parser, "env_vars", {}).items()}
    flags = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        for option in action.option_strings:
            if option.startswith("--"):
                flags[option] = env_of_dest.get(action.dest)
    return flags


def documented_flags(section: str) -> dict[str, set[str]]:
    """The flags named in the first column of the tables under the ``## section`` heading of
    docs/configuration.md, each with the environment variables named in its row's second column."""
    lines = _prose_lines(CONFIGURATION.read_text(encoding="utf-8"))
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == f"## {section}")
    except StopIteration:
        pytest.fail(f"docs/configuration.md has no section '## {section}'")
    flags: dict[str, set[str]] = {}
    for line in lines[start + 1:]:
        if line.startswith("## "):
            break
        if not line.startswith("|"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        for flag in _FLAG.findall(cells[0]):
            assert flag not in flags, f"{flag} is listed twice in '{section}'"
            flags[flag] = set(_ENV.findall(cells[1])) if len(cells) > 1 else set()
    return flags


def router_parser() -> argparse.ArgumentParser:
    from router_svc import config

    return config.build_parser()


def worker_parser(kind: str, port: int) -> argparse.ArgumentParser:
    from tandem.worker import config

    return config.build_parser(kind, port)


def compare(section: str, parser: argparse.ArgumentParser) -> None:
    accepted = parser_flags(parser)
    documented = documented_flags(section)
    assert accepted, "the parser has no flags"
    missing = sorted(set(accepted) - set(documented))
    unknown = sorted(set(documented) - set(accepted))
    assert not missing and not unknown, (f"'{section}' in docs/configuration.md: not documented {missing}; "
                                         f"documented but not accepted {unknown}")
    wrong_env = {flag: (sorted(documented[flag]), env) for flag, env in accepted.items()
                 if documented[flag] != ({env} if env else set())}
    assert wrong_env == {}, f"'{section}': flag -> (documented env vars, the parser's env var): {wrong_env}"


def test_the_router_table_lists_exactly_the_routers_flags():
    compare(ROUTER_SECTION, router_parser())


@pytest.mark.parametrize("kind, port", [("cpu", 50061), ("gpu", 50062)])
def test_the_worker_table_lists_exactly_each_workers_flags(kind, port):
    compare(WORKER_SECTION, worker_parser(kind, port))


def test_the_flag_comparison_notices_a_missing_or_extra_flag():
    parser = router_parser()
    parser.add_argument("--not-documented-anywhere")
    with pytest.raises(AssertionError, match="not-documented-anywhere"):
        compare(ROUTER_SECTION, parser)
    only_one = argparse.ArgumentParser()
    only_one.add_argument("--host")
    with pytest.raises(AssertionError, match="documented but not accepted"):
        compare(ROUTER_SECTION, only_one)

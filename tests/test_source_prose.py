"""The source's prose states facts a reader can use: the method, its complexity, departures from the paper and the
reason for a default. Timings, speed ratios and the cards they came from belong in results/ (the CSVs), and a
reference must point at something a user has (a paper, a public repository, an issue, docs/). Scanned: the comments
and docstrings of every .py file under lra/, models/ and hydra_plugins/, and the comments of lra/conf's YAML.
String literals the code uses (a log line, a data source's name) are code, not prose, and are not scanned."""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("lra", "models", "hydra_plugins")

NUMBER = r"(?<![\w.])(?<!Table )(?<!Figure )\d[\d.,]*"  # a figure, not a table's or a figure's number
RULES = {
    "a device name": re.compile(r"\b(?:GH|[ABHV])\d00\b|\bRTX\b"),
    "the word 'lease'": re.compile(r"\bleases?\b", re.IGNORECASE),
    "a speed figure": re.compile(
        NUMBER + r"\s*(?:ms|µs|us|s/step|steps/s|it/s|img/s|images/s|examples/s|tokens/s)(?!\w)"
        r"|" + NUMBER + r"\s*[GT]FLOP"
        r"|" + NUMBER + r"\s*(?:x|times|%)\s+(?:faster|slower)\b",
        re.IGNORECASE),
    "a private document": re.compile(r"\b(?:PEERS|LRA)\.md\b|/work/shared\b|\.\./shared/"),
}
# True technical terms that collide with a rule: each one is removed from the prose before the rules run.
ALLOWED = (
    "peers_h200_layer",  # results/published.csv's name for the stored public-package rows: a data key
)


def python_prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and every docstring (a string standing alone as a statement) of a module."""
    prose = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            prose += [(node.lineno + i, line) for i, line in enumerate(node.value.value.splitlines())]
    return prose


def yaml_prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every YAML comment: from a ``#`` that starts the line or follows a space, to its end."""
    return [(i, m.group(1)) for i, line in enumerate(source.splitlines(), 1)
            if (m := re.search(r"(?:^|\s)(#.*)$", line))]


def source_files() -> list[Path]:
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    return files + sorted((ROOT / "lra" / "conf").rglob("*.yaml"))


def violations(rule: re.Pattern, files: list[Path]) -> list[str]:
    found = []
    for path in files:
        source = path.read_text(encoding="utf-8")
        for line, text in (python_prose(source) if path.suffix == ".py" else yaml_prose(source)):
            for term in ALLOWED:
                text = text.replace(term, "")
            if match := rule.search(text):
                found.append(f"{path.relative_to(ROOT)}:{line}: {match.group(0)!r} in {text.strip()[:100]!r}")
    return found


def test_the_scan_covers_the_packages():
    files = source_files()
    assert {p.relative_to(ROOT).parts[0] for p in files} == set(PACKAGES)
    assert ROOT / "models" / "transformer.py" in files and ROOT / "lra" / "conf" / "config.yaml" in files


@pytest.mark.parametrize("what", RULES)
def test_prose_has_no(what):
    found = violations(RULES[what], source_files())
    assert not found, f"{len(found)} comment or docstring line(s) with {what}:\n" + "\n".join(found)


def test_the_scan_reads_comments_and_docstrings_not_code():
    source = '"""On an H100."""\nx = "H200"  # 3.4 ms\ndef f():\n    """1.5x faster."""\n    return "a lease"\n'
    prose = python_prose(source)
    assert sorted(line for line, _ in prose) == [1, 2, 4]
    hits = {what for what, rule in RULES.items() for _, text in prose if rule.search(text)}
    assert hits == {"a device name", "a speed figure"}
    yaml = "a: 1  # 20 steps/s\nb: '${now:%H}'\n# on an A100\n"
    assert yaml_prose(yaml) == [(1, "# 20 steps/s"), (3, "# on an A100")]


@pytest.mark.parametrize("text, what", [
    ("13.8 ms with Triton 3.6", "a speed figure"), ("33.2 steps/s packed", "a speed figure"),
    ("ran 1.19x faster than sdpa", "a speed figure"), ("14% faster", "a speed figure"),
    ("2-3x slower", "a speed figure"), ("~34 images/s/core", "a speed figure"), ("312 TFLOPS", "a speed figure"),
    ("an A100's 164 KiB", "a device name"), ("an RTX 4090", "a device name"),
    ("from one lease to the next", "the word 'lease'"), ("see PEERS.md", "a private document"),
    ("(../shared/data/imdb)", "a private document"),
])
def test_each_rule_catches_its_case(text, what):
    assert RULES[what].search(text)


@pytest.mark.parametrize("text", [
    "released", "the lra_release folder", "ms_fwd_bwd", "O(N m Dh)", "64x fewer keys per query", "sm_90",
    "fp32 matmuls run at half of bf16's rate", "peak MB", "x = training examples/s at one length (4K)",
    "x = Table 2 steps/s at ``length`` x 32",
])
def test_no_rule_catches_technical_prose(text):
    assert not [what for what, rule in RULES.items() if rule.search(text)]

"""The docs a newcomer acts on: every Python snippet in the README runs on the tiny model `make
demo` writes, and every relative link in the Markdown files points at a file that exists."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
DOCS = sorted([ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "CHANGELOG.md",
               *(ROOT / "docs").glob("*.md")])  # fmt: skip
SNIPPET = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def readme_snippets() -> list[str]:
    return SNIPPET.findall((ROOT / "README.md").read_text())


def test_the_readme_has_python_snippets():
    assert len(readme_snippets()) >= 2  # the LLM and the AsyncLLM ones


@pytest.mark.parametrize("index", range(len(readme_snippets())))
def test_every_readme_python_snippet_runs_on_the_tiny_model(make_tiny, tmp_path, index):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "tiny-llama").symlink_to(make_tiny("llama"))  # where `make demo` writes it
    script = tmp_path / "snippet.py"
    script.write_text(readme_snippets()[index])
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                            text=True, env=env, timeout=300)  # fmt: skip
    assert result.returncode == 0, f"README snippet {index} failed:\n{result.stderr[-3000:]}"
    assert result.stdout.strip(), "the snippet printed nothing"


def relative_links(path: Path) -> list[str]:
    links = LINK.findall(path.read_text())
    return [link for link in links if not re.match(r"[a-z]+:|#", link)]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_at_a_file_in_the_repo(path):
    assert path.is_file(), path
    for link in relative_links(path):
        target = (path.parent / link.split("#")[0]).resolve()
        assert target.exists(), f"{path.relative_to(ROOT)}: {link} does not exist"
        assert ROOT in target.parents, f"{path.relative_to(ROOT)}: {link} is outside the repo"


def test_the_docs_cite_nothing_outside_the_repo():
    for path in DOCS:
        text = path.read_text()
        assert "../shared" not in text and "/work/" not in text, path


def test_benchmarks_has_the_workloads_the_current_table_and_the_feature_wave_section():
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert "## Workloads" in text and "## Feature wave (2026-12)" in text
    header = next(
        line for line in text.splitlines() if line.startswith("| workload | tandem async")
    )
    for column in ("tandem sync", "vLLM 0.26", "transformers 5.17", "roofline"):
        assert column in header
    for workload in ("seed", "small", "latency"):
        assert re.search(rf"^\| {workload} \|", text, re.M), workload
        assert re.search(rf"# {workload}$", text, re.M), f"no command for {workload}"

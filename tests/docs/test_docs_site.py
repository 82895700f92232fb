"""The documentation site builds with warnings as errors, and what it quotes is still true: the README's
quick start is the example file the tests run, the porting diff is the diff of the two files it is of,
and every message the troubleshooting page quotes is still one elasticd can print."""

from __future__ import annotations

import ast
import difflib
import os
import re
import subprocess
import sys
from pathlib import Path

from util import REPO

EXAMPLES = REPO / "examples"


def test_the_site_builds_strict(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}{proc.stderr}"
    cli_page = (tmp_path / "site" / "cli" / "index.html").read_text()
    from elasticd.cli import _COMMANDS

    for command in _COMMANDS:   # the reference is generated from the click commands: each has its section
        assert f'id="{command}"' in cli_page, command


def test_every_page_is_in_the_site_s_navigation() -> None:
    nav = set(re.findall(r":\s*([\w-]+\.md)\s*$", (REPO / "mkdocs.yml").read_text(), re.M))
    pages = {p.name for p in (REPO / "docs").glob("*.md")}
    assert pages == nav, f"pages not in the nav: {pages - nav}; nav entries with no page: {nav - pages}"


def _blocks(markdown: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```$", markdown, re.S | re.M)


def test_the_readme_quick_start_is_the_example_the_tests_run() -> None:
    readme = (REPO / "README.md").read_text()
    assert _blocks(readme, "python")[0] == (EXAMPLES / "quickstart.py").read_text()
    assert '--8<-- "examples/quickstart.py"' in (REPO / "docs" / "getting-started.md").read_text()


def test_the_porting_diff_is_the_diff_of_the_two_files() -> None:
    port = EXAMPLES / "port"
    before, after = (port / "train_ddp.py").read_text(), (port / "train_elastic.py").read_text()
    want = "".join(difflib.unified_diff(before.splitlines(True), after.splitlines(True), "train_ddp.py",
                                        "train_elastic.py"))
    # `diff -u` writes its hunk headers without a trailing space after the file names, as difflib does.
    assert (port / "port.diff").read_text() == want, "examples/port/port.diff is stale: regenerate it with " \
        "`diff -u --label train_ddp.py --label train_elastic.py train_ddp.py train_elastic.py > port.diff`"


def _source_strings() -> list[str]:
    """Every string literal and f-string of elasticd's code, f-string fields as `{}`."""
    out = []
    for root in (REPO / "elasticd", REPO / "agent"):
        for path in root.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.JoinedStr):
                    out.append("".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values))
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    out.append(node.value)
    return out


def test_every_message_troubleshooting_quotes_is_still_printed() -> None:
    page = (REPO / "docs" / "troubleshooting.md").read_text()
    quoted = re.findall(r"\*\*`([^`]+)`\*\*", page)
    assert len(quoted) >= 15, quoted
    strings = _source_strings()
    stale = [q for q in quoted if not any(q in s for s in strings)]
    assert not stale, f"docs/troubleshooting.md quotes messages elasticd no longer prints: {stale}"


def test_the_metric_list_is_the_one_the_code_exports() -> None:
    from elasticd.observe.metrics import markdown_table

    page = (REPO / "docs" / "observability.md").read_text()
    shown = "\n".join(line.strip() for line in page.splitlines())
    assert markdown_table() in shown, "docs/observability.md's metric table differs from markdown_table(): " \
        "paste its output there"

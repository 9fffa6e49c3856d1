"""The documentation site's hooks (scripts/mkdocs_hooks.py): links written as in the
repository reach the site page or the repository file, a link to nothing is left for the
strict build to fail on, and an undocumented object an API page renders is found."""

from __future__ import annotations

import textwrap
from pathlib import Path
from types import SimpleNamespace

import griffe
from scripts import load_script  # tests/helpers/scripts.py

hooks = load_script("scripts/mkdocs_hooks.py")
PAGES = {"benchmarks/RESULTS.md": "results.md", "src/egeria/policies/SMARTFRZ.md": "policies/smartfrz.md"}


def render(markdown: str, uri: str, repo_url: str | None = None) -> str:
    page = SimpleNamespace(file=SimpleNamespace(src_uri=uri))
    config = SimpleNamespace(extra={"repo_pages": PAGES}, repo_url=repo_url)
    return hooks.on_page_markdown(markdown, page, config, files=None)


def test_links_reach_site_pages_from_repository_pages_and_from_docs() -> None:
    assert render("[r](../docs/decisions/023-mlperf-target.md#evidence)", "results.md") == \
        "[r](decisions/023-mlperf-target.md#evidence)"
    assert render("[card](smartfrz.md) [res](../../benchmarks/RESULTS.md#a)", "policies/egeria.md") == \
        "[card](smartfrz.md) [res](../results.md#a)"
    assert render("[index](../decisions/README.md)", "guides/ddp.md") == "[index](../decisions/README.md)"


def test_links_to_repository_files_become_code_or_web_links_and_broken_ones_stay() -> None:
    assert render("[runs](results/demo/amd-epyc/)", "results.md") == "runs (`benchmarks/results/demo/amd-epyc/`)"
    assert render("[x](results/demo/amd-epyc/)", "results.md", repo_url="https://example.org/egeria") == \
        "[x](https://example.org/egeria/tree/main/benchmarks/results/demo/amd-epyc)"
    assert render("[demo/amd-epyc/](results/demo/amd-epyc/)", "results.md") == "`benchmarks/results/demo/amd-epyc/`"
    assert render("[gone](results/no-such-folder/)", "results.md") == "[gone](results/no-such-folder/)"


def test_an_undocumented_method_or_field_is_found(tmp_path: Path) -> None:
    (tmp_path / "tinypkg").mkdir()
    (tmp_path / "tinypkg" / "__init__.py").write_text(textwrap.dedent('''
        """A package."""
        class Documented:
            """A class."""
            size: int = 1
            """Its size."""
            count: int = 2

            def run(self):
                """Runs."""

            def stop(self):
                pass
        '''))
    hooks._GRIFFE["tinypkg"] = griffe.load("tinypkg", search_paths=[str(tmp_path)])
    assert hooks._undocumented("tinypkg.Documented", set()) == ["tinypkg.Documented.stop"]
    assert hooks._undocumented("tinypkg.Documented", {"tinypkg.Documented"}) == \
        ["tinypkg.Documented.count", "tinypkg.Documented.stop"]

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


roles = load_script("scripts/griffe_roles.py")


def test_sphinx_roles_become_links_where_the_target_is_rendered_and_code_elsewhere(tmp_path: Path) -> None:
    (tmp_path / "rolepkg").mkdir()
    (tmp_path / "rolepkg" / "__init__.py").write_text(textwrap.dedent('''
        """A package."""
        from .core import Engine, helper
        __all__ = ["Engine"]
        '''))
    (tmp_path / "rolepkg" / "core.py").write_text(textwrap.dedent('''
        """The core."""
        class Base:
            def save(self):
                """Saves."""

        class Engine(Base):
            """Runs; see :meth:`step`, :meth:`save`, :class:`~rolepkg.Engine` and :func:`helper`.

            Usage::

                Engine().step()
            """
            def step(self):
                """One step of :class:`Engine`, then :mod:`rolepkg.core`."""

        def helper():
            """Helps."""
        '''))
    package = griffe.load("rolepkg", search_paths=[str(tmp_path)], resolve_aliases=True)
    ids = roles.rendered_ids(package, ["rolepkg.Engine"])
    assert ids["rolepkg.core.Base.save"] == "rolepkg.Engine.save"  # inherited: rendered on Engine
    engine = package["core.Engine"]
    assert roles.rewrite(engine.docstring.value, engine, package, ids).splitlines()[:3] == [
        "Runs; see [`step`][rolepkg.Engine.step], [`save`][rolepkg.Engine.save], [`Engine`][rolepkg.Engine] "
        "and `helper`.", "", "Usage:"]
    step = engine.members["step"]
    assert roles.rewrite(step.docstring.value, step, package, ids) == \
        "One step of [`Engine`][rolepkg.Engine], then `rolepkg.core`."


def test_the_site_renders_no_literal_role_and_the_inherited_checkpoint_methods() -> None:
    import re

    names = roles.directives()
    assert "egeria.Egeria" in names and "egeria.EgeriaConfig" in names
    package = griffe.load("egeria", search_paths=[str(roles.ROOT / "src")], resolve_aliases=True)
    ids = roles.rendered_ids(package, names)
    for method in ("save", "load", "dcp_state", "cache_loader", "state_dict", "load_state_dict"):
        assert f"egeria.Egeria.{method}" in ids.values(), method
    left = []
    for obj in roles._objects(package):
        if obj.docstring is not None:
            text = roles.rewrite(obj.docstring.value, obj, package, ids)
            left += [f"{obj.path}: {m}" for m in re.findall(r":\w+:`[^`]*`", text)]
    assert left == [], f"roles the rewrite leaves literal: {left[:5]}"

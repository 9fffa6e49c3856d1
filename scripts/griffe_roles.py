"""A Griffe extension of the documentation site (``mkdocs.yml``: the python handler's
``extensions``): the docstrings' Sphinx roles become links of the site.

The docstrings are written for readers of the code, in Sphinx's roles (``:class:`~egeria.EgeriaConfig```,
``:meth:`step```), which Markdown would show as literal text. Before the API pages render,
each role is rewritten in the loaded docstrings (never in the source):

- to a cross-reference, ``[`EgeriaConfig`][egeria.EgeriaConfig]``, where its target, looked up
  as Python would from the object that holds the docstring (its class, its module, their
  imports), is an object an API page renders (a ``::: name`` directive of ``docs/``, or one of
  the rendered class's public members, inherited ones included);
- to code, `` `EgeriaConfig` ``, where it is not (a private helper, a benchmark module), so
  that no link leads nowhere.

A ``~`` shows the last name only, as in Sphinx. A reST literal block's ``Usage::`` becomes
``Usage:`` (the indented block below it is already Markdown's code block).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import griffe

ROOT = Path(__file__).resolve().parents[1]
ROLE = re.compile(r":(?:class|meth|func|mod|data|attr|obj|exc|const):`(~?)\.?([\w.]+)(?:\(\))?`")
DIRECTIVE = re.compile(r"^::: ([\w.]+)", re.M)
LITERAL = re.compile(r"(\w)::$", re.M)


def directives(docs: Path = ROOT / "docs") -> list[str]:
    """The objects the site's pages render, by the names their ``:::`` directives give."""
    return sorted({name for page in docs.rglob("*.md") for name in DIRECTIVE.findall(page.read_text())})


def _target(obj: Any) -> Any:
    """``obj`` with an alias followed to what it names; None where that is outside the package."""
    try:
        return obj.final_target if obj.is_alias else obj
    except (griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None


def _member(scope: Any, name: str) -> Any:
    scope = _target(scope)
    if scope is None:
        return None
    members = scope.all_members if scope.is_class else scope.members
    return members.get(name)


def _walk(scope: Any, dotted: str) -> Any:
    obj = scope
    for part in dotted.split("."):
        obj = _member(obj, part)
        if obj is None:
            return None
    return _target(obj)


def rendered_ids(package: Any, names: list[str]) -> dict[str, str]:
    """Canonical path -> the identifier under which the site renders that object, for every
    directive's object and the public members of a directive's class, inherited ones included."""
    ids: dict[str, str] = {}
    for name in names:
        if name.split(".")[0] != package.name:
            continue
        obj = _walk(package, name.partition(".")[2]) if "." in name else package
        if obj is None:
            continue
        ids.setdefault(obj.canonical_path, name)
        if obj.is_class:
            for member_name, member in obj.all_members.items():
                member = _target(member)
                if member is not None and not member_name.startswith("_"):
                    ids.setdefault(member.canonical_path, f"{name}.{member_name}")
    return ids


def resolve(holder: Any, package: Any, dotted: str) -> Any:
    """The object ``dotted`` names in a docstring of ``holder``: an absolute path in the
    package, else a name seen from ``holder``, its parents up to its module, or the package."""
    if dotted.split(".")[0] == package.name:
        return _walk(package, dotted.partition(".")[2]) if "." in dotted else package
    scope = holder
    while scope is not None:
        found = _walk(scope, dotted)
        if found is not None:
            return found
        scope = scope.parent
    return None


def rewrite(text: str, holder: Any, package: Any, ids: dict[str, str]) -> str:
    """``text`` with its roles made links (where the target is rendered) or code."""

    def replace(match: re.Match) -> str:
        short, dotted = match.groups()
        shown = dotted.rsplit(".", 1)[-1] if short else dotted
        found = resolve(holder, package, dotted)
        identifier = ids.get(found.canonical_path) if found is not None else None
        return f"[`{shown}`][{identifier}]" if identifier else f"`{shown}`"

    return LITERAL.sub(r"\1:", ROLE.sub(replace, text))


def _objects(obj: Any) -> Iterator[Any]:
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _objects(member)


class SphinxRoles(griffe.Extension):
    """Rewrites the roles of every docstring of a loaded package (see the module's docstring)."""

    def on_package(self, *, pkg: Any, loader: Any, **kwargs: Any) -> None:
        ids = rendered_ids(pkg, directives())
        for obj in _objects(pkg):
            if obj.docstring is not None:
                obj.docstring.value = rewrite(obj.docstring.value, obj, pkg, ids)

"""MkDocs hooks of the documentation site (``mkdocs.yml``: ``hooks``).

- Repository pages that live outside ``docs/`` (``extra.repo_pages``: repository path ->
  site path) join the site as they are, so the results page, the benchmarks index, the
  SmartFRZ card and the architecture map are written once.
- Links are written as in the repository (relative to the file that holds them) and
  rewritten here: to the site page where the target is one, else, for a repository file or
  folder that exists (a run file, a result folder, code), to the repository on the web
  (``repo_url``) or, without one, to its path as code. A link to nothing is left alone, so
  ``mkdocs build --strict`` fails on it.
- Every object an API page renders with ``::: name`` must have a docstring, and so must a
  class's own public methods and properties (a policy's interface methods are documented
  once, on ``egeria.policies.FreezePolicy``) and, for the classes ``extra.attribute_docs``
  names, every public attribute: one missing is a warning, which fails the strict build.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

log = logging.getLogger("mkdocs.hooks.egeria")
ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")
DIRECTIVE = re.compile(r"^::: ([\w.]+)", re.M)


def _pages(config) -> dict[str, str]:
    return dict(config.extra.get("repo_pages") or {})


def on_files(files, config):
    for repo_path, uri in _pages(config).items():
        files.append(File.generated(config, uri, abs_src_path=str(ROOT / repo_path)))
    return files


def _site_uri(repo_path: str, pages: dict[str, str]) -> str | None:
    """The site path of a repository path, or None where it is not on the site."""
    if repo_path in pages:
        return pages[repo_path]
    if repo_path == "docs" or repo_path.startswith("docs/"):
        inside = repo_path[len("docs/"):]
        target = ROOT / repo_path
        if target.is_dir() and (target / "README.md").is_file():
            return posixpath.join(inside, "README.md")
        if target.is_file():
            return inside
    return None


def _rewrite(match: re.Match, page_repo: str, page_uri: str, pages: dict[str, str], repo_url: str | None) -> str:
    bang, text, target = match.groups()
    if "://" in target or target.startswith(("#", "mailto:")):
        return match.group(0)
    path, _, anchor = target.partition("#")
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(page_repo), path)) if path else page_repo
    uri = _site_uri(resolved, pages)
    if uri is not None:
        rel = posixpath.relpath(uri, posixpath.dirname(page_uri) or ".")
        return f"{bang}[{text}]({rel}{'#' + anchor if anchor else ''})"
    where = ROOT / resolved
    if resolved.startswith("..") or not where.exists():
        return match.group(0)  # a broken link: mkdocs warns
    if repo_url:
        kind = "tree" if where.is_dir() else "blob"
        return f"{bang}[{text}]({repo_url.rstrip('/')}/{kind}/main/{resolved})"
    shown = resolved + ("/" if where.is_dir() else "")
    named = text.strip("`").rstrip("/")
    return f"`{shown}`" if named and resolved.endswith(named) else f"{text} (`{shown}`)"


def on_page_markdown(markdown, page, config, files):
    pages = _pages(config)
    uri = page.file.src_uri
    repo = {v: k for k, v in pages.items()}.get(uri, "docs/" + uri)
    markdown = LINK.sub(lambda m: _rewrite(m, repo, uri, pages, config.repo_url), markdown)
    for name in DIRECTIVE.findall(markdown):
        for missing in _undocumented(name, set(config.extra.get("attribute_docs") or ())):
            log.warning("%s renders %s, which has no docstring", uri, missing)
    return markdown


_GRIFFE: dict = {}


def _find(name: str):
    import griffe

    top = name.split(".")[0]
    if top not in _GRIFFE:
        _GRIFFE[top] = griffe.load(top, search_paths=[str(ROOT / "src")], resolve_aliases=True)
    obj = _GRIFFE[top]
    for part in name.split(".")[1:]:
        obj = obj.members[part]
    return obj.final_target if obj.is_alias else obj


def _undocumented(name: str, attribute_docs: set[str]) -> list[str]:
    """``name`` and those of its public members (its own, not inherited) that must have a
    docstring and have none."""
    obj = _find(name)
    interface = {m.name for m in _find("egeria.policies.FreezePolicy").members.values() if m.docstring}
    missing = [] if obj.docstring else [obj.path]
    if obj.is_module:  # the names it exports
        for export in sorted(obj.exports or ()):
            member = obj.members.get(export)
            member = member.final_target if (member is not None and member.is_alias) else member
            if member is not None and not member.docstring:
                missing.append(f"{obj.path}.{export}")
    elif obj.is_class:  # its own public methods and properties; attributes where asked
        for member in obj.members.values():
            if member.name.startswith("_") or member.is_alias or member.docstring or member.name in interface:
                continue
            if member.is_function or "property" in member.labels or name in attribute_docs:
                missing.append(member.path)
    return missing

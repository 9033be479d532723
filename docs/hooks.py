"""MkDocs hooks: the benchmarks' result files (bench/results/) are published with the docs, so a page links to
one by its path in the repository (``../../bench/results/x.md``, right when read on disk or on a forge too) and
``mkdocs build --strict`` checks that the file exists."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parents[1]
PUBLISHED = ("bench/results",)
LINK = re.compile(r"\]\(((?:\.\./)+[^)#\s]*)")


def on_files(files, config):
    """Adds every file under PUBLISHED to the site, at its path in the repository."""
    for folder in PUBLISHED:
        for path in sorted((REPO / folder).rglob("*")):
            if path.is_file():
                files.append(File(path.relative_to(REPO).as_posix(), src_dir=str(REPO), dest_dir=config.site_dir,
                                  use_directory_urls=config.use_directory_urls))
    return files


def on_page_markdown(markdown, page, config, files):
    """Rewrites a link that leaves docs/ for a PUBLISHED file into the site's path of that file; any other link
    that leaves docs/ is left as it is, for the strict build to refuse."""
    docs = Path(config.docs_dir).resolve().relative_to(REPO).as_posix()
    here = posixpath.dirname(f"{docs}/{page.file.src_uri}")

    def into_site(match: re.Match) -> str:
        target = posixpath.normpath(posixpath.join(here, match.group(1)))
        if not target.startswith(tuple(f"{folder}/" for folder in PUBLISHED)):
            return match.group(0)
        return "](" + posixpath.relpath(target, posixpath.dirname(page.file.src_uri))

    return LINK.sub(into_site, markdown)

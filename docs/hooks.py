"""MkDocs hook: the published benchmark plots, served from where they live.

The pages link to `../benchmarks/results/<name>.png`, a path that works on GitHub
and in a checkout. This hook adds those PNGs to the site as `benchmarks/results/...`
(read in place, never copied into `docs/`) and points the links there.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
SITE_DIR = "benchmarks/results/"


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add every published plot (not the `-quick` ones of smoke runs) to the site."""
    for png in sorted(RESULTS.glob("*.png")):
        if not png.stem.endswith("-quick"):
            files.append(File.generated(config, SITE_DIR + png.name, abs_src_path=str(png)))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """`](../benchmarks/results/` (from the repository's layout) to the plots in the site."""
    depth = page.file.src_uri.count("/")
    return markdown.replace("](" + "../" * (depth + 1) + SITE_DIR, "](" + "../" * depth + SITE_DIR)

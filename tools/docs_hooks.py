"""MkDocs hooks (``hooks:`` in mkdocs.yml): what the site shows from outside docs/, read from its source at every
build so that it never drifts from it.

- A page line ``<!-- generated: KEY -->`` is replaced by the text ``GENERATED[KEY]`` makes: the real ``--help``
  output of the ``fabriclite`` command (by calling ``fabriclite.cli.main``, as the console script does), the table
  of peak FLOP/s that MFU is computed against, or a Markdown file of the repository without its title line
  (BENCHMARKS.md, the ViT series' results.md).
- ``ASSETS`` puts files of the repository into the site under a docs path (the ViT chart), so pages link to them
  and ``mkdocs build --strict`` checks those links like any other.

Usage: nothing to call; ``mkdocs build`` and ``mkdocs serve`` run ``on_files`` and ``on_page_markdown``.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path
from typing import Callable

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!-- generated: (.+?) -->$", re.MULTILINE)
HELP_COLUMNS = "100"  # argparse wraps to the terminal's width; the site shows one fixed width


def command_help(*args: str) -> str:
    """``fabriclite ARGS --help`` exactly as the command prints it, in a fenced text block."""
    from fabriclite.cli import main

    output = io.StringIO()
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        with contextlib.redirect_stdout(output), contextlib.suppress(SystemExit):
            main([*args, "--help"])
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    return f"```text\n$ fabriclite {' '.join([*args, '--help'])}\n{output.getvalue().rstrip()}\n```"


def markdown_without_title(path: str) -> str:
    """A Markdown file of the repository, without its first-level title (the page including it has its own)."""
    lines = (ROOT / path).read_text(encoding="utf-8").splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    return "\n".join(lines).strip() + "\n"


def peak_flops_table() -> str:
    """``fabriclite.throughput.PEAK_FLOPS`` as a Markdown table, in TFLOP/s."""
    import torch

    from fabriclite.throughput import PEAK_FLOPS

    columns = {
        torch.float64: "fp64",
        torch.float32: "fp32",
        "tf32": "tf32",
        torch.bfloat16: "bf16",
        torch.float16: "fp16",
    }
    lines = ["| GPU name contains | " + " | ".join(columns.values()) + " |", "|---|" + "---:|" * len(columns)]
    for pattern, peaks in PEAK_FLOPS:
        cells = [f"{peaks[key] / 1e12:g}" if key in peaks else "" for key in columns]
        lines.append(f"| `{pattern}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\nTFLOP/s per device; an empty cell: none known, so no MFU for that dtype.\n"


GENERATED: dict[str, Callable[[], str]] = {
    "fabriclite --help": lambda: command_help(),
    "fabriclite run --help": lambda: command_help("run"),
    "fabriclite plan --help": lambda: command_help("plan"),
    "fabriclite consolidate --help": lambda: command_help("consolidate"),
    "fabriclite plot --help": lambda: command_help("plot"),
    "peak FLOP/s table": peak_flops_table,
    "BENCHMARKS.md": lambda: markdown_without_title("BENCHMARKS.md"),
    "examples/vit/results.md": lambda: markdown_without_title("examples/vit/results.md"),
}

# Path in the site -> the repository file it is.
ASSETS = {"assets/vit-results.png": "examples/vit/results.png"}


def on_files(files: Files, config) -> Files:
    for uri, source in ASSETS.items():
        files.append(File.generated(config, uri, abs_src_path=str(ROOT / source)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    def generate(match: re.Match) -> str:
        key = match.group(1)
        if key not in GENERATED:
            raise PluginError(
                f"{page.file.src_uri}: no generated text is called {key!r}. Valid: {', '.join(map(repr, GENERATED))} "
                "(tools/docs_hooks.py)."
            )
        return GENERATED[key]()

    return MARKER.sub(generate, markdown)

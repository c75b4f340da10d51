"""The documentation site (mkdocs.yml, docs/): it builds with `mkdocs build --strict`, every Python block of its
pages and of README.md runs, and its API reference shows every public name.

Code blocks. Every ```python block of docs/**/*.md and README.md runs on the CPU as a script of its own, in a fresh
process (`run_python`, with a timeout) whose working folder is an empty temporary one; two blocks run at a time. A block that cannot run here
carries a marker on the line right before its opening fence, with the reason:

    <!-- no-run: needs a GPU -->
    ```python

Such a block is only compiled with `compile()`, so it must still be valid Python, and is then reported as skipped
with its reason. A marker without a reason, or one that is not right before a ```python fence, fails.

The build needs mkdocs, mkdocs-material and mkdocstrings[python]: the dev extra installs them
(`pip install -c constraints-cpu.txt -e ".[dev]"`, as CI does). Without them the build tests fail saying so; they
do not skip.
"""

from __future__ import annotations

import importlib
import re
import textwrap
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import pytest

from helpers import ROOT, run_python

DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)")
NO_RUN = re.compile(r"^\s*<!--\s*no-run:(?P<reason>.*?)-->\s*$")  # alone on its line
BLOCK_TIMEOUT_S = 120  # one block: a few training steps, at most two processes

# The modules whose public names (their __all__) the API reference must show.
PUBLIC_MODULES = (
    "fabriclite",
    "fabriclite.strategies",
    "fabriclite.plugins",
    "fabriclite.plugins.environments",
    "fabriclite.utilities",
    "fabriclite.loggers",
    "fabriclite.metrics",
    "fabriclite.kernels",
    "fabriclite.plan",
)
# The reference reads the kernels/ folder as the package it is in the repository (mkdocstrings finds packages by
# folder); it is installed as fabriclite.kernels.
REFERENCE_PREFIXES = {"fabriclite.kernels": "kernels"}
DOCS_PACKAGES = {
    "mkdocs": "mkdocs",
    "material": "mkdocs-material",
    "mkdocstrings": "mkdocstrings",
    "mkdocstrings_handlers.python": "mkdocstrings-python",
}


@dataclass(frozen=True)
class Block:
    """One fenced ```python block: where it starts (the fence's line, 1-based), its code, and its no-run reason."""

    path: Path
    line: int
    code: str
    no_run: str | None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def python_blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), len(lines))
        if fence["lang"] in ("python", "py"):
            marker = NO_RUN.search(lines[i - 1]) if i > 0 else None
            code = textwrap.dedent("\n".join(lines[i + 1 : end])) + "\n"
            blocks.append(Block(path, i + 1, code, marker["reason"].strip() if marker else None))
        i = end + 1
    return blocks


BLOCKS = [block for page in PAGES for block in python_blocks(page)]


def test_the_pages_have_python_blocks_to_run():
    assert sum(block.no_run is None for block in BLOCKS) >= 10, [block.where for block in BLOCKS]


def test_every_no_run_marker_has_a_reason_and_sits_right_before_a_python_block():
    misplaced = []
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines, 1):
            marker = NO_RUN.search(line)
            if marker is None:
                continue
            fence = FENCE.match(lines[number]) if number < len(lines) else None
            if not marker["reason"].strip() or fence is None or fence["lang"] not in ("python", "py"):
                misplaced.append(f"{page.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not misplaced, "a no-run marker needs a reason and a ```python fence on the next line:\n" + "\n".join(
        misplaced
    )


def run_block(block: Block, folder: Path) -> str | None:
    """Run one block as a script in ``folder`` (made for it); return None, or why it failed."""
    folder.mkdir()
    script = folder / f"{block.path.stem}_line_{block.line}.py"
    # The child must start in its own folder, where what the block writes (checkpoints, logs) stays; the blocks run
    # side by side, so this process cannot chdir for them. Script line k is page line block.line + k - 1.
    script.write_text(f"import os; os.chdir({str(folder)!r})  # added by tests/test_docs.py\n{block.code}", "utf-8")
    try:
        run_python(str(script), timeout=BLOCK_TIMEOUT_S)
    except AssertionError as error:
        return f"the block at {block.where} failed (line k of {script.name} is line {block.line}+k-1 there): {error}"
    return None


@pytest.fixture(scope="module")
def block_failures(tmp_path_factory) -> dict[str, str | None]:
    """Every block without a no-run marker, run once: {where: None, or why it failed}. Two at a time: each block is
    a single-threaded process (OMP_NUM_THREADS=1) that spends most of its time importing torch, and the machines
    the suite runs on have 2 cores."""
    folder = tmp_path_factory.mktemp("blocks")
    runnable = [block for block in BLOCKS if block.no_run is None]
    with ThreadPoolExecutor(max_workers=2) as pool:
        failures = pool.map(lambda block: run_block(block, folder / f"{block.path.stem}_{block.line}"), runnable)
        return {block.where: failure for block, failure in zip(runnable, failures)}


@pytest.mark.parametrize("block", BLOCKS, ids=[block.where for block in BLOCKS])
def test_a_python_block_of_the_docs_runs_on_the_cpu(block, request):
    compile(block.code, block.where, "exec")
    if block.no_run is not None:
        pytest.skip(f"compiled only: {block.no_run}")
    failure = request.getfixturevalue("block_failures")[block.where]
    assert failure is None, failure


# ---------------------------------------------------------------------------------------------- the site


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    missing = [package for module, package in DOCS_PACKAGES.items() if find_spec(module.split(".")[0]) is None]
    if not missing and find_spec("mkdocstrings_handlers.python") is None:
        missing = ["mkdocstrings-python"]
    if missing:
        pytest.fail(
            f"Building the docs needs {', '.join(missing)}, which are not installed. Install the dev extra: "
            "pip install -c constraints-cpu.txt -e '.[dev]'"
        )
    folder = tmp_path_factory.mktemp("site")
    result = run_python(
        "-m",
        "mkdocs",
        "build",
        "--strict",
        "--config-file",
        str(ROOT / "mkdocs.yml"),
        "--site-dir",
        str(folder),
        timeout=300,
        check=False,
        NO_MKDOCS_2_WARNING="1",
    )
    return folder, result


def test_the_site_builds_with_strict_warnings(site):
    folder, result = site
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout[-5000:]}\n{result.stderr[-5000:]}"
    pages = [path.read_text(encoding="utf-8") for path in folder.rglob("*.html")]
    assert not [page for page in pages if "<!-- generated:" in page], "a generated section was left unreplaced"
    cli = (folder / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    assert "usage: fabriclite run" in cli and "usage: fabriclite consolidate" in cli
    assert (folder / "assets" / "vit-results.png").read_bytes() == (ROOT / "examples/vit/results.png").read_bytes()


def reference_names(folder: Path) -> set[str]:
    """The objects the API reference pages document, from the site's objects.inv (Sphinx inventory format 2:
    four header lines, then zlib-compressed lines "name domain:role priority uri display-name")."""
    header_and_body = (folder / "objects.inv").read_bytes().split(b"\n", 4)
    names = set()
    for line in zlib.decompress(header_and_body[4]).decode().splitlines():
        name, _, _, uri = line.split(" ", 4)[:4]
        if uri.startswith("reference/"):
            names.add(name)
    return names


def public_names(module) -> list[str]:
    """``__all__``; a module without one: the names it defines itself that do not start with an underscore."""
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == module.__name__
    ]


def documented_as(module_name: str, name: str, value: object) -> set[str]:
    """The reference's names for ``module_name.name``: that path, or where the object is defined."""
    paths = {f"{module_name}.{name}"}
    if hasattr(value, "__qualname__") and hasattr(value, "__module__"):
        paths.add(f"{value.__module__}.{value.__qualname__}")
    elif getattr(value, "__spec__", None) is not None:  # a module
        paths.add(value.__name__)
    renamed = set()
    for path in paths:
        for installed, in_reference in REFERENCE_PREFIXES.items():
            if path.startswith(installed + "."):
                path = in_reference + path[len(installed) :]
        renamed.add(path)
    return renamed


def test_every_public_name_appears_in_the_api_reference(site):
    folder, result = site
    assert result.returncode == 0, "the site did not build: see test_the_site_builds_with_strict_warnings"
    documented = reference_names(folder)
    missing = []
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in public_names(module):
            if not documented_as(module_name, name, getattr(module, name)) & documented:
                missing.append(f"{module_name}.{name}")
    assert not missing, f"add these to a page under docs/reference/ (`::: module.name`): {missing}"

"""Runs the version-sensitive tests (``pytest -m torch_versions``) on each torch that requirements-torch-versions.txt
lists, each in a virtual environment of its own outside the checkout, deleted after its tests. Prints which torch
ran which tests, then one line per torch and a closing count; exits 1 if any torch failed.

Usage: ``python tools/torch_versions.py`` (the README's second test command; CI runs it after the full suite);
``python tools/torch_versions.py 2.15.0`` runs one of them.
``python tools/torch_versions.py --prepare`` only builds the environments (CI does that in the background while the
full suite runs; a later plain run uses those it finds ready). Everything lives in ~/.cache/fabriclite-ci (or
$FABRICLITE_CI_CACHE): the wheels stay there (``pip download``: the next run downloads nothing), the environments
(4.6-6.6 GB each: PyPI's torch is a CUDA build, which runs on a CPU) are deleted after their tests.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = ROOT / "requirements-torch-versions.txt"
CACHE = Path(os.environ.get("FABRICLITE_CI_CACHE", Path.home() / ".cache" / "fabriclite-ci"))
WHEELS, ENVIRONMENTS = CACHE / "wheels", CACHE / "environments"
# What fabriclite and the marked tests import besides torch (which does not need numpy), and a setuptools that installs this
# checkout without build isolation (offline; Python 3.11's venv brings one too old to build a wheel).
TEST_PACKAGES = ["numpy", "pytest", "pytest-xdist", "pytest-timeout", "pyyaml", "tqdm", "setuptools>=70.1"]
NEEDED_GB = 8  # free disk to build one environment
MARK = "torch_versions"


def versions() -> list[list[str]]:
    """Each line of requirements-torch-versions.txt as its requirements: ``["torch==2.8.0", "numpy<2.4"]``."""
    lines = [line.split("#")[0].split() for line in VERSIONS.read_text().splitlines()]
    return [line for line in lines if line]


def folder(pins: list[str]) -> Path:
    return ENVIRONMENTS / pins[0].replace("==", "-")


def built_here(venv: Path) -> bool:
    """Whether a folder is an environment this tool built: a virtual environment, or what a removal cut short by an
    older version of this tool left of one (rmtree took pyvenv.cfg first, then bin/ and lib/pythonX.Y/ stayed)."""
    return (venv / "pyvenv.cfg").exists() or ((venv / "bin").is_dir() and any(venv.glob("lib/python3*/site-packages")))


def remove(venv: Path) -> None:
    """Delete an environment this tool built; anything else there is left alone.

    The folder is renamed out of the way in one step, then deleted: a run killed while deleting leaves a folder named
    as trash (cleared by the next run), never half an environment under the version's name."""
    if not venv.exists():
        return
    if not built_here(venv):
        raise RuntimeError(f"{venv} is in the way and was not built by this tool; move it, then run again.")
    trash = venv.with_name(f".{venv.name}.removing-{os.getpid()}")
    os.rename(venv, trash)
    shutil.rmtree(trash, ignore_errors=True)


def clear_trash() -> None:
    """Delete what removals killed part way left (see ``remove``)."""
    for trash in ENVIRONMENTS.glob(".torch-*.removing-*") if ENVIRONMENTS.exists() else []:
        shutil.rmtree(trash, ignore_errors=True)


def _pip(python: Path, *args: str, log: Path) -> None:
    # Every torch here is pinned exactly, so a machine-wide cap on torch releases (a pip constraint file in pip's
    # configuration) is lifted for these calls: it would refuse the newest release.
    env = {**os.environ, "PIP_CONSTRAINT": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    with open(log, "a") as out:
        subprocess.run([str(python), "-m", "pip", *args], check=True, env=env, stdout=out, stderr=subprocess.STDOUT)


def prepare(pins: list[str]) -> Path:
    """Build (or find ready) the environment for one line: its pins and the test packages, wheels kept in WHEELS."""
    venv = folder(pins)
    if (venv / "ready").exists():
        return venv
    remove(venv)  # what a killed run left half built
    ENVIRONMENTS.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(ENVIRONMENTS).free / 1e9
    if free < NEEDED_GB:
        raise RuntimeError(
            f"{free:.1f} GB free under {ENVIRONMENTS}, but an environment for {pins[0]} needs about {NEEDED_GB} GB "
            f"(a CUDA build of torch). Free some disk, or set FABRICLITE_CI_CACHE to a larger disk."
        )
    log = CACHE / f"{venv.name}.log"
    log.unlink(missing_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    packages = [*pins, *TEST_PACKAGES]
    _pip(python, "download", "--dest", str(WHEELS), *packages, log=log)
    # --no-compile: Python compiles what the tests import; compiling all of torch's files up front takes minutes.
    _pip(python, "install", "--no-compile", "--no-index", "--find-links", str(WHEELS), *packages, log=log)
    (venv / "ready").touch()
    return venv


def marked_files() -> list[str]:
    """The test files with tests marked ``torch_versions`` (only these are collected: the others import packages
    these environments lack)."""
    return sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").rglob("test_*.py")
        if f"mark.{MARK}" in path.read_text()
    )


def run_tests(pins: list[str]) -> tuple[bool, str]:
    """Build the environment if needed, install this checkout into it, run the marked tests, delete it."""
    venv = prepare(pins)
    python = venv / "bin" / "python"
    try:
        _pip(python, "install", "--no-deps", "--no-build-isolation", "-e", str(ROOT), log=CACHE / f"{venv.name}.log")
        probe = "import numpy, torch, triton; print(torch.__version__, triton.__version__, numpy.__version__)"
        found = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
        if found.returncode != 0:
            raise RuntimeError(f"the environment for {pins[0]} cannot import what it needs: {found.stderr[-2000:]}")
        found = found.stdout.split()
        files = marked_files()
        print(f"==== torch {found[0]} (triton {found[1]}, numpy {found[2]}) runs pytest -m {MARK} on:", flush=True)
        print("     " + " ".join(files), flush=True)
        env = {
            **os.environ,
            "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
            "VIRTUAL_ENV": str(venv),
        }
        # -rfEsp: the summary names every test and its outcome, so the log says which torch ran which test.
        command = [
            str(python),
            "-m",
            "pytest",
            *f"-m {MARK} -n 2 --dist loadfile -p no:cacheprovider -rfEsp --durations=15".split(),
        ]
        child = subprocess.Popen([*command, *files], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        closing = ""
        for line in child.stdout:
            print(line, end="", flush=True)
            if re.search(r"\d+ (passed|failed|error)", line):
                closing = line.strip(" =\n")
        ok = child.wait() == 0
        return ok, f"torch {found[0]}: {closing or f'pytest exited {child.returncode}'}"
    finally:
        remove(venv)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prepare", action="store_true", help="only build the environments, as disk allows")
    parser.add_argument("only", nargs="*", help="run only these torch versions of the list (2.15.0)")
    args = parser.parse_args(argv)
    lines = [pins for pins in versions() if not args.only or pins[0].split("==")[1] in args.only]
    listed = {folder(pins).name for pins in versions()}
    clear_trash()
    for stale in ENVIRONMENTS.glob("torch-*") if ENVIRONMENTS.exists() else []:  # versions no longer listed
        if stale.name not in listed and built_here(stale):
            remove(stale)
    if args.prepare:
        os.nice(10)  # beside the full suite: let it have the cores first
        for pins in lines:
            start = time.monotonic()
            try:
                prepare(pins)
                print(f"prepared {pins[0]} in {time.monotonic() - start:.0f} s", flush=True)
            except (RuntimeError, subprocess.CalledProcessError) as error:  # the test run tries again, and says why
                print(f"could not prepare {pins[0]} now: {error}", flush=True)
        return 0
    results = []
    for pins in lines:
        try:
            results.append(run_tests(pins))
        except (RuntimeError, subprocess.CalledProcessError) as error:
            log = CACHE / f"{folder(pins).name}.log"
            print(log.read_text()[-3000:] if log.exists() else "", flush=True)
            results.append((False, f"{pins[0]}: not run ({error})"))
    print(f"==== the version-sensitive tests (-m {MARK}) on each torch CI tests besides the full suite's:")
    for _, line in results:
        print(line)
    passed = failed = 0
    for ok, line in results:
        passed += sum(int(n) for n in re.findall(r"(\d+) passed", line))
        broken = sum(int(n) for n in re.findall(r"(\d+) (?:failed|errors?)\b", line))
        failed += broken or (0 if ok else 1)  # a torch that could not run counts as one failure
    print(f"{MARK}: {passed} passed, {failed} failed")
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())

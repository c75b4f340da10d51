"""The wheel a user installs holds every module of the source tree: a package missing from pyproject.toml's list works
in an editable install (the tests') and breaks in a real one, so the wheel itself is built and read."""

import shutil
import zipfile

from helpers import ROOT, run_python


def source_modules() -> set[str]:
    """Every .py file a wheel must carry, named as it lies in the wheel (kernels/ installs as fabriclite/kernels/)."""
    modules = {str(path.relative_to(ROOT)) for path in (ROOT / "fabriclite").rglob("*.py")}
    modules |= {
        "fabriclite/kernels/" + str(path.relative_to(ROOT / "kernels")) for path in (ROOT / "kernels").rglob("*.py")
    }
    return {module for module in modules if "__pycache__" not in module}


def test_the_built_wheel_holds_every_module_of_fabriclite_and_its_kernels(tmp_path):
    # Built from a copy, so the build leaves no build/ or .egg-info folder in the checkout.
    source = tmp_path / "source"
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("fabriclite", "kernels"):
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)

    run_python(
        "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(source), timeout=300
    )
    (wheel,) = tmp_path.glob("fabriclite-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        packed = {name for name in archive.namelist() if name.endswith(".py")}

    missing = source_modules() - packed
    assert not missing, f"pyproject.toml's [tool.setuptools] packages leave these out of the wheel: {sorted(missing)}"
    assert not any(name.startswith("kernels/") for name in packed), "kernels/ must install as fabriclite.kernels only"

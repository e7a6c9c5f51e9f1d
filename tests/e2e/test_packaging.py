"""PEP 561: the package ships a py.typed marker, so type checkers use its annotations instead of ignoring them."""
import importlib.resources
import shutil
import subprocess
import sys
import zipfile

from .test_examples import REPO


def test_the_installed_package_is_marked_typed():
    assert importlib.resources.files("tiered_ckpt").joinpath("py.typed").is_file()


def test_a_wheel_built_from_the_tree_ships_the_marker(tmp_path):
    """The installed check alone passes for an editable install, which reads the source tree; a wheel holds only
    what pyproject.toml declares as package data."""
    src = tmp_path / "src"
    shutil.copytree(REPO / "tiered_ckpt", src / "tiered_ckpt", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, capture_output=True, timeout=300)
    wheel = next((tmp_path / "dist").glob("tiered_ckpt-*.whl"))
    assert "tiered_ckpt/py.typed" in zipfile.ZipFile(wheel).namelist()

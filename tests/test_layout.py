"""posttrain imports the same way installed and from a checkout's root, where the source tree shadows an install:
`algorithms/`, `rewards/`, `environments/` and `recipes/` are top-level folders that an install maps into the
package."""

import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WHERE = ("import posttrain.algorithms, posttrain.rewards, posttrain.environments, posttrain.config as c; "
         "print(posttrain.algorithms.__file__); print(posttrain.rewards.__file__); "
         "print(posttrain.environments.__file__); print(c.recipe_path('grpo_math'))")
FOLDERS = ("algorithms", "rewards", "environments", "recipes")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A non-editable install of this checkout, in a folder of its own."""
    site = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(ROOT)],
                   check=True, capture_output=True)
    return site


def where(cwd: Path, env: dict, *flags: str) -> list[str]:
    proc = subprocess.run([sys.executable, *flags, "-c", WHERE], cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.splitlines()


def test_checkout_root_without_an_editable_install():
    """From the root, `python -m posttrain` (what `posttrain compare` runs for each recipe, and what torchrun and
    `accelerate launch -m posttrain` start in each process) imports the checkout's posttrain/, which shadows any
    install, and must find algorithms/, rewards/, environments/ and recipes/ beside it.

    It runs as a non-editable install leaves it: `-S` skips site's .pth files, and with them the finder of an
    editable install (this suite's usual setting), which maps those folders by itself and would hide the failure;
    site-packages stays on the path, for the dependencies."""
    paths = [*site.getsitepackages(), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    probe = "import sys; print([f for f in sys.meta_path if 'editable' in repr(f)])"
    finders = subprocess.run([sys.executable, "-S", "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True)
    assert finders.stdout.strip() == "[]", finders.stdout + finders.stderr  # the path under test, not the finder's
    for line, folder in zip(where(ROOT, env, "-S"), FOLDERS, strict=True):
        assert Path(line).resolve().is_relative_to(ROOT / folder), (line, folder)
    listing = subprocess.run([sys.executable, "-S", "-m", "posttrain", "recipes"], cwd=ROOT, env=env,
                             capture_output=True, text=True)
    assert listing.returncode == 0 and "grpo_math" in listing.stdout, listing.stderr[-2000:]


def test_installed_package_elsewhere(installed, tmp_path):
    """Away from a checkout, the installed copy, with its mapped folders and recipes inside the package."""
    env = {**os.environ, "PYTHONPATH": str(installed)}
    for line, folder in zip(where(tmp_path, env), FOLDERS, strict=True):
        assert Path(line).resolve().is_relative_to((installed / "posttrain" / folder).resolve()), (line, folder)
    run = subprocess.run([sys.executable, "-m", "posttrain", "config", "recipe=grpo_math"], cwd=tmp_path, env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0 and "name: grpo" in run.stdout, run.stderr[-2000:]

"""posttrain imports the same way installed and from a checkout's root, where the source tree shadows an install:
`algorithms/`, `rewards/` and `recipes/` are top-level folders that an install maps into the package."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WHERE = ("import posttrain.algorithms, posttrain.rewards, posttrain.config as c; "
         "print(posttrain.algorithms.__file__); print(posttrain.rewards.__file__); print(c.recipe_path('grpo_math'))")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A non-editable install of this checkout, in a folder of its own."""
    site = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(ROOT)],
                   check=True, capture_output=True)
    return site


@pytest.mark.parametrize("cwd", ["root", "elsewhere"])
def test_installed_package_from_the_root_and_elsewhere(installed, tmp_path, cwd):
    """From the root the checkout's own folders are used (not a stale install, not an ImportError); elsewhere the
    installed copy, with its mapped folders and recipes inside the package."""
    env = {**os.environ, "PYTHONPATH": str(installed)}
    here = ROOT if cwd == "root" else tmp_path
    proc = subprocess.run([sys.executable, "-c", WHERE], cwd=here, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    expected = ROOT if cwd == "root" else installed / "posttrain"
    for line, folder in zip(proc.stdout.splitlines(), ("algorithms", "rewards", "recipes")):
        assert Path(line).resolve().is_relative_to((expected / folder).resolve()), (line, expected / folder)
    run = subprocess.run([sys.executable, "-m", "posttrain", "config", "recipe=grpo_math"], cwd=here, env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0 and "name: grpo" in run.stdout, run.stderr[-2000:]

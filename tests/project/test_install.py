"""The installed package is what a user's script imports, wherever the clone lies.

A user clones the repository as ``forge_obs`` next to their own scripts and installs it (``pip install
-e``). Their script's folder comes first on ``sys.path``, so the clone's root is seen as a namespace
package ``forge_obs``; with the library at the clone's top level it shadowed the installed package
(``ImportError: cannot import name 'Reduce' from 'forge_obs' (unknown location)``). The src layout
keeps the library under ``src/``, so the clone's root holds no ``forge_obs`` and the installed
package wins."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IGNORED = shutil.ignore_patterns(".git", ".venv", "runs", "build", "wandb", "results", "__pycache__", "*.egg-info")


def test_a_clone_named_forge_obs_beside_a_users_script_does_not_shadow_the_installed_package(tmp_path):
    shutil.copytree(ROOT, tmp_path / "forge_obs", ignore=IGNORED)  # the clone, as `git clone ... forge_obs` makes it
    (tmp_path / "train.py").write_text(
        "import forge_obs\n"
        "from forge_obs import Reduce, record_metric\n"
        "record_metric('loss', 1.0, Reduce.MEAN)\n"
        "print(forge_obs.__file__)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as the user runs it: no path set up
    res = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    imported = Path(res.stdout.strip().splitlines()[-1])
    assert imported.name == "__init__.py" and imported.parent.name == "forge_obs"
    assert tmp_path not in imported.parents, f"the clone beside the script was imported: {imported}"


def test_the_library_lives_under_src():
    assert (ROOT / "src" / "forge_obs" / "__init__.py").is_file()
    assert not (ROOT / "forge_obs").exists(), "a forge_obs/ package at the clone's root shadows the installed one"

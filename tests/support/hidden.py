"""Run a script in a child Python where some installed modules cannot be imported, as if an
optional extra were not installed."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from tests.support import ROOT


def check_needs_extra(
    module: str, extra: str, hidden: Sequence[str], tmp_path: Path, before: str = ""
) -> None:
    """With `hidden` not importable, the app sets up, runs `before` (Python code), takes a
    lock, and importing `module` raises an ImportError that names `django-keel-lock[extra]`."""
    script = f"""
import django_keel_lock
{before}
try:
    import {module}
except ImportError as exc:
    assert "django-keel-lock[{extra}]" in str(exc), exc
else:
    raise AssertionError("{module} imported without {", ".join(hidden)}")
with django_keel_lock.lock("no-{extra}", store="memory") as held:
    assert held.fence == 1
print("ok")
"""
    assert _run_hiding(hidden, script, tmp_path) == "ok\n"


def _run_hiding(modules: Sequence[str], script: str, tmp_path: Path) -> str:
    """`script`'s output, run with django set up on tests.settings and `modules` hidden;
    fails the test when it exits with an error."""
    hide = tmp_path / "sitecustomize.py"
    hide.write_text(
        "import sys\n"
        f"for name in {tuple(modules)!r}:\n"
        "    sys.modules[name] = None  # import fails as if not installed\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
        "DJANGO_SETTINGS_MODULE": "tests.settings",
    }
    done = subprocess.run(
        [sys.executable, "-c", "import django\ndjango.setup()\n" + script],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout

#!/usr/bin/env python3
"""Follow README.md's Install and Quick start from a built wheel, as a new user would.

    python3 .ci/wheel_quickstart.py dist/django_keel_lock-<version>-py3-none-any.whl

In a temporary directory: a fresh Python 3.13 venv, `pip install WHEEL 'django>=6.1,<6.2'`,
`django-admin startproject mysite`, then the fenced blocks under README's "## Quick start", as
written: a `# name.py` line sends the lines after it to that file of the project package
(settings.py: `...` in a list stands for what the list already holds; urls.py: appended), an
`sh` block's lines run in the project directory (`python` is the venv's), and a Python block
without a file runs in `manage.py shell -c`. Then the view wired in urls.py is called with
Django's test client: it must answer 200 and leave its lock in the table (released, with a
fence above the one the `with lock(...)` block took), and answer 409 while its key is held.
Standard library only; exits non-zero with a message naming the step that failed.
"""

from __future__ import annotations

import argparse
import ast
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# The tests' Markdown reader (standard library only), so both read the README alike.
sys.path.insert(0, str(ROOT))
from tests.support.markdown import blocks_of, split_files  # noqa: E402

HEADING = "## Quick start"
PROJECT = "mysite"


class Failed(Exception):
    """A step of the quick start did not do what the README says."""


def quickstart_blocks(readme: Path) -> list[tuple[str, str]]:
    """The (language, code) of each fenced block in the Quick start section, in order."""
    try:
        blocks = blocks_of(readme, section=HEADING)
    except ValueError as exc:
        raise Failed(str(exc)) from None
    if not blocks:
        raise Failed(f"{HEADING}: no fenced code blocks")
    return [(block.language, block.code) for block in blocks]


def settings_code(code: str) -> str:
    """Settings lines to append: `NAME = [..., x]` becomes `NAME = [*NAME, x]`."""

    class Extend(ast.NodeTransformer):
        def visit_Assign(self, node: ast.Assign) -> ast.Assign:
            if len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                name = node.targets[0].id
                if isinstance(node.value, (ast.List, ast.Tuple)):
                    node.value.elts = [
                        ast.Starred(ast.Name(name, ast.Load()), ast.Load())
                        if isinstance(e, ast.Constant) and e.value is Ellipsis
                        else e
                        for e in node.value.elts
                    ]
            return node

    tree = Extend().visit(ast.parse(code))
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n"


def run(
    argv: list[str], cwd: Path, what: str, env: dict[str, str] | None = None, shown: str = ""
) -> str:
    print(f"$ {shown or ' '.join(shlex.quote(a) for a in argv)}", flush=True)
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise Failed(
            f"{what}: exit code {proc.returncode}\n"
            f"--- stdout\n{proc.stdout}--- stderr\n{proc.stderr}"
        )
    return proc.stdout


def find_python313(given: str | None) -> str:
    """A Python 3.13 that runs: --python, QUICKSTART_PYTHON, python3.13 on PATH or pyenv's."""
    candidates = [given, os.environ.get("QUICKSTART_PYTHON"), shutil.which("python3.13")]
    if shutil.which("pyenv"):
        root = subprocess.run(["pyenv", "root"], capture_output=True, text=True).stdout.strip()
        candidates += sorted(glob.glob(f"{root}/versions/3.13*/bin/python3.13"), reverse=True)
    for candidate in filter(None, candidates):
        probe = subprocess.run(
            [candidate, "-c", "import sys; print(sys.version_info[:2] == (3, 13))"],
            capture_output=True,
            text=True,
        )
        if probe.returncode == 0 and probe.stdout.strip() == "True":
            return candidate
        if candidate in (given, os.environ.get("QUICKSTART_PYTHON")):
            raise Failed(f"{candidate} is not a working Python 3.13")
    raise Failed("no Python 3.13 found: pass --python or set QUICKSTART_PYTHON")


def check_code(url: str, key: str, fence_before: int) -> str:
    """Django-shell code that calls the quick start's view and checks its lock."""
    return textwrap.dedent(
        f"""
        from django.test import Client
        from django.test.utils import setup_test_environment
        from django_keel_lock import lock
        from django_keel_lock.models import Lock

        setup_test_environment()  # lets the test client's host in
        response = Client().get({url!r})
        got = f"{{response.status_code}} {{response.content[:300]!r}}"
        assert response.status_code == 200, f"GET {url}: {{got}}"
        print("GET {url}:", response.status_code, response.content.decode())
        row = Lock.objects.filter(key={key!r}).first()
        assert row is not None, "the view took no lock: no Lock row for {key!r}"
        assert row.fence > {fence_before}, f"fence {{row.fence}} is not above {fence_before}"
        assert not lock({key!r}).is_locked(), "the view's lock is still held after the response"
        print("Lock row:", row.key, "fence", row.fence, "released")
        others = Lock.objects.exclude(key={key!r})
        assert others.exists(), "the with lock(...) block left no Lock row"
        with lock({key!r}):
            busy = Client().get({url!r})
        assert busy.status_code == 409, f"GET {url} while {key!r} is held: {{busy.status_code}}"
        print("GET {url} while {key!r} is held:", busy.status_code, busy.headers.get("Retry-After"))
        """
    )


def quickstart(wheel: Path, python: str, django: str, work: Path, readme: Path) -> None:
    blocks = quickstart_blocks(readme)
    venv = work / "venv"
    run([python, "-m", "venv", str(venv)], work, "create the venv")
    vpython = str(venv / "bin" / "python")
    run([vpython, "-m", "pip", "install", "-q", str(wheel), django], work, "pip install")
    print(
        run(
            [
                vpython,
                "-c",
                "import django, django_keel_lock as k; print("
                "'django', django.__version__, '| django-keel-lock', k.__version__, k.__file__)",
            ],
            work,
            "import",
        ).strip()
    )
    run([str(venv / "bin" / "django-admin"), "startproject", PROJECT], work, "startproject")
    project = work / PROJECT
    package = project / PROJECT
    env = {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    manage = [vpython, "manage.py"]

    fence_before = 0
    url = key = None
    for number, (language, code) in enumerate(blocks, 1):
        where = f"{HEADING} block {number} ({language})"
        if language == "sh":
            for line in code.splitlines():
                line = line.split("#", 1)[0].strip()
                if not line:
                    continue
                argv = shlex.split(line)
                if argv[0] in {"python", "python3"}:
                    argv[0] = vpython
                print(run(argv, project, f"{where}: {line}", env), end="")
            continue
        if language != "python":
            raise Failed(f"{where}: only python and sh blocks are understood")
        for name, part in split_files(code):
            if name is None:
                out = run(
                    [*manage, "shell", "-c", part], project, f"{where} in manage.py shell", env
                )
                print(out, end="")
                fences = [int(n) for n in re.findall(r"fence\D*(\d+)", out)]
                fence_before = max([fence_before, *fences])
                continue
            target = package / name
            if name == "settings.py":
                part = settings_code(part)
            mode = "w" if not target.exists() else "a"
            with target.open(mode, encoding="utf-8") as f:
                f.write(("\n# From README.md's Quick start\n" if mode == "a" else "") + part)
            print(f"{'appended to' if mode == 'a' else 'wrote'} {PROJECT}/{name}:")
            print(textwrap.indent(part.rstrip("\n"), "    "))
            if name == "urls.py":
                route = re.search(r"""path\(\s*["']([^"']+)["']""", part)
                if route:
                    url = "/" + re.sub(r"<(?:\w+:)?\w+>", "42", route.group(1))
            template = re.search(r"""@lock_view\(\s*["']([^"']+)["']""", part)
            if template:
                key = re.sub(r"<\w+>", "42", template.group(1))
    if url is None or key is None:
        raise Failed(f'{HEADING}: found no path(...) in a urls.py part or no @lock_view("...")')
    print(
        run([*manage, "check", "--fail-level", "WARNING"], project, "manage.py check", env), end=""
    )
    checks = check_code(url, key, fence_before)
    out = run(
        [*manage, "shell", "-c", checks],
        project,
        "calling the quick start's view",
        env,
        shown=f"python manage.py shell -c <GET {url}: 200, then 409 while {key!r} is held>",
    )
    print(out, end="")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("wheel", type=Path, help="dist/django_keel_lock-<version>-py3-none-any.whl")
    parser.add_argument("--python", help="Python 3.13 to build the venv with (QUICKSTART_PYTHON)")
    parser.add_argument("--django", default="django>=6.1,<6.2", help="the Django to install")
    parser.add_argument("--readme", type=Path, default=README, help="default: this repository's")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="keel-lock-quickstart-"))
    try:
        if not args.wheel.is_file() or args.wheel.suffix != ".whl":
            raise Failed(f"{args.wheel} is not a wheel file (make dist builds one into dist/)")
        python = find_python313(args.python)
        quickstart(args.wheel.resolve(), python, args.django, work, args.readme)
    except Failed as exc:
        print(f"\nwheel_quickstart: FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        if args.keep:
            print(f"(kept {work})")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print("\nwheel_quickstart: OK: README's Install and Quick start work from the wheel.")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Run the docs' examples as a reader would: each page in a new project, from the built wheel.

    python3 .ci/docs_as_reader.py dist/django_keel_lock-<version>-py3-none-any.whl [PAGE ...]

In a temporary directory: a fresh Python 3.13 venv with the wheel (and its extras) and Django
6.1, and `django-admin startproject mysite`. Then every page (default: README.md's Quick start
and every docs/ page with a Python or sh block) runs in a copy of that project of its own:

- A page that adds "django_keel_lock" to INSTALLED_APPS in a settings block starts from the bare
  `startproject`; any other starts from the quick start's project (the app installed and
  migrated), as its reader would have it.
- A `# name.py` line in a Python block sends the lines after it to that file: `settings.py`,
  `urls.py` and any other bare name to the project package (`mysite/`), a path with a folder
  (`invoices/models.py`) to that path in the project (`startapp invoices` makes the folder),
  `./name.py` to the project directory (beside manage.py). An existing file is appended to; in
  settings.py `...` in a list stands for what the list already holds.
- An `sh` block's lines run in the project directory (`python`, `pip`, `pytest` are the venv's);
  a line naming `/path/to/django-keel-lock` is the install the venv already has.
- Python blocks without a file run in `python manage.py shell`: consecutive ones in one session,
  as a reader keeps a shell open while reading on; a file or settings block in between starts a
  new session, as a reader restarts the shell after editing code.
- A block with `<!-- not-runnable: why -->` on the line before it is not run.

Standard library only; exits non-zero naming the page and block that failed.
"""

from __future__ import annotations

import argparse
import ast
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
# The tests' Markdown reader (standard library only), so both read the pages alike.
sys.path.insert(0, str(ROOT))
from tests.support.markdown import Block, blocks_of, split_files  # noqa: E402

PROJECT = "mysite"
QUICK_START = "## Quick start"
EXTRAS = "redis,celery,tasks,prometheus"
PLACEHOLDER = "/path/to/django-keel-lock"
#: Fences a reader would run in a shell: only `sh` is followed, the others are refused.
SHELLS = {"sh", "bash", "shell", "console", "shell-session", "zsh"}
#: Runs each shell session's blocks in one namespace, naming the block that failed.
SESSION = textwrap.dedent(
    """
    import json, sys, traceback
    namespace = {"__name__": "__main__"}
    for where, code in json.load(open(%r)):
        try:
            exec(compile(code, where, "exec"), namespace)
        except BaseException:
            traceback.print_exc()
            print(f"the example at {where} failed", file=sys.stderr)
            sys.exit(1)
    """
)


class Failed(Exception):
    """A page's example did not do what the page says."""


def run(argv: list[str], cwd: Path, what: str, env: dict[str, str] | None = None) -> str:
    print(f"$ {' '.join(shlex.quote(a) for a in argv)}"[:200], flush=True)
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise Failed(
            f"{what}: exit code {proc.returncode}\n"
            f"--- stdout\n{proc.stdout[-4000:]}--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc.stdout


def find_python(given: str | None) -> str:
    """The Python for the venv: --python (any 3.11+), else a Python 3.13: QUICKSTART_PYTHON,
    python3.13 on PATH or pyenv's."""
    if given:
        return given
    candidates = [os.environ.get("QUICKSTART_PYTHON"), shutil.which("python3.13")]
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
        if candidate == os.environ.get("QUICKSTART_PYTHON"):
            raise Failed(f"{candidate} is not a working Python 3.13")
    raise Failed("no Python 3.13 found: pass --python or set QUICKSTART_PYTHON")


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


def installs_the_app(blocks: list[Block]) -> bool:
    """Whether the page itself adds django_keel_lock to INSTALLED_APPS (so starts bare)."""
    for block in blocks:
        for name, code in split_files(block.code) if block.language == "python" else ():
            if name == "settings.py" and re.search(r"INSTALLED_APPS.*django_keel_lock", code):
                return True
    return False


@dataclass
class Reader:
    """One page followed in a project of its own."""

    page: str
    project: Path
    env: dict[str, str]
    python: str
    session: list[tuple[str, str]] = field(default_factory=list)
    ran: int = 0

    def write(self, name: str, code: str) -> None:
        self.flush()
        target = self.project / (name if "/" in name else f"{PROJECT}/{name}")  # ./x: the root
        if name == "settings.py":
            code = settings_code(code)
        if not target.parent.is_dir():
            raise Failed(f"{self.page}: {name}: {target.parent.name}/ does not exist yet")
        with target.open("a", encoding="utf-8") as f:
            f.write(f"\n# From {self.page}\n{code}")
        self.ran += 1

    def shell_lines(self, block: Block) -> None:
        self.flush()
        for line in block.code.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if not line or line.startswith("#") or PLACEHOLDER in line:
                continue
            out = run(["bash", "-c", line], self.project, f"{block.where}: {line}", self.env)
            print(textwrap.indent(out.rstrip("\n"), "    ")) if out.strip() else None
        self.ran += 1

    def flush(self) -> None:
        """Run the Python blocks gathered for one `manage.py shell` session."""
        if not self.session:
            return
        script = self.project / ".session.json"
        script.write_text(json.dumps(self.session), encoding="utf-8")
        where = ", ".join(w for w, _ in self.session)
        code = SESSION % str(script)
        out = run([self.python, "manage.py", "shell", "-c", code], self.project, where, self.env)
        print(textwrap.indent(out.rstrip("\n"), "    ")) if out.strip() else None
        self.ran += len(self.session)
        self.session = []

    def follow(self, blocks: list[Block]) -> int:
        for block in blocks:
            if block.skip_reason is not None:
                continue
            if block.language == "sh":
                self.shell_lines(block)
            elif block.language in {"python", "py"}:
                for name, code in split_files(block.code):
                    if name is None:
                        self.session.append((block.where, code))
                    else:
                        self.write(name, code)
        self.flush()
        return self.ran


def pages_to_read(chosen: list[str]) -> list[tuple[Path, str | None]]:
    """(page, section) pairs: README's Quick start, then each docs page with examples."""
    if chosen:
        paths = [Path(p).resolve() for p in chosen]
    else:
        paths = [README, *sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)]
    return [(p, QUICK_START if p == README else None) for p in paths]


def prepare(work: Path, wheel: Path, python: str, django: str) -> tuple[str, dict[str, str]]:
    """In `work`: the venv (wheel, extras, Django) and two projects, bare and after the quick
    start; the venv's python and the environment to run it in."""
    venv = work / "venv"
    run([python, "-m", "venv", str(venv)], work, "create the venv")
    vpython = str(venv / "bin" / "python")
    run([vpython, "-m", "pip", "install", "-q", f"{wheel}[{EXTRAS}]", django], work, "pip install")
    env = {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    for name in ("DJANGO_SETTINGS_MODULE", "PYTHONPATH", "VIRTUAL_ENV"):
        env.pop(name, None)
    bare = work / "bare"
    bare.mkdir()
    run([str(venv / "bin" / "django-admin"), "startproject", PROJECT], bare, "startproject")
    started = work / "started"
    shutil.copytree(bare, started)
    settings = started / PROJECT / PROJECT / "settings.py"
    with settings.open("a", encoding="utf-8") as f:
        f.write('\n# The quick start\nINSTALLED_APPS = [*INSTALLED_APPS, "django_keel_lock"]\n')
    run([vpython, "manage.py", "migrate", "-v0"], started / PROJECT, "migrate", env)
    return vpython, env


def page_name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix() if page.is_relative_to(ROOT) else page.name


def read_page(work: Path, page: Path, section: str | None, python: str, env: dict) -> int:
    """Follow `page` (its `section` only) in a copy of a prepared project; how many blocks ran.
    Failed names the block that did not work."""
    blocks = blocks_of(page, section=section)
    for block in blocks:
        if block.language in SHELLS - {"sh"}:
            raise Failed(f"{block.where}: a ```{block.language} block: write ```sh (what runs)")
    blocks = [b for b in blocks if b.language in {"python", "py", "sh"}]
    if not blocks:
        return 0
    name = page_name(page)
    start = "bare" if installs_the_app(blocks) else "started"
    slug = name.replace("/", "_").removesuffix(".md")
    project = Path(tempfile.mkdtemp(prefix=f"{slug}-", dir=work)) / PROJECT
    shutil.copytree(work / start / PROJECT, project)
    print(f"\n== {name}{' ' + section if section else ''} (from the {start} project)", flush=True)
    ran = Reader(name, project, env, python).follow(blocks)
    # What the page's settings add must pass the system checks, as `runserver` would ask.
    run([python, "manage.py", "check", "--fail-level", "ERROR"], project, f"{name}: check", env)
    return ran


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("wheel", type=Path, help="dist/django_keel_lock-<version>-py3-none-any.whl")
    parser.add_argument("pages", nargs="*", help="pages to read (default: all with examples)")
    parser.add_argument("--python", help="the Python to build the venv with (default: a 3.13)")
    parser.add_argument("--django", default="django>=6.1,<6.2", help="the Django to install")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="keel-lock-reader-"))
    failed: list[str] = []
    ran = 0
    try:
        if not args.wheel.is_file() or args.wheel.suffix != ".whl":
            raise Failed(f"{args.wheel} is not a wheel file (make dist builds one into dist/)")
        python, env = prepare(work, args.wheel.resolve(), find_python(args.python), args.django)
        for page, section in pages_to_read(args.pages):
            try:
                ran += read_page(work, page, section, python, env)
            except (Failed, ValueError, subprocess.TimeoutExpired) as exc:
                print(f"FAILED: {exc}", file=sys.stderr, flush=True)
                failed.append(page_name(page))
    except Failed as exc:
        print(f"\ndocs_as_reader: FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        if args.keep:
            print(f"(kept {work})")
        else:
            shutil.rmtree(work, ignore_errors=True)
    if failed:
        print(f"\ndocs_as_reader: FAILED on {len(failed)} pages: {', '.join(failed)}")
        return 1
    if ran == 0:
        print("\ndocs_as_reader: FAILED: no example ran (no page, or every block skipped)")
        return 1
    print(f"\n{ran} examples ran.")
    print("\ndocs_as_reader: OK: every page's examples work in a new project, from the wheel.")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""scripts/check_imports.py, which scripts/test.sh runs: python/muond has no import circle, and the
check finds one that is planted, through a TYPE_CHECKING import and a function-level one."""

import subprocess
import sys

from conftest import REPO_ROOT

CHECK = REPO_ROOT / "scripts" / "check_imports.py"


def run(package):
    return subprocess.run([sys.executable, str(CHECK), str(package)], capture_output=True, text=True, timeout=60)


def test_the_package_has_no_import_circle():
    result = run(REPO_ROOT / "python" / "muond")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no circle" in result.stdout


def test_a_planted_circle_is_found(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from .sub import b\n")
    (package / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import c\n")
    (package / "sub" / "c.py").write_text("def late():\n    from .. import a\n")
    (package / "d.py").write_text("from . import a\n")  # outside the circle
    result = run(package)
    assert result.returncode == 1, result.stdout
    assert "import circle among 3 modules" in result.stdout
    assert "pkg.sub.c imports pkg.a" in result.stdout and "pkg.d" not in result.stdout

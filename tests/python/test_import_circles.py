"""scripts/check_imports.py and check_doc_paths.py, which scripts/test.sh runs: python/muond has no
import circle and docs/architecture.md names no missing path, and each check finds a planted fault
(a circle through a TYPE_CHECKING import and a function-level one; a path that went)."""

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


def test_docs_name_only_paths_that_exist(tmp_path):
    # scripts/check_doc_paths.py, which scripts/test.sh runs on docs/architecture.md.
    check = REPO_ROOT / "scripts" / "check_doc_paths.py"
    ok = subprocess.run([sys.executable, str(check)], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    stale = tmp_path / "stale.md"
    stale.write_text("The seam is `server/transport/step_transport.h`; `server/transport/gone.h` went, "
                     "`server/transport/x/` is any transport.\n")
    found = subprocess.run([sys.executable, str(check), str(stale)], capture_output=True, text=True, timeout=60)
    assert found.returncode == 1
    assert "`server/transport/gone.h` does not exist" in found.stdout
    assert "step_transport.h" not in found.stdout and "transport/x/" not in found.stdout

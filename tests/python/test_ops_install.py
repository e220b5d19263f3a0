"""`cmake --install` into a temporary prefix: the binaries, libmuond_client with its headers, the proto
files and muond's CMake package, against which examples/mlp_trainer.cc builds out of tree with
find_package(muond CONFIG REQUIRED) and trains through a real daemon. And the Python package built as
a wheel by `pip wheel ./python`, installed on its own, reporting its version and stepping."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.ops

REPO_ROOT = Path(__file__).resolve().parents[2]


def build_dir() -> Path:
    configured = os.environ.get("MUOND_BUILD_DIR")
    path = Path(configured) if configured else REPO_ROOT / "build"
    if not (path / "CMakeCache.txt").is_file():
        pytest.skip(f"no configured build tree at {path}: build first or set MUOND_BUILD_DIR")
    return path


def run(*args, cwd=None, env=None, timeout=900):
    result = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, **(env or {})})
    assert result.returncode == 0, f"{' '.join(map(str, args))} exited {result.returncode}:\n" \
                                   f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("prefix")
    run("cmake", "--install", build_dir(), "--prefix", prefix)
    return prefix


def test_install_lays_out_the_package(prefix):
    api = ("muond", "session_spec", "step", "device_transport", "error_details")
    for path in ("bin/muond", "bin/muondctl", "include/muond/client/muond_client.h",
                 "include/muond/v1/muond.grpc.pb.h", "share/doc/muond/README.md",
                 *(f"include/muond/v1/{name}.pb.h" for name in api),
                 *(f"share/muond/proto/muond/v1/{name}.proto" for name in api)):
        assert (prefix / path).is_file(), path
    libdir = next(p for p in (prefix / "lib", prefix / "lib64") if (p / "cmake" / "muond").is_dir())
    assert (libdir / "libmuond_client.a").is_file()
    assert (libdir / "cmake" / "muond" / "muondConfig.cmake").is_file()
    assert (libdir / "cmake" / "muond" / "muondConfigVersion.cmake").is_file()
    assert os.access(prefix / "bin" / "muondctl", os.X_OK)
    assert run(prefix / "bin" / "muond", "--version").strip() == "muond 0.1.0"


def test_a_trainer_builds_against_the_installed_package_and_trains(prefix, tmp_path, start_daemon):
    project = tmp_path / "trainer"
    project.mkdir()
    (project / "CMakeLists.txt").write_text(textwrap.dedent(f"""\
        cmake_minimum_required(VERSION 3.20)
        project(trainer LANGUAGES CXX)
        set(CMAKE_CXX_STANDARD 20)
        find_package(muond 0.1 CONFIG REQUIRED)
        find_package(CLI11 CONFIG REQUIRED)
        add_executable(mlp_trainer {REPO_ROOT / "examples" / "mlp_trainer.cc"})
        target_link_libraries(mlp_trainer PRIVATE muond::client CLI11::CLI11)
        """))
    build = tmp_path / "trainer-build"
    configured = run("cmake", "-S", project, "-B", build, f"-DCMAKE_PREFIX_PATH={prefix}",
                     "-DCMAKE_BUILD_TYPE=Release")
    assert "Configuring done" in configured
    run("cmake", "--build", build, "-j2")
    # The include paths come from the installed package, not from this checkout.
    flags = (build / "CMakeFiles" / "mlp_trainer.dir" / "flags.make").read_text()
    assert str(prefix) in flags and str(REPO_ROOT) not in flags.replace(str(REPO_ROOT / "examples"), "")

    daemon = start_daemon()
    out = run(build / "mlp_trainer", "--endpoint", daemon.endpoint, "--session", "installed", "--steps", "5")
    assert "over 5 steps" in out and "step    5  loss" in out, out

    # A version the package does not satisfy is refused by find_package.
    (project / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.20)\nproject(t LANGUAGES CXX)\nfind_package(muond 9.0 CONFIG REQUIRED)\n")
    result = subprocess.run(["cmake", "-S", str(project), "-B", str(tmp_path / "b2"), f"-DCMAKE_PREFIX_PATH={prefix}"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "muond" in result.stderr


def test_python_wheel_installs_and_steps(tmp_path, start_daemon):
    # From a copy of python/ (with proto/ beside it, as in the repository), so that setuptools'
    # build folders stay out of the checkout.
    source = tmp_path / "src"
    shutil.copytree(REPO_ROOT / "python", source / "python",
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "_proto", "__pycache__"))
    shutil.copytree(REPO_ROOT / "proto", source / "proto")
    wheels = tmp_path / "wheels"
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", wheels,
        source / "python", cwd=tmp_path)
    [wheel] = wheels.glob("muond-*.whl")
    assert wheel.name.startswith("muond-0.1.0-")
    site = tmp_path / "site"
    run(sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", site, wheel, cwd=tmp_path)
    daemon = start_daemon()
    script = textwrap.dedent("""\
        import sys, torch, muond
        assert muond.__file__.startswith(sys.argv[2]), muond.__file__
        model = torch.nn.Linear(8, 4)
        opt = muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=sys.argv[1])
        model(torch.randn(3, 8)).sum().backward()
        opt.step()
        print(muond.__version__, opt.last_step)
        opt.close()
        from muond.transport import stream_copy  # built from muond/_stream_copy.c by the wheel
        assert stream_copy.available(), stream_copy.reason()
        """)
    # Only the wheel's folder on the path: not this checkout, not the build tree's stubs.
    out = run(sys.executable, "-c", script, daemon.endpoint, site, cwd=tmp_path,
              env={"PYTHONPATH": str(site), "PYTHONDONTWRITEBYTECODE": "1"})
    assert out.split() == ["0.1.0", "1"]

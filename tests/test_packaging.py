"""The release artefacts: what ``pip install celery-redislock`` would get.

Builds the sdist and, from it, the wheel (``python -m build``, as ``make
dist`` does), checks both with ``twine check --strict``, then installs the
wheel into a fresh venv and takes a lock with it against the session's real
redis-server, from a directory outside the checkout so that nothing but the
installed wheel can be imported.

Offline-safe: the build runs without isolation when the build backend
(hatchling, in the ``dev`` extra) is installed, so no package index is
needed; the fresh venv gets the wheel with ``pip install --no-deps
--no-index`` and finds the dependencies (celery, redis) through a ``.pth``
line naming this interpreter's site-packages. Directories named in a
``.pth`` file are appended to ``sys.path`` without processing the ``.pth``
files inside them, so this checkout's editable install stays invisible
there.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.packaging, pytest.mark.slow, pytest.mark.timeout(600)]

PROBE = r"""
import importlib.metadata as md
import importlib.resources
import json
import sys

import redis

import celery_redislock
from celery_redislock import LockManager

url = sys.argv[1]
pkg = importlib.resources.files("celery_redislock")
client = redis.Redis.from_url(url)
mgr = LockManager(url, namespace="wheel")
with mgr.lock(exclusive=["res:1"], timeout=5.0) as lease:
    fence = lease.fencing_token
    held = bool(client.hexists("{wheel}:lock:res:1", lease.token))
mgr.close()
print(json.dumps({
    "file": celery_redislock.__file__,
    "lua": sorted(p.name for p in (pkg / "lua").iterdir()),
    "typed": (pkg / "py.typed").is_file(),
    "fence": fence,
    "held": held,
    "released": not client.exists("{wheel}:lock:res:1"),
    "version": md.version("celery-redislock"),
    "commands": [
        ep.value for ep in md.entry_points(group="celery.commands") if ep.name == "redislock"
    ],
}))
"""


def _run(*cmd: str | Path, cwd: Path | None = None) -> str:
    proc = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=540
    )
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    cmd: list[str | Path] = [sys.executable, "-m", "build", "--outdir", out, ROOT]
    if importlib.util.find_spec("hatchling") is not None:
        cmd.insert(3, "--no-isolation")
    _run(*cmd)
    return out


def test_sdist_and_wheel_pass_twine_check(dist: Path) -> None:
    files = sorted(p.name for p in dist.iterdir())
    version = _version()
    assert files == [
        f"celery_redislock-{version}-py3-none-any.whl",
        f"celery_redislock-{version}.tar.gz",
    ]
    _run(sys.executable, "-m", "twine", "check", "--strict", *sorted(dist.iterdir()))


def test_wheel_ships_lua_scripts_typing_marker_and_licence(dist: Path) -> None:
    (wheel,) = dist.glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = zf.read(meta_name).decode()
    lua = {
        f"celery_redislock/lua/{p.name}" for p in (ROOT / "celery_redislock" / "lua").glob("*.lua")
    }
    assert lua and lua <= names
    assert "celery_redislock/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "License-Expression: BSD-3-Clause" in meta
    assert "Project-URL: Repository, https://" in meta
    assert "pip install celery-redislock" in meta  # the README is the long description


def test_installed_wheel_takes_a_lock_in_a_fresh_venv(
    dist: Path, redis_url: str, tmp_path: Path
) -> None:
    (wheel,) = dist.glob("*.whl")
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv)
    py = venv / "bin" / "python"
    _run(
        sys.executable, "-m", "pip", "--python", py, "install",
        "--no-deps", "--no-index", "--no-cache-dir", "--quiet", wheel,
    )  # fmt: skip
    site = Path(
        _run(py, "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip()
    )
    (site / "_shared_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    away = tmp_path / "elsewhere"
    away.mkdir()
    out = json.loads(_run(py, "-I", "-c", PROBE, redis_url, cwd=away))
    assert Path(out["file"]).is_relative_to(site), out["file"]
    assert out["lua"] == sorted(p.name for p in (ROOT / "celery_redislock" / "lua").glob("*.lua"))
    assert out["typed"] and out["held"] and out["released"] and out["fence"] >= 1
    assert out["version"] == _version()
    assert out["commands"] == ["celery_redislock.integration.cli:redislock"]
    # The operator CLI of the installed wheel, without an app.
    status = json.loads(
        _run(py, "-I", "-m", "celery_redislock", "--url", redis_url, "--namespace", "wheel",
             "status", "--json", cwd=away)
    )  # fmt: skip
    assert status["namespace"] == "wheel"


def _version() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("version = "))
    return line.split('"')[1]

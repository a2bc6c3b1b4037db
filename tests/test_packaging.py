"""The wheel a user installs: built from this tree with ``pip wheel . --no-deps``, installed into a
brand-new virtual environment, and checked from outside the source tree:

* ``import k3tail`` works and imports the installed copy (not this checkout);
* the ``k3tail doctor`` console script runs and exits 0;
* no top-level ``triton_kernels`` or ``cute_fallback`` module is importable (they install as
  ``k3tail.triton_kernels`` and ``k3tail.cute_fallback``: a top-level ``triton_kernels`` would
  collide with the package of that name that vLLM imports), and the wheel holds no such folder;
* the shipped tactic table is in the wheel.

The fresh venv gets the wheel only (``--no-deps``); its dependencies (torch, triton, numpy) are
made visible through one ``.pth`` line naming the running environment's site-packages, so the test
does not download or copy torch.  A ``.pth`` line only adds a path: ``.pth`` files inside that
path (the editable install of this checkout, if any) are not executed, so the checkout cannot leak
in; the test asserts where ``k3tail`` was imported from.
"""

import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert r.returncode == 0, f"{cmd} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "-q", "-w", str(out)])
    wheels = list(out.glob("k3tail-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_contents(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names}
    assert "k3tail" in tops
    assert not tops & {"triton_kernels", "cute_fallback", "tests", "bench"}, tops
    for must in ("k3tail/triton_kernels/lamport.py", "k3tail/cute_fallback/mnnvl.py", "k3tail/tables/tactics.json",
                 "k3tail/tools/cli.py", "k3tail/runtime/launch.py", "k3tail/ops/tail.py"):
        assert must in names, must


def test_fresh_venv_import_doctor_and_no_top_level_kernels(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (site / "k3tail_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    _run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], env=env, cwd=tmp_path)

    probe = (
        "import importlib.util, json, k3tail, k3tail.triton_kernels, k3tail.cute_fallback\n"
        "print(json.dumps({'k3tail': k3tail.__file__, 'kernels': k3tail.triton_kernels.__file__,\n"
        "  'top_triton_kernels': importlib.util.find_spec('triton_kernels') is not None,\n"
        "  'top_cute_fallback': importlib.util.find_spec('cute_fallback') is not None}))\n"
    )
    import json

    info = json.loads(_run([str(py), "-c", probe], env=env, cwd=tmp_path).stdout.strip().splitlines()[-1])
    assert Path(info["k3tail"]).is_relative_to(site), info
    assert Path(info["kernels"]).is_relative_to(site), info
    assert not info["top_triton_kernels"] and not info["top_cute_fallback"], info

    r = _run([str(env_dir / "bin" / "k3tail"), "doctor"], env=env, cwd=tmp_path)
    assert "TAIL_FUSION" in r.stdout or "TAIL_FUSION" in r.stderr, r.stdout[-2000:]

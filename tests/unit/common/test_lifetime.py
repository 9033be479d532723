"""end_with: a process that watches another (not its parent) ends when that one ends, however it ends."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

WATCHER = "import sys, time; from services.common.lifetime import end_with; end_with(int(sys.argv[1])); " \
          "print('watching', flush=True); time.sleep(60)"
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="pidfds are Linux's")


def test_a_process_watching_another_is_killed_when_that_one_is_killed_with_sigkill():
    watched = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watcher = subprocess.Popen([sys.executable, "-c", WATCHER, str(watched.pid)], stdout=subprocess.PIPE, text=True)
    try:
        assert watcher.stdout.readline().strip() == "watching"
        time.sleep(0.2)
        assert watcher.poll() is None  # alive while the watched process is
        watched.kill()
        watched.wait()
        assert watcher.wait(timeout=10) == -9
    finally:
        watched.kill()
        watcher.kill()


def test_a_process_told_to_watch_one_that_has_already_ended_ends_at_once():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    watcher = subprocess.run([sys.executable, "-c", WATCHER, str(gone.pid)], capture_output=True, text=True,
                             timeout=30)
    assert watcher.returncode == -9 and "watching" not in watcher.stdout

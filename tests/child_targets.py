"""Functions run in spawned children by test_runner.py (a child must be able to import them)."""

import os
import signal
import subprocess
import sys
import time

PARENT_PID = os.getppid()


def echo_env(name):
    return {
        "value": os.environ.get(name),
        "pid_differs": os.getpid() != int(os.environ.get("ACCELAB_TEST_PARENT", "0")),
    }


def fail(message):
    raise ValueError(message)


def fake_cuda_oom(_=None):
    import torch

    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (fake, raised by a test)")


def kill_self(_=None):
    os.kill(os.getpid(), signal.SIGKILL)


def exit_now(code):
    os._exit(code)


def hang_with_grandchild(pid_file):
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(pid_file, "w") as f:
        f.write(f"{os.getpid()} {grandchild.pid}")
    time.sleep(600)


def sleep(seconds):
    time.sleep(seconds)
    return seconds

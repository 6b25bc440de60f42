"""Faults of the file system injected for real: a tmpfs mounted as root (no
framework imported: the JAX run uses them too)."""

import contextlib
import os
import subprocess

import pytest


@contextlib.contextmanager
def tmpfs(path, size="256k", read_only=False):
    """A tmpfs of `size` mounted at `path` for the test, unmounted after it;
    the unmount must succeed (nothing kerasdbg opened is left open)."""
    os.makedirs(path, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", path],
                             capture_output=True, text=True, timeout=30)
    if mounted.returncode:
        pytest.fail(f"this test injects the fault for real and needs root to mount a tmpfs at "
                    f"{path}: mount said {mounted.stderr.strip()!r}")
    busy = None
    try:
        yield path
    finally:
        unmounted = subprocess.run(["umount", path], capture_output=True, text=True, timeout=30)
        if unmounted.returncode:
            busy = unmounted.stderr.strip()
            subprocess.run(["umount", "-l", path], capture_output=True, timeout=30)
    assert busy is None, f"the tmpfs could not be unmounted after the fit: {busy}"


def open_files_under(path):
    """The files this process holds open under `path`."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(path)):
            found.append(target)
    return found

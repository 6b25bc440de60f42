"""Starts a cluster of worker processes on 127.0.0.1 and collects what each
one reports.

Each worker runs `python -m tests.multiworker.worker OUT SCENARIO...` with
its own `TF_CONFIG`, on free ports, and writes one JSON file per scenario
under `OUT/worker_<i>/`. The whole cluster has one deadline: a worker still
running then (a hang in a collective) is killed with its process group, and
nothing is left behind in any case.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_ports(count):
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class ClusterError(AssertionError):
    """A worker failed or hung; the message holds every worker's output."""


def run(out, scenarios, workers=2, timeout=420):
    """Runs `scenarios` (names in tests/multiworker/worker.py) on `workers`
    processes; returns `{scenario: [result of worker 0, worker 1, ...]}`."""
    ports = free_ports(workers)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    processes, logs = [], []
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    try:
        for index in range(workers):
            log = open(os.path.join(out, f"worker_{index}.log"), "w+")
            logs.append(log)
            worker_env = dict(env, TF_CONFIG=json.dumps(
                {"cluster": cluster, "task": {"type": "worker", "index": index}}))
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "tests.multiworker.worker", out, *scenarios],
                cwd=ROOT, env=worker_env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
            time.sleep(0.2)
        hung = [i for i, p in enumerate(processes) if p.poll() is None]
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    failed = [i for i, p in enumerate(processes) if p.returncode != 0]
    if hung or failed:
        raise ClusterError(
            f"workers {hung} hung past {timeout} s, workers {failed} failed:\n"
            + "\n".join(f"--- worker {i} ---\n{o[-6000:]}" for i, o in enumerate(outputs)))
    results = {}
    for scenario in scenarios:
        results[scenario] = []
        for index in range(workers):
            with open(os.path.join(out, f"worker_{index}", f"{scenario}.json")) as handle:
                results[scenario].append(json.load(handle))
    results["_outputs"] = outputs
    return results

"""`python -m specserve.launch_server` (or another server entry point) in a subprocess on a
free loopback port, for the tests that drive the real server over HTTP."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from typing import IO

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(port: int, *flags: str, log: IO | None = None) -> subprocess.Popen:
    """fp32 on the CPU, warnings and errors only; `log` gets its stdout and stderr."""
    return start_server_module("specserve.launch_server", "--host", "127.0.0.1", "--port", str(port),
                               "--dtype", "float32", "--log-level", "warning", *flags, log=log)


def start_server_module(module: str, *args: str, log: IO | None = None) -> subprocess.Popen:
    """`python -m module *args` (a server's entry point) run from the repository root."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT if log else None)


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def server_load(base_url: str) -> dict:
    return httpx.get(base_url + "/get_server_info").json()


def wait_idle(base_url: str, timeout: float = 10.0) -> dict:
    """A finished request's slots are freed by the engine thread: poll briefly."""
    deadline = time.monotonic() + timeout
    while True:
        info = server_load(base_url)
        idle = info["kv_free_slots"] == info["kv_total_slots"] and info["num_running"] == info["num_waiting"] == 0
        if idle or time.monotonic() > deadline:
            return info
        time.sleep(0.05)


def engine_pid(server_pid: int) -> int:
    """The pid of the server's engine process (its child started by multiprocessing's spawn)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat, open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
                command = cmdline.read()
        except (OSError, ValueError, IndexError):
            continue   # gone meanwhile
        if parent == server_pid and b"spawn_main" in command:
            return int(entry)
    raise LookupError(f"the server (pid {server_pid}) has no engine process")

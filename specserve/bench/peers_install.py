"""The peers' carried wheels, installed beside the GPU image's packages without touching them.

Each engine has its own set of wheels (`.peers_wheels/<engine>/`, or `<engine>.tar` as
split-for-device rebuilds it in /root/models) holding exactly what the image lacks or has
in a version the engine cannot use (SGLang 0.5.17 needs transformers 5.12.1); torch and the
CUDA libraries always come from the image. They go into a target directory of their own,
which only that engine's server puts first on PYTHONPATH.

`pip install --target` ignores what is installed, so it would fetch torch and every other
dependency again: the set is curated (peers_stage.sh), installed with --no-deps, and the
image supplies the rest.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import tarfile

from specserve.bench.file_lock import exclusive

_STAMP = ".installed_wheels"


class WheelsMissing(RuntimeError):
    """No carried wheels for an engine that needs some."""


def wheel_dir(engine: str, wheels_roots: list[str], envs_root: str) -> str | None:
    """The engine's wheel directory: the first `<root>/<engine>/` holding wheels, else the first
    `<root>/<engine>.tar`, unpacked under envs_root; None when there is neither."""
    for root in wheels_roots:
        directory = os.path.join(root, engine)
        if glob.glob(os.path.join(directory, "*.whl")):
            return directory
    archives = [os.path.join(root, f"{engine}.tar") for root in wheels_roots]
    archive = next((a for a in archives if os.path.exists(a)), None)
    if archive is None:
        return None
    unpacked = os.path.join(envs_root, "wheels", engine)
    if not glob.glob(os.path.join(unpacked, "*.whl")):
        os.makedirs(unpacked, exist_ok=True)
        with tarfile.open(archive) as tar:
            tar.extractall(unpacked, filter="data")
    return unpacked


def install(engine: str, wheels_roots: list[str], envs_root: str, required: bool = True) -> str | None:
    """Installs the engine's wheels into `<envs_root>/<engine>` (once: a stamp lists what is
    there) and returns that directory; None when the engine has no wheels and none are
    `required` (its packages must then import from the image). Jobs on other GPUs of the
    machine installing the same engine meanwhile are waited for (file_lock.py)."""
    with exclusive(os.path.join(envs_root, engine)):
        return _install(engine, wheels_roots, envs_root, required)


def _install(engine: str, wheels_roots: list[str], envs_root: str, required: bool) -> str | None:
    source = wheel_dir(engine, wheels_roots, envs_root)
    if source is None:
        if required:
            where = ", ".join(f"{root}/{engine}/ or {root}/{engine}.tar" for root in wheels_roots)
            raise WheelsMissing(f"no wheels for {engine} in {where} (stage them with specserve/bench/peers_stage.sh)")
        return None
    wheels = sorted(glob.glob(os.path.join(source, "*.whl")))
    target = os.path.join(envs_root, engine)
    wanted = "\n".join(os.path.basename(w) for w in wheels)
    if _read(os.path.join(target, _STAMP)) == wanted:
        return target
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--find-links", source, "--no-deps",
               "--no-compile", "--no-cache-dir", "--upgrade", "--target", target, *wheels]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise WheelsMissing(f"pip could not install {engine}'s wheels: {done.stderr.strip()[-1500:]}")
    with open(os.path.join(target, _STAMP), "w") as f:
        f.write(wanted)
    return target


def server_env(site_dir: str | None, repo_root: str, extra: dict[str, str]) -> dict[str, str]:
    """The environment of an engine's server: its wheels first, then the repository (for
    specserve), then whatever PYTHONPATH held; no hub downloads."""
    paths = [p for p in (site_dir, repo_root, os.environ.get("PYTHONPATH")) if p]
    libraries = [*cuda_library_dirs(), *filter(None, [os.environ.get("LD_LIBRARY_PATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "LD_LIBRARY_PATH": os.pathsep.join(libraries),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **extra}


def cuda_library_dirs() -> list[str]:
    """The image's CUDA runtime libraries as torch's wheels ship them (`nvidia/<package>/lib`):
    prebuilt extensions a peer carries (sgl-deep-gemm's `_C.so` needs libnvrtc.so.13 and
    libcublasLt.so.13) are loaded by the dynamic linker, which does not look where torch does."""
    found = []
    for entry in sys.path:
        found += sorted(glob.glob(os.path.join(entry, "nvidia", "*", "lib")))
    return list(dict.fromkeys(found))


def engine_version(engine: str, site_dir: str | None, repo_root: str) -> str:
    """`vllm 0.26.0`, `sglang 0.5.17`, or specserve's commit: $SPECSERVE_COMMIT where the
    tree's git metadata may be stale (a device machine's copy of a working tree), else git's."""
    if engine == "specserve":
        if os.environ.get("SPECSERVE_COMMIT"):
            return f"specserve {os.environ['SPECSERVE_COMMIT']}"
        done = subprocess.run(["git", "-C", repo_root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        return f"specserve {done.stdout.strip() or 'unknown'}"
    for info in glob.glob(os.path.join(site_dir or "", f"{engine}-*.dist-info")):
        return f"{engine} {os.path.basename(info).removesuffix('.dist-info').split('-', 1)[1]}"
    return f"{engine} (not installed)"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None

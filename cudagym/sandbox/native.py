"""Native helper libraries of the sandbox (the op watcher, the kernel watcher): built once per
compiler, flags and source into the cache, by one function both use (`build_shared`)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import uuid
from pathlib import Path

from cudagym.errors import ToolchainError

CXX = "g++"
BUILD_TIMEOUT_S = 300.0


def compiler_identity(cxx: str) -> tuple[str, str]:
    """(resolved path, path and `--version` output) of `cxx`."""
    found = shutil.which(cxx)
    if found is None:
        raise ToolchainError(f"compiler {cxx!r} was not found on PATH; the op watcher needs it")
    path = os.path.realpath(found)
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ToolchainError(f"cannot run compiler {path}: {e}") from e
    return path, f"{path}\n{version}"


def build_shared(cache_dir: Path, source: Path, compile_flags: list[str], link_flags: list[str], identity: str,
                 cxx: str = CXX) -> Path:
    """`cache_dir/opwatch/<key>/lib<source stem>.so`, compiled from `source` with the flags if
    absent; the key hashes the compiler's identity, `identity` (what else the build depends on),
    the flags and the source. The library is linked under a temporary directory and renamed into
    place, so concurrent builders are safe (the first rename wins; the others use it). Raises
    `ToolchainError` when the compiler is missing, fails or runs past `BUILD_TIMEOUT_S`.
    """
    from cudagym.sandbox.toolchain import run_tool, trim_log

    path, compiler = compiler_identity(cxx)
    name = f"lib{source.stem}.so"
    key = hashlib.sha256("\0".join([compiler, identity, *compile_flags, *link_flags, name]).encode()
                         + b"\0" + source.read_bytes()).hexdigest()[:32]
    root = Path(cache_dir).resolve() / "opwatch"
    final = root / key
    if (final / name).is_file():
        return final / name
    staging = root / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir(parents=True)
    try:
        argv = [path, *compile_flags, str(source), "-o", str(staging / name), *link_flags]
        run = run_tool(argv, staging, {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C",
                                   "LC_ALL": "C", "TMPDIR": str(staging)}, BUILD_TIMEOUT_S)
        if run.timed_out:
            raise ToolchainError(f"building {source.name} timed out after {BUILD_TIMEOUT_S:g} s")
        if run.returncode != 0 or not (staging / name).is_file():
            raise ToolchainError(f"building {source.name} failed with status "
                                 f"{run.returncode}:\n{trim_log(run.output, 40)}")
        try:
            os.rename(staging, final)
        except OSError:  # another process renamed the same key into place first: use theirs
            pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final / name

"""What a worker has mapped executable, read by the sandbox from outside it (`/proc/<pid>/maps`).

Verify's and the profile's workers report the native code they mapped that the harness did not
build (`cudagym.sandbox.worker.verify.unbuilt_code`), but that report is made in the candidate's
own process, where its code can rewrite what the harness reads. The local sandbox reads every
process of the job's worker from outside, once before the job starts (the spare as it was
prewarmed, before any candidate code) and once after its result is in (before the kill), and
adds what appeared in between (`unbuilt`) to the job's result: a file the job could write (under
its workspace, outside the candidate's build artifacts and the harness's own inline builds), or an
image with no file (memfd), as the worker reports too, but out of the candidate's reach.

Anonymous executable memory that appeared is named only where the job asks (`anonymous`: the CPU
target, whose verify and profile workers run torch with oneDNN off): torch's own CPU ops write code
there at run time (oneDNN's JIT: a GELU on the CPU maps 256 KiB of it), in the candidate's worker
too (the reference runs there), so elsewhere a generated library's pages copied into anonymous
memory and remapped over the file's cannot be told from torch's by the memory map
(docs/protection.md). Code mapped and unmapped again between the two reads is not seen.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

MAX_REPORTED = 32
UNREADABLE = "<the worker's memory map could not be read from outside it>"


def _anonymous(path: str) -> bool:
    """Memory with no file of its own: private or shared anonymous mappings (the latter show as
    /dev/zero, deleted), named ones, System V segments."""
    return path.startswith(("[anon", "/dev/zero", "/SYSV"))


# Directories a job (or another job) can write besides its workspace: a library found there that
# the harness did not build is code the harness did not build (red team 6's b1 loaded the
# compile-baseline job's inductor library from the evaluator's cache)
SCRATCH_ROOTS = ("/tmp/", "/var/tmp/", "/dev/shm/")

Mapping = tuple[int, str, str, bool]  # pid, address range, path ("" for anonymous memory), executable


def exec_mappings(pids: Iterable[int]) -> set[Mapping] | None:
    """Every executable mapping of the processes `pids`, and every mapping of a file that is not
    executable now (pages of a library can be made executable only while they run); None where one
    of them could not be read (it hid its map or is gone)."""
    out: set[Mapping] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
                for line in f:
                    parts = line.split(maxsplit=5)
                    if len(parts) < 5:
                        continue
                    path = parts[5].strip() if len(parts) == 6 else ""
                    path = "" if _anonymous(path) else path
                    executable = "x" in parts[1]
                    if executable or path.startswith("/"):
                        out.add((pid, parts[0], path, executable))
        except FileNotFoundError:
            continue  # a process of the tree that has exited meanwhile
        except OSError:
            return None
    return out


def _is_elf(path: str) -> bool:
    """Whether `path` is an ELF image (a mapped file deleted since counts as one: it cannot be told)."""
    try:
        with open(path.removesuffix(" (deleted)"), "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return path.endswith(" (deleted)")


def unbuilt(before: set[Mapping] | None, after: set[Mapping] | None, workspace: str, built: Iterable[str],
            anonymous: bool = False, reachable: Iterable[str] = ()) -> list[str]:
    """What `after` maps that `before` did not and the harness did not build (see the module's
    text): memfd images mapped executable; files of the workspace or of a directory jobs can write
    (`reachable`, `SCRATCH_ROOTS`) mapped executable, or ELF images mapped there at all; anonymous
    executable memory with `anonymous`. `built`: the directories of the harness's builds for the job."""
    if after is None:
        return [UNREADABLE]
    before = before or set()
    roots = [os.path.realpath(r) + "/" for r in built if r]
    writable = [os.path.realpath(r) + "/" for r in (workspace, *reachable) if r] + list(SCRATCH_ROOTS)
    seen_before = {(pid, span, path) for pid, span, path, x in before if x}
    found: list[str] = []
    for pid, span, path, executable in sorted(after):
        if (pid, span, path) in seen_before or (pid, span, path, executable) in before:
            continue
        if not path:
            if anonymous and executable:
                lo, hi = (int(x, 16) for x in span.split("-"))
                found.append(f"<anonymous executable memory {span} ({(hi - lo) >> 10} KiB), written at run time>")
        elif path.startswith("[") or any(path.startswith(r) for r in roots):
            continue  # [vdso] and the like, the harness's builds
        elif path.startswith("/memfd:"):
            if executable:
                found.append(path)
        elif any(path.startswith(r) for r in writable) and (executable or _is_elf(path)):
            found.append(path)
    return list(dict.fromkeys(found))[:MAX_REPORTED]

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


def exec_mappings(pids: Iterable[int]) -> set[tuple[int, str, str]] | None:
    """(pid, address range, path) of every executable mapping of the processes `pids` ("" for
    anonymous memory); None where one of them could not be read (it hid its map or is gone)."""
    out: set[tuple[int, str, str]] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
                for line in f:
                    parts = line.split(maxsplit=5)
                    if len(parts) >= 5 and "x" in parts[1]:
                        path = parts[5].strip() if len(parts) == 6 else ""
                        out.add((pid, parts[0], "" if _anonymous(path) else path))
        except FileNotFoundError:
            continue  # a process of the tree that has exited meanwhile
        except OSError:
            return None
    return out


def unbuilt(before: set[tuple[int, str, str]] | None, after: set[tuple[int, str, str]] | None,
            workspace: str, built: Iterable[str], anonymous: bool = False) -> list[str]:
    """What `after` maps executable that `before` did not and the harness did not build (see the
    module's text: files and memfd images; anonymous memory with `anonymous`); `built`: the
    directories of the harness's builds for the job."""
    if after is None:
        return [UNREADABLE]
    before = before or set()
    roots = [os.path.realpath(r) + "/" for r in built if r]
    ws = os.path.realpath(workspace) + "/" if workspace else None
    found: list[str] = []
    for _pid, span, path in sorted(after - before):
        if not path and anonymous:
            lo, hi = (int(x, 16) for x in span.split("-"))
            found.append(f"<anonymous executable memory {span} ({(hi - lo) >> 10} KiB), written at run time>")
        elif not path or path.startswith("[") or any(path.startswith(r) for r in roots):
            continue  # [vdso] and the like, the harness's builds
        elif path.startswith("/memfd:") or (ws and path.startswith(ws)):
            found.append(path)
    return list(dict.fromkeys(found))[:MAX_REPORTED]

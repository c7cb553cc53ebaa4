"""Dependency manifests: a two-level build cache that knows every file a build read.

Compiled outputs (the compile tool's objects, `load_inline` modules) are cached in two levels,
like ccache's manifest mode:

1. a *first key* over everything known before compiling, chosen by the caller (compiler
   identity, command line, source bytes, torch version, ...);
2. under it, one *variant* per set of dependencies seen: `<root>/<key>/<variant>/` holds the
   output and `deps.json`, the *manifest*: every file the compiler reported reading that is not
   under a trusted root, with its sha256. A variant is named by the hash of its manifest, so
   builds that read the same files land on one name.

A lookup hashes the current files that each manifest names and takes a variant whose files
all match (of several, the one naming the most files: it accounts for more of what is there
now). A miss compiles and stores a new variant. Variants are written to a temporary directory
and renamed into place, never overwritten: once visible, a variant never changes (its files are
read-only, and the digests in its `outputs.json` are checked before it is used).

Dependencies come from the compiler's own dependency output: `-MD`, not `-MMD` (which drops
headers the source itself marks as system headers, with `#pragma GCC system_header` or a
`# 1 "x" 3` linemarker, and so can be made to hide any header), and, with GNU as, the
assembler's `--MD` (files of `.incbin` and `.include`). A file is *trusted*, and left out,
only if both its lexical and its resolved path lie under a trusted root (the compiler's own
include directories, /usr/include, /usr/lib/gcc, torch's, Python's and CUDA's directories:
nothing a candidate can write; the compiler identity and the torch version in the first key
stand for them). A path is recorded as the compiler opened it: relative to the workspace when
it lies in it (so identical files in another workspace match), absolute otherwise. A file the
compiler reported that the manifest cannot stand for fails the build (`UnrecordedDependencyError`):
one under /proc, /dev or /sys, named so or reached through a symlink (`/proc/self/cwd` is the
compiler's directory when the compiler reads it and the evaluator's when the evaluator hashes
it), and one the evaluator cannot hash (missing, unreadable, not a regular file). Left out of
the manifest, such a file would let a later build reuse the variant whatever the file holds.

Not covered here, as in ccache's direct mode: a file whose mere existence changed the build
without being read (`__has_include`, or a header created in an include directory searched before
the one the recorded header came from). The compile tool and the `load_inline` cache cover it
for the workspace by putting the names of every file their build's copy holds in the first key
(`cudagym.sandbox.toolchain.source_listing`); outside the workspace and trusted roots (an
absolute include path), the cache reuses the variant built before such a file appeared.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

DEPS_FILE = "deps.json"
OUTPUTS_FILE = "outputs.json"  # sha256 of every other file of a cache entry, checked when used
_READ_CHUNK = 1 << 20


def parse_depfile(text: str) -> list[str]:
    """The prerequisites of a make-style dependency file (gcc's and nvcc's `-MD` output, GNU as's
    `--MD`): `target: dep dep \\` lines, with `\\ ` for a space in a path and `$$` for `$`."""
    body = text.replace("\\\r\n", " ").replace("\\\n", " ")
    _, sep, rest = body.partition(":")
    if not sep:
        return []
    deps: list[str] = []
    current: list[str] = []
    i = 0
    while i < len(rest):
        c = rest[i]
        if c == "\\" and i + 1 < len(rest) and rest[i + 1] in " #":
            current.append(rest[i + 1])
            i += 2
            continue
        if c == "$" and rest[i + 1 : i + 2] == "$":
            current.append("$")
            i += 2
            continue
        if c.isspace():
            if current:
                deps.append("".join(current))
                current = []
        else:
            current.append(c)
        i += 1
    if current:
        deps.append("".join(current))
    return deps


def host_path(path: str, paths: dict[str, str]) -> str:
    """`path` as a job's worker named it, where it is on this host: under the longest worker
    directory of `paths` ({worker dir: host dir}), moved to that directory's host side; any other
    path (relative, or one the worker saw where the host has it) unchanged."""
    for inside in sorted(paths, key=len, reverse=True):
        if path == inside or path.startswith(inside.rstrip("/") + "/"):
            return paths[inside].rstrip("/") + path[len(inside.rstrip("/")):]
    return path


def file_digest(path: str | os.PathLike[str]) -> str | None:
    """sha256 of a regular file's bytes; None when it is missing or not a regular file (a FIFO
    or a device is never opened for reading, so a lookup cannot be made to block)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        h = hashlib.sha256()
        while chunk := os.read(fd, _READ_CHUNK):
            h.update(chunk)
        return h.hexdigest()
    except OSError:
        return None
    finally:
        os.close(fd)


def _under(path: str, roots: Iterable[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


class Roots:
    """A set of directories (trusted roots, a build's scratch), compared lexically and resolved."""

    def __init__(self, dirs: Iterable[str]) -> None:
        found = {p for d in dirs if d for p in (os.path.normpath(d), os.path.realpath(d))}
        self.dirs = tuple(sorted(found))

    def contains(self, path: str) -> bool:
        """Whether `path` (absolute) is under a root both as written and once resolved."""
        return _under(os.path.normpath(path), self.dirs) and _under(os.path.realpath(path), self.dirs)


def compiler_include_dirs(compiler: str) -> list[str]:
    """The directories `compiler` searches for `#include <...>` by itself (its `-E -v` list)."""
    try:
        r = subprocess.run([compiler, "-E", "-v", "-x", "c++", os.devnull], capture_output=True, text=True,
                           timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return []
    dirs, inside = [], False
    for line in r.stderr.splitlines():
        if line.startswith("#include <...> search starts here"):
            inside = True
        elif line.startswith("End of search list"):
            break
        elif inside and line.startswith(" "):
            dirs.append(line.strip().removesuffix(" (framework directory)"))
    return dirs


def system_roots(compiler: str, *extra: str | None) -> Roots:
    """The trusted roots of builds by `compiler`: its include directories, /usr/include,
    /usr/lib/gcc, torch's and Python's include directories, and `extra` (CUDA's home)."""
    import sysconfig

    import torch

    return Roots([*compiler_include_dirs(compiler), "/usr/include", "/usr/lib/gcc",
                         os.path.join(os.path.dirname(torch.__file__), "include"),
                         sysconfig.get_path("include", scheme="posix_prefix") or "", *(e or "" for e in extra)])


PROCESS_DEPENDENT = ("/proc", "/dev", "/sys")  # what a path there holds depends on the process reading it


class UnrecordedDependencyError(ValueError):
    """A file the compiler read that a manifest cannot stand for: under /proc, /dev or /sys (its
    contents depend on which process reads it: `/proc/self/cwd` is the compiler's directory for the
    compiler and the evaluator's for the evaluator), or one the evaluator cannot hash (missing,
    unreadable, not a regular file). `problems` are readable lines, one per file; the build must
    fail (a variant without that file in its manifest would be reused whatever the file holds)."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def process_dependent(path: str) -> str | None:
    """The first path under /proc, /dev or /sys that `path` (absolute) names, lexically or on the
    way the kernel resolves it (a symlink such as /etc/mtab -> ../proc/self/mounts), or None."""
    if _under(os.path.normpath(path), PROCESS_DEPENDENT):
        return os.path.normpath(path)
    pending = [p for p in path.split("/") if p]
    cur, hops = "/", 0
    while pending:
        part = pending.pop(0)
        if part == ".":
            continue
        nxt = os.path.dirname(cur) if part == ".." else os.path.join(cur, part)
        if _under(nxt, PROCESS_DEPENDENT):
            return nxt
        if part != "..":
            try:
                link = os.readlink(nxt)
            except OSError:  # not a symlink, or missing: taken as written
                link = None
            if link is not None:
                hops += 1
                if hops > 40:  # a symlink loop: the compiler could not have opened it either
                    return None
                pending[:0] = [p for p in link.split("/") if p]
                if link.startswith("/"):
                    cur = "/"
                continue
        cur = nxt
    return None


def record(deps: Iterable[str], *, cwd: Path, workspace: Path, trusted: Roots,
           exclude: Roots | None = None, assembler: Iterable[str] = ()) -> dict[str, str]:
    """The manifest of a build that just ran: {path: sha256} of its untrusted dependencies.

    `deps` are paths as the compiler (the preprocessor) reported them, relative to `cwd` (where
    it ran); `assembler` what GNU as reported (`--MD`). Files under `exclude` (the build's own
    scratch: generated sources, temporaries) are left out. A file under /proc, /dev or /sys, or
    one that cannot be hashed here, raises `UnrecordedDependencyError` (never silently left out: the
    variant would then be reused whatever that file holds for the next build). The only names
    skipped for being missing are the assembler's: GNU as lists the `.file` names, which it
    never opens, and fails on an `.incbin` or `.include` it cannot read. Nothing writes the
    build's copy of the workspace while the compiler runs.
    """
    ws = str(workspace)
    out: dict[str, str] = {}
    problems: list[str] = []
    tolerant = set(assembler)
    for dep in [*deps, *assembler]:
        path = os.path.join(str(cwd), dep)
        if trusted.contains(path):
            continue
        where = process_dependent(path)
        if where is not None:
            problems.append(f"'{dep}': kernels may not include files under /proc, /dev or /sys (what such a "
                            f"file holds depends on the process that reads it); include headers by a path "
                            f"relative to the source or to kernels/")
            continue
        if exclude is not None and exclude.contains(path):
            continue
        digest = file_digest(path)
        if digest is None:
            if dep in tolerant and not os.path.lexists(path):
                continue
            problems.append(f"'{dep}': a file the compiler read could not be recorded in the build cache's "
                            f"manifest (missing, unreadable or not a regular file where the evaluator looks "
                            f"for it); include only regular files of kernels/ and system headers")
            continue
        # The lexical form where it names the same file; else the path exactly as opened (a
        # symlink followed by '..' resolves elsewhere than the text suggests).
        norm = os.path.normpath(path)
        name = norm if os.path.realpath(norm) == os.path.realpath(path) else path
        if _under(name, [ws]) and name != ws:
            name = name[len(ws) + 1 :]
        out[name] = digest
    if problems:
        raise UnrecordedDependencyError(list(dict.fromkeys(problems)))
    return dict(sorted(out.items()))


def matches(manifest: dict[str, str], workspace: Path, digests: dict[str, str | None] | None = None) -> bool:
    """Whether every file of `manifest` has its recorded content now (relative paths inside
    `workspace`). `digests` memoizes file hashes across the lookups of one build."""
    memo = {} if digests is None else digests
    for name, digest in manifest.items():
        path = name if os.path.isabs(name) else os.path.join(str(workspace), name)
        if path not in memo:
            memo[path] = file_digest(path)
        if memo[path] != digest:
            return False
    return True


def seal_outputs(entry: Path) -> None:
    """Record the digest of every file of a cache entry about to be renamed into place, and make
    its files read-only: once visible, an entry never changes (`outputs_intact` checks it)."""
    files = sorted(p for p in entry.rglob("*") if p.is_file() and p.name != OUTPUTS_FILE)
    digests = {p.relative_to(entry).as_posix(): file_digest(p) for p in files}
    (entry / OUTPUTS_FILE).write_text(json.dumps(digests, sort_keys=True))
    for p in [*files, entry / OUTPUTS_FILE]:
        p.chmod(0o444)


def outputs_intact(entry: Path) -> bool:
    """Whether every file `seal_outputs` recorded for `entry` still has its digest."""
    try:
        digests = json.loads((entry / OUTPUTS_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(digests, dict) and all(file_digest(entry / name) == d for name, d in digests.items())


class VariantStore:
    """Variants under `root/<key>/` (see the module docstring); safe across threads and processes."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def find(self, key: str, workspace: Path, digests: dict[str, str | None] | None = None) -> Path | None:
        """The variant of `key` whose manifest matches `workspace`'s files now, or None."""
        best: tuple[int, str] | None = None
        try:
            variants = sorted(p for p in (self.root / key).iterdir() if not p.name.startswith("."))
        except OSError:
            return None
        for v in variants:
            try:
                manifest = json.loads((v / DEPS_FILE).read_text())["deps"]
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if isinstance(manifest, dict) and matches(manifest, workspace, digests):
                if best is None or len(manifest) > best[0]:
                    best = (len(manifest), v.name)
        if best is None:
            return None
        found = self.root / key / best[1]
        if not outputs_intact(found):  # changed since it was stored: never used
            return None
        try:
            os.utime(found)  # its last use, for the cache's LRU eviction
        except OSError:  # a read-only view of the cache (a candidate's job)
            pass
        return found

    @staticmethod
    def variant_name(manifest: dict[str, str]) -> str:
        return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:32]

    def store(self, key: str, manifest: dict[str, str], fill: Callable[[Path], None],
              created: list[Path] | None = None) -> Path:
        """Write a variant of `key`: `fill(dir)` puts the output files into a fresh directory,
        which is renamed into place with its manifest. If that variant exists already (built
        concurrently from the same files), it is kept and this one discarded. `created` gets the
        variant when this call put it in place."""
        variant = self.variant_name(manifest)
        final = self.root / key / variant
        if final.is_dir():
            if outputs_intact(final):
                return final
            gone = self.root / f".corrupt-{uuid.uuid4().hex[:12]}"
            try:
                os.rename(final, gone)  # changed since it was stored: replaced below
            except OSError:
                pass
            shutil.rmtree(gone, ignore_errors=True)
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        tmp.mkdir()
        try:
            fill(tmp)
            (tmp / DEPS_FILE).write_text(json.dumps({"deps": manifest}, sort_keys=True))
            seal_outputs(tmp)
            final.parent.mkdir(exist_ok=True)
            os.rename(tmp, final)  # fails when `final` exists: never replaces a variant
            if created is not None:
                created.append(final)
        except OSError:
            if not final.is_dir():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return final

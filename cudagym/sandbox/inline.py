"""Single-file (KernelBench) solutions: `load_inline`/`load` extensions, built by trusted jobs.

A KernelBench-style `model_new.py` builds its kernels with `torch.utils.cpp_extension.load_inline`
(or `load` on files of the workspace): at import, in `ModelNew.__init__` or a helper it calls,
or lazily on the first `forward`, often inside `try/except` with a torch fallback. The rule
here: **a job that runs candidate code never writes shared state**, so the candidate's process
never compiles and never writes the cache. Three parties:

- **The candidate's jobs** (`install_inline_loader`, in compile_inline, verify, profile and ncu
  workers) get an `InlineLoader` in place of torch's two functions. A call whose module is in
  the cache is imported from there, read-only. Any other call is recorded (its arguments in
  canonical form, its call site `model_new.py:LINE`) *before* `ExtensionNotBuilt` is raised,
  so the record stands whatever the candidate does with the exception. In the compile step
  the records are *build requests*; in verify and profile they, and modules that failed to
  load, are *problems* (`InlineLoader.problems`) the harness turns into a compile error
  instead of letting the solution fall back to torch unnoticed.
- **The parent** (the evaluator, `InlineBuildCache`) checks each request: types, names, and
  compiler flags that could run a program or read files the manifest cannot see (see
  `refusal`); computes its key; and after the build, the dependency manifest, and stores the
  module as a variant of that key (`cudagym.sandbox.deps`: written once, never overwritten).
- **The trusted build job** (`build_extension`, kind `build_inline`) runs no candidate Python:
  torch's own `load_inline`/`load` with `build_directory` in a fresh staging directory (its
  only writable directory), on a copy of the workspace's declared files made by the parent
  (`kernels/` and `model_new.py`, as the compile tool copies them: no precompiled headers, no
  symlinks or FIFOs, bounded; see `cudagym.sandbox.toolchain.copy_sources`), never on the
  workspace itself, which a job that ran candidate code may have written; with torch's final import step disabled, so the library is never
  loaded and none of its static constructors run. Its build file is rewritten to record every
  dependency: `-MD` instead of torch's `-MMD` (which a source can blind with
  `#pragma GCC system_header`), `.d` files kept, and GNU as's `--MD` for `.incbin`.

The key hashes the canonical arguments (sources, functions, flags, include paths; paths
relative to the workspace when inside it; for a request on workspace files, the names of the
files a build job's copy holds), torch and Python versions, the CUDA arch list and
the compilers' identities (`c++` on PATH and CUDA_HOME's nvcc, which the build job uses: it
drops CC, CXX and PYTORCH_NVCC). The manifest holds every file the build read outside trusted
roots (torch's, CUDA's and Python's include directories, /usr/include, /usr/lib/gcc and the
compiler's own), with its sha256; a lookup takes the variant whose files match the workspace.

Compile errors come back as `InlineCompileError` whose message is the readable error list of
`cudagym.sandbox.toolchain.parse_diagnostics`, with line numbers of the user's source strings
(`cpp_sources:12: error: ...`, `cuda_sources:7: error: ...`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cudagym.sandbox.deps import (Roots, UnrecordedDependency, VariantStore, host_path, parse_depfile, record,
                                  system_roots)
from cudagym.sandbox.toolchain import (CacheBound, copy_sources, parse_diagnostics, relativize, source_listing,
                                       trim_log)

INLINE_FORMAT = "cudagym-inline-v4"
INLINE_DIR = "inline"  # under the build cache
META_FILE = "meta.json"
MAX_ERROR_LINES = 40
MAX_REQUEST_BYTES = 256 * 1024  # of one request's arguments (sources included)
MAX_REQUESTS_PER_PASS = 3  # requests a compile pass reports (the rest come in the next pass)
MAX_SOURCE_BYTES = 64 << 20  # of the workspace files a build job gets (its copy of kernels/, model_new.py)
MAX_SOURCE_FILES = 1024
SOURCE_COPY = "ws"  # under a build job's staging directory
COPIED_FILES = ("model_new.py",)  # with kernels/, what of the workspace a build job's copy holds
KINDS = ("load_inline", "load")

_NOT_KEYED = frozenset({"build_directory", "verbose", "keep_intermediates", "use_pch"})  # do not change the module
_LISTS = frozenset({"cpp_sources", "cuda_sources", "sycl_sources", "extra_cflags", "extra_cuda_cflags",
                    "extra_sycl_cflags", "extra_ldflags", "extra_include_paths", "sources"})
_PATHS = frozenset({"extra_include_paths", "sources"})


class InlineCompileError(RuntimeError):
    """A `load_inline`/`load` module failed to compile or was refused; the message is readable."""


class ExtensionNotBuilt(RuntimeError):  # noqa: N818 - what the candidate sees, as torch's own errors read
    """Raised to the candidate for a module that is not in the build cache (already recorded)."""


# -- requests: canonical arguments and their key ------------------------------------------------


def canonical_args(arguments: dict[str, Any], workspace: Path, cwd: Path) -> dict[str, Any]:
    """torch's bound arguments in one JSON-able form: lists for string-or-list arguments, paths
    (`sources`, `extra_include_paths`) resolved from `cwd` as torch resolves them, relative when
    inside `workspace`; arguments that do not change the module dropped. TypeError if a value
    has a type torch would not accept."""
    out: dict[str, Any] = {}
    for k, v in arguments.items():
        if k in _NOT_KEYED:
            continue
        if k in _LISTS:
            items = [] if v is None else [v] if isinstance(v, (str, os.PathLike)) else v
            if not isinstance(items, (list, tuple)) or not all(isinstance(x, (str, os.PathLike)) for x in items):
                raise TypeError(f"{k} must be a string or a list of strings")
            out[k] = [_workspace_path(os.fspath(x), workspace, cwd) if k in _PATHS else os.fspath(x) for x in items]
        elif k == "functions":
            if isinstance(v, str):
                v = [v]
            if isinstance(v, dict) and all(isinstance(a, str) and isinstance(b, str) for a, b in v.items()):
                out[k] = dict(sorted(v.items()))
            elif v is None or (isinstance(v, (list, tuple)) and all(isinstance(f, str) for f in v)):
                out[k] = None if v is None else list(v)
            else:
                raise TypeError("functions must be a name, a list of names or a dict of names to docstrings")
        elif k == "name":
            if not isinstance(v, str):
                raise TypeError("name must be a string")
            out[k] = v
        else:
            out[k] = None if v is None else bool(v)
    return out


def _workspace_path(path: str, workspace: Path, cwd: Path) -> str:
    full = os.path.normpath(os.path.join(str(cwd), path))  # what torch's os.path.abspath gives
    ws = str(workspace)
    return full[len(ws) + 1 :] if full.startswith(ws + "/") else full


def with_cuda_of(kind: str, args: dict[str, Any]) -> bool:
    """Whether torch compiles this request with nvcc (as `_jit_compile` decides it)."""
    if args.get("with_cuda") is not None:
        return bool(args["with_cuda"])
    if kind == "load_inline":
        return bool(args.get("cuda_sources"))
    return any(s.endswith((".cu", ".cuh")) for s in args.get("sources", []))


def compiler_identity(with_cuda: bool) -> str:
    """The compilers of torch's JIT builds in a worker, as path and `--version`: `c++` on PATH
    and, for CUDA, CUDA_HOME's nvcc (the build job drops CXX, CC and PYTORCH_NVCC)."""
    import torch.utils.cpp_extension as cpp

    tools = ["c++"] + ([os.path.join(cpp.CUDA_HOME, "bin", "nvcc")] if with_cuda and cpp.CUDA_HOME else [])
    parts = []
    for tool in tools:
        path = shutil.which(tool)
        try:
            version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60,
                                     stdin=subprocess.DEVNULL).stdout if path else "not found"
        except (OSError, subprocess.TimeoutExpired) as e:
            version = f"cannot run: {e}"
        parts.append(f"{tool}: {os.path.realpath(path) if path else ''}\n{version}")
    return "\n".join(parts)


def _arch_list(with_cuda: bool) -> str:
    """What torch compiles CUDA code for: TORCH_CUDA_ARCH_LIST, else the visible GPUs."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if env is not None or not with_cuda:
        return env or ""
    import torch

    if not torch.cuda.is_available():
        return ""
    return ";".join(sorted({"%d.%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}))


def inline_key(kind: str, args: dict[str, Any], identity: str, workspace: Path | None = None) -> str:
    """The first-level cache key of a request (canonical `args`; `identity` of its compilers).
    A request whose sources or include paths lie in `workspace` is keyed by the names of the
    files its build job's copy would hold too (`workspace_listing`): a file's mere existence can
    change a build (`__has_include`, a header found earlier on the search path)."""
    import torch

    payload = {"format": INLINE_FORMAT, "kind": kind, "args": args, "torch": torch.__version__,
               "python": sys.version, "arch": _arch_list(with_cuda_of(kind, args)), "compilers": identity}
    if workspace is not None and _reads_workspace(args, workspace):
        payload["workspace_files"] = workspace_listing(workspace)
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def workspace_listing(workspace: Path) -> str:
    """The names of the files a build job's copy of `workspace` holds (see `job_request`)."""
    return source_listing(Path(workspace), files=COPIED_FILES)


def _reads_workspace(args: dict[str, Any], workspace: Path) -> bool:
    """Whether canonical `args` name a source or an include directory in `workspace` (relative)
    or the workspace itself."""
    ws = str(workspace)
    return any(not os.path.isabs(p) or p == ws for k in _PATHS for p in args.get(k, []))


# -- which requests are built --------------------------------------------------------------------

# torch joins the flags with spaces into build.ninja, whose commands run through /bin/sh: an entry
# may only hold words of these characters (no quotes, $, ;, `, *, ~ or @ response files).
_FLAG_ENTRY = re.compile(r"[A-Za-z0-9_+\-=.,:/% ]+")
_PATH_ENTRY = re.compile(r"[A-Za-z0-9_+\-=.,:/%]+")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LIB_NAME = re.compile(r"[A-Za-z0-9_+.\-]+")

# Compile options refused (by prefix), and why: each runs another program, loads code into the
# compiler, reads a file that no dependency output reports, hides headers from it, or replaces it.
_REFUSED: dict[str, str] = {
    "-fplugin": "loads a plugin into the compiler",
    "-fpass-plugin": "loads a plugin into the compiler",
    "-iplugindir": "chooses where compiler plugins are loaded from",
    "-Xclang": "passes options to clang's front end unchecked (plugins among them)",
    "-specs": "a specs file rewrites the compiler's commands",
    "-B": "makes the compiler driver run other programs as its passes",
    "-wrapper": "runs the compiler's passes under another program",
    "-fuse-ld": "selects another linker program",
    "-ccbin": "selects nvcc's host compiler",
    "--compiler-bindir": "selects nvcc's host compiler",
    "-run": "runs the program it builds",
    "--run": "runs the program it builds",
    "-ldir": "points nvcc at another libdevice",
    "--libdevice-directory": "points nvcc at another libdevice",
    "-o": "redirects the compiler's output",  # also nvcc's -odir and -optf
    "--output-": "redirects the compiler's output",
    "--options-file": "reads further options from a file",
    "-M": "replaces the dependency output the cache's manifest is made from",
    "--generate-dependencies": "replaces the dependency output the cache's manifest is made from",
    "--generate-nonsystem-dependencies": "replaces the dependency output the cache's manifest is made from",
    "--dependency-": "replaces the dependency output the cache's manifest is made from",
    "-Wp,": "passes options to the preprocessor unchecked",
    "-Xpreprocessor": "passes options to the preprocessor unchecked",
    "-Wa,": "passes options to the assembler unchecked",
    "-Xassembler": "passes options to the assembler unchecked",
    "-Wl,": "is a linker option: pass it in extra_ldflags",
    "-Xlinker": "is a linker option: pass it in extra_ldflags",
    "--linker-options": "is a linker option: pass it in extra_ldflags",
    "-isysroot": "moves the system headers (which the manifest leaves out)",
    "--sysroot": "moves the system headers (which the manifest leaves out)",
    "-iprefix": "adds system header directories (which the manifest leaves out)",
    "-iwithprefix": "adds system header directories (which the manifest leaves out)",
    "-imultilib": "adds system header directories (which the manifest leaves out)",
    "-imultiarch": "adds system header directories (which the manifest leaves out)",
    "-fprofile-use": "reads profile data (a file no dependency output reports)",
    "-fauto-profile": "reads profile data (a file no dependency output reports)",
}
# GCC reads any other `--name` as `-fname` (`--plugin=x.so` is `-fplugin=x.so`): in host compiler
# flags only these long options are accepted.
_HOST_LONG = ("--std=", "--param")
# Options whose directory holds *system* headers, left out of the manifest: trusted roots only.
_SYSTEM_DIRS = ("-isystem", "-idirafter", "--system-include")
# Options whose value may be the next word.
_SEPARATE = frozenset({"-I", "-iquote", "--include-path", *_SYSTEM_DIRS, "-D", "-U", "-include", "-imacros",
                       "--pre-include", "-x", "-gencode", "--generate-code", "-arch", "--gpu-architecture", "-code",
                       "--gpu-code", "-maxrregcount", "--maxrregcount", "--param", "-t", "--threads", "-rdc",
                       "--relocatable-device-code", "-std", "--std", "-L", "-l"})
# nvcc options passing a comma-separated list to another tool: -Xcompiler's items are host
# compiler flags, the others' are checked against the refused options.
_HOST_SUBTOOL = ("-Xcompiler", "--compiler-options")
_SUBTOOL = (*_HOST_SUBTOOL, "-Xptxas", "--ptxas-options", "-Xcudafe", "-Xnvlink", "--nvlink-options", "-Xfatbin",
            "--fatbin-options", "-Xarchive", "--archive-options")
# Linker flags accepted (extra_ldflags is an allow-list: the linker reads whatever it is named).
_LD_WORDS = frozenset({"-fopenmp", "-pthread", "-shared", "-rdynamic", "-static-libstdc++", "-static-libgcc"})
_LD_SUBOPTIONS = frozenset({"--as-needed", "--no-as-needed", "-O1", "--gc-sections", "--no-undefined", "-z", "defs",
                            "now", "relro", "noexecstack"})


def _option(word: str, options: tuple[str, ...] | frozenset[str]) -> str | None:
    """The option of `options` that `word` is or starts with (`-I` of `-Ifoo`, `-I=foo`)."""
    return next((o for o in sorted(options, key=len, reverse=True) if word == o or word.startswith(o)), None)


def _check_compile_words(words: list[str], tool: str, include_roots: Roots, lib_roots: Roots) -> str | None:
    """Why compile flags `words` for `tool` ("host": the C++ compiler, "nvcc", or "sub": a tool
    behind an nvcc -X option) are refused, or None."""
    i = 0
    while i < len(words):
        w = words[i]
        if not w.startswith("-"):
            return f"{w!r} is refused: an input file the build would read untracked"
        if tool == "host" and w.startswith("--") and not w.startswith(_HOST_LONG):
            return f"{w!r} is refused: GCC reads it as -f{w[2:]}; write the short form"
        refused = _option(w, tuple(_REFUSED))
        if refused:
            return f"{w!r} is refused: it {_REFUSED[refused]}"
        sub = _option(w, _SUBTOOL) if tool == "nvcc" else None
        sep = _option(w, _SEPARATE) if sub is None else None
        if sub is None and sep is None:
            i += 1
            continue
        option = sub or sep
        value = w[len(option):].lstrip("=")
        if not value and w == option:
            value = words[i + 1] if i + 1 < len(words) else ""
            i += 1
        if sub is not None:
            why = _check_compile_words([p for p in value.split(",") if p], "host" if sub in _HOST_SUBTOOL else "sub",
                                       include_roots, lib_roots)
            if why:
                return f"{sub} {why}"
        elif sep in _SYSTEM_DIRS and not (os.path.isabs(value) and include_roots.contains(value)):
            return (f"{sep} {value!r} is refused: headers found there count as system headers, which the cache's "
                    "manifest leaves out; only system, torch, CUDA and Python include directories qualify")
        elif sep == "-L" and not (os.path.isabs(value) and lib_roots.contains(value)):
            return f"-L {value!r} is refused: libraries are linked from system, torch and CUDA directories only"
        elif sep == "-l" and not _LIB_NAME.fullmatch(value):
            return f"-l{value} is refused: a library name, not a path"
        i += 1
    return None


def _check_ldflags(words: list[str], lib_roots: Roots) -> str | None:
    i = 0
    while i < len(words):
        w = words[i]
        if w in ("-l", "-L"):
            w, i = w + (words[i + 1] if i + 1 < len(words) else ""), i + 1
        if w in _LD_WORDS or (w.startswith("-l") and _LIB_NAME.fullmatch(w[2:])):
            pass
        elif w.startswith("-L"):
            if not (os.path.isabs(w[2:]) and lib_roots.contains(w[2:])):
                return f"-L {w[2:]!r} is refused: libraries are linked from system, torch and CUDA directories only"
        elif w.startswith("-Wl,"):
            parts = w[4:].split(",")
            j = 0
            while j < len(parts):
                p = parts[j]
                if p in ("-rpath", "-R") and j + 1 < len(parts):
                    p, j = "-rpath=" + parts[j + 1], j + 1
                if p.startswith("-rpath="):
                    if not (os.path.isabs(p[7:]) and lib_roots.contains(p[7:])):
                        return f"{w!r} is refused: an rpath outside the system, torch and CUDA library directories"
                elif p not in _LD_SUBOPTIONS:
                    return f"{w!r} is refused: linker option {p!r} is not among those accepted " \
                           f"({', '.join(sorted(_LD_SUBOPTIONS))}, -rpath)"
                j += 1
        else:
            return (f"{w!r} is refused: extra_ldflags accepts -l<name>, -L<dir> and -Wl,-rpath,<dir> (system, torch "
                    f"and CUDA library directories), {', '.join(sorted(_LD_WORDS))} and "
                    f"-Wl,{{{','.join(sorted(_LD_SUBOPTIONS))}}}")
        i += 1
    return None


def refusal(kind: str, args: dict[str, Any], include_roots: Roots, lib_roots: Roots) -> str | None:
    """Why a request (canonical `args`) is not built, or None.

    Refused: a module name that is not an identifier; SYCL and standalone builds; list entries
    with characters the shell would interpret (which also rules out `@file` response files);
    compile flags in `_REFUSED` (plugins, specs, `-B`, wrappers, another linker or host
    compiler, nvcc's `--run` and libdevice directory, output and dependency-file options, raw
    preprocessor/assembler/linker passthrough, profile data, moved system headers), host
    compiler long options (GCC reads `--x` as `-fx`), `-isystem`/`-idirafter` outside trusted
    roots (their headers count as system headers, left out of the manifest) and bare words
    (input files); in extra_ldflags, anything beyond `-l<name>`, `-L`/rpath under system, torch
    or CUDA library directories and a few harmless switches. `-I` and `-include` may point
    anywhere: the files they lead to are reported by `-MD`.
    """
    if not _NAME.fullmatch(args.get("name", "")):
        return f"the module name {args.get('name')!r} is not an identifier"
    if args.get("sycl_sources") or args.get("extra_sycl_cflags") or args.get("with_sycl"):
        return "SYCL builds are not supported"
    if args.get("is_standalone"):
        return "standalone executables (is_standalone=True) are not built"
    for k in ("extra_include_paths", "sources"):
        for p in args.get(k, []):
            if not _PATH_ENTRY.fullmatch(p):
                return f"{k} entry {p!r} is refused: it has characters that are not accepted in a path"
    for k in ("extra_cflags", "extra_cuda_cflags", "extra_ldflags"):
        entries = args.get(k, [])
        bad = next((e for e in entries if not _FLAG_ENTRY.fullmatch(e)), None)
        if bad is not None:
            return f"{k} entry {bad!r} is refused: it has characters the shell would interpret (quotes, $, ;, @, ...)"
        words = [w for e in entries for w in e.split()]
        why = _check_ldflags(words, lib_roots) if k == "extra_ldflags" else \
            _check_compile_words(words, "host" if k == "extra_cflags" else "nvcc", include_roots, lib_roots)
        if why:
            return f"{k}: {why}"
    return None


# -- the candidate's side: the loader -------------------------------------------------------------


@dataclass
class InlineLoader:
    """`load_inline` and `load` in a process that runs candidate code (see the module docstring).

    `missing`: requests (`{"kind", "args", "site"}`) for calls whose module is not in the cache;
    `failures`: cached modules that failed to load; `loaded`: names of modules imported.
    """

    cache_root: Path  # <cache>/build/inline
    workspace: Path
    missing: list[dict[str, Any]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    loaded: list[str] = field(default_factory=list)
    _originals: dict[str, Callable[..., Any]] = field(default_factory=dict, repr=False)
    _modules: dict[str, Any] = field(default_factory=dict, repr=False)
    _identity: dict[bool, str] = field(default_factory=dict, repr=False)

    def load_inline(self, *args: Any, **kwargs: Any) -> Any:
        return self._load("load_inline", args, kwargs)

    def load(self, *args: Any, **kwargs: Any) -> Any:
        return self._load("load", args, kwargs)

    def problems(self) -> list[str]:
        """What went wrong with this process's extensions, for the harness to report: modules
        requested here but not built by the compile step, and modules that failed to load."""
        return [f"{r['kind']} module '{r['args']['name']}' ({r['site']}) was not built by the compile step"
                for r in self.missing] + self.failures

    def _load(self, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        site = _call_site(self.workspace)
        bound = inspect.signature(self._originals[kind]).bind(*args, **kwargs)
        bound.apply_defaults()
        canon = canonical_args(dict(bound.arguments), self.workspace, Path.cwd())
        with_cuda = with_cuda_of(kind, canon)
        if with_cuda not in self._identity:
            self._identity[with_cuda] = compiler_identity(with_cuda)
        key = inline_key(kind, canon, self._identity[with_cuda], self.workspace)
        if key in self._modules:
            return self._modules[key]
        name = canon["name"]
        entry = VariantStore(self.cache_root).find(key, self.workspace)
        if entry is None:
            request = {"kind": kind, "args": canon, "site": site}
            size = len(json.dumps(request))
            if size > MAX_REQUEST_BYTES:
                self._fail(f"{kind} module '{name}' ({site}): its arguments are {size >> 10} KB; the compile step "
                           f"builds extensions of up to {MAX_REQUEST_BYTES >> 10} KB")
            elif request not in self.missing:
                self.missing.append(request)
            raise ExtensionNotBuilt(f"{kind} module '{name}' ({site}) is not in the build cache: the compile tool "
                                    "builds the extensions a solution asks for")
        try:
            module = _import_cached(entry)
        except Exception as e:
            self._fail(f"extension '{name}' ({site}) failed to load: {type(e).__name__}: {e}; "
                       "the solution fell back to torch")
            raise
        self.loaded.append(name)
        self._modules[key] = module
        return module

    def _fail(self, problem: str) -> None:
        if problem not in self.failures:  # a solution may retry on every call
            self.failures.append(problem)


# The one loader installed in this process (it replaces process-global torch functions); the
# harness asks it for problems at the end of a job. Advisory only: the candidate's code runs in
# the same process and could clear it, and then the op audit and the own-kernel share still see
# a torch fallback.
_INSTALLED: list[InlineLoader] = []


def install_inline_loader(cache_dir: Path, workspace: Path) -> InlineLoader:
    """Replace `torch.utils.cpp_extension.load_inline` and `load` in this process.

    `cache_dir`: the build cache (modules under `cache_dir/inline/`), read-only here;
    `workspace`: the candidate's workspace (paths in requests and manifests are relative to it).
    """
    import torch.utils.cpp_extension as cpp

    loader = InlineLoader(Path(cache_dir).resolve() / INLINE_DIR, Path(workspace).resolve())
    loader._originals = {"load_inline": cpp.load_inline, "load": cpp.load}
    cpp.load_inline = loader.load_inline
    cpp.load = loader.load
    _INSTALLED[:] = [loader]
    return loader


def inline_problems() -> list[str]:
    """The problems of the loader installed in this process (none installed: none)."""
    return _INSTALLED[0].problems() if _INSTALLED else []


def _call_site(workspace: Path) -> str:
    """`path:line` of the innermost frame in a workspace file: the candidate's call."""
    prefix = str(workspace) + os.sep
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith(prefix):
            return f"{frame.f_code.co_filename[len(prefix):]}:{frame.f_lineno}"
        frame = frame.f_back
    return "called from outside the workspace"


def _import_cached(entry: Path) -> Any:
    meta = json.loads((entry / META_FILE).read_text())
    path = entry / meta["file"]
    if not meta["python_module"]:
        import torch

        torch.ops.load_library(str(path))
        return str(path)
    spec = importlib.util.spec_from_file_location(meta["name"], path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import cached module {meta['name']} from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[meta["name"]] = module
    return module


# -- the trusted build job ------------------------------------------------------------------------


def build_extension(request: dict[str, Any], build_dir: Path) -> None:
    """Build a request the parent checked (`InlineBuildCache.job_request`: absolute paths) with
    torch's own `load_inline`/`load` into `build_dir`, recording every dependency, without
    loading the library. For a worker that runs no candidate code; InlineCompileError when the
    build fails."""
    import torch.utils.cpp_extension as cpp

    for var in ("CC", "CXX", "PYTORCH_NVCC", "TORCH_EXTENSION_SKIP_NVCC_GEN_DEPENDENCIES"):
        os.environ.pop(var, None)  # the key names `c++` and CUDA_HOME's nvcc, with dependency output
    gnu_as = "Free Software Foundation" in compiler_identity(False)
    write_ninja = cpp._write_ninja_file

    def write_tracked(*args: Any, **kwargs: Any) -> None:
        write_ninja(*args, **kwargs)
        _track_all_dependencies(Path(kwargs["path"] if "path" in kwargs else args[0]), gnu_as)

    cpp._write_ninja_file = write_tracked
    cpp._import_module_from_library = lambda module_name, path, is_python_module: os.path.join(
        path, module_name + cpp.LIB_EXT)  # never load what was built here
    kind, args = request["kind"], dict(request["args"])
    name = args["name"]
    workspace = request["workspace"]
    build_dir.mkdir(parents=True, exist_ok=True)  # load_inline writes its sources before torch makes it
    try:
        if kind == "load_inline":
            cpp.load_inline(**args, build_directory=str(build_dir), verbose=False, use_pch=False)
        else:
            cpp.load(**args, build_directory=str(build_dir), verbose=False)
    except (RuntimeError, ValueError, TypeError, OSError) as e:
        if "Error building extension" not in str(e):
            raise InlineCompileError(f"{kind} module '{name}' ({request['site']}) cannot be built: "
                                     f"{type(e).__name__}: {str(e)[:2000]}") from None
        implicit = not args.get("no_implicit_headers", False)
        offsets = {"main.cpp": ("cpp_sources", 1 if implicit else 0), "cuda.cu": ("cuda_sources", 3 if implicit else 0)} \
            if kind == "load_inline" else {}
        raise InlineCompileError(_readable_error(f"{kind} module '{name}' ({request['site']})", str(e), build_dir,
                                                 Path(workspace), offsets)) from None


def _track_all_dependencies(build_file: Path, gnu_as: bool) -> None:
    """Rewrite torch's build.ninja so that every compile writes `$out.d` with all headers (`-MD`,
    not `-MMD`) and, with GNU as, `$out.asd` with the assembler's files; ninja keeps them."""
    text = build_file.read_text()
    cxx = "command = $cxx -MMD -MF $out.d "
    if cxx not in text:
        raise RuntimeError(f"torch's build file has no '{cxx.strip()}' rule: its dependencies cannot be recorded")
    text = text.replace(cxx, "command = $cxx -MD -MF $out.d" + (" -Wa,--MD,$out.asd " if gnu_as else " "))
    # nvcc splits -Xcompiler values at commas, and /bin/sh takes one backslash of each pair
    nvcc_as = " -Xcompiler -Wa\\\\,--MD\\\\,$out.asd" if gnu_as else ""
    if "command = $nvcc -MD -MF $out.d " in text:
        text = text.replace("command = $nvcc -MD -MF $out.d ", f"command = $nvcc -MD -MF $out.d{nvcc_as} ")
    elif "command = $nvcc " in text:  # torch left nvcc's dependency output out
        text = text.replace("command = $nvcc ", f"command = $nvcc -MD -MF $out.d{nvcc_as} ")
    build_file.write_text(text.replace("  deps = gcc\n", ""))  # with `deps = gcc` ninja deletes the .d files


_SOURCE_LINE = re.compile(r"^(main\.cpp|cuda\.cu):(\d+):")


def _readable_error(what: str, message: str, build_dir: Path, workspace: Path,
                    offsets: dict[str, tuple[str, int]]) -> str:
    """torch's 'Error building extension' message as readable lines of the user's sources."""
    import torch

    out = relativize(message, {str(build_dir) + "/": "", str(build_dir): ".", str(workspace) + "/": "",
                               os.path.dirname(torch.__file__): "<torch>"})
    errors = []
    for err in parse_diagnostics(out, MAX_ERROR_LINES):
        m = _SOURCE_LINE.match(err)
        if m and m.group(1) in offsets:
            label, shift = offsets[m.group(1)]
            err = f"{label}:{max(1, int(m.group(2)) - shift)}:{err[m.end():]}"
        errors.append(err)
    if not errors:
        tail = trim_log(out).splitlines()[-MAX_ERROR_LINES // 2:]
        errors = tail or ["the build failed without output"]
    return f"{what} failed to compile:\n" + "\n".join(errors)


# -- the parent's side ----------------------------------------------------------------------------


@dataclass(frozen=True)
class InlineBuild:
    """A request the parent checked: canonical arguments, the candidate's call site, the key."""

    kind: str
    args: dict[str, Any]
    site: str
    key: str

    @property
    def name(self) -> str:
        return self.args["name"]


class InlineBuildCache:
    """The trusted side of the inline module cache at `cache_dir/inline` (the evaluator's).

    `prepare` checks and keys a build request from a candidate's job; `job_request` is what a
    build job gets; `store` files the built library with its dependency manifest. Thread-safe.
    """

    def __init__(self, cache_dir: Path, bound: CacheBound | None = None, max_output_bytes: int = 256 << 20):
        self.root = Path(cache_dir).resolve() / INLINE_DIR
        self.bound = bound  # the build cache's size bound, enforced after each store
        self.max_output_bytes = max_output_bytes  # of one module stored (ToolchainConfig.max_build_output_mb)
        self._variants = VariantStore(self.root)
        self._identity: dict[bool, str] = {}
        self._roots: tuple[Roots, Roots] | None = None

    def prepare(self, request: Any, workspace: Path) -> InlineBuild:
        """The checked form of `request`; InlineCompileError naming what is refused."""
        import torch.utils.cpp_extension as cpp

        if not isinstance(request, dict) or request.get("kind") not in KINDS or not isinstance(request.get("args"), dict):
            raise InlineCompileError(f"a malformed extension build request: {str(request)[:200]}")
        kind, site = request["kind"], str(request.get("site", "?"))[:300]
        try:
            bound = inspect.signature(getattr(cpp, kind)).bind(**request["args"])
            bound.apply_defaults()
            args = canonical_args(dict(bound.arguments), workspace, workspace)
        except TypeError as e:
            raise InlineCompileError(f"{kind} call ({site}): {e}") from None
        why = refusal(kind, args, *self.trusted_roots())
        if why:
            raise InlineCompileError(f"{kind} module '{args.get('name')}' ({site}): {why}")
        with_cuda = with_cuda_of(kind, args)
        if with_cuda not in self._identity:
            self._identity[with_cuda] = compiler_identity(with_cuda)
        return InlineBuild(kind, args, site, inline_key(kind, args, self._identity[with_cuda], Path(workspace)))

    def cached(self, build: InlineBuild, workspace: Path) -> bool:
        return self._variants.find(build.key, workspace) is not None

    def staging(self) -> Path:
        """A fresh directory for one build job (on the cache's file system, for the final rename)."""
        d = self.root / f".staging-{uuid.uuid4().hex}"
        d.mkdir(parents=True)
        return d

    def job_request(self, build: InlineBuild, workspace: Path, staging: Path | None = None) -> dict[str, Any]:
        """The build job's request: the arguments with absolute paths. With `staging`, paths in
        `workspace` point into a copy of its declared files made there (`SOURCE_COPY`), which is
        all of the workspace the build reads; InlineCompileError when that copy is over its bounds."""
        root = Path(workspace)
        if staging is not None:
            copy = copy_sources(root, staging / SOURCE_COPY, files=COPIED_FILES, max_bytes=MAX_SOURCE_BYTES,
                                max_files=MAX_SOURCE_FILES)
            if copy.error:
                raise InlineCompileError(f"{build.kind} module '{build.name}' ({build.site}): {copy.error}")
            root = copy.root

        def place(v: str) -> str:
            if not os.path.isabs(v):
                return str(root / v)
            ws = str(workspace)
            return str(root) + v[len(ws):] if v == ws or v.startswith(ws + "/") else v

        args = {k: [place(v) for v in vals] if k in _PATHS else vals for k, vals in build.args.items()}
        return {"kind": build.kind, "args": args, "site": build.site, "workspace": str(root)}

    def store(self, build: InlineBuild, staging: Path, build_dir: Path, workspace: Path,
              paths: dict[str, str] | None = None) -> None:
        """File the library a build job left in `build_dir` (inside `staging`) as a variant of
        its key, with the manifest of every untrusted file the build read. `paths` maps where the
        job saw its directories to where they are here (`JobOutcome.paths`: a container's job
        directory); the dependency files name what the compiler opened, as it saw it."""
        import torch.utils.cpp_extension as cpp

        lib = build_dir / f"{build.name}{cpp.LIB_EXT}"
        if not lib.is_file():
            raise InlineCompileError(f"{build.kind} module '{build.name}' ({build.site}): the build left no {lib.name}")
        what = f"{build.kind} module '{build.name}' ({build.site})"
        size = lib.stat().st_size
        if size > self.max_output_bytes:
            raise InlineCompileError(f"{what} failed to compile:\nits library holds {size >> 20} MiB, over the limit of "
                                     f"{self.max_output_bytes >> 20} MiB for one build; a large initialized array or "
                                     f"table belongs in memory allocated at run time")

        def listed(pattern: str) -> list[str]:
            return [host_path(d, paths or {}) for f in sorted(build_dir.glob(pattern))
                    for d in parse_depfile(f.read_text(errors="replace"))]

        copy = staging / SOURCE_COPY
        try:
            if copy.is_dir():  # the build read the copy: recorded relative to it, as the workspace's files
                manifest = record(listed("*.d"), cwd=build_dir, workspace=copy, trusted=self.trusted_roots()[0],
                                  exclude=Roots([str(build_dir), str(staging / "tmp")]), assembler=listed("*.asd"))
            else:
                manifest = record(listed("*.d"), cwd=build_dir, workspace=workspace, trusted=self.trusted_roots()[0],
                                  exclude=Roots([str(staging)]), assembler=listed("*.asd"))
        except UnrecordedDependency as e:  # nothing is stored
            repl = {str(copy) + "/": "", str(build_dir) + "/": "", str(workspace) + "/": ""}
            raise InlineCompileError(f"{what} failed to compile:\n" + "\n".join(
                f"error: {relativize(p, repl)}" for p in e.problems)) from None
        meta = {"name": build.name, "file": lib.name, "python_module": bool(build.args.get("is_python_module", True))}

        def fill(d: Path) -> None:
            shutil.copy2(lib, d / lib.name)
            (d / META_FILE).write_text(json.dumps(meta))

        entry = self._variants.store(build.key, manifest, fill)
        if self.bound is not None:
            self.bound.enforce(CacheBound.size_of(entry))

    def trusted_roots(self) -> tuple[Roots, Roots]:
        """(include roots, library roots) of torch's JIT builds on this host."""
        if self._roots is None:
            import sysconfig

            import torch.utils.cpp_extension as cpp

            self._roots = (system_roots(shutil.which("c++") or "c++", cpp.CUDA_HOME),
                           Roots(["/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/local/lib", cpp.TORCH_LIB_PATH,
                                  cpp.CUDA_HOME or "", sysconfig.get_config_var("LIBDIR") or ""]))
        return self._roots

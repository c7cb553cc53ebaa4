"""Which `load_inline`/`load` requests are built (`cudagym.sandbox.inline`): the types, names and
compiler or linker flags a request may hold; a flag that could run a program or read files the
dependency manifest cannot see is refused (`refusal`).
"""

from __future__ import annotations

import os
import re
from typing import Any

from cudagym.sandbox.deps import Roots


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
        option = sub or sep
        if option is None:
            i += 1
            continue
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

"""Kernel images loaded from memory: how the kernel watcher names them (`origin.cpp`: a file only
for its read-only, unwritten bytes, else `<memory:DIGEST>`), and which of them permissive mode
counts as the candidate's own (`cudagym.sandbox.jit`: a Triton cache entry compiled from a
function in the candidate's workspace). CPU only: the watcher's naming is a host function of the
image's address, called here on real images nvcc builds; the attribution reads a Triton cache
directory built here file by file, in the layout Triton 3.6-3.8 writes."""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import json
import threading
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from cudagym.core.audit import Origins, foreign_kernels, own_time_share
from cudagym.errors import ToolchainError
from cudagym.sandbox import jit
from cudagym.sandbox.jit import (
    MAX_SOURCE_BYTES, Reading, entry_location, jit_attribution, own_jit_images, own_triton_kernels, triton_kernels,
    workspace_scratch,
)
from cudagym.sandbox.origin import KernelRecord, build_library, image_digest, image_extent, memory_digest


# -- the watcher's naming of an image, by its address -------------------------------------------
@pytest.fixture(scope="module")
def watcher(tmp_path_factory: pytest.TempPathFactory):
    """`origin_image_origin` of a freshly built kernel watcher: the origin a load of an image at an
    address would record (no CUPTI, no GPU: only the library's host code runs)."""
    try:
        lib = ctypes.CDLL(str(build_library(tmp_path_factory.mktemp("origin"))))
    except ToolchainError as e:
        pytest.skip(f"the kernel watcher cannot be built here: {e}")
    fn = lib.origin_image_origin
    fn.restype, fn.argtypes = ctypes.c_size_t, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]

    def origin(address: int) -> str:
        buf = ctypes.create_string_buffer(4096)
        fn(address, buf, len(buf))
        return buf.value.decode()

    return origin


def nvcc(tmp: Path, source: str, *args: str) -> Path:
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed")
    (tmp / "k.cu").write_text(source)
    out = tmp / args[-1]
    r = subprocess.run(["nvcc", "-arch=sm_90", *args[:-1], str(tmp / "k.cu"), "-o", str(out)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return out


LIBRARY = r"""
__global__ void twice(float* x) { x[threadIdx.x] *= 2.f; }
extern "C" void launch_twice(float* x) { twice<<<1, 32>>>(x); }
// where a candidate would copy a foreign image inside its own library: .bss and .data
extern "C" { char bss_slot[1 << 16]; char data_slot[1 << 16] = {1}; }
"""


def section(path: Path, name: str) -> tuple[int, int, int]:
    """(address, file offset, size) of an ELF64 file's section `name`."""
    b = path.read_bytes()
    shoff, = struct.unpack_from("<Q", b, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", b, 0x3a)
    strtab_off, = struct.unpack_from("<Q", b, shoff + shstrndx * shentsize + 0x18)
    for i in range(shnum):
        h = shoff + i * shentsize
        name_off, = struct.unpack_from("<I", b, h)
        if b[strtab_off + name_off:].split(b"\0", 1)[0].decode() == name:
            addr, offset, size = struct.unpack_from("<QQQ", b, h + 0x10)
            return addr, offset, size
    raise AssertionError(f"{path.name} has no section {name}")


def test_an_image_is_named_by_its_file_only_where_the_file_holds_it(watcher, tmp_path: Path) -> None:
    """nvcc's fatbin lies in a read-only segment (`.nv_fatbin`; the wrapper pointing at it in
    `.nvFatBinSegment`, writable data): named by the library. The same bytes copied into the
    library's .bss or .data (the red team's g2), into the heap, or written over its own fatbin
    after an mprotect, are `<memory:DIGEST>`, the digest `image_digest` computes."""
    so = nvcc(tmp_path, LIBRARY, "-shared", "-Xcompiler", "-fPIC", "libimage.so")
    segments = subprocess.run(["readelf", "-lW", str(so)], capture_output=True, text=True).stdout
    mapping = [line.split() for line in segments.split("Section to Segment mapping:")[1].splitlines()[2:]]
    headers = [line.split() for line in segments.splitlines() if line.strip().startswith("LOAD")]
    holder = next(int(row[0]) for row in mapping if ".nv_fatbin" in row)
    assert "W" not in "".join(headers[holder][6:-1]), segments  # the fatbin's segment is read-only

    lib = ctypes.CDLL(str(so))
    maps = Path("/proc/self/maps").read_text().splitlines()
    base = next(int(line.split("-")[0], 16) for line in maps
                if line.rstrip().endswith(str(so)) and int(line.split()[2], 16) == 0)
    addr, offset, size = section(so, ".nv_fatbin")
    fatbin_at = base + addr
    image = so.read_bytes()[offset:offset + size]
    digest = image_digest(image)
    assert digest and image_extent(image) and image_extent(image) <= size
    memory = f"<memory:{digest}>"

    assert watcher(fatbin_at) == str(so)
    wrapper_addr, _, _ = section(so, ".nvFatBinSegment")
    assert watcher(base + wrapper_addr) == str(so)  # a wrapper is followed to its fatbin
    for slot in ("bss_slot", "data_slot"):
        at = ctypes.addressof(ctypes.c_char.in_dll(lib, slot))
        ctypes.memmove(at, image, len(image))
        assert watcher(at) == memory, slot
    heap = ctypes.create_string_buffer(image, len(image))
    assert watcher(ctypes.addressof(heap)) == memory

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = fatbin_at & ~(os.sysconf("SC_PAGESIZE") - 1)
    assert libc.mprotect(page, fatbin_at + size - page, 3) == 0, ctypes.get_errno()  # PROT_READ | PROT_WRITE
    byte = ctypes.c_ubyte.from_address(fatbin_at + 64)
    byte.value = byte.value  # the same value: the page is the process's own copy now
    libc.mprotect(page, fatbin_at + size - page, 1)
    assert watcher(fatbin_at) == memory


def test_the_watcher_and_the_parent_digest_an_image_alike(watcher, tmp_path: Path) -> None:
    """A cubin (what Triton loads), a fatbin and PTX text, each from memory: the watcher's digest
    is the one the parent computes from the same bytes in a cache file."""
    images = [nvcc(tmp_path, LIBRARY, "-cubin", "k.cubin").read_bytes(),
              nvcc(tmp_path, LIBRARY, "-fatbin", "k.fatbin").read_bytes(),
              nvcc(tmp_path, LIBRARY, "-ptx", "k.ptx").read_bytes() + b"\0"]
    assert images[0][:4] == b"\x7fELF" and image_extent(images[0]) == len(images[0])
    for image in images:
        buf = ctypes.create_string_buffer(image + b"\0" * 64, len(image) + 64)  # bytes past the image: not digested
        assert watcher(ctypes.addressof(buf)) == f"<memory:{image_digest(image)}>"
    assert len({image_digest(i) for i in images}) == 3


# -- which images are the candidate's own: a Triton cache, file by file --------------------------
def fake_cubin(payload: bytes) -> bytes:
    """An ELF64 image: its header, `payload` as one section, the section header table."""
    shoff = 0x40 + len(payload)
    header = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9) + struct.pack(
        "<HHIQQQIHHHHHH", 2, 190, 1, 0, 0, shoff, 0, 0x40, 0x38, 0, 0x40, 2, 0)
    null = bytes(0x40)
    text = struct.pack("<IIQQQQIIQQ", 0, 1, 6, 0, 0x40, len(payload), 0, 0, 16, 0)
    return header + payload + null + text


# Triton IR as Triton 3.8 writes it (`.ttir`), shortened: the entry function's location is printed
# after its closing brace; aliases are listed before and after the module.
TTIR = """\
#loc = loc("{source}":{line}:1)
#loc16 = loc("x_ptr"(#loc))
module {{
  tt.func public @{name}(%x_ptr: !tt.ptr<f32> loc("x_ptr"(#loc))) attributes {{noinline = false}} {{
    %cst = arith.constant dense<1.000000e+00> : tensor<1024xf32> loc(#loc1)
    tt.return loc(#loc)
  }} loc({func_loc})
}} loc(#loc)
#loc1 = loc("{source}":{body}:41)
#loc2 = loc("{name}"(#loc))
"""
MODEL_NEW = """\
import triton
import triton.language as tl


@triton.jit
def scale_kernel(x_ptr):
    pass


def not_a_kernel(x_ptr):
    pass
"""
INDUCTOR = """\
import triton
from torch._inductor.runtime import triton_helpers


@triton.jit
def triton_poi_fused_gelu_0(in_ptr0):
    pass
"""


def cache_entry(cache: Path, key: str, name: str, cubin: bytes, source: str, line: int,
                func_loc: str = "#loc") -> str:
    """One compiled kernel as Triton writes it: `<key>/<name>.{json,ttir,cubin}` and the group file."""
    d = cache / key
    d.mkdir(parents=True)
    (d / f"{name}.json").write_text(json.dumps({"name": name, "num_warps": 4, "triton_version": "3.8.0"}))
    (d / f"{name}.ttir").write_text(TTIR.format(source=source, line=line, body=line + 2, name=name,
                                                func_loc=func_loc))
    (d / f"{name}.cubin").write_bytes(cubin)
    (d / f"__grp__{name}.json").write_text(json.dumps({"child_paths": {}}))
    digest = image_digest(cubin)
    assert digest
    return digest


def test_entry_location_reads_the_function_definition() -> None:
    ir = TTIR.format(source="/ws/model_new.py", line=6, body=8, name="k", func_loc="#loc2")
    assert entry_location(ir, "k") == ("/ws/model_new.py", 6)  # through a named location
    ir = TTIR.format(source="/ws/a\\22b.py", line=6, body=8, name="k", func_loc="#loc")
    assert entry_location(ir, "k") == ('/ws/a"b.py', 6)  # MLIR's escapes undone
    assert entry_location(ir, "other") is None
    assert entry_location(ir.replace("  } loc(#loc)", "  }"), "k") is None


def test_own_triton_kernels_are_those_compiled_from_the_workspace(tmp_path: Path) -> None:
    """Only a cache entry whose IR places its entry function at a `def` of that name in a file of
    the workspace outside `.build/` names an own image: inductor's generated source (under the
    job's scratch), a line that is no such `def`, a file outside the workspace, a workspace file
    that is a link into the scratch and a cubin that is a link are not."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "model_new.py").write_text(MODEL_NEW)
    cache = workspace_scratch(ws) / "triton"
    generated = workspace_scratch(ws) / "inductor" / "ab" / "cab.py"
    generated.parent.mkdir(parents=True)
    generated.write_text(INDUCTOR)
    (ws / "copied.py").symlink_to(generated)
    outside = tmp_path / "elsewhere.py"
    outside.write_text(MODEL_NEW)

    own = cache_entry(cache, "A1", "scale_kernel", fake_cubin(b"own"), str(ws / "model_new.py"), 6)
    named = cache_entry(cache, "A2", "scale_kernel", fake_cubin(b"own, autotuned"), "model_new.py", 6, "#loc2")
    inductor = cache_entry(cache, "B", "triton_poi_fused_gelu_0", fake_cubin(b"inductor"), str(generated), 6)
    model_new = str(ws / "model_new.py")
    wrong_line = cache_entry(cache, "C", "scale_kernel", fake_cubin(b"line"), model_new, 5)  # the decorator's line
    not_kernel = cache_entry(cache, "D", "not_a_kernel", fake_cubin(b"def"), str(ws / "model_new.py"), 10)
    foreign_file = cache_entry(cache, "E", "scale_kernel", fake_cubin(b"outside"), str(outside), 6)
    via_link = cache_entry(cache, "F", "triton_poi_fused_gelu_0", fake_cubin(b"link"), str(ws / "copied.py"), 6)
    linked = cache / "G"
    linked.mkdir()
    (linked / "scale_kernel.json").write_text(json.dumps({"name": "scale_kernel"}))
    (linked / "scale_kernel.ttir").write_text(TTIR.format(source=ws / "model_new.py", line=6, body=8,
                                                          name="scale_kernel", func_loc="#loc"))
    (tmp_path / "real.cubin").write_bytes(fake_cubin(b"linked"))
    (linked / "scale_kernel.cubin").symlink_to(tmp_path / "real.cubin")
    (cache / "H").mkdir()
    (cache / "H" / "broken.json").write_text("{not json")

    listed = {k.digest: k for k in triton_kernels(cache)}
    assert set(listed) == {own, named, inductor, wrong_line, not_kernel, foreign_file, via_link}
    assert listed[inductor].source == str(generated) and listed[inductor].line == 6
    assert {k.digest for k in own_triton_kernels(ws)} == {own, named}
    assert own_jit_images(ws) == frozenset({own, named})
    assert own_jit_images(tmp_path / "no-such-workspace") == frozenset()


def test_the_rules_count_own_images_in_permissive_mode_only(tmp_path: Path) -> None:
    """The share counts a Triton kernel's launches as own when its image's digest is one of the
    candidate's; inductor's stay foreign; strict mode (no own images) names both."""
    own, inductor = image_digest(fake_cubin(b"own")), image_digest(fake_cubin(b"inductor"))
    records = [KernelRecord("launch", "scale_kernel", f"<memory:{own}>", 5, 5 << 20, time_ns=9000),
               KernelRecord("launch", "triton_poi_fused_gelu_0", f"<memory:{inductor}>", 5, 5 << 20, time_ns=1000),
               KernelRecord("launch", "nvrtc_kernel", "<memory>", 1, 32, time_ns=0)]
    assert memory_digest(records[0].origin) == own and memory_digest("/lib/libkernels.so") is None
    permissive = Origins(own_roots=("/cache/build/artifacts",), own_images=frozenset({own}))
    assert own_time_share(records, permissive) == pytest.approx(0.9)
    assert foreign_kernels(records, permissive) == [f"triton_poi_fused_gelu_0 (from <memory:{inductor}>)",
                                                    "nvrtc_kernel (from <memory>)"]
    strict = Origins(own_roots=("/cache/build/artifacts",))
    assert len(foreign_kernels(records, strict)) == 3 and own_time_share(records, strict) == 0
    assert not permissive.is_own("<memory:>") and not permissive.is_own(f"<memory:{own}")


# -- what one attribution may cost the parent (issue 32: the caches are written by the candidate) --
def _many_entries(ws: Path, n: int) -> set[str]:
    """`n` Triton cache entries, each a distinct cubin whose IR names `scale_kernel` of the
    workspace's model_new.py; and one CuPy entry whose source is a string of that file."""
    cache = workspace_scratch(ws) / "triton"
    return {cache_entry(cache, f"g{i:04d}", "scale_kernel", fake_cubin(b"own %d" % i), "model_new.py", 6)
            for i in range(n)}


def test_a_source_named_by_many_entries_is_parsed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hundred cache entries naming one file, plus a CuPy entry whose source the workspace's
    Python files are searched for: each file is parsed at most once in one attribution (parses
    counted at `ast.parse`), the search stops once every source is found, and every entry is
    judged as before."""
    ws = tmp_path / "ws"
    ws.mkdir()
    kernel = 'extern "C" __global__ void k(float* y) { y[0] = 1.0f; }'
    (ws / "model_new.py").write_text(MODEL_NEW + f"\nSRC = {kernel!r}\n")
    (ws / "a_helpers.py").write_text("X = 'not a kernel'\n")
    (ws / "unread.py").write_text("Y = 'after the kernel was found'\n")
    own = _many_entries(ws, 100)
    cupy = workspace_scratch(ws) / "cupy"
    cupy.mkdir(parents=True)
    stored = fake_cubin(b"cupy")
    (cupy / "k.cubin").write_bytes(hashlib.sha1(stored).hexdigest().encode() + stored)
    (cupy / "k.cubin.cu").write_text(kernel)
    parsed: list[bytes] = []
    real_parse = jit.ast.parse

    def counted(source: bytes, *args: object, **kwargs: object) -> object:
        parsed.append(source)
        return real_parse(source, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(jit.ast, "parse", counted)
    reading = Reading()
    found = jit_attribution(ws, reading)
    assert found.digests == own | {image_digest(stored)} and found.unattributed == ""
    # each file once: model_new.py for the Triton entries; then the CuPy search parses a_helpers.py,
    # finds the source in model_new.py (parsed already) and reads no further (unread.py)
    assert [p.split(b"\n")[0] for p in parsed] == [b"import triton", b"X = 'not a kernel'"]
    assert reading.parses == 2
    parsed.clear()
    assert {k.digest for k in own_triton_kernels(ws)} == own and len(parsed) == 1


def test_the_budget_cuts_attribution_short_with_a_reason(tmp_path: Path) -> None:
    """Past its bytes or its seconds (a clock that moves a second a read), an attribution reads no
    more: the entries not yet judged get no own credit, and why is stated; a source file over
    `MAX_SOURCE_BYTES` is not parsed, and named."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "model_new.py").write_text(MODEL_NEW)
    own = _many_entries(ws, 40)
    assert jit_attribution(ws).digests == own

    by_bytes = jit_attribution(ws, Reading(max_bytes=4096))
    assert by_bytes.digests < own and "MiB of files read were spent" in by_bytes.unattributed, by_bytes
    assert "got no own credit" in by_bytes.unattributed

    ticks = iter(range(10_000))
    by_time = jit_attribution(ws, Reading(max_seconds=30, clock=lambda: float(next(ticks))))
    assert by_time.digests < own and "its 30 s were spent" in by_time.unattributed, by_time

    big = ws / "big.py"
    big.write_text(MODEL_NEW + "X = [" + "'s'," * (MAX_SOURCE_BYTES // 4) + "]\n")
    cache_entry(workspace_scratch(ws) / "triton", "zbig", "scale_kernel", fake_cubin(b"big"), "big.py", 6)
    over = jit_attribution(ws)
    assert over.digests == own and f"{big} (over 1 MiB, not parsed)" in over.unattributed, over


def test_the_audit_states_why_attribution_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Permissive mode on the GPU: a cut-short attribution fails nothing by itself, and the audit's
    notes say why kernels went uncredited (`Audit.kernels`, which verify's result reports)."""
    from cudagym.rewards import checks
    from cudagym.rewards.checks import Audit
    from cudagym.rewards.evaluator import EvaluatorConfig
    from cudagym.tasks.model import Target

    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "model_new.py").write_text(MODEL_NEW)
    own = sorted(_many_entries(ws, 8))
    monkeypatch.setattr(checks, "jit_attribution", lambda w: jit_attribution(w, Reading(max_bytes=2048)))
    audit = Audit(EvaluatorConfig(mode="permissive", cache_dir=tmp_path / "cache"), Target.CUDA)
    final = {"kernels": {}, "share_kernels": {}}
    notes: list[str] = []
    forbidden, reasons, _ = audit.kernels(final, None, str(ws), notes)
    assert not forbidden and not reasons
    assert len(notes) == 1 and notes[0].startswith("permissive mode: the own-kernel attribution stopped"), notes
    assert len(own) == 8


def test_the_profile_audit_runs_off_the_event_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The profile's audit of its timed calls (`checks.timed_calls_audited`) reads the job's JIT
    caches in a thread: while it is held inside the attribution, another coroutine of the same
    loop runs and lets it go on (on the loop, the attribution would wait for it in vain)."""
    from types import SimpleNamespace

    from cudagym.core.verdict import AuditResult, VerifyResult
    from cudagym.rewards import checks
    from cudagym.rewards.checks import Audit, timed_calls_audited
    from cudagym.rewards.evaluator import EvaluatorConfig
    from cudagym.tasks.model import Target

    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "model_new.py").write_text(MODEL_NEW)
    own = _many_entries(ws, 3)
    entered, go_on = threading.Event(), threading.Event()
    seen: list[frozenset[str]] = []

    def held(w: Path) -> jit.JitImages:
        entered.set()
        if not go_on.wait(timeout=60):
            raise AssertionError("the other coroutine never ran while the attribution was held")
        found = jit_attribution(w)
        seen.append(found.digests)
        return found

    monkeypatch.setattr(checks, "jit_attribution", held)
    audit = Audit(EvaluatorConfig(mode="permissive", cache_dir=tmp_path / "cache"), Target.CUDA)
    measured = VerifyResult(ok=True, trials=5, audit=AuditResult(mode="permissive", passed=True, ops_seen={}))
    run = SimpleNamespace(audit=audit, timed_ops={}, artifact_dir=None, measured=measured, workspace=str(ws))

    async def other() -> None:
        while not entered.is_set():
            await asyncio.sleep(0.001)
        go_on.set()

    async def both() -> object:
        found, _ = await asyncio.gather(timed_calls_audited(run), other())  # type: ignore[arg-type]
        return found

    assert asyncio.run(both()) is None
    assert seen == [own]


def test_verify_audits_off_the_event_loop(eval_cache: Path, build_ws) -> None:
    """Verify's audit (`Audit.kernels`, where the JIT caches are read) runs in a thread: a real
    CPU verify whose audit is held until another coroutine of the caller's loop lets it go on."""
    from cudagym.rewards.evaluator import Evaluator
    from cudagym.sandbox.protocol import VerifyConfig
    from cudagym.selfcheck import reference_as_candidate
    from cudagym.tasks.model import Task

    from conftest import cpu_config

    task = Task(id="jit_loop_scale", code="import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n"
                "    def forward(self, x):\n        return x * 2.0\n\n\ndef get_inputs():\n"
                "    return [torch.randn(16, 16)]\n\n\ndef get_init_inputs():\n    return []\n")
    entered, go_on = threading.Event(), threading.Event()
    with Evaluator(cpu_config(eval_cache, mode="permissive", verify=VerifyConfig(min_own_share=0.0))) as ev:
        kernels = ev.audit.kernels

        def held(*args: object) -> object:
            entered.set()
            if not go_on.wait(timeout=60):
                raise AssertionError("the other coroutine never ran while the audit was held")
            return kernels(*args)  # type: ignore[arg-type]

        ev.audit.kernels = held  # type: ignore[method-assign]

        async def other() -> None:
            while not entered.is_set():
                await asyncio.sleep(0.001)
            go_on.set()

        async def both() -> object:
            v, _ = await asyncio.gather(ev.averify(task, build_ws(task, reference_as_candidate(task.code))), other())
            return v

        v = asyncio.run(both())
    assert v.ok, v.error  # type: ignore[attr-defined]
    assert go_on.is_set()

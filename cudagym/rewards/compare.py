"""Output comparison, done in the evaluator's process on raw bytes sent by the worker.

`compare_outputs` gives a verdict on whatever a worker sent and never raises for it: a frame it
cannot read (a dtype outside `WIRE_DTYPES`, a malformed shape, a payload of the wrong size,
missing or mistyped keys) fails the comparison as `output_format`, naming the frame and why.
A verify output above `VerifyConfig.whole_output_mb` comes as evidence (`SampledOutput`: samples
and projections, `cudagym.sandbox.worker.verify.output_evidence`) rather than whole.
`sampled_pairs` pairs the samples of timed calls with a reference worker's outputs; the
comparisons run on one comparer thread (`in_comparer`), off the evaluator's event loop.
"""

from __future__ import annotations

import asyncio
import math
import os
import warnings
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeGuard, TypeVar

import torch

from cudagym.core.verdict import ErrorKind
from cudagym.sandbox.worker.wire import JobOutcome
from cudagym.sandbox.worker.dtypes import WIRE_DTYPES
from cudagym.tasks.model import Task, Tolerance

_ROLES = ("candidate", "reference")
_PARTS = ("samples", "projections")  # the frames of an output sent as evidence (`SampledOutput`)
_MAX_DIMS = 64  # far beyond any model's output; bounds the work one header can ask for
_MAX_SIZE = 1 << 63  # torch's sizes and strides are int64, even those of a shape with a zero in it
_SIGNED_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_count(value: Any) -> TypeGuard[int]:
    return type(value) is int and value >= 0  # not bool, not float: the harness sends plain ints


def _shape(shape: Any) -> list[int]:
    """`shape` if it is a list of at most `_MAX_DIMS` sizes >= 0 torch can hold, else `ValueError`."""
    if not (isinstance(shape, list) and len(shape) <= _MAX_DIMS and all(_is_count(s) for s in shape)
            and math.prod(max(s, 1) for s in shape) < _MAX_SIZE):
        raise ValueError(f"shape {_short(shape)} is not a list of at most {_MAX_DIMS} sizes >= 0 "
                         "whose product fits in int64")
    return shape


def decode_tensor(header: dict[str, Any], payload: bytes | memoryview) -> torch.Tensor:
    """The tensor a frame's `dtype` and `shape` describe, viewing `payload` (no copy).

    `ValueError` naming the problem if they do not describe one: a dtype outside `WIRE_DTYPES`,
    a shape that is not a list of at most `_MAX_DIMS` sizes >= 0 torch can hold, or a payload
    whose size is not the shape's.
    """
    name = header.get("dtype")
    dtype = WIRE_DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise ValueError(f"dtype {_short(name)} cannot be compared (outputs may be {', '.join(WIRE_DTYPES)})")
    shape = _shape(header.get("shape"))
    try:
        raw = memoryview(payload).cast("B")
    except TypeError:
        raise ValueError(f"its payload is a {type(payload).__name__}, not bytes") from None
    numel = math.prod(shape)
    if raw.nbytes != numel * dtype.itemsize:
        raise ValueError(f"{raw.nbytes} bytes of payload for a {name} tensor of shape {tuple(shape)} "
                         f"({numel * dtype.itemsize} bytes)")
    with warnings.catch_warnings():  # read-only buffers (never written to), complex32 "experimental"
        warnings.simplefilter("ignore", UserWarning)
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)


@dataclass(frozen=True)
class SampledOutput:
    """An output sent as evidence (`cudagym.sandbox.worker.verify.output_evidence`): its shape,
    its values at the positions drawn from the trial's evidence seed (`samples`, of its dtype)
    and its projections with the weights of that seed (float64)."""

    shape: tuple[int, ...]
    samples: torch.Tensor
    projections: torch.Tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.samples.dtype


def _read_frame(header: Any, payload: bytes | memoryview) -> tuple[str, int, int, str | None, torch.Tensor,
                                                                     list[int] | None]:
    """(role, trial, index, part, tensor, output shape) of one tensor frame: `part` None for a
    whole output, else one of `_PARTS` (a samples frame names its output's shape, `of_shape`);
    `ValueError` naming what is wrong."""
    if not isinstance(header, dict):
        raise ValueError(f"the header is a {type(header).__name__}, not an object")
    role, trial, index, part = header.get("role"), header.get("trial"), header.get("index"), header.get("part")
    if role not in _ROLES:
        raise ValueError(f"role {_short(role)} is neither candidate nor reference")
    if not (_is_count(trial) and _is_count(index)):
        raise ValueError(f"{role} output: trial {_short(trial)} and index {_short(index)} must be integers >= 0")
    try:
        if part is not None and part not in _PARTS:
            raise ValueError(f"part {_short(part)} is neither samples nor projections")
        of_shape = _shape(header.get("of_shape")) if part == "samples" else None
        return role, trial, index, part, decode_tensor(header, payload), of_shape
    except ValueError as e:
        raise ValueError(f"trial {trial}: {role} output {index}: {e}") from None


def _read_frames(tensors: list[tuple[dict[str, Any], bytes | memoryview]]
                 ) -> tuple[dict[int, dict[str, dict[int, torch.Tensor | SampledOutput]]], list[str]]:
    """The outputs of each trial by role and index (whole, or `SampledOutput` from its two
    frames), and why frames could not be read (none: all were)."""
    by_trial: dict[int, dict[str, dict[int, torch.Tensor | SampledOutput]]] = defaultdict(
        lambda: {role: {} for role in _ROLES})
    parts: dict[tuple[int, str, int], dict[str, tuple[torch.Tensor, list[int] | None]]] = defaultdict(dict)
    unreadable: list[str] = []
    for n, (header, payload) in enumerate(tensors):
        try:
            role, trial, index, part, tensor, of_shape = _read_frame(header, payload)
        except ValueError as e:
            unreadable.append(f"output frame {n}: {e}")
            continue
        known, key = parts[(trial, role, index)], part or "whole"
        if key in known or "whole" in known or (part is None and known):
            unreadable.append(f"output frame {n}: trial {trial}: {role} output {index} was sent twice")
            continue
        if part is None:
            by_trial[trial][role][index] = tensor
        known[key] = tensor, of_shape
    for (trial, role, index), known in parts.items():
        if "whole" in known:
            continue
        if set(known) != set(_PARTS):
            unreadable.append(f"trial {trial}: {role} output {index}: {' and '.join(known)} without "
                              f"{' and '.join(p for p in _PARTS if p not in known)}")
            continue
        (samples, shape), (sums, _) = known["samples"], known["projections"]
        by_trial[trial][role][index] = SampledOutput(tuple(shape or ()), samples, sums)
    return by_trial, unreadable


@dataclass
class Comparison:
    trials: int
    passed: int
    max_abs_error: float | None
    reasons: list[str]
    kind: str | None  # None when all passed; "mismatch", "output_format", or "internal" (the comparison itself failed)
    sampled: list[int] = field(default_factory=list)  # outputs checked by samples and projections (`SampledOutput`)


_CHUNK = 1 << 22  # elements per step: temporaries are reused, not allocated (and faulted in) per output


def _compare_values(c: torch.Tensor, r: torch.Tensor, tol: Tolerance) -> tuple[float, int, bool]:
    """(max abs error, elements out of tolerance, NaN/inf disagreement) of two floating tensors.

    An element passes if r is finite and |c - r| <= atol + rtol * |r|, or both are NaN, or
    both are the same infinity. The max error ignores elements where both are NaN/the same infinity, and is inf
    where NaNs disagree.
    """
    c, r = c.reshape(-1), r.reshape(-1)
    n = r.numel()
    if n == 0:
        return 0.0, 0, False
    f = torch.float64 if r.dtype == torch.float64 else torch.float32  # halves and float8: compared in fp32
    size = min(n, _CHUNK)
    diff, bound = torch.empty(size, dtype=f), torch.empty(size, dtype=f)
    within = torch.empty(size, dtype=torch.bool)
    worst, nbad, nan_bad = 0.0, 0, False
    for lo in range(0, n, _CHUNK):
        cc, rr = c[lo : lo + _CHUNK].to(f), r[lo : lo + _CHUNK].to(f)
        k = rr.numel()
        d, b, w = diff[:k], bound[:k], within[:k]
        torch.sub(cc, rr, out=d).abs_()
        torch.abs(rr, out=b).mul_(tol.rtol).add_(tol.atol)
        torch.le(d, b, out=w)
        # fast path: NaN anywhere makes `w` False, and the bound is infinite only at an infinite r
        if bool(w.all()) and float(b.max()) != float("inf"):
            worst = max(worst, float(d.max()))
            continue
        same_special = (torch.isnan(cc) & torch.isnan(rr)) | ((cc == rr) & torch.isinf(rr))
        good = (w & torch.isfinite(rr)) | same_special
        nbad += int((~good).sum())
        d = d.masked_fill(same_special, 0.0).nan_to_num_(float("inf"), float("inf"))
        worst = max(worst, float(d.max()))
        nan_bad = nan_bad or not bool((torch.isnan(cc) == torch.isnan(rr)).all())
    return worst, nbad, nan_bad


def _differing_elements(c: torch.Tensor, r: torch.Tensor) -> int:
    """How many elements of two same-dtype tensors differ in their bytes (exact comparison)."""
    c, r = c.reshape(-1), r.reshape(-1)
    if torch.equal(c.view(torch.uint8), r.view(torch.uint8)):
        return 0
    same_width = _SIGNED_OF_WIDTH[r.element_size()]  # a type with kernels for `!=`, whatever the dtype
    return int((c.view(same_width) != r.view(same_width)).sum())


def _value_mismatch(c: torch.Tensor, r: torch.Tensor, tol: Tolerance) -> tuple[float, str | None]:
    """(max abs error, why `c` is not `r` within `tol`, or None) for two tensors of one shape
    and dtype: integers and bool exactly, floating values by `_compare_values`, complex ones as
    pairs of real and imaginary parts."""
    if not (r.is_floating_point() or r.is_complex()):
        ndiff = _differing_elements(c, r)
        return 0.0, (f"differs from the reference at {ndiff}/{r.numel()} elements" if ndiff else None)
    parts = "elements"
    if r.is_complex():
        c, r, parts = torch.view_as_real(c), torch.view_as_real(r), "real/imaginary parts"
    err, nbad, nan_bad = _compare_values(c, r, tol)
    if not nbad:
        return err, None
    return err, (f"mismatches at {nbad}/{r.numel()} {parts} (max abs error {err:.3g}; atol={tol.atol}, "
                 f"rtol={tol.rtol}" + ("; NaN where the reference has none" if nan_bad else "") + ")")


def _sampled_mismatch(c: SampledOutput, r: SampledOutput, tol: Tolerance) -> tuple[float, str | None, bool]:
    """(max abs error at the samples, why `c` cannot be an output within `tol` of `r`, or None,
    whether the evidence itself is malformed) for two outputs of one shape and dtype sent as
    evidence: the samples as whole outputs are, the projections by `projection_mismatch`."""
    if c.samples.shape != r.samples.shape or c.projections.dtype != torch.float64:
        return 0.0, (f"its evidence is {tuple(c.samples.shape)} samples and {c.projections.dtype} projections, "
                     f"expected {tuple(r.samples.shape)} and torch.float64"), True
    err, why = _value_mismatch(c.samples, r.samples, tol)
    if why:
        return err, f"at {r.samples.numel()} sampled positions {why}", False
    exact = not (r.dtype.is_floating_point or r.dtype.is_complex)
    components = math.prod(r.shape) * (2 if r.dtype.is_complex else 1)
    why = projection_mismatch(c.projections.reshape(-1), r.projections.reshape(-1), components, tol, exact)
    return err, (f"mismatches by its projections: {why}" if why else None), False


def _form(output: torch.Tensor | SampledOutput) -> str:
    return "as evidence" if isinstance(output, SampledOutput) else "whole"


def compare_outputs(tensors: list[tuple[dict[str, Any], bytes | memoryview]], tol: Tolerance) -> Comparison:
    """Compare candidate and reference outputs per trial: structure, shape, dtype, values.

    Integers and bool must match exactly; floating outputs within `tol` (see `_compare_values`);
    complex outputs as pairs of real and imaginary parts. An output sent as evidence
    (`SampledOutput`) is compared so at its samples, and by its projections
    (`projection_mismatch`); the comparison's `sampled` names it. Any frame that cannot be read
    fails the whole comparison as `output_format`, without comparing values.
    """
    by_trial, unreadable = _read_frames(tensors)
    if unreadable:
        return Comparison(trials=len(by_trial), passed=0, max_abs_error=None, reasons=unreadable[:8],
                          kind="output_format")
    reasons: list[str] = []
    sampled: set[int] = set()
    passed, worst, kind = 0, 0.0, None
    for trial in sorted(by_trial):
        cand, ref = by_trial[trial]["candidate"], by_trial[trial]["reference"]
        ok = True
        if sorted(cand) != sorted(ref):
            reasons.append(f"trial {trial}: ModelNew returned {len(cand)} outputs, the reference {len(ref)}")
            kind, ok = "output_format", False
        for i in sorted(set(cand) & set(ref)):
            c, r = cand[i], ref[i]
            if c.shape != r.shape or c.dtype != r.dtype:
                reasons.append(f"trial {trial}: output {i} is {c.dtype} {tuple(c.shape)}, "
                               f"expected {r.dtype} {tuple(r.shape)}")
                kind, ok = "output_format", False
                continue
            if isinstance(c, SampledOutput) or isinstance(r, SampledOutput):
                if not (isinstance(c, SampledOutput) and isinstance(r, SampledOutput)):
                    reasons.append(f"trial {trial}: output {i} was sent {_form(c)}, the reference's {_form(r)}")
                    kind, ok = "output_format", False
                    continue
                sampled.add(i)
                err, why, malformed = _sampled_mismatch(c, r, tol)
                if malformed:
                    kind = "output_format"
            else:
                err, why = _value_mismatch(c, r, tol)
            worst = max(worst, err)
            if why:
                reasons.append(f"trial {trial}: output {i} {why}")
                kind, ok = kind or "mismatch", False
        passed += ok
    if not by_trial:
        reasons.append("no outputs were compared")
        kind = "mismatch"
    return Comparison(trials=len(by_trial), passed=passed, max_abs_error=worst if by_trial else None,
                      reasons=reasons[:8], kind=kind, sampled=sorted(sampled))


# An honest output's projection differs from the reference's by more than this many of its
# standard deviations' bound with probability at most 2 exp(-PROJECTION_SIGMAS^2 / 2) (Hoeffding):
# 2.5e-14 per projection.
PROJECTION_SIGMAS = 8.0
_FP64_UNIT = 2.0 ** -53


def projection_mismatch(cand: torch.Tensor, ref: torch.Tensor, components: int, tol: Tolerance,
                        exact: bool) -> str | None:
    """Why a timed call's projections of one output (`cand`: the close kernel's sums, float64)
    cannot come from an output within `tol` of the reference's (`ref`: the same sums of the
    reference's output with the same weights, then its sum |r_i|, sum r_i^2 and non-finite count;
    `cudagym.sandbox.timing.projection`); None if they can.

    With weights w_i = +-1 drawn after the call returned, an honest output's errors e_i
    (|e_i| <= atol + rtol |r_i| =: t_i, or 0 where `exact`) do not depend on them, so the
    difference sum w_i e_i exceeds PROJECTION_SIGMAS * sqrt(sum t_i^2) with probability at most
    2 exp(-PROJECTION_SIGMAS^2 / 2); to that the fp64 sums' rounding is added (any order: at most
    `components` units in the last place of sum |x_i| per side). An output left uncomputed,
    or computed only where it was sampled, differs by a sum of errors that are not small: it
    fails unless its projections were computed from the whole output. A reference with a
    non-finite component is not checked this way (its samples still are)."""
    k = cand.numel()
    if ref.numel() != k + 3 or k == 0:
        return f"{k} projections against the reference's {max(ref.numel() - 3, 0)}"
    if float(ref[k + 2]) > 0:
        return None
    if not bool(torch.isfinite(cand).all()):
        return "its projections are not finite (a NaN or infinity where the reference has none)"
    atol, rtol = (0.0, 0.0) if exact else (float(tol.atol), float(tol.rtol))
    s_abs, s_sq = float(ref[k]), float(ref[k + 1])
    sigma = math.sqrt(max(components * atol * atol + 2 * atol * rtol * s_abs + rtol * rtol * s_sq, 0.0))
    rounding = 2 * components * _FP64_UNIT * (2 * s_abs + components * atol + rtol * s_abs)
    allowed = PROJECTION_SIGMAS * sigma + rounding
    worst = float((cand - ref[:k]).abs().max())
    if worst <= allowed:
        return None
    return (f"its projections over the whole output differ from the reference's by {worst:.4g} "
            f"(an honest output within atol={tol.atol}, rtol={tol.rtol} differs by at most {allowed:.4g}): "
            "the output was not computed in full")


def projection_seeds(candidate: list[tuple[dict[str, Any], Any]], picks: list[tuple[int, int]]) -> list[int | None]:
    """The seed of each picked timed call's projections (None: the call sent none)."""
    seeds: dict[Any, Any] = {h.get("trial"): h.get("seed") for h, _ in candidate if h.get("role") == "projection"}
    return [s if type(s) is int and 0 <= s < 2**64 else None for s in (seeds.get(c) for c, _ in picks)]


def projected_mismatch(candidate: list[tuple[dict[str, Any], Any]], reference: list[tuple[dict[str, Any], Any]],
                       picks: list[tuple[int, int]], tol: Tolerance) -> str | None:
    """Why the projections of the picked timed calls (the close kernel's, on the GPU) cannot
    come from outputs within `tol` of the reference's (`projection_mismatch`); None if they can.
    `picks[t]` is the reference's trial t; those past the ones whose outputs the reference sent
    (`Job.projected_only_from`) are checked by their projections alone, with the outputs'
    shapes and dtypes of its first trial (every call's are the same: `calls_shaped`)."""
    def frames(which: list[tuple[dict[str, Any], Any]], role: str) -> dict[tuple[Any, Any], tuple[dict[str, Any], Any]]:
        return {(h.get("trial"), h.get("index")): (h, p) for h, p in which if h.get("role") == role}

    cand, ref_proj = frames(candidate, "projection"), frames(reference, "projection")
    ref_out = frames(reference, "reference")
    first = sorted(((j, rh) for (tt, j), (rh, _) in ref_out.items() if tt == 0), key=lambda kv: kv[0])
    for t, (call, _seed) in enumerate(picks):
        for j, rh in first:
            if (call, j) not in cand or (t, j) not in ref_proj:
                return f"timed call {call}: output {j} has no projections"
            c, r = decode_tensor(*cand[(call, j)]), decode_tensor(*ref_proj[(t, j)])
            if c.dtype != torch.float64 or r.dtype != torch.float64:
                return f"timed call {call}: the projections of output {j} are not float64"
            dtype = WIRE_DTYPES.get(str(rh.get("dtype")))
            numel = math.prod(rh.get("shape") or [])
            exact = dtype is not None and not (dtype.is_floating_point or dtype.is_complex)
            components = numel * (2 if dtype is not None and dtype.is_complex else 1)
            why = projection_mismatch(c.reshape(-1), r.reshape(-1), components, tol, exact)
            if why:
                return f"timed call {call}: output {j}: {why}"
    return None


def _raw(t: Any) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def calls_shaped(candidate: list[tuple[dict[str, Any], Any]], reference: list[tuple[dict[str, Any], Any]],
                 calls: list[int]) -> str | None:
    """Why a model call of the timed loop (`calls`: their indices) returned outputs other than the
    reference's in number, shape or dtype (as the evidence it sent says), or None: every call's,
    not only the re-checked ones' (red team 22's candidate returned one element from the calls
    the re-check could not draw)."""
    want: dict[Any, tuple[list[Any], Any]] = {}
    for h, _ in reference:
        if h.get("role") == "reference":
            want.setdefault(h.get("index"), (list(h.get("shape") or []), h.get("dtype")))
    got: dict[Any, dict[Any, tuple[list[Any], Any]]] = {}
    for h, _ in candidate:
        if h.get("role") == "sample":
            got.setdefault(h.get("trial"), {})[h.get("index")] = (list(h.get("full_shape") or []), h.get("dtype"))
    for call in calls:
        outs = got.get(call, {})
        if sorted(outs, key=str) != sorted(want, key=str):
            return f"timed call {call}: ModelNew returned {len(outs)} outputs, the reference {len(want)}"
        for j, (shape, dtype) in outs.items():
            if (shape, dtype) != want[j]:
                return (f"timed call {call}: output {j} is {dtype} {tuple(shape)}, expected {want[j][1]} "
                        f"{tuple(want[j][0])}")
    return None


def sampled_pairs(candidate: list[tuple[dict[str, Any], Any]], reference: list[tuple[dict[str, Any], Any]],
                  picks: list[tuple[int, int]]) -> list[tuple[dict[str, Any], bytes]] | str:
    """Candidate/reference frames for `compare_outputs` from the samples of the picked timed
    calls (`picks[t]` = (call index, seed); the reference worker ran seed t as its trial t): the
    reference's outputs at the sampled positions. A string names a structural mismatch."""
    samples: dict[tuple[Any, Any], dict[str, Any]] = {}
    for h, payload in candidate:
        if h.get("role") in ("sample", "positions"):
            samples.setdefault((h.get("trial"), h.get("index")), {})[h["role"]] = (h, payload)
    refs: dict[tuple[Any, Any], tuple[dict[str, Any], Any]] = {
        (h.get("trial"), h.get("index")): (h, p) for h, p in reference if h.get("role") == "reference"}
    pairs: list[tuple[dict[str, Any], bytes]] = []
    for t, (call, _seed) in enumerate(picks):
        outs = sorted(j for (c, j) in samples if c == call)
        want = sorted(j for (tt, j) in refs if tt == t)
        if outs != want:
            return f"timed call {call}: ModelNew returned {len(outs)} outputs, the reference {len(want)}"
        for j in outs:
            sh, sp = samples[(call, j)]["sample"]
            rh, rp = refs[(t, j)]
            if list(sh.get("full_shape") or []) != list(rh.get("shape") or []) or sh.get("dtype") != rh.get("dtype"):
                return (f"timed call {call}: output {j} is {sh.get('dtype')} {tuple(sh.get('full_shape') or [])}, "
                        f"expected {rh.get('dtype')} {tuple(rh.get('shape') or [])}")
            ref = decode_tensor(rh, rp)
            if "positions" in samples[(call, j)]:
                ph, pp = samples[(call, j)]["positions"]
                idx = decode_tensor(ph, pp)
                if idx.dtype != torch.int64 or idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= ref.numel()):
                    return f"timed call {call}: the sampled positions of output {j} are invalid"
                ref = ref.reshape(-1)[idx]
            head = {"trial": t, "index": j, "dtype": rh.get("dtype"), "shape": list(ref.shape)}
            pairs.append(({**head, "role": "candidate", "shape": list(sh.get("shape") or [])}, bytes(sp)))
            pairs.append(({**head, "role": "reference"}, _raw(ref)))
    return pairs


# -- the comparer thread ------------------------------------------------------------------------
def _comparer_threads() -> None:
    # A few intra-op threads, set for this thread only: with every core's thread in each op,
    # one core busy elsewhere (a spare starting) stalls every op of the comparison.
    torch.set_num_threads(max(1, min(8, (os.cpu_count() or 2) // 4)))


_COMPARER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cudagym-compare", initializer=_comparer_threads)
_T = TypeVar("_T")


async def in_comparer(fn: Callable[..., _T], *args: Any) -> _T:
    """`fn(*args)` on the comparer thread: the event loop stays free while outputs are compared."""
    return await asyncio.get_running_loop().run_in_executor(_COMPARER, fn, *args)


async def compare_outcome(o: JobOutcome, task: Task) -> Comparison:
    """Compare the outcome's outputs on the comparer thread (the event loop stays free).

    Never raises: `compare_outputs` turns whatever the worker sent into a verdict, and a failure
    of the comparison itself (out of memory, a bug) is a Comparison of kind "internal".
    """
    try:
        return await in_comparer(compare_outputs, o.tensors, task.effective_tolerance)
    except Exception as e:  # noqa: BLE001 - the evaluator's failure, not the candidate's: named, not raised
        return Comparison(trials=0, passed=0, max_abs_error=None, kind=ErrorKind.INTERNAL.value,
                          reasons=[f"the evaluator failed to compare the outputs: {type(e).__name__}: {e}"])

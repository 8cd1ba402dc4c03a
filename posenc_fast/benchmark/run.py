"""The benchmark run: case by case, implementation by implementation, check agreement with eager,
time each op, and write the JSON after every case (a run cut short keeps what it measured)."""

from __future__ import annotations

import dataclasses
import gc
import os
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .. import config
from .cases import OPS, FUSED_IMPLS, COMPILE_IMPLS, HEADLINE, JSON_IMPLS, Case, for_device
from .impls import (
    rotation_sets, CaseInputs, impl_unavailable, build_runner, forward_fn, backward_fn, step_fn, relative_error,
    agreement_bar,
)
from .timing import sync, time_op, copy_bandwidth_GBps, step_peak_bytes
from .results import Measurement, device_name, device_slug, make_document, rows_to_merge, write_document


@dataclasses.dataclass
class RunReport:
    measurements: List[Measurement]
    copy_GBps: float
    document: dict
    json_path: str
    notes: List[str]  # extra lines: id check on, determinism, agreement, skips, failures
    deterministic: Dict[str, bool]
    failures: List[str]
    written: bool  # json_path was written: the run measured a row the JSON keeps


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _reset_compiler() -> None:
    """Every case compiles afresh: dynamo's per-code-object cache would otherwise fill up across
    cases (and fall back to eager silently) or switch to dynamic shapes."""
    import torch._dynamo

    torch._dynamo.reset()
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))


def run_benchmark(cases: Sequence[Case], impls: Sequence[str], device: torch.device, out_dir: str, *,
                  ops: Sequence[str] = OPS, time_budget_s: Optional[float] = None, explicit_impls: bool = False,
                  merge: bool = False, log: Callable[[str], None] = print, seed: int = 0) -> RunReport:
    """Time every (case, op, impl), writing the JSON after each case that measured something; return what was
    measured.

    ``explicit_impls``: compile-max-autotune runs on every case (else only on cases marked
    ``autotune``).  ``time_budget_s``: once exceeded, the remaining (case, impl) pairs are skipped
    (and listed), so a run with a hard time limit still ends with a complete JSON.  ``merge``:
    keep the rows of an existing ``<out_dir>/<slug>.json`` that this run does not re-measure.
    """
    started = time.monotonic()
    slug = device_slug(device_name(device))
    json_path = os.path.join(out_dir, f"{slug}.json")
    notes: List[str] = []
    failures: List[str] = []
    deterministic: Dict[str, bool] = {}
    measurements: List[Measurement] = []
    kept_rows: List[dict] = []
    if merge:
        kept_rows, merge_note = rows_to_merge(json_path, device)
        if merge_note:
            notes.append(merge_note)

    usable = []
    for impl in impls:
        reason = impl_unavailable(impl, device)
        if reason is None:
            usable.append(impl)
        else:
            notes.append(f"skipped {impl}: {reason.splitlines()[0][:300]}")
            log(f"skipping {impl}: {reason.splitlines()[0][:300]}")

    copy = copy_bandwidth_GBps(device)
    log(f"device {device_name(device)}; {'copy' if device.type == 'cuda' else 'gather + write'} bandwidth {copy:.1f} GB/s (read + write)")
    skipped_for_time = []

    for case in (for_device(c, device) for c in cases):
        case_ops = [op for op in case.ops if op in ops]
        if not case_ops:
            continue
        if any(impl in COMPILE_IMPLS for impl in usable):
            _reset_compiler()
        _free_memory(device)
        needs_grad = any(op != "forward" for op in case_ops)
        try:
            inputs = CaseInputs(case, device, rotation_sets(case, device), seed=seed, need_grads=needs_grad)
            reference = _eager_reference(case, inputs, device, needs_grad)
        except Exception as error:  # out of memory, most likely: the other cases can still run
            failures.append(f"{case.name}: preparing inputs and eager's reference failed: {type(error).__name__}: "
                            f"{(str(error).splitlines() or [''])[0][:300]}")
            log(f"FAILED {failures[-1]}")
            inputs = reference = None
            _free_memory(device)
            continue
        for impl in usable:
            if impl == "compile-max-autotune" and not (case.autotune or explicit_impls):
                continue
            if time_budget_s is not None and time.monotonic() - started > time_budget_s:
                skipped_for_time.append(f"{case.name}/{impl}")
                continue
            try:  # appends to measurements as it goes: what was timed before a failure is kept
                _measure_impl(case, case_ops, impl, inputs, reference, device, measurements, notes, deterministic,
                              failures, log)
            except Exception as error:  # one broken implementation must not lose the others' numbers
                first_line = (str(error).splitlines() or [""])[0][:300]
                failures.append(f"{case.name} {impl}: {type(error).__name__}: {first_line}")
                log(f"FAILED {failures[-1]}")
            _free_memory(device)
        del inputs, reference
        if _any_kept(measurements):
            write_document(json_path, make_document(device, copy, measurements, kept_rows))
    if skipped_for_time:
        notes.append(f"time budget ({time_budget_s:g} s) reached; not run: {', '.join(skipped_for_time)}")
    notes.append(f"{len(measurements)} measurements in {time.monotonic() - started:.0f} s")
    doc = make_document(device, copy, measurements, kept_rows)
    written = _any_kept(measurements)  # a run with no row for the JSON leaves an earlier results file as it was
    if written:
        write_document(json_path, doc)
    notes.extend(f"FAILED {f}" for f in failures)
    return RunReport(measurements, copy, doc, json_path, notes, deterministic, failures, written)


def _any_kept(measurements: Sequence[Measurement]) -> bool:
    """Whether the JSON keeps any of these rows (not the torch reference's, ``make_document``)."""
    return any(m.impl in JSON_IMPLS for m in measurements)


def _eager_reference(case: Case, inputs: CaseInputs, device: torch.device, needs_grad: bool):
    """Eager's output (and weight gradient) on the first input set: what every implementation
    must agree with."""
    runner = build_runner("eager", case, inputs, device)
    with torch.no_grad():
        out = runner.module(inputs.ids[0])
    grad = None
    if needs_grad:
        grad = torch.autograd.grad(runner.module(inputs.ids[0]), (runner.weight,), inputs.grads[0])[0]
    return out, grad


def _measure_impl(case, case_ops, impl, inputs, reference, device, measurements, notes, deterministic, failures,
                  log) -> None:
    """Check ``impl`` against eager's reference, then time each op (appended to ``measurements``)."""
    runner = build_runner(impl, case, inputs, device)
    bar = agreement_bar(case.dtype)
    results = []
    t0 = time.monotonic()
    with config.id_check(False):
        # Agreement with eager (also the compile / JIT warm-up of the forward).
        with torch.no_grad():
            out = runner.module(inputs.ids[0])
        sync(device)
        if impl in COMPILE_IMPLS:
            log(f"  {case.name} {impl}: forward compiled in {time.monotonic() - t0:.1f} s")
        err = relative_error(out, reference[0])
        del out
        if not err <= bar:
            failures.append(f"{case.name} {impl}: output differs from eager, rel. error {err:.2e} > {bar:g}")
            log(f"MISMATCH {failures[-1]}")
        for op in case_ops:
            if op == "forward":
                fn = forward_fn(runner, inputs)
            elif op == "backward":
                fn = backward_fn(runner, inputs)
                first_out, first_grad = runner.module(inputs.ids[0]), inputs.grads[0]
                g1 = torch.autograd.grad(first_out, (runner.weight,), first_grad, retain_graph=True)[0]
                g2 = torch.autograd.grad(first_out, (runner.weight,), first_grad)[0]
                same = torch.equal(g1, g2)
                if case.name == HEADLINE[device.type]:
                    deterministic[impl] = same
                notes.append(f"{case.name} backward deterministic (two runs bitwise equal), {impl}: "
                             f"{'yes' if same else 'NO'}")
                gerr = relative_error(g1, reference[1])
                del first_out, g1, g2
                if not gerr <= bar:
                    failures.append(f"{case.name} {impl}: weight gradient differs from eager, rel. error "
                                    f"{gerr:.2e} > {bar:g}")
                    log(f"MISMATCH {failures[-1]}")
            else:
                fn = step_fn(runner, inputs)
            timing = time_op(fn, device, latency=case.latency)
            peak = step_peak_bytes(fn, runner.weight, device) if op == "step" else None
            m = Measurement(case, op, impl, timing.median_ms, timing.spread_pct, peak)
            results.append(m)
            measurements.append(m)
            log(f"  {case.name:<21}{op:<9}{impl:<21}{m.median_ms:10.4f} ms {m.GBps:9.1f} GB/s"
                + (f"  peak {peak / 2**20:.0f} MiB" if peak is not None else ""))
            del fn
            runner.weight.grad = None
            _free_memory(device)
    # The headline forward with the id check on: a note, not a row (the JSON's impl enum has no slot for it).
    if case.name == HEADLINE[device.type] and "forward" in case_ops and impl in FUSED_IMPLS:
        with config.id_check(True):
            on = time_op(forward_fn(runner, inputs), device, latency=case.latency)
        off = next(m for m in results if m.op == "forward")
        what = ("one device->host sync per call" if device.type == "cuda"
                else "a range check of every id on the host per call")
        notes.append(f"{case.name} forward, {impl}, with the id range check ON ({what}): {on.median_ms:.4f} ms, "
                     f"against {off.median_ms:.4f} ms with it off (the timed rows): "
                     f"{100.0 * (on.median_ms / off.median_ms - 1):+.1f}%")
    log(f"  {case.name} {impl}: {time.monotonic() - t0:.1f} s in all (warm-up and compilation included)")

"""README.md: its Python examples run as printed (on this machine's device), and every figure the
README and docs quote from a measurement matches the committed results file it comes from."""

import json
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)

# Blocks that need what a test machine cannot have; each with why.  Every other block must run.
NOT_RUN = {
    'AutoModelForSeq2SeqLM.from_pretrained("facebook/m2m100_418M")': "downloads a model from the Hub "
                                                                     "(tests/test_integrations_transformers.py covers patch_model)",
}


def test_readme_has_python_examples():
    assert len(PYTHON_BLOCKS) >= 2


def test_readme_python_examples_run_as_printed(tmp_path, monkeypatch):
    """The blocks run in order in one namespace, as a reader pasting them into one session would (in an
    empty folder: the Deploy block saves a file)."""
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "readme"}
    ran = 0
    for block in PYTHON_BLOCKS:
        if any(marker in block for marker in NOT_RUN):
            continue
        exec(compile(block, "README.md", "exec"), namespace)
        ran += 1
    assert ran >= 2
    # The API block's own check: its functional concat output against the float64 reference.
    y, exact = namespace["y"], namespace["exact"]
    assert y.shape == (8, 2048, 1024) and (y.double() - exact).abs().max().item() < 1e-4


# ---- quoted figures against the committed results files ---------------------------------------

def _load(name):
    with open(os.path.join(ROOT, "bench", "results", name), encoding="utf-8") as f:
        return json.load(f)


CPU_RUN = "cpu-intel-r-xeon-r-processor.json"
GPU_RUN = "nvidia-h200.json"
CUDA_FORWARD_AB = "cuda-forward-ab-nvidia-h200.json"
HEADLINE = 524288  # tokens
BUILD = "build-size.json"


def cpu_ms(threads, op, impl):
    return lambda doc: next(r["ms"] for r in doc["rows"] if (r["threads"], r["op"], r["impl"]) == (threads, op, impl))


def cpu_speedup(threads, op, vs):
    return lambda doc: next(s["speedup"] for s in doc["speedups"]
                            if (s["threads"], s["op"], s["impl"], s["vs"]) == (threads, op, "cpu", vs))


def gpu_ms(tokens, op, impl):
    return lambda doc: next(r["median_ms"] for r in doc["cases"]
                            if (r["tokens"], r["op"], r["impl"]) == (tokens, op, impl))


def copy_pct(tokens, op, impl):
    return lambda doc: 100 * next(r["GBps"] for r in doc["cases"]
                                  if (r["tokens"], r["op"], r["impl"]) == (tokens, op, impl)) / doc["copy_GBps"]


def ab_ms(case, variant):
    return lambda doc: next(r["median_ms"] for r in doc["rows"] if (r["case"], r["variant"]) == (case, variant))


def megabytes(key):
    return lambda doc: doc[key] / 1e6


# (document, text as quoted with {} for each figure, results file, one getter per figure).  A new
# quoted figure is one new entry here.
QUOTED = [
    ("README.md", "on one core, forward {:.2f} ms against {:.2f} ms for eager PyTorch", CPU_RUN,
     [cpu_ms(1, "forward", "cpu"), cpu_ms(1, "forward", "eager")]),
    ("README.md", "and {:.2f} ms for `torch.compile` of it", CPU_RUN, [cpu_ms(1, "forward", "compile")]),
    ("README.md", "forward + backward {:.1f} ms against {:.1f} ms eager", CPU_RUN,
     [cpu_ms(1, "step", "cpu"), cpu_ms(1, "step", "eager")]),
    ("README.md", "On both cores, forward {:.2f} ms against {:.2f} ms eager ({:.2f}x) and {:.2f} ms compiled ({:.2f}x)",
     CPU_RUN, [cpu_ms(2, "forward", "cpu"), cpu_ms(2, "forward", "eager"), cpu_speedup(2, "forward", "eager"),
               cpu_ms(2, "forward", "compile"), cpu_speedup(2, "forward", "compile")]),
    ("README.md", "the step {:.2f}x faster than eager", CPU_RUN, [cpu_speedup(2, "step", "eager")]),
    ("README.md", "the forward takes {:.3f} ms with `backend=\"triton\"` and {:.3f} ms with `backend=\"cuda\"` "
     "against {:.2f} ms for eager PyTorch and {:.3f} ms for `torch.compile` of it", GPU_RUN,
     [gpu_ms(HEADLINE, "forward", impl) for impl in ("triton", "cuda", "eager", "compile")]),
    ("README.md", "the training step (forward + backward) {:.2f} ms with `triton` and {:.2f} ms with `cuda` against "
     "{:.2f} ms eager and {:.2f} ms compiled", GPU_RUN,
     [gpu_ms(HEADLINE, "step", impl) for impl in ("triton", "cuda", "eager", "compile")]),
    ("README.md", "an A/B in one process put the capped build at {:.3f} ms against {:.3f} ms", CUDA_FORWARD_AB,
     [ab_ms("headline", "POSENC_FORWARD_MIN_BLOCKS=4"), ab_ms("headline", "installed")]),
    ("docs/cuda_backend.md", "| headline, 524288 tokens x 1024 | forward | {:.3f} ms ({:.0f}% of copy) | {:.3f} ms ({:.0f}%) |",
     GPU_RUN, [gpu_ms(HEADLINE, "forward", "cuda"), copy_pct(HEADLINE, "forward", "cuda"),
               gpu_ms(HEADLINE, "forward", "triton"), copy_pct(HEADLINE, "forward", "triton")]),
    ("docs/cuda_backend.md", "| | backward | {:.3f} ms | {:.3f} ms | | | step | {:.3f} ms | {:.3f} ms |", GPU_RUN,
     [gpu_ms(HEADLINE, op, impl) for op in ("backward", "step") for impl in ("cuda", "triton")]),
    ("docs/cuda_backend.md", "{:.1f} MB after stripping, of which the `.nv_fatbin` section is {:.1f} MB; "
     "zip-compressed as a wheel stores it, {:.1f} MB", BUILD,
     [megabytes("module_bytes"), megabytes("nv_fatbin_section_bytes"), megabytes("module_zip_deflated_bytes")]),
] + [
    ("docs/performance.md", f"| {threads} | {op} | {{:.3g}} ms | {{:.3g}} ms | {{:.3g}} ms | {{:.2f}}x | {{:.2f}}x |",
     CPU_RUN, [cpu_ms(threads, op, "eager"), cpu_ms(threads, op, "compile"), cpu_ms(threads, op, "cpu"),
               cpu_speedup(threads, op, "eager"), cpu_speedup(threads, op, "compile")])
    for threads in (1, 2) for op in ("forward", "step")
]


def _text(document):
    with open(os.path.join(ROOT, document), encoding="utf-8") as f:
        return " ".join(f.read().split())  # line breaks of the prose do not matter


@pytest.mark.parametrize("document,template,results,getters", QUOTED,
                         ids=[f"{d}:{t[:40]}" for d, t, _, _ in QUOTED])
def test_quoted_figure_matches_its_results_file(document, template, results, getters):
    doc = _load(results)
    expected = template.format(*(get(doc) for get in getters))
    assert expected in _text(document), f"{document} should say: {expected!r} (from bench/results/{results})"


def test_every_measured_figure_in_the_readme_is_checked():
    """Timings (ms), sizes (MB) and speedups (x) in the README's prose all lie in a checked quote,
    so a new figure cannot be added without a results file behind it."""
    text = _text("README.md")
    checked = [t.format(*(g(_load(r)) for g in gs)) for d, t, r, gs in QUOTED if d == "README.md"]
    for match in re.finditer(r"\d+(\.\d+)? ?(ms|MB)\b|\d+\.\d+x\b", text):
        if any(quote in text and text.find(quote) <= match.start() < text.find(quote) + len(quote) for quote in checked):
            continue
        # Sizes of what pip downloads are not measurements of this project (README: "Which torch").
        if text[max(0, match.start() - 60):match.end() + 40].count("CUDA packages"):
            continue
        raise AssertionError(f"README figure {match.group(0)!r} is in no checked quote: "
                             f"...{text[max(0, match.start() - 80):match.end() + 20]}...")

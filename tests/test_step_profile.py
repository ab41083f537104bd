"""benchmarks/step_profile.py's sorting of `perf script` samples into kinds of work, per thread."""

from __future__ import annotations

import pytest

from conftest import script_module

SAMPLES = """\
   101       329d0 (anonymous namespace)::bf16_row_pair<2> (/root/.cache/waferline/kernels/x/waferline_cpu_ops.so)
   101       329d4 (anonymous namespace)::bf16_row_pair<2> (/root/.cache/waferline/kernels/x/waferline_cpu_ops.so)
   101       8ab10 _PyEval_EvalFrameDefault (/usr/lib/libpython3.11.so.1.0)
   101       97fdc _int_malloc (/usr/lib/x86_64-linux-gnu/libc.so.6)
   107       1e02a [unknown] (/venv/lib/python3.11/site-packages/torch/lib/libgomp.so.1)
   107       1e02a [unknown] (/venv/lib/python3.11/site-packages/torch/lib/libgomp.so.1)
   107       40a10 (anonymous namespace)::gqa_rows<c10::BFloat16, c10::BFloat16>(...)::{lambda(long, long)#1}::operator() (/root/.cache/waferline/kernels/x/waferline_cpu_ops.so)
   107       329d0 (anonymous namespace)::bf16_row_pair<2> (/root/.cache/waferline/kernels/x/waferline_cpu_ops.so)
not a sample line
"""


@pytest.fixture(scope="module")
def sp():
    yield from script_module("step_profile")


def test_samples_are_sorted_per_thread_into_kinds(sp):
    got = sp.classify(SAMPLES)
    assert got["101"] == {"weight products": 0.5, "python interpreter": 0.25, "C library": 0.25}
    assert got["107"] == {"OpenMP wait": 0.5, "attention": 0.25, "weight products": 0.25}
    assert sp.kind_of("c10::function_ref<...> (/venv/torch/lib/libtorch_cpu.so)") == "torch ops"
    assert sp.kind_of("something (/usr/lib/libfoo.so)") == "other"
    for kernel in ("bf16_tile_block<8, 2>", "int4_tile_block<8, 1, c10::BFloat16, c10::BFloat16>",
                   "int8_tile_block<1, 4, c10::Half>"):  # the tile copies' kernels are weight products too
        assert sp.kind_of(f"(anonymous namespace)::{kernel} (/x/waferline_cpu_ops.so)") == "weight products"


def test_top_functions_counts_every_thread(sp):
    top = sp.top_functions(SAMPLES, 2)
    assert top[0] == ("(anonymous namespace)::bf16_row_pair<2>", "weight products", 3 / 8)
    assert top[1] == ("[unknown]", "OpenMP wait", 2 / 8)

"""extract_model_from_parallel: the model out of DataParallel, torch.compile, a precision
wrapper, and (recursively) out of submodules that hold another as `.module`."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from notebook_accel.big_modeling import extract_model_from_parallel


def test_wrappers_come_off():
    model = nn.Linear(3, 2)
    assert extract_model_from_parallel(model) is model
    assert extract_model_from_parallel(nn.DataParallel(nn.DataParallel(model))) is model


def test_recursive_unwraps_submodules_too():
    inner = nn.Linear(3, 2)
    model = nn.Sequential(nn.DataParallel(inner), nn.ReLU())
    assert extract_model_from_parallel(model) is model and model[0].module is inner
    assert extract_model_from_parallel(model, recursive=True)[0] is inner


def test_the_precision_wrapper_comes_off_when_asked():
    model = nn.Linear(3, 2)
    original = model.forward
    model._original_forward = original
    model.forward = lambda x: original(x).double()  # what a precision wrapper does
    x = torch.randn(1, 3)
    assert extract_model_from_parallel(model)(x).dtype == torch.float64
    assert extract_model_from_parallel(model, keep_fp32_wrapper=False)(x).dtype == torch.float32


@pytest.mark.timeout(300)
def test_a_compiled_model_keeps_or_loses_its_compiled_wrapper():
    inner = nn.Linear(3, 2)
    compiled = torch.compile(nn.DataParallel(inner))
    kept = extract_model_from_parallel(compiled)
    assert kept is compiled and compiled._orig_mod is inner
    compiled = torch.compile(nn.DataParallel(inner))
    assert extract_model_from_parallel(compiled, keep_torch_compile=False) is inner
    model = nn.Sequential(nn.Linear(3, 3), torch.compile(nn.Linear(3, 2)))  # a compiled part
    extracted = extract_model_from_parallel(model, keep_torch_compile=False)
    assert extracted is model and hasattr(extracted[1], "_orig_mod")

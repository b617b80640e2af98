"""prepare_pippy over 2 CPU workers (gloo): the output gathered to the launching process
equals the one-process model's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from notebook_accel import notebook_launcher
from tests_support import dev_dependency


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(4)]
    return nn.Sequential(*blocks, nn.Linear(16, 4)).eval()


def _gpt2():
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        n_layer=4, n_embd=32, n_head=2, vocab_size=100, n_positions=32, use_cache=False
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def _pipelined(build, inputs, split_points, no_split):
    from notebook_accel.big_modeling import prepare_pippy

    model = prepare_pippy(
        build(),
        split_points=split_points,
        no_split_module_classes=no_split,
        example_args=(inputs,),
        gather_output=True,
    )
    return model(inputs), model.hf_split_points


@pytest.mark.timeout(180)
@pytest.mark.parametrize("split_points", ["auto", ["3"]])
def test_pipelined_mlp_equals_one_process(split_points):
    inputs = torch.randn(5, 16)  # 5 rows in 2 micro-batches: padded, then trimmed
    with torch.no_grad():
        expected = _mlp()(inputs)
    output, points = notebook_launcher(
        _pipelined, args=(_mlp, inputs, split_points, None), num_processes=2, backend="cpu"
    )
    assert len(points) == 1
    torch.testing.assert_close(output, expected)


@pytest.mark.timeout(180)
def test_pipelined_transformers_model_equals_one_process():
    dev_dependency("transformers")
    inputs = torch.randint(0, 100, (4, 8), generator=torch.Generator().manual_seed(0))
    reference = _gpt2()
    with torch.no_grad():
        expected = reference(inputs).logits
    # warm=False: the kernel imports nothing in the background afterwards (it would race
    # with this process importing transformers' modules in a later test)
    output, points = notebook_launcher(
        _pipelined,
        args=(_gpt2, inputs, "auto", ["GPT2Block"]),
        num_processes=2,
        backend="cpu",
        warm=False,
    )
    assert points[0].startswith("transformer.h.")
    logits = output if torch.is_tensor(output) else output[0]
    torch.testing.assert_close(logits, expected)


def test_one_process_runs_the_model_as_it_is():
    from notebook_accel.big_modeling import prepare_pippy

    model = _mlp()
    inputs = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(
            prepare_pippy(model, example_args=(inputs,))(inputs), model(inputs)
        )

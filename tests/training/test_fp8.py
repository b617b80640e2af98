"""fp8 without a GPU: which layers become float8, the recipe handler, the conversion.

torchao is replaced by a small stand-in module (its float8 layer is a Linear
subclass named Float8Linear), and the device by a platform that says yes to
fp8, so every decision runs here; tests/gpu checks the real thing.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import types
import warnings

import pytest
import torch

from notebook_accel import Accelerator, AORecipeKwargs
from notebook_accel.platforms import CpuPlatform, CudaPlatform, GpuInfo, Hardware
from notebook_accel.training import fp8
from notebook_accel.training.fp8 import Float8Plan, layer_problem, plan_layers
from notebook_accel.training.precision import Precision

pytestmark = pytest.mark.timeout(60)


# -- a stand-in for torchao.float8 -------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FakeFloat8LinearConfig:
    enable_fsdp_float8_all_gather: bool = False
    pad_inner_dim: bool = False
    recipe: str = "tensorwise"

    @staticmethod
    def from_recipe_name(name: str) -> FakeFloat8LinearConfig:
        return FakeFloat8LinearConfig(recipe=name)


class Float8Linear(torch.nn.Linear):
    """What the stand-in swaps in: torchao's class name, plain Linear arithmetic."""

    config = None


def fake_convert(module, *, module_filter_fn=None, config=None):
    for name, child in list(module.named_modules()):
        if isinstance(child, torch.nn.Linear) and module_filter_fn(child, name):
            parent_name, _, leaf = name.rpartition(".")
            layer = Float8Linear(child.in_features, child.out_features, child.bias is not None)
            layer.weight, layer.bias, layer.config = child.weight, child.bias, config
            setattr(module.get_submodule(parent_name), leaf, layer)
    return module


@pytest.fixture
def torchao(monkeypatch):
    """A fake torchao.float8, importable and found by find_spec."""
    float8 = types.ModuleType("torchao.float8")
    float8.Float8LinearConfig = FakeFloat8LinearConfig
    float8.convert_to_float8_training = fake_convert
    float8.refreshed = []
    float8.precompute_float8_dynamic_scale_for_fsdp = float8.refreshed.append
    package = types.ModuleType("torchao")
    package.float8 = float8
    monkeypatch.setitem(sys.modules, "torchao", package)
    monkeypatch.setitem(sys.modules, "torchao.float8", float8)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "torchao" else real_find_spec(name, *a),
    )
    return float8


@pytest.fixture
def compiled(monkeypatch):
    """Records the modules compiled in place instead of compiling them."""
    calls = []
    monkeypatch.setattr(
        torch.nn.Module, "compile", lambda self, **kwargs: calls.append((self, kwargs))
    )
    return calls


class Fp8ReadyCpu(CpuPlatform):
    """The CPU, described as a device that can run fp8 (a fake capability)."""

    def precision_problem(self, precision, hardware):
        return None

    def compile_problem(self, backend):
        return None


class Fp8ReadyWithoutCompiler(Fp8ReadyCpu):
    def compile_problem(self, backend):
        return "no C++ compiler"


def precision(platform=None, recipe=None) -> Precision:
    return Precision("fp8", platform or Fp8ReadyCpu(), torch.device("cpu"), ao_recipe=recipe)


def transformer_lm(width: int = 1024, layers: int = 2, device: str = "meta") -> torch.nn.Module:
    """The issue's LM shape: per block qkv, out, mlp up and down; an LM head."""

    def block():
        return torch.nn.ModuleDict(
            {
                "qkv": torch.nn.Linear(width, 3 * width),
                "out": torch.nn.Linear(width, width),
                "up": torch.nn.Linear(width, 4 * width),
                "down": torch.nn.Linear(4 * width, width),
            }
        )

    return torch.nn.ModuleDict(
        {
            "blocks": torch.nn.ModuleList(block() for _ in range(layers)),
            "head": torch.nn.Linear(width, 8192),
        }
    ).to(device)


def wide_mlp(width: int = 8192, device: str = "meta") -> torch.nn.Sequential:
    return torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(4))).to(device)


# -- which layers: sizes, filters, the compiler --------------------------------------


def test_float8_pays_only_for_layers_large_enough():
    assert layer_problem(torch.nn.Linear(8192, 8192, device="meta")) is None
    assert layer_problem(torch.nn.Linear(4096, 4096, device="meta")) is None
    assert layer_problem(torch.nn.Linear(2048, 8192, device="meta")) is None
    assert "too small" in layer_problem(torch.nn.Linear(1024, 4096, device="meta"))
    assert "too small" in layer_problem(torch.nn.Linear(2048, 2048, device="meta"))
    assert "multiples of 16" in layer_problem(torch.nn.Linear(8192, 8190, device="meta"))


def test_the_wide_mlp_converts_every_layer_and_compiles_them():
    plan = plan_layers(wide_mlp())
    assert plan.convert == ["0", "1", "2", "3"] and plan.keep == {}
    assert plan.compile_layers and plan.message() is None


def test_a_1024_wide_transformer_stays_in_bf16_and_says_why():
    plan = plan_layers(transformer_lm())
    assert plan.convert == []
    assert set(plan.keep.values()) == {"too small for float8 to pay"}
    message = plan.message()
    assert message.startswith("fp8: all 9 Linear layers kept in bf16, none trains in float8")
    assert "blocks.0.qkv 1024x3072" in message and "and 5 more" in message


def test_a_4096_wide_transformer_converts_its_blocks_but_names_the_rest():
    model = transformer_lm(width=4096)
    model["head"] = torch.nn.Linear(4096, 50257, device="meta")  # a vocabulary not /16
    plan = plan_layers(model)
    assert len(plan.convert) == 8 and plan.keep == {"head": "sizes not multiples of 16"}
    assert plan.message() == (
        "fp8: 1 of 9 Linear layers kept in bf16 (sizes not multiples of 16: head 4096x50257)."
    )


def test_without_a_compiler_nothing_is_converted_unless_the_model_is_compiled():
    plan = plan_layers(wide_mlp(), compile_problem="no C++ compiler")
    assert plan.convert == [] and "no compiler to fuse" in plan.keep["0"]
    assert "no C++ compiler" in plan.message()
    # dynamo_backend=...: the whole model is compiled, so the layers need no compiler of their own
    whole = plan_layers(wide_mlp(), compile_problem="no C++ compiler", model_compiled=True)
    assert whole.convert == ["0", "1", "2", "3"] and not whole.compile_layers


def test_a_module_filter_replaces_the_size_rule():
    chosen = plan_layers(transformer_lm(), module_filter=lambda module, name: "up" in name)
    assert chosen.convert == ["blocks.0.up", "blocks.1.up"]
    assert chosen.keep["head"] == "left out by module_filter_func"
    # without a compiler the person's choice stands, and the warning says what it costs
    eager = plan_layers(
        transformer_lm(), module_filter=lambda module, name: "up" in name, compile_problem="none"
    )
    assert eager.convert == ["blocks.0.up", "blocks.1.up"] and not eager.compile_layers
    assert eager.message() == (
        "fp8: the 2 float8 layers module_filter_func chose run uncompiled, slower than bf16 (none)."
    )


def test_multihead_attention_projection_is_never_converted():
    model = torch.nn.TransformerEncoderLayer(4096, 32, 16384, device="meta")
    plan = plan_layers(model)
    assert "self_attn.out_proj" not in plan.convert + list(plan.keep)
    assert plan.convert == ["linear1", "linear2"]


# -- the recipe handler --------------------------------------------------------------


def test_recipe_handler_without_torchao_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ImportError, match="pip install torchao"):
        AORecipeKwargs()


def test_recipe_handler_checks_its_fields(torchao):
    assert AORecipeKwargs().config == "tensorwise"
    with pytest.raises(ValueError, match="tensorwise, rowwise, rowwise_with_gw_hp"):
        AORecipeKwargs(config="columnwise")
    with pytest.raises(ValueError, match="needs the 'tensorwise' recipe"):
        AORecipeKwargs(config="rowwise", enable_fsdp_float8_all_gather=True)
    with pytest.raises(TypeError, match="module_filter_func must be a function"):
        AORecipeKwargs(module_filter_func=["0"])


def test_recipes_become_torchao_configs(torchao):
    assert AORecipeKwargs().float8_config() == FakeFloat8LinearConfig()
    # float8 all-gather only where the model is sharded, unless asked
    assert AORecipeKwargs().float8_config(sharded=True).enable_fsdp_float8_all_gather
    off = AORecipeKwargs(enable_fsdp_float8_all_gather=False)
    assert not off.float8_config(sharded=True).enable_fsdp_float8_all_gather
    assert AORecipeKwargs(config="rowwise").float8_config().recipe == "rowwise"
    padded = AORecipeKwargs(config="rowwise_with_gw_hp", pad_inner_dim=True).float8_config()
    assert padded.recipe == "rowwise_with_gw_hp" and padded.pad_inner_dim
    mine = FakeFloat8LinearConfig(recipe="mine")
    assert AORecipeKwargs(config=mine).float8_config(sharded=True) is mine


def test_the_accelerator_takes_the_recipe_handler_only_with_fp8(torchao):
    with pytest.raises(ValueError, match="pass mixed_precision='fp8'"):
        Accelerator(cpu=True, kwargs_handlers=[AORecipeKwargs()])
    with pytest.raises(ValueError, match="more than one AORecipeKwargs"):
        Accelerator(cpu=True, kwargs_handlers=[AORecipeKwargs(), AORecipeKwargs()])


def test_fp8_on_the_cpu_is_still_refused_with_a_recipe(torchao):
    with pytest.raises(ValueError, match="fp8 needs a CUDA GPU"):
        Accelerator(cpu=True, mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs()])


def test_fake_capabilities_decide_fp8_and_compiling(monkeypatch):
    gpu = CudaPlatform()
    ada = Hardware(gpus=(GpuInfo(0, "L4", 24 << 30, (8, 9)),))
    ampere = Hardware(gpus=(GpuInfo(0, "A100", 80 << 30, (8, 0)),))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert gpu.precision_problem("fp8", ada) is None
    assert "A100 has 8.0" in gpu.precision_problem("fp8", ampere)
    assert gpu.compile_problem("inductor") is None
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert "triton" in gpu.compile_problem("inductor")
    assert gpu.compile_problem("aot_eager") is None


# -- conversion -------------------------------------------------------------------


def test_prepared_fp8_model_has_float8_layers_compiled_and_names_the_rest(torchao, compiled):
    model = torch.nn.Sequential(
        torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 10)
    )
    with pytest.warns(UserWarning, match=r"1 of 2 Linear layers kept in bf16 .*2 4096x10"):
        prepared = precision().prepare_model(model)
    assert fp8.float8_layers(prepared) == ["0"]
    assert type(prepared[2]) is torch.nn.Linear
    assert [(layer, kwargs) for layer, kwargs in compiled] == [
        (prepared[0], {"backend": "inductor"})
    ]
    out = prepared(torch.randn(3, 4096))  # bf16 autocast inside, float32 out
    assert out.dtype == torch.float32 and out.shape == (3, 10)
    # Prepared again: nothing converted twice, nothing compiled twice.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        precision().prepare_model(prepared)
    assert len(compiled) == 1


def test_no_warning_when_every_layer_is_float8(torchao, compiled):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 4096))
        prepared = precision().prepare_model(model)
    assert fp8.float8_layers(prepared) == ["0", "1"]


def test_only_the_main_process_warns(torchao, compiled):
    quiet = Precision("fp8", Fp8ReadyCpu(), torch.device("cpu"), main_process=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet.prepare_model(torch.nn.Sequential(torch.nn.Linear(16, 16)))


def test_without_a_compiler_the_model_trains_in_bf16_and_says_so(torchao, compiled):
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096))
    with pytest.warns(UserWarning, match="no compiler to fuse float8's casts .no C.. compiler"):
        prepared = precision(Fp8ReadyWithoutCompiler()).prepare_model(model)
    assert fp8.float8_layers(prepared) == [] and compiled == []


def test_a_chosen_layer_left_unconverted_fails_instead_of_training_in_bf16(torchao, compiled):
    torchao.convert_to_float8_training = lambda module, **kwargs: module  # does nothing
    with pytest.raises(RuntimeError, match="torchao left 0 4096x4096 as plain Linear"):
        precision().prepare_model(torch.nn.Sequential(torch.nn.Linear(4096, 4096)))


def test_a_filter_choosing_unaligned_layers_needs_padding(torchao, compiled):
    pick_all = AORecipeKwargs(module_filter_func=lambda module, name: True)
    with pytest.raises(ValueError, match="pad_inner_dim=True"):
        precision(recipe=pick_all).prepare_model(torch.nn.Sequential(torch.nn.Linear(10, 20)))
    padded = AORecipeKwargs(module_filter_func=lambda module, name: True, pad_inner_dim=True)
    model = precision(recipe=padded).prepare_model(torch.nn.Sequential(torch.nn.Linear(10, 20)))
    assert fp8.float8_layers(model) == ["0"] and model[0].config.pad_inner_dim


def test_recipe_reaches_the_layers(torchao, compiled):
    recipe = AORecipeKwargs(config="rowwise")
    model = precision(recipe=recipe).prepare_model(torch.nn.Sequential(torch.nn.Linear(4096, 4096)))
    assert model[0].config.recipe == "rowwise"


def test_float8_all_gather_refreshes_scales_after_each_real_step(torchao, compiled):
    model = precision().prepare_model(
        torch.nn.Sequential(torch.nn.Linear(4096, 4096)), sharded=True
    )
    assert model[0].config.enable_fsdp_float8_all_gather
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    unrelated = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    fp8.refresh_scales_after_steps([model], [optimizer, unrelated])
    fp8.refresh_scales_after_steps([model], [optimizer, unrelated])  # prepare() called again
    optimizer.step()
    unrelated.step()
    assert torchao.refreshed == [model]


def test_plan_message_lists_few_names():
    plan = Float8Plan(
        keep={f"l{i}": "too small for float8 to pay" for i in range(6)},
        sizes={f"l{i}": (64, 64) for i in range(6)},
    )
    assert plan.message().endswith("l0 64x64, l1 64x64, l2 64x64, l3 64x64 and 2 more).")


def test_the_accelerator_converts_in_prepare_and_leaves_compiling_to_dynamo(
    torchao, compiled, monkeypatch
):
    monkeypatch.setattr(CpuPlatform, "precision_problem", lambda self, precision, hw: None)
    recipe = AORecipeKwargs(config="rowwise")
    accelerator = Accelerator(cpu=True, mixed_precision="fp8", kwargs_handlers=[recipe])
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="1 of 2 Linear layers kept in bf16"):
        model, optimizer = accelerator.prepare(model, optimizer)
    assert fp8.float8_layers(model) == ["0"] and model[0].config.recipe == "rowwise"
    assert [layer for layer, _ in compiled] == [model[0]]
    loss = model(torch.randn(2, 4096)).sum()
    accelerator.backward(loss)
    optimizer.step()
    # with dynamo_backend the whole model is compiled, so no layer is compiled on its own
    whole = Accelerator(cpu=True, mixed_precision="fp8", dynamo_backend="aot_eager")
    prepared = whole.prepare(torch.nn.Sequential(torch.nn.Linear(4096, 4096)))
    assert fp8.float8_layers(whole.unwrap_model(prepared)) == ["0"]
    assert len(compiled) == 1


def test_many_layer_shapes_stay_compiled(torchao, compiled):
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    # config.patch restores the entry; monkeypatch's undo would delete it from dynamo's config.
    with config.patch(**{name: 8}):
        widths = [4096, 6144, 8192]  # 4096 x n and n x 4096: 5 shapes in 6 layers
        layers = [torch.nn.Linear(4096, n, device="meta") for n in widths]
        layers += [torch.nn.Linear(n, 4096, device="meta") for n in widths]
        model = torch.nn.Sequential(*layers)
        plan = plan_layers(model)
        assert len(plan.convert) == 6 and len(compiled) == 0
        fp8.convert(model, plan, AORecipeKwargs())
        assert len(compiled) == 6
        assert getattr(config, name) == 4 * 5
        fp8.convert(
            torch.nn.Sequential(torch.nn.Linear(4096, 4096, device="meta")),
            plan_layers(torch.nn.Sequential(torch.nn.Linear(4096, 4096, device="meta"))),
            AORecipeKwargs(),
        )
        assert getattr(config, name) == 4 * 5  # never lowered
    assert hasattr(config, name)

"""Accelerate's ParallelismConfig: its checks, and HSDP and FSDP on a device mesh of four
real gloo workers, trained against DDP on the same four."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from notebook_accel import Accelerator, ParallelismConfig, WorkerError, notebook_launcher

FOUR = {"num_processes": 4, "backend": "cpu", "timeout": 120}


# -- the config alone ------------------------------------------------------------------


def test_sizes_default_to_one_or_accelerate_s_variables(monkeypatch):
    config = ParallelismConfig(dp_shard_size=2)
    assert (config.dp_replicate_size, config.dp_shard_size, config.tp_size) == (1, 2, 1)
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "3")
    assert ParallelismConfig().dp_replicate_size == 3


def test_names_and_sizes_follow_accelerate():
    config = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)
    assert config.total_size == 4 and config.data_parallel_size == 4
    assert config.non_data_parallel_size == 1
    assert config.dp_dim_names == ["dp_replicate", "dp_shard"] == config.active_mesh_dims
    # FSDP2 shards over dp_shard and cp flattened into one dimension, as in Accelerate;
    # without cp over dp_shard itself (torch deprecates slicing a flattened dimension)
    assert config.fsdp_dim_names == ["dp_replicate", "dp_shard"]
    assert config.dp_shard_cp_dim_names == ["dp_shard"]
    with_cp = ParallelismConfig(dp_shard_size=2, cp_size=2, tp_size=2)
    assert with_cp.active_mesh_dims == ["dp_shard", "cp", "tp"]
    assert with_cp.dp_shard_cp_dim_names == ["dp_shard", "cp"]
    assert with_cp.fsdp_dim_names == ["dp_shard_cp"]
    # ranks 0-3 share dp rank 0 (its cp x tp group), 4-7 dp rank 1
    assert [with_cp.data_parallel_rank(rank) for rank in range(8)] == [0] * 4 + [1] * 4
    assert config.dp_replicate_enabled and config.dp_shard_enabled and not config.tp_enabled
    assert [config.data_parallel_rank(rank) for rank in range(4)] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("sizes", "dp", "dp_shard_cp", "dp_cp", "mesh"),
    [
        ((4, 1, 1, 1), ["dp_replicate"], [], ["dp_replicate"], (("dp_replicate",), (4,))),
        ((2, 2, 1, 1), ["dp_replicate", "dp_shard"], ["dp_shard"], ["dp_replicate", "dp_shard"],
         (("dp_replicate", "dp_shard"), (2, 2))),
        ((1, 1, 4, 1), [], [], [], (("tp",), (4,))),
        ((1, 1, 1, 4), [], ["cp"], ["cp"], (("cp",), (4,))),
        ((2, 2, 2, 2), ["dp_replicate", "dp_shard"], ["dp_shard", "cp"],
         ["dp_replicate", "dp_shard", "cp"],
         (("dp_replicate", "dp_shard", "cp", "tp"), (2, 2, 2, 2))),
    ],
    ids=["ddp-4", "hsdp-2x2", "tp-4", "cp-4", "hsdp-x-cp-x-tp"],
)  # fmt: skip
def test_flattened_dimension_names_and_mesh_arguments_follow_accelerate(
    sizes, dp, dp_shard_cp, dp_cp, mesh
):
    replicate, shard, tp, cp = sizes
    config = ParallelismConfig(
        dp_replicate_size=replicate, dp_shard_size=shard, tp_size=tp, cp_size=cp
    )
    # "dp" is what batches differ over, "dp_shard_cp" what FSDP2 shards over, "dp_cp"
    # what the loss is averaged over
    assert config.dp_dim_names == dp
    assert config.dp_shard_cp_dim_names == dp_shard_cp
    assert config.dp_cp_dim_names == dp_cp
    assert config._get_mesh() == mesh  # init_device_mesh's names and shape
    assert ParallelismConfig()._get_mesh() == ()


def test_cp_comm_strategy_comes_from_the_handler_or_accelerate_s_variable(monkeypatch):
    from notebook_accel.utils import TorchContextParallelConfig

    assert ParallelismConfig(cp_size=2).cp_handler.cp_comm_strategy == "allgather"
    assert ParallelismConfig(dp_shard_size=2).cp_handler is None  # without cp, none
    given = TorchContextParallelConfig(cp_comm_strategy="alltoall")
    assert ParallelismConfig(cp_size=2, cp_handler=given).cp_handler is given
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_COMM_STRATEGY", "alltoall")
    assert ParallelismConfig(cp_size=2).cp_handler.cp_comm_strategy == "alltoall"
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_COMM_STRATEGY", "ring")
    with pytest.raises(ValueError, match="Invalid cp_comm_strategy: ring .*'allgather'"):
        ParallelismConfig(cp_size=2)  # refused where it is made
    with pytest.raises(ValueError, match="Invalid cp_comm_strategy: ring"):
        TorchContextParallelConfig()
    with pytest.raises(ValueError, match="cp_handler must be a TorchContextParallelConfig"):
        ParallelismConfig(cp_size=2, cp_handler={"cp_comm_strategy": "alltoall"})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"dp_shard_size": 0}, "dp_shard_size=0 must be a whole number, at least 1"),
        ({"tp_size": 1.5}, "tp_size=1.5 must be a whole number"),
        ({"cp_size": 2, "sp_size": 2}, "context and sequence parallelism exclude each other"),
        ({"dp_replicate_size": 2, "tp_size": 2}, "cannot be composed with plain data parallel"),
        ({"cp_backend": "ring"}, "the one backend is 'torch'"),
    ],
)
def test_bad_sizes_are_refused_with_what_to_do(options, message):
    with pytest.raises(ValueError, match=message):
        ParallelismConfig(**options)


def test_deepspeed_s_sequence_parallelism_is_refused():
    with pytest.raises(NotImplementedError, match="sp_size=2: sequence parallelism is DeepSpeed"):
        ParallelismConfig(dp_shard_size=2, sp_size=2)


def test_sizes_must_multiply_to_the_processes():
    config = ParallelismConfig(dp_replicate_size=2, dp_shard_size=3)
    with pytest.raises(ValueError, match="needs 6 processes .* but 4 train: make the sizes"):
        config.check_world(4)
    everything_one = ParallelismConfig()
    everything_one.check_world(4)  # plain data parallelism over all of them
    assert everything_one.dp_replicate_size == 4


# -- four workers ------------------------------------------------------------------------


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Linear(32, 1)
    )


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(96, 8, generator=g), torch.randn(96, 1, generator=g))
    return DataLoader(data, batch_size=4)


def _tp_plan() -> dict:
    """A tensor-parallel plan in torch's styles: the first layer's outputs split, the
    second layer's inputs (Megatron's MLP)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"0": ColwiseParallel(), "2": RowwiseParallel()}


def _split_over_tp(model: torch.nn.Module, accelerator: Accelerator) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, accelerator.torch_device_mesh["tp"], _tp_plan())


def train(sizes: dict | None, split_by: str = "user") -> dict:
    """Train `_model()` under `sizes`; with tp, split by the user before prepare(), or by
    prepare() from a plan of torch's styles ("prepare") or of their names ("names")."""
    config = ParallelismConfig(**sizes) if sizes is not None else None
    accelerator = Accelerator(parallelism_config=config)
    model = _model()
    plan = None
    if config is not None and config.tp_enabled:
        if split_by == "user":
            _split_over_tp(model, accelerator)
        else:
            plan = _tp_plan() if split_by == "prepare" else {"0": "colwise", "2": "rowwise"}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, _loader(), tp_plan=plan)
    seen, losses = [], []
    for x, y in loader:
        seen.append(x[0, 0].item())
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.gather_for_metrics(loss.detach()[None]).mean().item())
    mesh = accelerator.torch_device_mesh
    first = next(accelerator.unwrap_model(model).parameters())
    return {
        "weights": accelerator.get_state_dict(model),
        "losses": losses,
        "batches": accelerator.gather_for_metrics(torch.tensor(seen)).tolist(),
        "mesh": None if mesh is None else (mesh.mesh_dim_names, tuple(mesh.shape)),
        "placements": [type(p).__name__ for p in getattr(first, "placements", ())],
        "type": str(accelerator.distributed_type),
    }


@pytest.fixture(scope="module")
def ddp_on_four() -> dict:
    return notebook_launcher(train, args=(None,), **FOUR)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("sizes", "mesh", "placements"),
    [
        (
            {"dp_replicate_size": 2, "dp_shard_size": 2},
            (("dp_replicate", "dp_shard"), (2, 2)),
            ["Replicate", "Shard"],
        ),
        ({"dp_shard_size": 4}, (("dp_shard",), (4,)), ["Shard"]),
    ],
    ids=["hsdp-2x2", "fsdp-4"],
)
def test_hsdp_and_fsdp_on_a_mesh_train_as_ddp_on_four(ddp_on_four, sizes, mesh, placements):
    run = notebook_launcher(train, args=(sizes,), **FOUR)
    assert run["mesh"] == mesh and run["placements"] == placements
    assert run["type"] == "FSDP"
    # every rank read its own part of the data, the same parts as under DDP
    assert run["batches"] == ddp_on_four["batches"]
    assert len(set(run["batches"])) == len(run["batches"])
    # the same training, up to the order in which the ranks' gradients are summed
    assert run["losses"] == pytest.approx(ddp_on_four["losses"], abs=1e-6)
    for name, reference in ddp_on_four["weights"].items():
        torch.testing.assert_close(run["weights"][name], reference, atol=2e-6, rtol=0)


def wrong_world() -> None:
    Accelerator(parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2))


@pytest.mark.timeout(120)
def test_a_config_for_another_number_of_processes_is_refused_at_once():
    with pytest.raises(WorkerError, match="needs 4 processes .* but 2 train"):
        notebook_launcher(wrong_world, num_processes=2, backend="cpu", timeout=60)


def resume(sizes: dict, directory: str, save_after: int | None) -> dict:
    """Train under `sizes`; save after `save_after` steps and go on, or (None) load the
    checkpoint and go on from where it was saved."""
    config = ParallelismConfig(**sizes)
    accelerator = Accelerator(parallelism_config=config)
    model = _model()
    if config.tp_enabled:
        _split_over_tp(model, accelerator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, _loader())
    if save_after is None:
        accelerator.load_state(directory)
    for step, (x, y) in enumerate(loader):
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        if step + 1 == save_after:
            accelerator.save_state(directory)
    return accelerator.get_state_dict(model)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "sizes",
    [
        {"dp_replicate_size": 2, "dp_shard_size": 2},
        {"dp_shard_size": 2, "tp_size": 2},
        {"tp_size": 2},  # split, not sharded: saved through DCP all the same
    ],
    ids=["hsdp-2x2", "fsdp-2-x-tp-2", "tp-2"],
)
def test_a_checkpoint_resumes_bit_for_bit_under_the_same_layout(tmp_path, sizes):
    directory = str(tmp_path / "state")
    launch = {**FOUR, "num_processes": ParallelismConfig(**sizes).total_size}
    uninterrupted = notebook_launcher(resume, args=(sizes, directory, 3), **launch)
    resumed = notebook_launcher(resume, args=(sizes, directory, None), **launch)
    assert uninterrupted.keys() == resumed.keys()
    for name, value in uninterrupted.items():
        assert torch.equal(resumed[name], value), name


@pytest.mark.timeout(240)
def test_tensor_parallel_over_two_trains_as_one_process():
    alone = notebook_launcher(train, args=(None,), num_processes=1, backend="cpu")
    split = notebook_launcher(train, args=({"tp_size": 2},), num_processes=2, backend="cpu")
    assert split["mesh"] == (("tp",), (2,)) and split["placements"] == ["Shard"]
    # both ranks of the pair read every batch; each batch's result is gathered once
    assert split["batches"] == alone["batches"]
    # float tolerance: the split matmuls add their partial sums in another order
    assert split["losses"] == pytest.approx(alone["losses"], abs=1e-5)
    for name, reference in alone["weights"].items():
        torch.testing.assert_close(split["weights"][name], reference, atol=1e-5, rtol=0)


@pytest.mark.timeout(240)
def test_fsdp_2_x_tp_2_trains_as_ddp_on_two():
    ddp = notebook_launcher(train, args=(None,), num_processes=2, backend="cpu")
    both = notebook_launcher(train, args=({"dp_shard_size": 2, "tp_size": 2},), **FOUR)
    assert both["mesh"] == (("dp_shard", "tp"), (2, 2))
    # the first layer's rows split over tp, and each part's rows again over dp_shard
    assert both["placements"] == ["_StridedShard", "Shard"]
    assert both["batches"] == ddp["batches"]
    assert both["losses"] == pytest.approx(ddp["losses"], abs=1e-5)
    for name, reference in ddp["weights"].items():
        torch.testing.assert_close(both["weights"][name], reference, atol=1e-5, rtol=0)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("split_by", ["prepare", "names"])
@pytest.mark.parametrize(
    "sizes", [{"tp_size": 2}, {"dp_shard_size": 2, "tp_size": 2}], ids=["tp-2", "fsdp-2-x-tp-2"]
)
def test_prepare_splits_by_a_plan_as_the_user_would(sizes, split_by):
    launch = {**FOUR, "num_processes": ParallelismConfig(**sizes).total_size}
    by_user = notebook_launcher(train, args=(sizes, "user"), **launch)
    by_prepare = notebook_launcher(train, args=(sizes, split_by), **launch)
    assert by_prepare["placements"] == by_user["placements"]
    # the optimizer made before prepare() stepped the split (and sharded) parameters
    assert by_prepare["losses"] == by_user["losses"]
    for name, reference in by_user["weights"].items():
        assert torch.equal(by_prepare["weights"][name], reference), name


def bad_plans() -> list[str]:
    """What prepare() says to each plan it cannot use, on a pair of tp ranks."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    accelerator = Accelerator(parallelism_config=ParallelismConfig(tp_size=2))
    odd = torch.nn.Sequential(torch.nn.Linear(8, 7), torch.nn.Linear(7, 1))
    attempts = [
        (_model(), None),  # no plan, and none of its own
        (_model(), {"0": ColwiseParallel(), "fc9": ColwiseParallel()}),
        (_model(), {"0": "sequence_parallel"}),
        (odd, {"0": ColwiseParallel()}),
    ]
    said = []
    for model, plan in attempts:
        try:
            accelerator.prepare_model(model, tp_plan=plan)
        except ValueError as error:
            said.append(str(error))
        else:
            said.append("")
    split = _model()
    _split_over_tp(split, accelerator)
    try:
        accelerator.prepare_model(split, tp_plan=_tp_plan())
    except ValueError as error:
        said.append(str(error))
    # nothing was done to a model refused: with a plan it can use, it is split
    refused = attempts[1][0]
    accelerator.prepare_model(refused, tp_plan=_tp_plan())
    said.append(type(refused[0].weight).__name__)
    return said


@pytest.mark.timeout(120)
def test_a_plan_prepare_cannot_use_is_refused_with_what_to_do():
    said = notebook_launcher(bad_plans, num_processes=2, backend="cpu", timeout=60)
    no_plan, unknown_module, unknown_style, uneven, split_twice, then = said
    assert "Sequential is not split over the tp dimension and has no tp_plan" in no_plan
    assert "tp_plan={" in no_plan and 'tp_plan="auto"' in no_plan
    assert "tp_plan names no module of Sequential: ['fc9']" in unknown_module
    assert "tp_plan['0'] = 'sequence_parallel': give one of torch's styles" in unknown_style
    assert "0: ColwiseParallel splits its 7 rows of weight" in uneven
    assert "tp_size=2 equal parts" in uneven
    assert "split over tp already; pass tp_plan= only" in split_twice
    assert then == "DTensor"


def test_a_plan_without_a_tp_dimension_is_refused():
    from torch.distributed.tensor.parallel import ColwiseParallel

    accelerator = Accelerator(cpu=True)
    with pytest.raises(ValueError, match="tp_plan= splits a model over the tp dimension"):
        accelerator.prepare(_model(), tp_plan={"0": ColwiseParallel()})
    with pytest.raises(ValueError, match="tp_plan= splits one model: pass prepare"):
        accelerator.prepare(_model(), _model(), tp_plan={"0": ColwiseParallel()})


# -- context parallel ------------------------------------------------------------------


def per_token(cp_size: int, attention: bool = False) -> dict:
    """A model applied to each position of a sequence alone (what runs on CPU under torch's
    context parallelism: its attention runs on CUDA only), trained on sequences split
    over `cp_size` ranks; with `attention`, one SDPA call inside the split."""
    config = ParallelismConfig(cp_size=cp_size) if cp_size > 1 else None
    accelerator = Accelerator(parallelism_config=config)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    g = torch.Generator().manual_seed(1)
    losses, lengths = [], []
    for _ in range(3):
        x, y = torch.randn(2, 12, 8, generator=g), torch.randn(2, 12, 1, generator=g)
        with accelerator.maybe_context_parallel(buffers=[x, y], buffer_seq_dims=[1, 1]):
            lengths.append(x.shape[1])
            if attention:
                q = x.unsqueeze(1)
                torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
    mesh = accelerator.torch_device_mesh
    return {
        "losses": losses,
        "lengths": lengths,
        "weights": accelerator.get_state_dict(model),
        "mesh": None if mesh is None else mesh.mesh_dim_names,
    }


@pytest.mark.timeout(240)
def test_sequences_split_over_two_context_parallel_ranks_train_as_one_process():
    with pytest.warns(UserWarning, match="maybe_context_parallel.. does nothing"):
        alone = notebook_launcher(per_token, args=(1,), num_processes=1, backend="cpu")
    split = notebook_launcher(per_token, args=(2,), num_processes=2, backend="cpu")
    assert split["mesh"] == ("cp",) and split["lengths"] == [6, 6, 6]  # half each
    assert alone["lengths"] == [12, 12, 12]
    assert split["losses"] == pytest.approx(alone["losses"], abs=1e-6)
    for name, reference in alone["weights"].items():
        torch.testing.assert_close(split["weights"][name], reference, atol=1e-6, rtol=0)


@pytest.mark.timeout(120)
def test_attention_split_on_cpu_says_torch_runs_it_on_cuda_only():
    with pytest.raises(
        WorkerError, match="torch's context parallelism splits SDPA attention on CUDA"
    ):
        notebook_launcher(per_token, args=(2, True), num_processes=2, backend="cpu", timeout=60)

"""Two real workers: what each rank sees and what gather_for_metrics returns, vs Accelerate.

Configurations: dataset length, batch size, even_batches, split_batches, and
shuffling (through the seedable sampler, so both libraries draw one order).
"""

from __future__ import annotations

import itertools

import torch
from torch.utils.data import DataLoader, TensorDataset

from notebook_accel import Accelerator, DataLoaderConfiguration, notebook_launcher
from tests_support import dev_dependency

dev_dependency("accelerate")

CONFIGS = list(itertools.product([7, 13, 64], [2, 4], [True, False], [False, True], [False, True]))


def _loader(length, batch_size, shuffle):
    return DataLoader(TensorDataset(torch.arange(length)), batch_size=batch_size, shuffle=shuffle)


def _run(accelerator, length, batch_size, even, split, shuffle, gather):
    """Two epochs: the batches this rank saw, and gather_for_metrics of each batch."""
    loader = accelerator.prepare(_loader(length, batch_size, shuffle))
    seen, gathered = [], []
    for _ in range(2):
        for (batch,) in loader:
            seen.append(batch.tolist())
            if gather:
                if even:
                    gathered += accelerator.gather_for_metrics(batch).tolist()
                else:  # shapes may differ on the last step: gather as objects
                    gathered += accelerator.gather_for_metrics(batch.tolist())
    return seen, gathered


def _differential_worker():
    import accelerate
    from accelerate.state import AcceleratorState, GradientState

    # This process was forked from one that may have created Accelerate's
    # singletons for a single process; start them afresh.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    results = []
    for length, batch_size, even, split, shuffle in CONFIGS:
        ours = Accelerator(
            dataloader_config=DataLoaderConfiguration(
                split_batches=split, even_batches=even, use_seedable_sampler=True, data_seed=11
            )
        )
        theirs = accelerate.Accelerator(
            cpu=True,
            dataloader_config=accelerate.DataLoaderConfiguration(
                split_batches=split, even_batches=even, use_seedable_sampler=True, data_seed=11
            ),
        )
        # Collectives need the same number of batches on every rank. Our len() is
        # exact per rank (Accelerate's is not with split_batches and uneven data).
        counts = [None, None]
        torch.distributed.all_gather_object(
            counts, len(ours.prepare(_loader(length, batch_size, shuffle)))
        )
        args = (length, batch_size, even, split, shuffle, counts[0] == counts[1])
        results.append((_run(ours, *args), _run(theirs, *args)))
    return results


def test_batches_and_gather_for_metrics_match_accelerate():
    per_rank = notebook_launcher(
        _differential_worker, num_processes=2, return_all=True, backend="cpu"
    )
    for rank, results in enumerate(per_rank):
        for config, (ours, theirs) in zip(CONFIGS, results, strict=True):
            assert ours[0] == theirs[0], f"rank {rank} batches differ for {config}"
            assert ours[1] == theirs[1], f"gather_for_metrics differs for {config}"
            length, _, even, _, _ = config
            if even:  # one item per sample per epoch
                assert sorted(ours[1]) == sorted(list(range(length)) * 2), config

"""Runs a test body on N GPUs: one process per GPU (torch.multiprocessing), joined by an NCCL process group.
Tests skip (not fail) without torch, without CUDA, or with fewer GPUs than they need.

EPX_TEST_RANKS_PER_GPU=N lets N ranks share each GPU (rank r on cuda:r % GPUs, a Gloo group since NCCL refuses
two ranks on one GPU): it checks larger groups' logic on fewer GPUs, never their speed. EPX_TEST_MIN_RANKS=N skips
the tests of fewer ranks."""

import os
import sys
import tempfile
import traceback

import pytest


def require_gpus(num_gpus):
    """torch, or a pytest skip when this machine cannot run an N-GPU test."""
    torch = pytest.importorskip("torch")
    import epx

    if not epx.WITH_CUDA:
        pytest.skip("epx was built without CUDA")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if torch.cuda.device_count() * ranks_per_gpu() < num_gpus:
        pytest.skip(f"needs {num_gpus} GPU{'' if num_gpus == 1 else 's'}, {torch.cuda.device_count()} present")
    if num_gpus < min_ranks():
        pytest.skip(f"{num_gpus} ranks: below EPX_TEST_MIN_RANKS={min_ranks()}")
    return torch


def ranks_per_gpu():
    return max(1, int(os.environ.get("EPX_TEST_RANKS_PER_GPU", "1")))


def min_ranks():
    """EPX_TEST_MIN_RANKS=N skips tests of fewer ranks (a shared-GPU run that covers only the larger groups)."""
    return int(os.environ.get("EPX_TEST_MIN_RANKS", "1"))


def _entry(rank, num_ranks, store_file, worker, args):
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank % torch.cuda.device_count())
    backend = "gloo" if ranks_per_gpu() > 1 else "nccl"
    dist.init_process_group(backend, init_method=f"file://{store_file}", rank=rank, world_size=num_ranks)
    try:
        worker(rank, num_ranks, dist.group.WORLD, *args)
        torch.cuda.synchronize()
        dist.barrier()
    except BaseException:
        # Said at once, naming the rank, and without destroy_process_group: a peer left waiting in a collective
        # keeps this rank there, and spawn then reports nothing (the process never exits).
        print(f"rank {rank} of {num_ranks} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise
    dist.destroy_process_group()


def run(worker, num_ranks, *args):
    """worker(rank, num_ranks, group, *args) on num_ranks GPUs (rank r on cuda:r, the current device); a failure in
    any rank fails the test with that rank's traceback. `worker` must be a module-level function."""
    require_gpus(num_ranks)
    import torch.multiprocessing as mp

    # The group meets through a file, not a TCP port: a port picked free here can be taken before rank 0 listens
    # on it (EADDRINUSE) when other suites run beside this one.
    with tempfile.TemporaryDirectory(prefix="epx-test-") as directory:
        mp.spawn(_entry, args=(num_ranks, os.path.join(directory, "store"), worker, args), nprocs=num_ranks, join=True)


def gpu_counts(*counts):
    """pytest parameters for rank counts, each skipped where too few GPUs exist."""
    return [pytest.param(n, id=f"{n}gpu") for n in counts]

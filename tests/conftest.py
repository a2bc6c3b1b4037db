import os

import pytest
import torch

# Keep NVLink multicast off in every GPU process (DESIGN §8); spawned ranks inherit these.
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    n = torch.cuda.device_count() if HAS_CUDA else 0
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and n < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs >= 2 CUDA GPUs (found {n})"))

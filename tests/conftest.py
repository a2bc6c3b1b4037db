import os

import pytest
import torch

# Keep NVLink multicast off in every GPU process (DESIGN §8); spawned ranks inherit these.
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

HAS_CUDA = torch.cuda.is_available()

# The `smoke` subset: what CI's second pass runs with the oldest tested Triton (3.6).  Together these
# launch every Triton kernel of the package under the interpreter, on one and on several CPU ranks, and
# compile every launched variant for sm_90 with that Triton (test_compile_sm90 asserts the kernel set).
# Node-id prefixes, kept in this one place.
SMOKE = (
    "tests/test_compile_sm90.py",
    "tests/test_numerics.py::test_latent_bitwise_cpu[2]",
    "tests/test_module.py::test_equivalence_cpu[2]",
    "tests/test_packaging.py",
    "tests/test_large_m.py::test_large_m_cpu_ranks[3]",  # the sharded path, uneven shards, both exchanges
    "tests/test_imports.py",
    "tests/test_gemm.py::test_chain_candidates_compile_for_sm90",  # the chain's tiles (TREE_S = 1)
    "tests/test_tree.py::test_projector_chain_exact",
)


def pytest_collection_modifyitems(config, items):
    n = torch.cuda.device_count() if HAS_CUDA else 0
    for item in items:
        if item.nodeid.startswith(SMOKE):
            item.add_marker(pytest.mark.smoke)
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and n < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs >= 2 CUDA GPUs (found {n})"))

"""CuTe-DSL SM100 path (flashinfer mnnvl-cutedsl, flashinfer-python >= 0.7.2.post1), imported lazily.

UNVERIFIED ON HARDWARE: no SM100 GPU is available to this project; the kernels behind
:mod:`cute_fallback.mnnvl` have never run here.  Its calls are checked without a GPU against the
published flashinfer-python release (signatures, argument checks, eligibility probe:
``tests/test_flashinfer_contract.py``) and its behaviour against a fake flashinfer that mirrors them.
Importing this package never imports flashinfer (see :func:`cute_fallback.mnnvl.import_flashinfer_comm`).
"""

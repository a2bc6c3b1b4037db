"""A FAKE flashinfer for k3tail's tests (put on sys.path only by tests/test_cute_fallback.py).

It implements just enough of ``flashinfer.comm`` (``allreduce_fusion``,
``create_allreduce_fusion_workspace``, ``AllReduceFusionPattern``) to test the gating and the
argument mapping of ``cute_fallback.mnnvl``; every call is recorded in ``flashinfer.comm.CALLS``.
"""
__version__ = "0.0.0+k3tail.fake"

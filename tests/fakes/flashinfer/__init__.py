"""A FAKE flashinfer for k3tail's tests (put on sys.path only by the tests that use it).

``flashinfer.comm`` here mirrors the part of flashinfer-python >= 0.7.2.post1 that
``k3tail.cute_fallback.mnnvl`` binds to: ``create_allreduce_fusion_workspace``, ``allreduce_fusion``,
``is_mnnvl_cutedsl_supported`` and ``AllReduceFusionPattern``, with the real signatures (names, kinds,
defaults) and the real mnnvl-cutedsl argument checks.  ``tests/test_flashinfer_contract.py`` checks
the signatures, the pattern constants and the profile table against the published wheel, so the
fake cannot drift from the release silently.  Every call is recorded in ``flashinfer.comm.CALLS``.
"""
__version__ = "0.7.2.post1+k3tail.fake"

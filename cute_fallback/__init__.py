"""CuTe-DSL SM100 path (flashinfer mnnvl-cutedsl), imported lazily.

UNVERIFIED ON HARDWARE: no SM100 GPU is available to this project; the adapter in
:mod:`cute_fallback.mnnvl` is tested only against a fake flashinfer module.  Importing this
package never imports flashinfer (see :func:`cute_fallback.mnnvl.import_flashinfer_comm`).
"""

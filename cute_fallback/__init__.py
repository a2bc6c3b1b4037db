"""CuTe-DSL SM100 path (flashinfer mnnvl-cutedsl), imported lazily. Unverified on hardware here."""

"""``python -m k3tail ...``: the ``k3tail`` console script (e.g. under ``torchrun -m k3tail bench``)."""

import sys

from k3tail.tools.cli import main

sys.exit(main())

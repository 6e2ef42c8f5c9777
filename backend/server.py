"""The launcher's former name: `python -m splitfuse.server` and `from splitfuse.server import
serve` keep working; the code lives in `splitfuse.launcher`."""

import sys

from splitfuse.launcher import *  # noqa: F403
from splitfuse.launcher import __all__, main  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())

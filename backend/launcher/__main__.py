import sys

from splitfuse.launcher.cli import main

sys.exit(main())

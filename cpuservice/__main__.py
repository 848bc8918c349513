"""``python3 -m cpuservice`` runs the daemon."""

import sys

from .daemon import main

sys.exit(main())

"""``python3 -m cpuservice`` runs the daemon."""

import sys

from cpuservice.daemon import main

sys.exit(main())

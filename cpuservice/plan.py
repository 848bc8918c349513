"""``python3 -m cpuservice.plan``: kept at the path earlier releases documented; the module is
cpuservice.cli.plan."""

import sys

from cpuservice.cli.plan import main

if __name__ == "__main__":
    sys.exit(main())

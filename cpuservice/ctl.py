"""``python3 -m cpuservice.ctl``: kept at the path earlier releases documented; the module is
cpuservice.cli.ctl."""

import sys

from cpuservice.cli.ctl import main

if __name__ == "__main__":
    sys.exit(main())

"""``python3 -m cpuservice.run``: kept at the path earlier releases documented; the module is
cpuservice.cli.run."""

import sys

from cpuservice.cli.run import main

if __name__ == "__main__":
    sys.exit(main())

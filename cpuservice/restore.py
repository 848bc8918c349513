"""``python3 -m cpuservice.restore``: kept at the path earlier releases documented; the module is
cpuservice.cli.restore."""

import sys

from cpuservice.cli.restore import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""``python3 -m cpuservice.irqs``: kept at the path earlier releases documented; the module is
cpuservice.host.irqs."""

import sys

from cpuservice.host.irqs import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

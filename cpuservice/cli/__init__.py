"""The command-line tools: cpuservicectl, cpuservice-run, the offline planner, the package's
restore."""

"""cpuservice: hands out CPUs on a systemd host over D-Bus."""

__version__ = "0.1.0"

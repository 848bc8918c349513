"""Typed errors; each carries the D-Bus error name a caller sees. Every error a D-Bus caller
can get is declared here (the man page test reads them from here), and nowhere else."""

from __future__ import annotations


class CPUServiceError(Exception):
    """Base of every error a caller may see; the message is meant for a person."""

    dbus_name = "org.cpuservice1.Error.Failed"


class InvalidArgument(CPUServiceError):
    dbus_name = "org.cpuservice1.Error.InvalidArgument"


class InsufficientCPUs(CPUServiceError):
    dbus_name = "org.cpuservice1.Error.InsufficientCPUs"


class NoSuchAllocation(CPUServiceError):
    dbus_name = "org.cpuservice1.Error.NoSuchAllocation"


class AllocationExists(CPUServiceError):
    dbus_name = "org.cpuservice1.Error.AllocationExists"


class SystemdFailure(CPUServiceError):
    dbus_name = "org.cpuservice1.Error.SystemdFailure"


class LimitExceeded(CPUServiceError):
    """A per-user limit (max_allocations_per_user, max_cpus_per_user) would be exceeded, or a
    service-wide bound on work in flight (descriptors of Attach calls) is reached."""

    dbus_name = "org.cpuservice1.Error.LimitExceeded"


class NotSupported(CPUServiceError):
    """This host cannot do what was asked (e.g. a cpuset partition on systemd < 261)."""

    dbus_name = "org.cpuservice1.Error.NotSupported"


class SharedPoolStarving(CPUServiceError):
    """The admission guard (admission_guard_percent) refused a request that would take CPUs
    out of the shared pool while its CPU pressure is above the limit."""

    dbus_name = "org.cpuservice1.Error.SharedPoolStarving"


class IsolationFailed(CPUServiceError):
    """The kernel refused the interrupt or workqueue affinity as a whole."""

    dbus_name = "org.cpuservice1.Error.IsolationFailed"


class CheckpointWriteError(CPUServiceError):
    """The state could not be written (disk full, I/O error, read-only): nothing changed."""

    dbus_name = "org.cpuservice1.Error.CheckpointFailed"


class AccessDenied(CPUServiceError):
    dbus_name = "org.freedesktop.DBus.Error.AccessDenied"


class InteractiveAuthorizationRequired(CPUServiceError):
    dbus_name = "org.freedesktop.DBus.Error.InteractiveAuthorizationRequired"

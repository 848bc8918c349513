"""The D-Bus API: org.cpuservice1.Manager and the Allocation objects."""

"""Adapters to the host: systemd, sysfs, udev, polkit, the journal, sd_notify, metrics files, the
kernel's IRQ and workqueue masks, the checkpoint file. They never import the shell."""

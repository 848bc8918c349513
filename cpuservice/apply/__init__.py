"""What systemd must hold and how to get there: unit specs, the reconcile transaction, changes as
values, partitions, views. Pure."""

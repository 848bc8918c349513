"""The vocabulary: CPU sets, topology, requests, the ledger, the state, errors, configuration.
Pure."""

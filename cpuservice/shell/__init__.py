"""The imperative shell: ports, the engine and its one apply, the service's use cases, startup
recovery, lifetimes."""

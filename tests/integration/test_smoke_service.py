from tests.integration.service_env import ServiceHost


def test_seed(daemon: ServiceHost) -> None:
    assert daemon.prop("OnlineCPUs") == "0-7"
    print(daemon.allocate("web", "2", bind=True))
    print(daemon.call("ListAllocations"))
    print(daemon.show("cpuservice-bound-web.slice", "AllowedCPUs", "CPUWeight", "Description"))
    print(daemon.show("cpuservice-shared.slice", "AllowedCPUs"))

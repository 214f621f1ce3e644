"""The EFA pools' network interface layout, decided against AWS's own guidance (issue 24 item 6).

Sources:
- AWS EC2 User Guide, "Maximize network bandwidth on Amazon EC2 instances with multiple
  network cards" (efa-acc-inst-types.html, read 2026-12-01): the primary interface (network
  card 0, device index 0) is an EFA (EFA with ENA) interface, and "You can't use an EFA-only
  network interface as the primary network interface"; each additional interface takes the
  next unused network card index, device index 1, and is EFA or EFA-only "depending on your
  use case, such as ENA bandwidth requirements or IP address space".
- AWS "What's New" 2024-10-28 (EFA-only interfaces): EFA-only interfaces get no IP address
  (SRD runs over MAC addresses); the primary is EFA with ENA or ENA alone, since ENA carries
  the VPC's TCP/IP.
- pulumi/pulumi-eks v4.4.0 `nodejs/eks/nodes/instances.ts` `getEfaNetworkInterfaces`: the
  same layout (tests/upstream.efa_network_interfaces).

Decision: keep "efa" on card 0 and "efa-only" on every other card. An ENA-only primary (the
other layout the issue names) would leave card 0 without an EFA device: 31 instead of 32 on a
p5.48xlarge, one 100 Gbps rail short, and the catalog's `efa_interfaces` (what the pods ask
the device plugin for) would overcount. EFA-only on the other cards spends no VPC addresses
on 31 interfaces per node.
"""

from __future__ import annotations

from infra import catalog
from tests.infra.components.test_efa_node_template_contract import _efa_groups, _templates

EFA_TYPES = ("efa", "efa-only")


def layout_problems(interfaces: list[dict]) -> list[str]:
    """AWS's rule for multi-card EFA instances, applied to a launch template's interfaces."""
    problems = []
    primary = [i for i in interfaces if int(i["networkCardIndex"]) == 0 and int(i["deviceIndex"]) == 0]
    if len(primary) != 1:
        problems.append("no single primary interface at network card 0, device index 0")
    elif primary[0].get("interfaceType") == "efa-only":
        problems.append("an EFA-only interface cannot be the primary")
    cards = [int(i["networkCardIndex"]) for i in interfaces]
    if len(set(cards)) != len(cards):
        problems.append("two interfaces on one network card")
    for i in interfaces:
        if int(i["networkCardIndex"]) > 0:
            if int(i["deviceIndex"]) != 1:
                problems.append(f"card {i['networkCardIndex']}: device index {i['deviceIndex']}, not 1")
            if i.get("interfaceType") not in EFA_TYPES:
                problems.append(f"card {i['networkCardIndex']}: {i.get('interfaceType')!r} is not EFA")
    return problems


def efa_devices(interfaces: list[dict]) -> int:
    return sum(1 for i in interfaces if i.get("interfaceType") in EFA_TYPES)


def test_efa_pools_follow_awss_layout_and_expose_every_efa_device(rendered_stacks) -> None:
    seen = 0
    for stack, rendered, role, group in _efa_groups(rendered_stacks):
        inst = catalog.lookup(group.inputs["instanceTypes"][0])
        nics = _templates(rendered.result)[group.inputs["launchTemplate"]["id"]]["networkInterfaces"]
        assert layout_problems(nics) == [], (stack, role)
        assert efa_devices(nics) == inst.efa_interfaces, (stack, role)  # what the pods ask for
        assert nics[0]["interfaceType"] == "efa"
        assert all(n["interfaceType"] == "efa-only" for n in nics[1:])  # no VPC address per rail
        seen += 1
    assert seen


def test_the_layout_rule_bites() -> None:
    ena_primary = [{"networkCardIndex": 0, "deviceIndex": 0, "interfaceType": "interface"}] + [
        {"networkCardIndex": c, "deviceIndex": 1, "interfaceType": "efa-only"} for c in range(1, 32)
    ]
    assert layout_problems(ena_primary) == []  # allowed by AWS ...
    assert efa_devices(ena_primary) == 31  # ... but one EFA device short of the catalog's 32
    efa_only_primary = [{**ena_primary[0], "interfaceType": "efa-only"}, *ena_primary[1:]]
    assert "an EFA-only interface cannot be the primary" in layout_problems(efa_only_primary)
    wrong_index = [ena_primary[0], {**ena_primary[1], "deviceIndex": 0}]
    assert any("device index 0, not 1" in p for p in layout_problems(wrong_index))

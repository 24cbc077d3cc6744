"""loadtest/router_bench.py's virtual-time cluster on a small workload: every request ends, and
the numbers it reports hold together (the bench itself: docs/benchmarks.md)."""

from __future__ import annotations

from loadtest_scripts import load_script

from parkade.services.common.simulation import Simulation


def test_the_virtual_cluster_serves_every_request_and_kv_routing_finds_the_shared_prefixes():
    bench = load_script("router_bench")
    simulation = Simulation.parse("h200:llama-3-8b")
    rows = {}
    for policy in ("kv", "round-robin"):
        workload = bench.multi_tenant(20.0, 3.0, seed=5, tenants=6, prefix=512)
        rows[policy] = bench.run(simulation, workload, policy, replicas=3, blocks=400)
        assert all(r.done is not None and r.first_token is not None for r in workload), policy
        assert sum(rows[policy]["requests_per_replica"]) == len(workload) == rows[policy]["requests"]
    assert rows["round-robin"]["max_over_min"] <= 1.1  # each in turn
    assert rows["kv"]["prefix_hit_rate"] > rows["round-robin"]["prefix_hit_rate"]
    assert rows["kv"]["predicted_confirmed"] >= 0.95

"""The link model (moetrain/tools/plan/links.py) against hand arithmetic."""

import pytest

from moetrain.tools.plan.links import Links, split_all_to_all, split_collective

GB = 1e9


def test_collectives_inside_one_node():
    links = Links(nvlink_gbps=450, internode_gbps=50, latency_us=0)
    # 8 ranks, 1 GB: ring all-reduce sends 2 * 7/8 GB per GPU at 450 GB/s
    assert links.all_reduce_s(GB, 8) == pytest.approx(2 * 7 / 8 / 450)
    assert links.reduce_scatter_s(GB, 8) == pytest.approx(7 / 8 / 450)
    assert links.all_gather_s(GB, 8) == links.reduce_scatter_s(GB, 8)
    # all-to-all: 1/8 of the payload stays, 7/8 goes over NVLink, in messages of GB / 8 a peer
    rate = (GB / 8) / (GB / 8 + 2**20)
    assert links.all_to_all_s(GB, 8) == pytest.approx(7 / 8 / 450 / rate)
    assert links.all_reduce_s(GB, 1) == links.all_to_all_s(GB, 1) == 0.0


def test_latency_and_efficiency():
    links = Links(nvlink_gbps=900, internode_gbps=100, latency_us=10, efficiency=0.8)
    assert links.all_gather_s(GB, 4) == pytest.approx(3 / 4 / (900 * 0.8) + 10e-6)
    assert links.all_reduce_s(GB, 4) == pytest.approx(2 * (3 / 4 / 720 + 10e-6))
    with pytest.raises(ValueError, match="efficiency"):
        Links(nvlink_gbps=1, internode_gbps=1, efficiency=0)


def test_groups_spanning_nodes():
    links = Links(nvlink_gbps=450, internode_gbps=50, gpus_per_node=8, latency_us=0)
    # 16 consecutive ranks on 2 nodes: 7/8 of the buffer inside the node, then 1/8 of it
    # among the 2 ranks holding the same slice, half of that across
    assert split_collective(GB, 16, 1, 8) == pytest.approx((7 / 8 * GB, GB / 8 / 2))
    assert links.reduce_scatter_s(GB, 16) == pytest.approx(7 / 8 / 450 + 1 / 16 / 50)
    # ranks 8 apart (expert replicas at ep 8): one per node, everything crosses
    assert split_collective(GB, 2, 8, 8) == pytest.approx((0.0, GB / 2))
    # all-to-all over 16: 7/16 to node-mates, 8/16 to the other node, both links at once
    assert split_all_to_all(GB, 16, 8) == pytest.approx((7 / 16 * GB, 8 / 16 * GB))
    rate = (GB / 16) / (GB / 16 + 2**20)
    assert links.all_to_all_s(GB, 16) == pytest.approx(max(7 / 16 / 450, 8 / 16 / 50) / rate)


def test_small_all_to_all_messages_run_below_the_collectives_rate():
    links = Links(nvlink_gbps=450, internode_gbps=50, latency_us=0, half_rate_bytes=2**20)
    # 8 MiB over 8 ranks: 1 MiB messages, half the rate; 8 GiB: 1 GiB messages, 0.1% short
    assert links.all_to_all_s(8 * 2**20, 8) == pytest.approx(2 * 7 / 8 * 8 * 2**20 / 450e9)
    big = links.all_to_all_s(8 * 2**30, 8)
    assert big == pytest.approx(7 / 8 * 8 * 2**30 / 450e9 * (1 + 2**20 / 2**30))

"""Stages on Ray vs embedded: the per-request hand-off cost, and DiT throughput with 2 replicas vs 1.

One Ray cluster on this machine (a head and one worker node), tiny-glm-shapes at 128x128 (its preset:
8 steps, greedy AR), measured side by side in one run (docs/distributed.md):

- hand-off: each round runs ``--requests`` requests one after another on the embedded engine and on the
  same pipeline with both stages as Ray actors, interleaved; prints per-request ms of each, their
  difference and ratio, and the hand-off proper: per stage, the studio-side time of a job minus the actor's
  own time for it, summed over both stages (target <= 30 ms); median and range over ``--rounds``; same
  bytes checked;
- throughput: ``--clients`` concurrent requests on Ray with the DiT stage as 1 replica, then 2; images/s
  and the ratio, median and range over rounds. On a 2-core machine two replicas share the same cores,
  so expect little; on nodes with their own GPUs the ratio approaches 2.

Ray binds every interface: the benchmark re-runs itself inside a loopback-only network namespace
(``unshare -n``, root), as the tests do.

    .venv/bin/python bench/ray.py [--rounds 5] [--requests 4] [--clients 4]
"""

from __future__ import annotations

import argparse
import io
import os
import socket
import statistics
import sys
import tempfile
import threading
import time

# This file is named ray.py: keep its folder off the import path, or ``import ray`` would import itself.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.1f} ({min(values):.1f}-{max(values):.1f})"


def in_loopback_namespace() -> bool:
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=4, help="sequential requests per round and mode")
    parser.add_argument("--clients", type=int, default=4, help="concurrent requests for the throughput part")
    args = parser.parse_args()
    if not in_loopback_namespace():
        os.execvp(
            "unshare",
            ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", sys.executable, *sys.argv],
        )

    import ray
    import yaml
    from ray.cluster_utils import Cluster

    from engine import GenerationParams, GenerationRequest, build_engine
    from engine.environment import quiet_libraries
    from engine.paths import DEPLOY_PRESETS_DIR

    quiet_libraries()
    started = time.monotonic()
    common = {"node_ip_address": "127.0.0.1", "num_cpus": 3}  # one logical CPU per actor
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**common, "resources": {"node_a": 2}, "include_dashboard": False},
    )
    cluster.add_node(**common, resources={"node_b": 3})
    ray.init(
        address=cluster.address, _node_ip_address="127.0.0.1", log_to_driver=False, logging_level="ERROR"
    )
    data = tempfile.mkdtemp()
    preset = yaml.safe_load((DEPLOY_PRESETS_DIR / "tiny-glm-shapes.yaml").read_text())

    def deploy(replicas: int) -> dict:
        stages = [dict(s) for s in preset["stages"]]
        stages[0]["resources"] = {"node_a": 1}
        stages[1].update(resources={"node_b": 1}, num_replicas=replicas)
        return {**preset, "stages": stages}

    embedded = build_engine("tiny-glm-shapes", data_dir=data)
    on_ray = build_engine("tiny-glm-shapes", deploy(1), data_dir=data, ray_address=cluster.address)
    print(f"cluster and engines up in {time.monotonic() - started:.0f} s (2 nodes, 1 actor per stage)")

    def request(i: int) -> GenerationRequest:
        return GenerationRequest("a red circle on a blue background, top left", GenerationParams(seed=i))

    # warm both (first-call allocations, lazy imports)
    assert png(embedded.run(request(0)).images[0]) == png(on_ray.run(request(0)).images[0]), "bytes differ"

    def handoff_ms(engine) -> float:
        """This round's per-request hand-off: per stage, the median of (studio-side time of a job minus
        the actor's own time for it), summed over the stages."""
        total = 0.0
        for runner in engine.runners.values():
            values = sorted(runner.handoff_s)
            total += values[len(values) // 2] * 1000
            runner.handoff_s.clear()
        return total

    embedded_ms: list[float] = []
    ray_ms: list[float] = []
    trip_ms: list[float] = []
    for runner in on_ray.runners.values():
        runner.handoff_s.clear()
    for r in range(args.rounds):
        for engine, out in (
            ((embedded, embedded_ms), (on_ray, ray_ms))
            if r % 2 == 0
            else ((on_ray, ray_ms), (embedded, embedded_ms))
        ):
            t0 = time.perf_counter()
            for i in range(args.requests):
                engine.run(request(100 + i))
            out.append((time.perf_counter() - t0) * 1000 / args.requests)
        trip_ms.append(handoff_ms(on_ray))
    cost = [b - a for a, b in zip(embedded_ms, ray_ms, strict=True)]
    ratio = [b / a for a, b in zip(embedded_ms, ray_ms, strict=True)]
    print("\nper request, 128x128, sequential (median (min-max) over rounds)")
    print(f"  embedded ms      {spread(embedded_ms)}")
    print(f"  ray ms           {spread(ray_ms)}")
    print(f"  difference ms    {spread(cost)}   (all of Ray's cost, compute contention included)")
    print(f"  hand-off ms      {spread(trip_ms)}   (studio-side minus actor time, both stages; target <= 30)")
    print(f"  ratio ray/embed  {statistics.median(ratio):7.2f} ({min(ratio):.2f}-{max(ratio):.2f})")
    embedded.close()

    def throughput(engine) -> float:
        done = []

        def client(c: int) -> None:
            for i in range(args.requests):
                done.append(engine.run(request(1000 + c * 100 + i)))

        threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return len(done) / (time.perf_counter() - t0)

    two = build_engine("tiny-glm-shapes", deploy(2), data_dir=data, ray_address=cluster.address)
    one_ips: list[float] = []
    two_ips: list[float] = []
    throughput(on_ray), throughput(two)  # warm
    for r in range(args.rounds):
        pair = ((on_ray, one_ips), (two, two_ips)) if r % 2 == 0 else ((two, two_ips), (on_ray, one_ips))
        for engine, out in pair:
            out.append(throughput(engine))
    gain = [b / a for a, b in zip(one_ips, two_ips, strict=True)]
    print(f"\nDiT replicas, {args.clients} concurrent clients x {args.requests} requests (images/s)")
    print(f"  1 replica        {spread(one_ips)}")
    print(f"  2 replicas       {spread(two_ips)}")
    print(f"  ratio 2/1        {statistics.median(gain):7.2f} ({min(gain):.2f}-{max(gain):.2f})")
    on_ray.close()
    two.close()
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main()

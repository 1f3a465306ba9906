"""The multinode demo's training step on real Kubo nodes, next to the raw PubSub hops it needs.

Run: python bench/bench_ipfs_step.py [--rounds 40]

Starts three loopback Kubo nodes with one worker each (a temporary swarm, stopped at the
end); the client uses node 0. The step is examples/multinode_demo.py's (`make_step`): each
worker holds one data shard, every shard's gradient is computed where the shard is and the
gradients meet on one worker, which updates the weights.

A step's messages form chains: the client's run messages (one PubSub hop), each transfer a
worker waits for (one hop after its sender could send it), the replies (one hop). `hops`
finds the longest chain in the step's plan; raw Kubo would need that many hops one after
another, that is hops / 2 round trips. Prints, per step (medians; raw and gridgraph samples
alternate, so both see the same machine load): a raw Kubo PubSub round trip between node 0
and node 1 (bench_ipfs.Echo) times the round trips the step needs, and the step with
`gg.compile` (replayed) and with `gg.trace()` + `gg.compute`, as ratios to that; then the
mean and the slowest of the steps, where the ones that lost a message show.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_ipfs import Echo

import gridgraph as gg
from gridgraph.exec.ipfs.kubo import Kubo
from gridgraph.exec.ipfs.swarm import local_swarm
from gridgraph.schedule.plan import Plan
from gridgraph.schedule.program import Recv, Send

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from multinode_demo import make_step, shards  # noqa: E402

LR = 0.1


def hops(plan: Plan) -> int:
    """PubSub hops one after another on the longest chain of messages of one run of `plan`."""
    programs = plan.programs
    level: dict[tuple[str, int], int] = {}  # (worker, stage) -> hops before it can start

    def start(worker: str, stage: int) -> int:
        if (worker, stage) not in level:
            at = 1 if stage == 0 else start(worker, stage - 1)  # its run message
            for step in programs[worker][stage]:
                if type(step) is Recv:
                    slots, src = list(step.slots), step.worker
                    sent_in = next(
                        i for i, steps in enumerate(programs[src])
                        if any(type(s) is Send and s.worker == worker and list(s.slots) == slots
                               for s in steps)
                    )  # fmt: skip
                    at = max(at, start(src, sent_in) + 1)
            level[worker, stage] = at
        return level[worker, stage]

    return 1 + max(start(w, len(stages) - 1) for w, stages in programs.items())  # + replies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40, help="steps to time, each way")
    args = parser.parse_args()
    xs, ys, _ = shards(3)
    with tempfile.TemporaryDirectory(prefix="gg-bench-") as tmp:
        with local_swarm(3, Path(tmp), log_level="WARNING") as apis:
            echo = Echo(Kubo(apis[0]), Kubo(apis[1]))
            with gg.connect(ipfs=apis[0], min_workers=3, workers=["w0", "w1", "w2"]) as grid:
                workers = grid.workers
                rx = [x.send(w) for x, w in zip(xs, workers)]
                ry = [y.send(w) for y, w in zip(ys, workers)]
                w_compiled = w_traced = torch.zeros(8, 1).send(workers[0])
                step = make_step(rx, ry, LR, workers)  # compiled
                traced_step = step.fn

                def compiled() -> float:
                    nonlocal w_compiled
                    start = time.perf_counter()
                    w_compiled = step(w_compiled)
                    return time.perf_counter() - start

                def traced() -> float:
                    nonlocal w_traced
                    start = time.perf_counter()
                    with gg.trace():
                        w_traced = traced_step(w_traced)
                    gg.compute(w_traced)
                    return time.perf_counter() - start

                samples: dict[str, list[float]] = {"raw": [], "compiled": [], "traced": []}
                for i in range(args.rounds + 5):
                    raw, c, t = echo.once(), compiled(), traced()
                    if i >= 5 and raw is not None:  # warm-up: plans cached, the step replays
                        samples["raw"].append(raw)
                        samples["compiled"].append(c)
                        samples["traced"].append(t)
                assert step.replays > 0, step.not_replayable
                compiled()  # one more step each, to read the compiled step's plan
                plan = grid.client.last_plan
                traced()
                chain = hops(plan)
                messages = plan.messages
                torch.testing.assert_close(w_compiled.get(), w_traced.get())
            echo.close()

    med = {k: 1000 * statistics.median(v) for k, v in samples.items()}
    needed = med["raw"] * chain / 2
    print(f"multinode demo step (3 shards of 2000 x 8): {messages} messages, the longest "
          f"chain {chain} PubSub hops = {chain / 2:g} raw round trips")  # fmt: skip
    print(f"  raw Kubo round trip   {med['raw']:7.2f} ms  x {chain / 2:g} = {needed:7.2f} ms")
    for name in ("compiled", "traced"):
        print(f"  {name:9s} step      {med[name]:7.2f} ms   {med[name] / needed:5.2f}x raw")
    # PubSub loses a message now and then; the step that lost one waits to ask again, which
    # the medians do not show and a training loop's total does.
    print("  mean (max) of all steps, losses included:")
    for name in ("compiled", "traced"):
        mean, worst = 1000 * statistics.mean(samples[name]), 1000 * max(samples[name])
        print(f"  {name:9s} step      {mean:7.2f} ms ({worst:.0f} ms)  {mean / needed:5.2f}x raw")
    if echo.lost:
        print(f"  ({echo.lost} raw echoes lost, left out)")


if __name__ == "__main__":
    main()

"""The `gridgraph` command line.

    gridgraph worker --ipfs /ip4/127.0.0.1/tcp/5001 --name w1 [--lease 300] [--log-level INFO]
                     [--allow-peers FILE]                # serve only the peers listed
    gridgraph id --ipfs /ip4/127.0.0.1/tcp/5001        # the node's peer ID, for trust lists
    gridgraph ipfs up --nodes 3 --root /tmp/swarm      # private loopback Kubo swarm
    gridgraph ipfs down --root /tmp/swarm
    gridgraph demo                                     # 3 in-process workers train a model

`python -m gridgraph ...` is the same.
"""

from __future__ import annotations

import argparse
import logging
import sys

from gridgraph.exec.ipfs import swarm


def _worker(args: argparse.Namespace) -> int:
    from gridgraph.exec.ipfs.worker_main import run_worker  # imports torch: only when needed

    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("urllib3").setLevel(logging.WARNING)  # one line per RPC call otherwise
    return run_worker(args.ipfs, args.name, lease=args.lease, allow_peers=args.allow_peers)


def _id(args: argparse.Namespace) -> int:
    from gridgraph.exec.ipfs.kubo import Kubo

    print(Kubo(args.ipfs).id())
    return 0


def _demo(args: argparse.Namespace) -> int:
    from gridgraph import demo  # written separately; imported lazily

    return demo.main() or 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="gridgraph", description=__doc__.splitlines()[0])
    commands = top.add_subparsers(dest="command", required=True)

    worker = commands.add_parser("worker", help="run a worker on a Kubo node until Ctrl-C")
    worker.add_argument(
        "--ipfs",
        default="/ip4/127.0.0.1/tcp/5001",
        help="the Kubo node's RPC API multiaddr (default: %(default)s)",
    )
    worker.add_argument("--name", required=True, help="this worker's name, unique on the grid")
    worker.add_argument(
        "--lease",
        type=float,
        default=300.0,
        help="free a client's tensors after this many silent seconds (default: %(default)s)",
    )
    worker.add_argument(
        "--log-level", default="INFO", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    worker.add_argument(
        "--allow-peers",
        metavar="FILE",
        help="serve only these peers (clients and the grid's other workers): a file of peer "
        "IDs, one a line, or `name peer_id` lines (default: an open grid, anyone)",
    )
    worker.set_defaults(func=_worker)

    ident = commands.add_parser("id", help="print a Kubo node's peer ID (for trust lists)")
    ident.add_argument("--ipfs", default="/ip4/127.0.0.1/tcp/5001", help="the node's RPC API")
    ident.set_defaults(func=_id)

    ipfs = commands.add_parser("ipfs", help="start or stop a local Kubo swarm on loopback")
    swarm.add_cli(ipfs.add_subparsers(dest="action", required=True))

    demo = commands.add_parser("demo", help="train a small model on 3 in-process workers")
    demo.set_defaults(func=_demo)
    return top


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (FileNotFoundError, RuntimeError, ValueError) as error:  # KuboError: RuntimeError
        print(f"gridgraph {args.command}: error: {error}", file=sys.stderr)
        return 1

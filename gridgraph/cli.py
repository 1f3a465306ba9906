"""The `gridgraph` command line.

    gridgraph worker --ipfs /ip4/127.0.0.1/tcp/5001 --name w1 [--lease 300] [--log-level INFO]
                     [--max-client-memory 4GiB] [--max-request-seconds 300]
                     [--max-message-size 256MiB] [--max-requests-per-second 500]
                     [--max-worker-memory 8GiB]         # default: a quarter of the machine
                     [--allow-peers FILE]                # serve only the peers listed
    gridgraph id --ipfs /ip4/127.0.0.1/tcp/5001        # the node's peer ID, for trust lists
    gridgraph status --ipfs /ip4/127.0.0.1/tcp/5001    # the workers a client would see
                     [--trust FILE] [--wait 2]
    gridgraph ipfs up --nodes 3 --root /tmp/swarm      # private loopback Kubo swarm
    gridgraph ipfs down --root /tmp/swarm
    gridgraph demo                                     # 3 in-process workers train a model
    gridgraph --version

`python -m gridgraph ...` is the same.
"""

from __future__ import annotations

import argparse
import logging
import sys

from gridgraph.exec.ipfs import swarm
from gridgraph.exec.safety.limits import Limits, parse_size


def _worker(args: argparse.Namespace) -> int:
    from gridgraph.exec.ipfs.worker_main import run_worker  # imports torch: only when needed

    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("urllib3").setLevel(logging.WARNING)  # one line per RPC call otherwise
    limits = Limits(
        max_client_memory=args.max_client_memory,
        max_request_seconds=args.max_request_seconds,
        max_message_bytes=args.max_message_size,
        requests_per_second=args.max_requests_per_second,
        request_burst=max(1, int(4 * args.max_requests_per_second)),
        max_executors=args.max_executors,
        max_worker_memory=args.max_worker_memory,
    )
    if args.isolate:
        _shield_worker()
    return run_worker(
        args.ipfs,
        args.name,
        lease=args.lease,
        limits=limits,
        isolate=args.isolate,
        allow_peers=args.allow_peers,
    )


def _shield_worker() -> None:
    """Keep the executors' sandbox from having holes: the network process's memory closed to
    its user's other processes, and a warning for each part this kernel cannot apply."""
    from gridgraph.exec.isolation import sandbox

    sandbox.protect_worker()
    for gap in sandbox.missing():
        logging.getLogger("gridgraph.worker").warning("executor sandbox without %s", gap)


def _id(args: argparse.Namespace) -> int:
    from gridgraph.exec.ipfs.kubo import Kubo

    print(Kubo(args.ipfs).id())
    return 0


def _status(args: argparse.Namespace) -> int:
    from gridgraph.exec.ipfs import status
    from gridgraph.exec.ipfs.discovery import load_trust

    trust = load_trust(args.trust) if args.trust else None
    workers = status.survey(args.ipfs, wait=args.wait)
    if not workers:
        print(
            f"no workers heard through {args.ipfs} in {args.wait:g} s; start one with "
            f"`gridgraph worker --ipfs ADDR --name w0` on a node connected to this one "
            "(check `ipfs swarm peers`)"
        )
        return 1
    print(status.render(workers, trust))
    return 0


def version() -> str:
    """This gridgraph's version, as installed (or as pyproject.toml says, from a checkout)."""
    from importlib import metadata

    try:
        return metadata.version("gridgraph")
    except metadata.PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def _demo(args: argparse.Namespace) -> int:
    from gridgraph import demo  # written separately; imported lazily

    return demo.main() or 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="gridgraph", description=__doc__.splitlines()[0])
    top.add_argument("--version", action="version", version=f"gridgraph {version()}")
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
    defaults = Limits()
    worker.add_argument(
        "--max-client-memory",
        type=parse_size,
        default=defaults.max_client_memory,
        metavar="SIZE",
        help="bytes each client may hold here: tensors, transfers, cached replies and "
        "programs; a program that would need more is refused before it runs (default: 4GiB)",
    )
    worker.add_argument(
        "--max-request-seconds",
        type=float,
        default=defaults.max_request_seconds,
        metavar="S",
        help="a request running longer is stopped and undone (default: %(default)s)",
    )
    worker.add_argument(
        "--max-worker-memory",
        type=parse_size,
        default=defaults.max_worker_memory,
        metavar="SIZE",
        help="bytes this worker's network process holds for all peers at once: requests "
        "waiting to run, transfers, payloads being fetched; each peer gets a 1/16 share, and "
        "what would go past it is refused (default: a quarter of this machine's memory)",
    )
    worker.add_argument(
        "--max-message-size",
        type=parse_size,
        default=defaults.max_message_bytes,
        metavar="SIZE",
        help="larger messages are dropped unread (default: 256MiB)",
    )
    worker.add_argument(
        "--max-requests-per-second",
        type=float,
        default=defaults.requests_per_second,
        metavar="N",
        help="per peer, in bursts of up to 4 s worth (default: %(default)s)",
    )
    worker.add_argument(
        "--max-executors",
        type=int,
        default=defaults.max_executors,
        metavar="N",
        help="client sessions running in executor processes at once; a session past it is "
        "refused until one ends (default: %(default)s)",
    )
    worker.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run each client session's programs in a process of its own (default: on; "
        "--no-isolate only for clients you trust: a kernel crash then ends the whole worker)",
    )
    worker.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="what the worker logs to stderr: DEBUG adds every message received "
        "(default: %(default)s)",
    )
    worker.add_argument(
        "--allow-peers",
        metavar="FILE",
        help="serve only these peers (clients and the grid's other workers): a file of peer "
        "IDs, one a line, or `name peer_id` lines (default: an open grid, anyone)",
    )
    worker.set_defaults(func=_worker)

    ident = commands.add_parser("id", help="print a Kubo node's peer ID (for trust lists)")
    ident.add_argument(
        "--ipfs",
        default="/ip4/127.0.0.1/tcp/5001",
        help="the node's RPC API multiaddr (default: %(default)s)",
    )
    ident.set_defaults(func=_id)

    status = commands.add_parser(
        "status", help="list the workers a client would see through a Kubo node"
    )
    status.add_argument(
        "--ipfs",
        default="/ip4/127.0.0.1/tcp/5001",
        help="the Kubo node's RPC API multiaddr or http://HOST:PORT (default: %(default)s)",
    )
    status.add_argument(
        "--trust",
        metavar="FILE",
        help="a trust file, as connect(trust=FILE) takes: the TRUSTED column says whether a "
        "client with it would use each worker (default: an open grid, any worker)",
    )
    status.add_argument(
        "--wait",
        type=float,
        default=2.0,
        metavar="S",
        help="listen this long for workers' announcements (default: %(default)s)",
    )
    status.set_defaults(func=_status)

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

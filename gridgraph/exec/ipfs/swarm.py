"""Start and stop a private swarm of Kubo nodes on loopback, for tests and local runs.

Layout under `root`: one repo per node in `node<i>/` (with `daemon.pid` and `daemon.log`),
and `nodes.json`, the list of `NodeInfo` for whoever wants to connect.

Policy:
- Nothing leaves 127.0.0.1: every address (API, gateway, swarm) is a loopback TCP port
  picked free here; no bootstrap peers, no mDNS, no routing (no DHT, no delegated HTTP
  routers), no providing, no AutoConf/AutoTLS/AutoNAT/relays/NAT port mapping/hole
  punching, telemetry off, only the TCP transport.
- The nodes know each other through `Peering.Peers` (so they reconnect if a connection drops)
  and are dialed explicitly once up (so callers need not wait for peering's first tick).
- Pubsub is enabled in config (`Pubsub.Enabled`), the non-deprecated way.
- The repos are made and the daemons started all at once; a node is up when its API answers
  with its own peer ID (a port picked free may be taken by another daemon before ours binds
  it: then the start fails, naming that peer). `local_swarm` starts each worker as soon as
  its own node is up.
- `stop_nodes` kills only the pids recorded under `root`, and only if they still are
  `ipfs daemon` processes.

Example:
    nodes = start_nodes(3, Path("/tmp/swarm"))
    ...
    stop_nodes(Path("/tmp/swarm"))
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from gridgraph.exec.ipfs.discovery import check_name, discover
from gridgraph.exec.ipfs.kubo import Kubo, KuboError

INSTALL_HINT = "run scripts/install_kubo.sh (it prints the binary's path) or set IPFS_BIN"


@dataclass(frozen=True)
class NodeInfo:
    """How to reach one local Kubo node."""

    index: int
    repo: str
    api: str  # RPC multiaddr, e.g. /ip4/127.0.0.1/tcp/40001
    peer_id: str
    swarm: str  # dialable swarm multiaddr, ending in /p2p/<peer_id>
    pid: int


def find_ipfs_binary() -> Path:
    """The Kubo `ipfs` binary: $IPFS_BIN, else `ipfs` on PATH, else Go's bin directory."""
    candidates = []
    if os.environ.get("IPFS_BIN"):
        candidates.append(Path(os.environ["IPFS_BIN"]))
    on_path = shutil.which("ipfs")
    if on_path:
        candidates.append(Path(on_path))
    gopath = os.environ.get("GOPATH") or _go_env_gopath() or str(Path.home() / "go")
    candidates += [Path(p) / "bin" / "ipfs" for p in gopath.split(os.pathsep) if p]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    looked = ", ".join(str(c) for c in candidates) or "nowhere"
    raise FileNotFoundError(f"Kubo's ipfs binary not found (looked at {looked}); {INSTALL_HINT}")


def _go_env_gopath() -> str | None:
    if not shutil.which("go"):
        return None
    result = subprocess.run(["go", "env", "GOPATH"], capture_output=True, text=True)
    return result.stdout.strip() or None


def _free_ports(count: int) -> list[int]:
    # Hold all sockets open until every port is chosen, so no port is handed out twice.
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _loopback_only(config: dict, api: int, gateway: int, swarm: int) -> None:
    """Edit a Kubo config in place so that the node talks to nothing but loopback peers."""
    config["Addresses"].update(
        API=f"/ip4/127.0.0.1/tcp/{api}",
        Gateway=f"/ip4/127.0.0.1/tcp/{gateway}",
        Swarm=[f"/ip4/127.0.0.1/tcp/{swarm}"],
        Announce=[],
        AppendAnnounce=[],
    )
    config["Bootstrap"] = []
    config.setdefault("Discovery", {}).setdefault("MDNS", {})["Enabled"] = False
    config.setdefault("Routing", {}).update(Type="none", DelegatedRouters=[])
    config.setdefault("AutoConf", {})["Enabled"] = False
    config.setdefault("AutoTLS", {})["Enabled"] = False
    config.setdefault("AutoNAT", {})["ServiceMode"] = "disabled"
    config.setdefault("Provide", {})["Enabled"] = False
    config.setdefault("HTTPRetrieval", {})["Enabled"] = False
    config.setdefault("DNS", {})["Resolvers"] = {}
    config.setdefault("Ipns", {})["DelegatedPublishers"] = []
    swarm_cfg = config.setdefault("Swarm", {})
    swarm_cfg["DisableNatPortMap"] = True
    swarm_cfg["EnableHolePunching"] = False
    swarm_cfg.setdefault("RelayClient", {})["Enabled"] = False
    swarm_cfg.setdefault("RelayService", {})["Enabled"] = False
    network = swarm_cfg.setdefault("Transports", {}).setdefault("Network", {})
    network.update(
        TCP=True, QUIC=False, Websocket=False, Relay=False, WebTransport=False, WebRTCDirect=False
    )
    plugins = config.setdefault("Plugins", {})
    telemetry_off = {"telemetry": {"Config": {"Mode": "off"}}}
    plugins["Plugins"] = {**(plugins.get("Plugins") or {}), **telemetry_off}
    config.setdefault("Pubsub", {})["Enabled"] = True


def _daemon_env(repo: Path) -> dict[str, str]:
    # IPFS_TELEMETRY beats config; belt and braces with Plugins.telemetry.Config.Mode.
    return {**os.environ, "IPFS_PATH": str(repo), "IPFS_TELEMETRY": "off"}


def _init_repos(binary: Path, repos: list[Path]) -> None:
    """`ipfs init` in each repo that has no config yet, all at once."""
    started = []
    for repo in repos:
        if (repo / "config").exists():
            continue
        repo.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(
            [str(binary), "init", "--profile", "test", "--empty-repo"],
            env=_daemon_env(repo),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        started.append((repo, proc))
    failed = []
    for repo, proc in started:
        _, err = proc.communicate()
        if proc.returncode != 0:
            failed.append(f"ipfs init in {repo} failed: {err.strip()}")
    if failed:
        raise RuntimeError("; ".join(failed))


def _is_ipfs_daemon(pid: int) -> bool:
    """True while `pid` is a live (not zombie) `ipfs daemon`: guards against reused pids."""
    try:
        os.waitpid(pid, os.WNOHANG)  # reap it if it is our exited child
    except ChildProcessError:
        pass
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    fields = stat_fields(pid)
    if not fields or fields[0] == "Z":
        return False
    return b"daemon" in cmdline and Path(cmdline[0].decode()).name == "ipfs"


def stat_fields(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the process name (state, parent, ...), or None if
    there is no such process (gone meanwhile)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2 :].split()  # (the name may hold spaces and parentheses)


API_POLL = 0.02  # seconds between two looks at a starting daemon's API


def _wait_for_apis(
    nodes: list[NodeInfo], procs: list[subprocess.Popen], timeout: float,
    on_ready: Callable[[NodeInfo], None] | None,
) -> None:  # fmt: skip
    """Wait until every node's API answers as that node (not as another daemon that took
    its port meanwhile), calling `on_ready(node)` for each as it does."""
    waiting = {node.index: (node, proc) for node, proc in zip(nodes, procs, strict=True)}
    deadline = time.monotonic() + timeout
    while waiting:
        for index, (node, proc) in list(waiting.items()):
            if proc.poll() is not None:
                log = (Path(node.repo) / "daemon.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(
                    f"ipfs daemon for {node.repo} exited ({proc.returncode}):\n{log}"
                )
            try:
                answered = Kubo(node.api, timeout=2.0).id()
            except KuboError:
                continue
            if answered != node.peer_id:  # a port picked free was taken meanwhile
                raise RuntimeError(
                    f"{node.api} answers as peer {answered}, not as the daemon started in "
                    f"{node.repo} ({node.peer_id}): another process took the port; start again"
                )
            del waiting[index]
            if on_ready is not None:
                on_ready(node)
        if not waiting:
            return
        if time.monotonic() > deadline:
            node = next(iter(waiting.values()))[0]
            raise RuntimeError(
                f"ipfs daemon for {node.repo} did not answer on {node.api} in {timeout}s; "
                f"see {node.repo}/daemon.log"
            )
        time.sleep(API_POLL)


def _read_nodes(root: Path) -> list[NodeInfo]:
    path = root / "nodes.json"
    if not path.exists():
        return []
    return [NodeInfo(**entry) for entry in json.loads(path.read_text())]


def start_nodes(
    n: int, root: Path, timeout: float = 60.0,
    on_ready: Callable[[NodeInfo], None] | None = None,
) -> list[NodeInfo]:  # fmt: skip
    """Start `n` connected Kubo daemons with repos under `root`; return how to reach them.

    If `root` already runs exactly `n` live nodes, they are returned as they are; any other
    leftover daemons under `root` are stopped first and their repos reused. The repos are
    made and the daemons started all at once; `on_ready(node)` is called for each node as
    soon as its API answers (before the nodes are connected to each other), and for each
    node of a swarm already running.

    Example:
        nodes = start_nodes(2, Path("/tmp/swarm"))
        Kubo(nodes[0].api).swarm_peers() == [nodes[1].peer_id]
    """
    root = Path(root).resolve()
    existing = _read_nodes(root)
    if len(existing) == n and all(_is_ipfs_daemon(node.pid) for node in existing):
        for node in existing if on_ready is not None else ():
            on_ready(node)
        return existing
    stop_nodes(root)

    binary = find_ipfs_binary()
    root.mkdir(parents=True, exist_ok=True)
    ports = _free_ports(3 * n)
    repos = [root / f"node{i}" for i in range(n)]
    _init_repos(binary, repos)
    configs = []
    for i, repo in enumerate(repos):
        config = json.loads((repo / "config").read_text())
        _loopback_only(config, *ports[3 * i : 3 * i + 3])
        configs.append(config)

    peer_ids = [config["Identity"]["PeerID"] for config in configs]
    swarm_addrs = [config["Addresses"]["Swarm"][0] for config in configs]
    nodes, procs = [], []
    try:
        for i, (repo, config) in enumerate(zip(repos, configs, strict=True)):
            config["Peering"] = {
                "Peers": [
                    {"ID": peer_ids[j], "Addrs": [swarm_addrs[j]]} for j in range(n) if j != i
                ]
            }
            (repo / "config").write_text(json.dumps(config, indent=2))
            with open(repo / "daemon.log", "wb") as log:
                # A new session: the daemons outlive `gridgraph ipfs up` and its Ctrl-C.
                proc = subprocess.Popen(
                    [str(binary), "daemon"],
                    env=_daemon_env(repo),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            (repo / "daemon.pid").write_text(f"{proc.pid}\n")
            procs.append(proc)
            nodes.append(
                NodeInfo(
                    index=i,
                    repo=str(repo),
                    api=config["Addresses"]["API"],
                    peer_id=peer_ids[i],
                    swarm=f"{swarm_addrs[i]}/p2p/{peer_ids[i]}",
                    pid=proc.pid,
                )
            )
        _wait_for_apis(nodes, procs, timeout, on_ready)
        for node in nodes:
            kubo = Kubo(node.api)
            for other in nodes[node.index + 1 :]:
                kubo.swarm_connect(other.swarm)
    except BaseException:
        stop_nodes(root)
        raise
    (root / "nodes.json").write_text(json.dumps([asdict(node) for node in nodes], indent=2))
    return nodes


def stop_nodes(root: Path, grace: float = 5.0) -> list[int]:
    """Stop the daemons whose pids are recorded under `root`; return the pids stopped.

    Kubo shuts down cleanly on SIGTERM, but its RPC server then waits up to 30 s for open
    streams (pubsub subscriptions) to end. After `grace` seconds a second SIGTERM makes it
    exit at once; SIGKILL is the last resort.
    """
    root = Path(root)
    pids = []
    for pid_file in sorted(root.glob("node*/daemon.pid")):
        pid = int(pid_file.read_text().strip() or 0)
        if pid > 0 and _is_ipfs_daemon(pid):
            pids.append(pid)
        pid_file.unlink()
    remaining = pids
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGTERM, grace), (signal.SIGKILL, grace)):
        for pid in remaining:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        remaining = _wait_gone(remaining, wait)
        if not remaining:
            break
    (root / "nodes.json").unlink(missing_ok=True)
    if remaining:
        raise RuntimeError(f"ipfs daemons {remaining} under {root} survived SIGKILL")
    return pids


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        alive = [pid for pid in pids if _is_ipfs_daemon(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def cli_up(args: argparse.Namespace) -> None:
    """`gridgraph ipfs up --nodes N --root DIR`: start the nodes, then print each node's
    addresses, labelled, and the commands to run next."""
    root = Path(args.root)
    nodes = start_nodes(args.nodes, root)
    print(f"{len(nodes)} Kubo nodes on loopback, repos under {root}:")
    for node in nodes:
        print(f"  node{node.index}  api {node.api}  peer {node.peer_id}  swarm {node.swarm}")
    print("next, a worker on each node (each in its own terminal, or with &):")
    for node in nodes:
        print(f"  gridgraph worker --ipfs {node.api} --name w{node.index}")
    print("then see them, and connect from Python:")
    print(f"  gridgraph status --ipfs {nodes[0].api}")
    print(f'  gg.connect(ipfs="{nodes[0].api}", min_workers={len(nodes)})')
    print(f"stop the nodes with: gridgraph ipfs down --root {root}")


def cli_down(args: argparse.Namespace) -> None:
    """`gridgraph ipfs down --root DIR`: stop the daemons started under DIR."""
    pids = stop_nodes(Path(args.root))
    print(f"stopped {len(pids)} ipfs daemon(s)")


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add the `up` and `down` subcommands to an argparse subparsers object."""
    up = subparsers.add_parser("up", help="start N local Kubo nodes on loopback")
    up.add_argument(
        "--nodes", type=int, default=3, metavar="N", help="how many nodes (default: %(default)s)"
    )
    up.add_argument("--root", required=True, help="directory for the node repos")
    up.set_defaults(func=cli_up)
    down = subparsers.add_parser("down", help="stop the Kubo nodes started under --root")
    down.add_argument("--root", required=True, help="the directory `ipfs up --root` was given")
    down.set_defaults(func=cli_down)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m gridgraph.exec.ipfs.swarm")
    add_cli(parser.add_subparsers(required=True))
    parsed = parser.parse_args()
    try:
        parsed.func(parsed)
    except (FileNotFoundError, RuntimeError) as error:  # KuboError is a RuntimeError
        parser.exit(1, f"error: {error}\n")


# --- local worker processes: what tests, the demo and the benchmark start ----------------


def spawn_worker(
    api: str,
    name: str,
    log_path: Path,
    *,
    lease: float | None = None,
    log_level: str = "INFO",
    allow_peers: Path | None = None,
    isolate: bool = True,
    options: list[str] = (),
) -> subprocess.Popen:
    """Start `python -m gridgraph worker` on the node at `api`, logging to `log_path`
    (`isolate=False`: with `--no-isolate`, its programs in its own process; `options`:
    more of its flags, as `["--max-message-size", "2MiB"]`)."""
    args = [sys.executable, "-m", "gridgraph", "worker", "--ipfs", api,
            "--name", check_name(name), "--log-level", log_level]  # fmt: skip
    if lease is not None:
        args += ["--lease", str(lease)]
    if allow_peers is not None:
        args += ["--allow-peers", str(allow_peers)]
    if not isolate:
        args.append("--no-isolate")
    args += options
    with open(log_path, "ab") as out:
        return subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )


def stop_worker(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM one worker process we started (by its pid), SIGKILL it after `grace` s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def local_swarm(n: int, root: Path, *, log_level: str = "INFO") -> Iterator[list[str]]:
    """`n` loopback Kubo nodes under `root`, worker w<i> on node i; yields the nodes' APIs.

    Each worker is started as soon as its own node answers (a worker spends its first
    seconds importing torch, while the other nodes come up). Everything started here is
    stopped on exit (workers by pid, then the daemons).

    Example:
        with local_swarm(3, Path("/tmp/swarm")) as apis, connect(apis[0], 3) as grid: ...
    """
    root = Path(root)
    procs: list[subprocess.Popen] = []

    def start_worker(node: NodeInfo) -> None:
        log_path = root / f"worker{node.index}.log"
        procs.append(spawn_worker(node.api, f"w{node.index}", log_path, log_level=log_level))

    try:
        nodes = start_nodes(n, root, on_ready=start_worker)
        discover(nodes[0].api, names=[f"w{i}" for i in range(n)], timeout=120, procs=procs)
        yield [node.api for node in nodes]
    finally:
        for proc in procs:  # all at once: each takes a few seconds to say goodbye
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            stop_worker(proc)
        stop_nodes(root)

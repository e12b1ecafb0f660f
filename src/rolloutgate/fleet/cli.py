"""`rolloutgate fleet`: a controller and N gateway replicas on Ray, until Ctrl-C (docs/fleet.md).

    rolloutgate fleet --replicas 3 --engine http://10.0.0.1:30000 --engine http://10.0.0.2:30000
    rolloutgate fleet --replicas 4 --address auto --host 0.0.0.0 --admin-token T ...   # in a Ray cluster

Every `rolloutgate serve` flag applies to every replica (`--port P`: replica i on P + i; by default any free
port); `--engine` gives the fleet's engines; `--shared-port S`: every replica also listens on S, the one URL
on each node. Prints each replica's URL and the one URL (the shared port, else replica 0's).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from types import FrameType

from pydantic import ValidationError

from rolloutgate.config import load_settings
from rolloutgate.server import cli as serve_cli

__all__ = ("add_arguments", "run")

_OWN = ("replicas", "address", "num_cpus", "replica_cpus", "name", "namespace", "max_restarts", "shared_port")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=2, help="gateway replicas (default 2)")
    parser.add_argument(
        "--address",
        default=None,
        help="the Ray cluster to join ('auto': the one on this node); default: a new local one",
    )
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs of a new local Ray cluster")
    parser.add_argument(
        "--replica-cpus", type=float, default=1.0, help="Ray CPUs each replica reserves (default 1)"
    )
    parser.add_argument("--name", default="rolloutgate", help="Ray actor name prefix (default rolloutgate)")
    parser.add_argument("--namespace", default=None, help="Ray namespace")
    parser.add_argument(
        "--shared-port",
        type=int,
        default=None,
        help="a port every replica also listens on (SO_REUSEPORT): the one URL, on each node",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=-1,
        help="Ray restarts of a replica that dies (default -1: always)",
    )
    serve_cli.add_arguments(parser)  # every gateway setting, for every replica


def run(args: argparse.Namespace) -> int:
    options = vars(args)
    flags = {k: v for k, v in options.items() if k not in (*_OWN, "command", "config")}
    base_port = int(flags.pop("port", 0))
    try:
        settings = load_settings(flags, options.get("config"))
    except ValidationError as exc:
        print(f"rolloutgate fleet: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    if settings.sim:
        print("rolloutgate fleet: no --sim; run `rolloutgate sim` and give its engines", file=sys.stderr)
        return 2
    engines = list(settings.engines)
    settings = settings.model_copy(update={"engines": [], "port": 0})

    from rolloutgate.fleet.launch import start_fleet  # imports Ray

    ray_init = {"num_cpus": args.num_cpus} if args.num_cpus is not None and args.address is None else {}
    fleet = start_fleet(
        args.replicas,
        engines,
        settings,
        name=args.name,
        address=args.address,
        namespace=args.namespace,
        base_port=base_port,
        shared_port=args.shared_port,
        replica_num_cpus=args.replica_cpus,
        max_restarts=args.max_restarts,
        ray_init=ray_init,
    )
    for replica_id, url in zip(fleet.replicas, fleet.urls, strict=True):
        print(f"replica {replica_id} {url}", flush=True)
    print(
        f"rolloutgate fleet serving on {fleet.url} ({len(engines)} engines, {args.replicas} replicas)",
        flush=True,
    )
    stop = threading.Event()

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    while not stop.wait(1.0):  # wakes each second so the signal handler runs promptly
        pass
    fleet.stop(grace_s=settings.shutdown_grace / settings.time_scale)
    print("rolloutgate fleet stopped", flush=True)
    return 0

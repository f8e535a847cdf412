"""`fusionllm-node`: a compute node in Python that joins a fusionllm broker, with the flags of
`fusionllm node` where they mean the same thing."""

import argparse
import logging
import os
import re
import signal
import stat
import sys

from .backends import make_backend
from .errors import Evicted, NodeError, Refused
from .transport import Identity

NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


class Config:
    pass


def parse(argv):
    p = argparse.ArgumentParser(prog="fusionllm-node", description=__doc__)
    p.add_argument("--broker", required=True, help="the broker's control-plane URL, e.g. https://10.0.0.1:7070")
    p.add_argument("--name", required=True, help="this node's name (its certificate's name)")
    p.add_argument("--certs", required=True, help="directory with ca.pem and NAME.pem / NAME.key")
    p.add_argument("--token", default=os.environ.get("FUSIONLLM_TOKEN"),
                   help="the job's join token (better given as FUSIONLLM_TOKEN or with --token-file)")
    p.add_argument("--token-file", help="file holding the job's join token (its first line)")
    p.add_argument("--backend", choices=["numpy", "torch"], default="numpy")
    p.add_argument("--device", default=None, help="torch device (cpu, cuda, cuda:1); default: cpu")
    p.add_argument("--data-listen", default="0.0.0.0:0", help="where to accept peers' tensor streams")
    p.add_argument("--advertise", default=None, help="host:port peers use to reach this node")
    p.add_argument("--heartbeat-ms", type=int, default=500)
    p.add_argument("--peer-timeout", type=float, default=120.0,
                   help="seconds to wait for a peer's tensor before failing the step")
    p.add_argument("--reconnect-for", type=float, default=300.0,
                   help="after losing the broker, seconds to keep trying to rejoin it")
    p.add_argument("--state-dir", default=None,
                   help="where this node keeps shards of sharded snapshots, its own and its buddies' "
                        "(default: a new temporary directory, removed when the node exits)")
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def config(a):
    if not NAME.match(a.name) or a.name in ("broker", "localhost", "ca"):
        raise NodeError(f"'{a.name}' is not a valid node name (a lowercase DNS label, not broker, localhost or ca)")
    token = a.token
    if a.token_file:
        with open(a.token_file, encoding="utf-8") as f:
            token = f.readline().strip()
    if not token:
        raise NodeError("no join token: give --token, --token-file or FUSIONLLM_TOKEN")
    cert, key, ca = (os.path.join(a.certs, f) for f in (f"{a.name}.pem", f"{a.name}.key", "ca.pem"))
    for path in (cert, key, ca):
        if not os.path.isfile(path):
            raise NodeError(f"{path} is missing (make certificates with `fusionllm cert`)")
    if os.stat(key).st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise NodeError(f"{key} can be read by others: make it private (chmod 600)")
    c = Config()
    c.broker, c.name, c.token = a.broker, a.name, token
    c.identity = Identity(cert, key, ca)
    c.data_listen, c.advertise = a.data_listen, a.advertise
    c.heartbeat_s = max(a.heartbeat_ms, 10) / 1000.0
    c.peer_timeout = a.peer_timeout
    c.reconnect_for = a.reconnect_for
    c.state_dir = a.state_dir
    return c


def main(argv=None):
    a = parse(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s")
    from .node import Node

    try:
        cfg = config(a)
        node = Node(cfg, make_backend(a.backend, a.device))
        signal.signal(signal.SIGTERM, lambda *_: setattr(node, "leave_requested", True))
        if cfg.advertise is None and cfg.data_listen.startswith("0.0.0.0"):
            logging.getLogger("fusionllm_node").warning(
                "the data plane listens on all interfaces; give --advertise so peers can reach it")
        node.run()
        return 0
    except Refused as e:
        print(f"fusionllm-node: the broker refused this node: {e}", file=sys.stderr)
        return 2
    except Evicted as e:
        print(f"fusionllm-node: evicted: {e}", file=sys.stderr)
        return 3
    except (NodeError, OSError) as e:
        print(f"fusionllm-node: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

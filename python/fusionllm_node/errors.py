"""What can go wrong on a node, each with the words the broker and the user read."""


class NodeError(Exception):
    """Base of the node's errors."""


class ProtocolError(NodeError):
    """The broker or a peer sent something this node cannot accept (a malformed assignment, a
    command out of place, a tensor that breaks the rules of docs/PROTOCOL.md)."""


class OpError(NodeError):
    """An operator could not run on its inputs (wrong shapes, ids out of range)."""


class PeerError(NodeError):
    """A peer is to blame: `proven` when this node holds proof (a malformed or non-finite tensor),
    else a suspicion (a wait that timed out, a session that broke)."""

    def __init__(self, peer, reason, proven):
        super().__init__(reason)
        self.peer = peer
        self.proven = proven


class Superseded(NodeError):
    """The step or assignment was abandoned: the broker reset the job or moved on."""


class Refused(NodeError):
    """The broker refused this node for good (a wrong token, an unsupported protocol version)."""


class Evicted(NodeError):
    """The broker evicted this node."""

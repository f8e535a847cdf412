//! Which way a data-plane session between two nodes is opened, given who accepts connections.
//!
//! A session always carries tensors from a sender to a receiver, and TLS always runs with the
//! sender as client and the receiver as server, both pinned to the certificates they joined
//! with. Only who opens the TCP connection changes:
//! - **direct**: the receiver accepts connections; the sender dials it (the default);
//! - **reversed**: the receiver accepts none (NAT, firewall) but the sender does: the receiver
//!   dials the sender, which takes that connection for its session;
//! - **relayed**: neither accepts connections: both dial a third node (the relay) that accepts
//!   them, which pairs the two connections and copies bytes between them. It sees ciphertext
//!   only; a byte it alters fails TLS's authentication at the far end.
//!
//! Both ends derive their side from the same two facts the broker sends them, so they agree.

use serde::Serialize;

/// The path of one directed link, as the plan and the report name it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "path", rename_all = "lowercase")]
pub enum LinkPath {
    Direct,
    Reversed,
    Relayed { via: String },
}

impl LinkPath {
    /// The path of sessions from a sender to a receiver; `relay` is the node the broker chose
    /// for the pair when neither accepts connections.
    pub fn of(sender_reachable: bool, receiver_reachable: bool, relay: Option<&str>) -> Self {
        match (sender_reachable, receiver_reachable, relay) {
            (_, true, _) => LinkPath::Direct,
            (true, false, _) => LinkPath::Reversed,
            (false, false, Some(via)) => LinkPath::Relayed { via: via.into() },
            // No relay: the broker refuses such a placement; treat it as what it tries.
            (false, false, None) => LinkPath::Direct,
        }
    }

    pub fn name(&self) -> String {
        match self {
            LinkPath::Direct => "direct".into(),
            LinkPath::Reversed => "reversed".into(),
            LinkPath::Relayed { via } => format!("relayed via {via}"),
        }
    }
}

/// How a node opens the TCP connection of a session it sends on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SendRoute {
    /// Dial the receiver's address.
    Dial,
    /// Wait for the receiver to dial this node (reversed).
    AwaitDial,
    /// Dial the relay at this address.
    Relay(String),
}

/// How a node gets the TCP connection of a session it receives on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReceiveRoute {
    /// The sender dials this node.
    Accept,
    /// Dial the sender (reversed).
    DialSender,
    /// Dial the relay at this address.
    Relay(String),
}

/// This node's side of its sessions to and from one peer: `me`/`peer` say who accepts
/// connections, `relay` where the relay listens (needed only when neither does).
pub fn routes(me: bool, peer: bool, relay: Option<&str>) -> (SendRoute, ReceiveRoute) {
    let relay = relay.filter(|r| !r.is_empty());
    let send = match (me, peer, relay) {
        (_, true, _) => SendRoute::Dial,
        (true, false, _) => SendRoute::AwaitDial,
        (false, false, Some(r)) => SendRoute::Relay(r.into()),
        (false, false, None) => SendRoute::Dial,
    };
    let receive = match (me, peer, relay) {
        (true, _, _) => ReceiveRoute::Accept,
        (false, true, _) => ReceiveRoute::DialSender,
        (false, false, Some(r)) => ReceiveRoute::Relay(r.into()),
        (false, false, None) => ReceiveRoute::Accept,
    };
    (send, receive)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// For every combination, what the sender does matches what the receiver does: exactly one
    /// of them opens the connection to the other, or both open one to the same relay.
    #[test]
    fn both_ends_agree_on_every_path() {
        for a in [false, true] {
            for b in [false, true] {
                let relay = Some("10.0.0.9:7000");
                let (a_send, _) = routes(a, b, relay);
                let (_, b_receive) = routes(b, a, relay);
                let path = LinkPath::of(a, b, Some("r"));
                match path {
                    LinkPath::Direct => {
                        assert_eq!((a_send, b_receive), (SendRoute::Dial, ReceiveRoute::Accept))
                    }
                    LinkPath::Reversed => assert_eq!(
                        (a_send, b_receive),
                        (SendRoute::AwaitDial, ReceiveRoute::DialSender)
                    ),
                    LinkPath::Relayed { .. } => assert_eq!(
                        (a_send, b_receive),
                        (
                            SendRoute::Relay("10.0.0.9:7000".into()),
                            ReceiveRoute::Relay("10.0.0.9:7000".into())
                        )
                    ),
                }
            }
        }
    }

    #[test]
    fn a_reachable_receiver_is_always_dialled() {
        assert_eq!(LinkPath::of(false, true, None), LinkPath::Direct);
        assert_eq!(LinkPath::of(true, false, None), LinkPath::Reversed);
        assert_eq!(
            LinkPath::of(false, false, Some("hub")).name(),
            "relayed via hub"
        );
    }
}

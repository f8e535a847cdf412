//! Which way a data-plane session between two nodes is opened, given who accepts connections.
//!
//! A session always carries tensors from a sender to a receiver, and TLS always runs with the
//! sender as client and the receiver as server, both pinned to the certificates they joined
//! with. Only who opens the TCP connection changes:
//! - **direct**: the receiver accepts connections; the sender dials it (the default);
//! - **reversed**: the receiver accepts none (NAT, firewall) but the sender does: the receiver
//!   dials the sender, which takes that connection for its session;
//! - **punched**: neither accepts connections, but both sit behind NATs that keep a connection's
//!   source port (the broker learns it from the probes: the port a peer saw is the port the
//!   probe left from). Both dial each other's public address at once from ports both derive
//!   from the session's name (TCP simultaneous open): each side's outgoing SYN opens its own
//!   NAT for the other's. A NAT that picks a new port per connection (symmetric) defeats it;
//!   a punch that does not go through is reported, and the broker relays the pair instead;
//! - **relayed**: neither accepts connections: both dial a third node (the relay) that accepts
//!   them, which pairs the two connections and copies bytes between them. It sees ciphertext
//!   only; a byte it alters fails TLS's authentication at the far end.
//!
//! Cheapest first: direct, reversed, punched, relayed (a relayed link crosses the relay's links
//! twice and adds its latency).
//!
//! Both ends derive their side from the same facts the broker sends them (who accepts
//! connections, the peer's public IP for a punch, the relay), so they agree.

use serde::Serialize;

/// The path of one directed link, as the plan and the report name it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "path", rename_all = "lowercase")]
pub enum LinkPath {
    Direct,
    Reversed,
    Punched,
    Relayed { via: String },
}

impl LinkPath {
    /// The path of sessions from a sender to a receiver; when neither accepts connections,
    /// `punch` says whether both NATs keep ports, `relay` is the node the broker chose.
    pub fn of(
        sender_reachable: bool,
        receiver_reachable: bool,
        punch: bool,
        relay: Option<&str>,
    ) -> Self {
        match (sender_reachable, receiver_reachable, punch, relay) {
            (_, true, _, _) => LinkPath::Direct,
            (true, false, _, _) => LinkPath::Reversed,
            (false, false, true, _) => LinkPath::Punched,
            (false, false, false, Some(via)) => LinkPath::Relayed { via: via.into() },
            // No way: the sender dials and fails, saying so.
            (false, false, false, None) => LinkPath::Direct,
        }
    }

    pub fn name(&self) -> String {
        match self {
            LinkPath::Direct => "direct".into(),
            LinkPath::Reversed => "reversed".into(),
            LinkPath::Punched => "punched".into(),
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
    /// Punch through both NATs to the receiver's public IP address.
    Punch(String),
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
    /// Punch through both NATs to the sender's public IP address.
    Punch(String),
    /// Dial the relay at this address.
    Relay(String),
}

/// This node's side of its sessions to and from one peer: `me`/`peer` say who accepts
/// connections; when neither does, `punch` is the peer's public IP (both NATs keep ports) and
/// `relay` where the relay listens.
pub fn routes(
    me: bool,
    peer: bool,
    punch: Option<&str>,
    relay: Option<&str>,
) -> (SendRoute, ReceiveRoute) {
    let punch = punch.filter(|r| !r.is_empty());
    let relay = relay.filter(|r| !r.is_empty());
    if !me && !peer {
        return match (punch, relay) {
            (Some(ip), _) => (SendRoute::Punch(ip.into()), ReceiveRoute::Punch(ip.into())),
            (None, Some(r)) => (SendRoute::Relay(r.into()), ReceiveRoute::Relay(r.into())),
            (None, None) => (SendRoute::Dial, ReceiveRoute::Accept),
        };
    }
    let send = if peer {
        SendRoute::Dial
    } else {
        SendRoute::AwaitDial
    };
    let receive = if me {
        ReceiveRoute::Accept
    } else {
        ReceiveRoute::DialSender
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
        for (a, b, punch) in [false, true]
            .into_iter()
            .flat_map(|a| [false, true].map(|b| (a, b)))
            .flat_map(|(a, b)| [false, true].map(|p| (a, b, p)))
        {
            {
                let relay = Some("10.0.0.9:7000");
                let ip = |x: &'static str| punch.then_some(x);
                let (a_send, _) = routes(a, b, ip("10.201.0.2"), relay);
                let (_, b_receive) = routes(b, a, ip("10.201.0.1"), relay);
                let path = LinkPath::of(a, b, punch, Some("r"));
                match path {
                    LinkPath::Direct => {
                        assert_eq!((a_send, b_receive), (SendRoute::Dial, ReceiveRoute::Accept))
                    }
                    LinkPath::Reversed => assert_eq!(
                        (a_send, b_receive),
                        (SendRoute::AwaitDial, ReceiveRoute::DialSender)
                    ),
                    LinkPath::Punched => assert_eq!(
                        (a_send, b_receive),
                        (
                            SendRoute::Punch("10.201.0.2".into()),
                            ReceiveRoute::Punch("10.201.0.1".into())
                        )
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
        assert_eq!(LinkPath::of(false, true, true, None), LinkPath::Direct);
        assert_eq!(LinkPath::of(true, false, true, None), LinkPath::Reversed);
        assert_eq!(
            LinkPath::of(false, false, true, Some("hub")),
            LinkPath::Punched
        );
        assert_eq!(
            LinkPath::of(false, false, false, Some("hub")).name(),
            "relayed via hub"
        );
    }
}

//! The sessions a node that accepts no connections opens itself for the peers that send to it:
//! it dials the sender (reversed) or the relay (relayed), then serves the session exactly as if
//! the sender had dialled it (TLS server, token, generation, pinned certificate, validation).
//! When a session breaks it dials again, as a sender re-opens a direct one, for as long as the
//! assignment lasts.

use crate::dataplane::{serve_peer, AcceptContext, PeerAddr};
use crate::error::Result;
use crate::outgoing::{connect_tcp, punch_to};
use crate::path::ReceiveRoute;
use crate::rendezvous::{join_relay, keep_alive, punch_ports, session_key, Kind, Preamble};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;

/// How long a node keeps dialling for one sender's session while no attempt lasts over 5 s (a
/// session that ran is a working path: its break restarts the count). The loop also ends with
/// the generation.
const KEEP_TRYING: Duration = Duration::from_secs(180);

/// Keeps the session from `peer` to `me` open for `generation`.
pub(crate) async fn keep_open(
    ctx: Arc<AcceptContext>,
    generation: u64,
    me: String,
    peer: PeerAddr,
) {
    let key = session_key(generation, &peer.id, &me);
    let mut since = Instant::now();
    let mut pause = Duration::from_millis(100);
    while ctx.generation() == Some(generation) && since.elapsed() < KEEP_TRYING {
        let started = Instant::now();
        match open_once(&ctx, &key, &peer).await {
            // The sender closed the session with a goodbye: its assignment ended.
            Ok(()) => return,
            Err(e) => {
                tracing::debug!("{me}: the session from {} ({key}): {e}", peer.id);
                // A session that ran a while was a working one: the sender re-opens it now.
                if started.elapsed() > Duration::from_secs(5) {
                    since = Instant::now();
                    pause = Duration::from_millis(100);
                }
            }
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(2));
    }
    if ctx.generation() == Some(generation) {
        tracing::warn!(
            "{me}: gave up opening the session from {} after {} s",
            peer.id,
            KEEP_TRYING.as_secs()
        );
    }
}

/// Opens the connection the route calls for and serves one session over it.
pub(crate) async fn open_once(ctx: &AcceptContext, key: &str, peer: &PeerAddr) -> Result<()> {
    match &peer.receive {
        ReceiveRoute::Accept => Ok(()),
        ReceiveRoute::DialSender => {
            let mut tcp = connect_tcp(&peer.id, &peer.address).await?;
            keep_alive(&tcp);
            let preamble = Preamble {
                kind: Kind::Reverse,
                key: key.into(),
            };
            tcp.write_all(&preamble.encode())
                .await
                .map_err(crate::error::io_err(format!("dialling {} back", peer.id)))?;
            serve_peer(tcp, ctx, None, None).await
        }
        ReceiveRoute::Punch(ip) => {
            let (theirs, mine) = punch_ports(key);
            let tcp = punch_to(&peer.id, ip, mine, theirs, true).await?;
            keep_alive(&tcp);
            serve_peer(tcp, ctx, None, None).await
        }
        ReceiveRoute::Relay(relay) => {
            let mut tcp = connect_tcp(&format!("the relay {}", peer.relay_node), relay).await?;
            keep_alive(&tcp);
            join_relay(&mut tcp, Kind::RelayReceiver, key)
                .await
                .map_err(crate::error::io_err(format!(
                    "relaying from {} through {relay}",
                    peer.id
                )))?;
            serve_peer(tcp, ctx, Some(&peer.relay_node), None).await
        }
    }
}

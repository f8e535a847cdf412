//! Session handshake: both sides exchange Hello; the accepting side checks the protocol version
//! and the job's join token and refuses with a Goodbye that says why.

use crate::error::{Result, TransportError};
use crate::frame::{FrameReader, FrameWriter};
use fusion_proto::{frame::Body, Frame, Goodbye, Hello, PROTOCOL_VERSION};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadHalf, WriteHalf};

/// What a session knows about its peer: its hello, with the token it presented cleared.
#[derive(Clone, Debug, PartialEq)]
pub struct SessionInfo {
    pub peer: Hello,
}

/// Whether `given` is the job's token, compared in constant time (a mismatch takes as long
/// wherever the first differing byte is; only the length can be learnt).
pub fn token_matches(given: &str, expected: &str) -> bool {
    use subtle::ConstantTimeEq;
    given.len() == expected.len() && bool::from(given.as_bytes().ct_eq(expected.as_bytes()))
}

/// How long either side waits for the peer's hello before giving up (a silent peer must not hold
/// a connection, or the broker's accept loop, forever).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

type Halves<S> = (
    FrameReader<ReadHalf<S>>,
    FrameWriter<WriteHalf<S>>,
    SessionInfo,
);

async fn read_hello<R: AsyncRead + Unpin>(r: &mut FrameReader<R>) -> Result<Hello> {
    let frame = tokio::time::timeout(HANDSHAKE_TIMEOUT, r.read())
        .await
        .map_err(|_| {
            TransportError::Protocol(format!(
                "no hello from the peer within {} s",
                HANDSHAKE_TIMEOUT.as_secs()
            ))
        })??;
    match frame.body {
        Some(Body::Hello(h)) => Ok(h),
        Some(Body::Goodbye(g)) => Err(TransportError::Refused(g.reason)),
        _ => Err(TransportError::Protocol(
            "the first frame of a session must be a hello".into(),
        )),
    }
}

/// Client side: announce `me` (with the join token) and wait for the peer's answer.
pub async fn open_session<S: AsyncRead + AsyncWrite>(
    stream: S,
    me: Hello,
    max_frame: usize,
) -> Result<Halves<S>> {
    let (r, w) = tokio::io::split(stream);
    let (mut r, mut w) = (FrameReader::new(r, max_frame), FrameWriter::new(w));
    w.write(&Frame {
        body: Some(Body::Hello(me)),
    })
    .await?;
    w.flush().await?;
    let mut peer = read_hello(&mut r).await?;
    peer.token.clear();
    if peer.protocol_version != PROTOCOL_VERSION {
        return Err(TransportError::Refused(format!(
            "peer speaks protocol {}, this node {PROTOCOL_VERSION}",
            peer.protocol_version
        )));
    }
    Ok((r, w, SessionInfo { peer }))
}

/// Server side: check the peer's hello against `token`, answer with `me` or refuse.
pub async fn accept_session<S: AsyncRead + AsyncWrite>(
    stream: S,
    me: Hello,
    token: &str,
    max_frame: usize,
) -> Result<Halves<S>> {
    let (r, w) = tokio::io::split(stream);
    let (mut r, mut w) = (FrameReader::new(r, max_frame), FrameWriter::new(w));
    let mut peer = read_hello(&mut r).await?;
    let refusal = if peer.protocol_version != PROTOCOL_VERSION {
        Some(format!(
            "protocol version {} is not supported (this node speaks {PROTOCOL_VERSION})",
            peer.protocol_version
        ))
    } else if !token_matches(&peer.token, token) {
        Some("invalid join token".to_string())
    } else {
        None
    };
    peer.token.clear();
    if let Some(reason) = refusal {
        w.write(&Frame {
            body: Some(Body::Goodbye(Goodbye {
                reason: reason.clone(),
            })),
        })
        .await?;
        w.flush().await?;
        return Err(TransportError::Refused(format!(
            "refused '{}': {reason}",
            peer.node_id
        )));
    }
    w.write(&Frame {
        body: Some(Body::Hello(Hello {
            token: String::new(),
            ..me
        })),
    })
    .await?;
    w.flush().await?;
    Ok((r, w, SessionInfo { peer }))
}

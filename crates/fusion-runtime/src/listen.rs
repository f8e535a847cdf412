//! The broker's control-plane listener, hardened before gRPC sees a byte: connections are
//! admitted through a [`ConnectionGate`] (a cap in all and per address, closed on arrival past
//! it, with backoff when accepting fails), the TLS handshake has a deadline, and the join token,
//! sent as request metadata, is checked in constant time before the first message is decoded.

use crate::service::TOKEN_METADATA;
use fusion_transport::{token_matches, ConnectionGate, ConnectionLimits, GatedStream};
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::{Connected, TcpConnectInfo};
use tonic::{Request, Status};

/// An admitted connection to the broker (gRPC needs its addresses, for the peer's certificate).
pub struct ControlConnection(GatedStream);

impl Connected for ControlConnection {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        TcpConnectInfo {
            local_addr: self.0.tcp().local_addr().ok(),
            remote_addr: self.0.tcp().peer_addr().ok(),
        }
    }
}

impl AsyncRead for ControlConnection {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl AsyncWrite for ControlConnection {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }
}

/// The connections `listener` admits under `limits`, for `Server::serve_with_incoming`. The
/// accepting task (and with it the listening socket) ends as soon as the server drops the
/// stream.
pub fn gated_incoming(
    listener: TcpListener,
    limits: ConnectionLimits,
) -> (
    ReceiverStream<io::Result<ControlConnection>>,
    ConnectionGate,
) {
    let gate = ConnectionGate::new(limits);
    let (tx, rx) = mpsc::channel(16);
    let g = gate.clone();
    tokio::spawn(async move {
        loop {
            let conn = tokio::select! {
                (conn, _) = g.accept(&listener) => conn,
                _ = tx.closed() => return,
            };
            if tx.send(Ok(ControlConnection(conn))).await.is_err() {
                return;
            }
        }
    });
    (ReceiverStream::new(rx), gate)
}

/// A gRPC interceptor admitting only calls that carry the job's token as metadata (checked
/// before any message of the call is decoded).
pub fn require_token(
    token: String,
) -> impl FnMut(Request<()>) -> Result<Request<()>, Status> + Clone {
    move |req: Request<()>| {
        let given = req
            .metadata()
            .get(TOKEN_METADATA)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        if token_matches(given, &token) {
            Ok(req)
        } else {
            Err(Status::permission_denied("invalid join token"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_without_the_token_are_refused_before_decoding() {
        let mut check = require_token("s3cret".into());
        let mut ok = Request::new(());
        ok.metadata_mut()
            .insert(TOKEN_METADATA, "s3cret".parse().expect("value"));
        assert!(check(ok).is_ok());
        let mut wrong = Request::new(());
        wrong
            .metadata_mut()
            .insert(TOKEN_METADATA, "s3cre7".parse().expect("value"));
        let status = check(wrong).expect_err("wrong token");
        assert_eq!(status.code(), tonic::Code::PermissionDenied);
        assert!(check(Request::new(())).is_err(), "no token");
    }
}

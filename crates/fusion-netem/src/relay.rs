//! The delay-and-loss bridge between the two veths of a link namespace. Two threads per
//! direction: one reads frames from a packet socket and stamps them with their delivery time, the
//! other writes them to the opposite interface when that time comes (the delay is constant, so
//! order is kept). Frames this process sent itself come back as outgoing and are skipped.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::mpsc;
use std::time::{Duration, Instant};

fn last_error(what: &str) -> io::Error {
    let e = io::Error::last_os_error();
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// A raw packet socket bound to `ifname`, in promiscuous mode.
fn packet_socket(ifname: &str) -> io::Result<(OwnedFd, i32)> {
    let name = std::ffi::CString::new(ifname)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "interface name with a NUL"))?;
    // SAFETY: plain libc calls with valid arguments; the descriptor is owned right away.
    unsafe {
        let ifindex = libc::if_nametoindex(name.as_ptr()) as i32;
        if ifindex == 0 {
            return Err(last_error(&format!("no interface '{ifname}'")));
        }
        let proto = (libc::ETH_P_ALL as u16).to_be() as i32;
        let fd = libc::socket(libc::AF_PACKET, libc::SOCK_RAW, proto);
        if fd < 0 {
            return Err(last_error("packet socket (needs root)"));
        }
        let fd = OwnedFd::from_raw_fd(fd);
        let mut addr: libc::sockaddr_ll = std::mem::zeroed();
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_protocol = (libc::ETH_P_ALL as u16).to_be();
        addr.sll_ifindex = ifindex;
        let rc = libc::bind(
            fd.as_raw_fd(),
            &addr as *const libc::sockaddr_ll as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_ll>() as u32,
        );
        if rc < 0 {
            return Err(last_error(&format!("binding to '{ifname}'")));
        }
        let mut mreq: libc::packet_mreq = std::mem::zeroed();
        mreq.mr_ifindex = ifindex;
        mreq.mr_type = libc::PACKET_MR_PROMISC as u16;
        let rc = libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_PACKET,
            libc::PACKET_ADD_MEMBERSHIP,
            &mreq as *const libc::packet_mreq as *const libc::c_void,
            std::mem::size_of::<libc::packet_mreq>() as u32,
        );
        if rc < 0 {
            return Err(last_error(&format!("promiscuous mode on '{ifname}'")));
        }
        Ok((fd, ifindex))
    }
}

fn sum16(data: &[u8], mut acc: u32) -> u32 {
    let mut chunks = data.chunks_exact(2);
    for c in &mut chunks {
        acc += u16::from_be_bytes([c[0], c[1]]) as u32;
    }
    if let [last] = chunks.remainder() {
        acc += (*last as u32) << 8;
    }
    acc
}

fn fold(mut acc: u32) -> u16 {
    while acc >> 16 != 0 {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    !(acc as u16)
}

/// Recomputes the TCP or UDP checksum of an IPv4 frame. Locally sent packets cross a veth with
/// the checksum left for hardware to fill in ("partial"); once a packet socket has copied the
/// frame, nothing would, and the receiver would drop it.
pub fn fix_checksums(frame: &mut [u8]) {
    if frame.len() < 34 || frame[12..14] != [0x08, 0x00] || frame[14] >> 4 != 4 {
        return;
    }
    let ihl = (frame[14] & 0x0f) as usize * 4;
    let total = u16::from_be_bytes([frame[16], frame[17]]) as usize;
    let fragment = u16::from_be_bytes([frame[20], frame[21]]) & 0x3fff;
    let l4 = 14 + ihl;
    let end = (14 + total).min(frame.len());
    let offset = match frame[23] {
        6 => 16,
        17 => 6,
        _ => return,
    };
    if fragment != 0 || ihl < 20 || end < l4 + offset + 2 {
        return;
    }
    frame[l4 + offset] = 0;
    frame[l4 + offset + 1] = 0;
    let len = (end - l4) as u32;
    let mut acc = sum16(&frame[26..34], 0);
    acc += frame[23] as u32 + len;
    let mut cs = fold(sum16(&frame[l4..end], acc));
    if frame[23] == 17 && cs == 0 {
        cs = 0xffff;
    }
    frame[l4 + offset..l4 + offset + 2].copy_from_slice(&cs.to_be_bytes());
}

/// A small xorshift generator for loss decisions (no need for cryptographic randomness).
struct Lossy {
    state: u64,
    threshold: u64,
}

impl Lossy {
    fn new(loss: f64, seed: u64) -> Self {
        Lossy {
            state: seed | 1,
            threshold: (loss.clamp(0.0, 1.0) * u64::MAX as f64) as u64,
        }
    }
    fn drop_next(&mut self) -> bool {
        if self.threshold == 0 {
            return false;
        }
        self.state ^= self.state << 13;
        self.state ^= self.state >> 7;
        self.state ^= self.state << 17;
        self.state < self.threshold
    }
}

fn forward(
    from: OwnedFd,
    to: OwnedFd,
    to_index: i32,
    delay: Duration,
    loss: f64,
    seed: u64,
) -> io::Result<()> {
    let (tx, rx) = mpsc::channel::<(Instant, Vec<u8>)>();
    let sender = std::thread::spawn(move || -> io::Result<()> {
        // SAFETY: zeroed sockaddr_ll is a valid value; fields set below.
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_ifindex = to_index;
        addr.sll_halen = 6;
        while let Ok((due, frame)) = rx.recv() {
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            // SAFETY: the buffer and address outlive the call.
            let rc = unsafe {
                libc::sendto(
                    to.as_raw_fd(),
                    frame.as_ptr() as *const libc::c_void,
                    frame.len(),
                    0,
                    &addr as *const libc::sockaddr_ll as *const libc::sockaddr,
                    std::mem::size_of::<libc::sockaddr_ll>() as u32,
                )
            };
            if rc < 0 {
                let e = io::Error::last_os_error();
                // A full queue or an oversized frame loses that frame, as a real link would.
                if !matches!(
                    e.raw_os_error(),
                    Some(libc::ENOBUFS) | Some(libc::EMSGSIZE) | Some(libc::EAGAIN)
                ) {
                    return Err(e);
                }
            }
        }
        Ok(())
    });
    let mut lossy = Lossy::new(loss, seed);
    let mut buf = vec![0u8; 65536];
    loop {
        // SAFETY: zeroed sockaddr_ll is valid; recvfrom writes at most its size.
        let mut from_addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::sockaddr_ll>() as u32;
        let n = unsafe {
            libc::recvfrom(
                from.as_raw_fd(),
                buf.as_mut_ptr() as *mut libc::c_void,
                buf.len(),
                0,
                &mut from_addr as *mut libc::sockaddr_ll as *mut libc::sockaddr,
                &mut len,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if from_addr.sll_pkttype == libc::PACKET_OUTGOING || lossy.drop_next() {
            continue;
        }
        let mut frame = buf[..n as usize].to_vec();
        fix_checksums(&mut frame);
        if tx.send((Instant::now() + delay, frame)).is_err() {
            break;
        }
    }
    drop(tx);
    sender
        .join()
        .map_err(|_| io::Error::other("relay sender thread panicked"))?
}

/// Bridges interfaces `a` and `b` in both directions, delaying every frame by `delay` and dropping
/// it with probability `loss`. Runs until an error (or until the process is killed).
pub fn run_relay(a: &str, b: &str, delay: Duration, loss: f64) -> io::Result<()> {
    let (fa, ia) = packet_socket(a)?;
    let (fb, ib) = packet_socket(b)?;
    let (fa2, fb2) = (fa.try_clone()?, fb.try_clone()?);
    let ab = std::thread::spawn(move || forward(fa, fb2, ib, delay, loss, 0x9e37_79b9));
    let ba = std::thread::spawn(move || forward(fb, fa2, ia, delay, loss, 0x85eb_ca6b));
    let r1 = ab
        .join()
        .map_err(|_| io::Error::other("relay thread panicked"))?;
    let r2 = ba
        .join()
        .map_err(|_| io::Error::other("relay thread panicked"))?;
    r1.and(r2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recomputed_udp_checksum_verifies() {
        // Ethernet + IPv4 (10.0.0.1 -> 10.0.0.2) + UDP 1234 -> 5678 with 4 payload bytes.
        let mut f = vec![0u8; 14];
        f[12] = 0x08;
        f.extend_from_slice(&[
            0x45, 0, 0, 32, 0, 0, 0x40, 0, 64, 17, 0, 0, 10, 0, 0, 1, 10, 0, 0, 2,
        ]);
        f.extend_from_slice(&[0x04, 0xd2, 0x16, 0x2e, 0, 12, 0xde, 0xad, 1, 2, 3, 4]);
        fix_checksums(&mut f);
        // Summing pseudo-header and segment including the checksum gives 0xffff.
        let mut acc = sum16(&f[26..34], 17 + 12);
        acc = sum16(&f[34..], acc);
        assert_eq!(fold(acc), 0);
        assert_ne!(&f[40..42], &[0xde, 0xad]);
    }

    #[test]
    fn loss_rate_is_close_to_the_setting() {
        let mut l = Lossy::new(0.1, 42);
        let dropped = (0..100_000).filter(|_| l.drop_next()).count();
        assert!((9_000..11_000).contains(&dropped), "{dropped}");
        let mut none = Lossy::new(0.0, 42);
        assert!((0..1000).all(|_| !none.drop_next()));
    }
}

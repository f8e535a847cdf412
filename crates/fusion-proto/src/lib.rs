//! The wire protocol shared by every fusionllm implementation (`proto/fusionllm.proto`).

#![allow(clippy::doc_lazy_continuation)]

/// Version 1 of the protocol.
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/fusionllm.v1.rs"));
}

/// The protocol version this build speaks.
pub const PROTOCOL_VERSION: u32 = 1;

pub use v1::*;

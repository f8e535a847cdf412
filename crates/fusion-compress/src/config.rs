//! What a job asks for, and what one node is told to apply on each of its links.

use crate::codec::Codec;
use crate::rule::AdaTopKPolicy;
use crate::select::Selection;
use crate::wire::ValueType;
use serde::{Deserialize, Serialize};

/// A job's compression settings (the broker's side).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CompressionConfig {
    /// Codec for activations flowing downstream.
    pub forward: Codec,
    /// Codec for gradients flowing upstream.
    pub backward: Codec,
    /// Carry what backward messages leave out into the next message of the same tensor.
    pub error_feedback: bool,
    /// Steps sent dense before compression starts.
    pub warmup_steps: u64,
    /// Precision of the values of sparse messages.
    pub values: ValueType,
    pub selection: Selection,
    /// AdaTopK: the smallest share of values a message keeps.
    pub floor: f64,
    /// AdaTopK: try an fp16 cast and int8 quantisation before dropping values.
    pub quantize: bool,
}

impl Default for CompressionConfig {
    fn default() -> Self {
        CompressionConfig {
            forward: Codec::None,
            backward: Codec::None,
            // Off by default: in a pipeline the residual of one micro-batch's activation gradient
            // would be added to another micro-batch's, whose inputs differ.
            error_feedback: false,
            warmup_steps: 0,
            values: AdaTopKPolicy::default().values,
            selection: Selection::Approx,
            floor: AdaTopKPolicy::default().floor,
            quantize: AdaTopKPolicy::default().quantize,
        }
    }
}

impl CompressionConfig {
    /// Whether anything is compressed at all.
    pub fn is_on(&self) -> bool {
        self.forward != Codec::None || self.backward != Codec::None
    }

    /// Whether a direction's density comes from the AdaTopK rule.
    pub fn adaptive(&self) -> bool {
        self.forward == Codec::AdaTopK || self.backward == Codec::AdaTopK
    }

    pub fn policy(&self) -> AdaTopKPolicy {
        AdaTopKPolicy {
            floor: self.floor,
            values: self.values,
            quantize: self.quantize,
            ..Default::default()
        }
    }

    /// Checks the numbers a job file may get wrong.
    pub fn validate(&self) -> Result<(), String> {
        for c in [self.forward, self.backward] {
            if let Codec::TopK { density } | Codec::RandomK { density } = c {
                if !(density > 0.0 && density <= 1.0) {
                    return Err(format!("density must be in (0, 1], got {density}"));
                }
            }
            if let Codec::Int8 { block } = c {
                if block == 0 {
                    return Err("int8 block size must be positive".into());
                }
            }
        }
        if !(self.floor > 0.0 && self.floor <= 1.0) {
            return Err(format!(
                "the AdaTopK floor must be in (0, 1], got {}",
                self.floor
            ));
        }
        Ok(())
    }
}

/// The codecs one node applies to what it sends to one peer stage (AdaTopK resolved by the
/// broker to a rung of its ladder; `None` sends dense).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct PeerCodecs {
    pub stage: usize,
    /// Activations this node sends to that stage.
    pub forward: Codec,
    /// Gradients this node sends to that stage.
    pub backward: Codec,
}

/// What the broker tells a node (as JSON on the control stream).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeCompression {
    pub peers: Vec<PeerCodecs>,
    pub error_feedback: bool,
    pub warmup_steps: u64,
    pub values: ValueType,
    pub selection: Selection,
}

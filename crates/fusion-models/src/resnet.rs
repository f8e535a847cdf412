//! ResNet (He et al.): basic blocks up to 34 layers, bottleneck blocks from 50 up, plus
//! small-image variants with a 3x3 stem and no max-pool for 28x28 inputs.

use fusion_graph::{DType, Graph, GraphBuilder, GraphError, Op, TensorId};
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Block {
    Basic,
    /// 1x1 reduce, 3x3 (carrying the stride), 1x1 expand by 4.
    Bottleneck,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stem {
    /// 7x7 stride-2 convolution and 3x3 stride-2 max-pool (224x224 inputs).
    ImageNet,
    /// 3x3 stride-1 convolution, no pooling (28x28 or 32x32 inputs).
    Small,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ResNetConfig {
    pub block: Block,
    /// Blocks per stage.
    pub layers: Vec<usize>,
    /// Base width of each stage (output channels are 4x this for bottleneck blocks).
    pub widths: Vec<usize>,
    pub stem: Stem,
    pub in_channels: usize,
    pub image_size: usize,
    pub classes: usize,
}

impl ResNetConfig {
    /// The ImageNet model of the given depth (18, 34, 50, 101 or 152).
    pub fn imagenet(depth: usize) -> Option<Self> {
        let (block, layers) = match depth {
            18 => (Block::Basic, vec![2, 2, 2, 2]),
            34 => (Block::Basic, vec![3, 4, 6, 3]),
            50 => (Block::Bottleneck, vec![3, 4, 6, 3]),
            101 => (Block::Bottleneck, vec![3, 4, 23, 3]),
            152 => (Block::Bottleneck, vec![3, 8, 36, 3]),
            _ => return None,
        };
        Some(ResNetConfig {
            block,
            layers,
            widths: vec![64, 128, 256, 512],
            stem: Stem::ImageNet,
            in_channels: 3,
            image_size: 224,
            classes: 1000,
        })
    }

    /// The same depth for 28x28 single-channel images and 10 classes.
    pub fn small_image(depth: usize) -> Option<Self> {
        let mut c = Self::imagenet(depth)?;
        c.stem = Stem::Small;
        c.in_channels = 1;
        c.image_size = 28;
        c.classes = 10;
        Some(c)
    }

    /// A narrow 8-layer ResNet for 28x28 images: three stages of one basic block (16, 32, 64
    /// channels). Trains on Fashion-MNIST on a CPU in minutes.
    pub fn tiny() -> Self {
        ResNetConfig {
            block: Block::Basic,
            layers: vec![1, 1, 1],
            widths: vec![16, 32, 64],
            stem: Stem::Small,
            in_channels: 1,
            image_size: 28,
            classes: 10,
        }
    }

    fn expansion(&self) -> usize {
        match self.block {
            Block::Basic => 1,
            Block::Bottleneck => 4,
        }
    }

    fn conv_bn(
        g: &mut GraphBuilder,
        name: &str,
        x: TensorId,
        out: usize,
        k: usize,
        stride: usize,
        relu: bool,
    ) -> Result<TensorId, GraphError> {
        let y = g.conv2d(&format!("{name}.conv"), x, out, k, stride, k / 2)?;
        let y = g.op(
            &format!("{name}.bn"),
            Op::BatchNorm2d {
                eps: 1e-5,
                momentum: 0.1,
            },
            &[y],
            None,
        )?;
        if relu {
            g.op(&format!("{name}.relu"), Op::Relu, &[y], None)
        } else {
            Ok(y)
        }
    }

    fn block(
        &self,
        g: &mut GraphBuilder,
        x: TensorId,
        width: usize,
        stride: usize,
    ) -> Result<TensorId, GraphError> {
        let in_c = g.shape(x)[1];
        let out_c = width * self.expansion();
        let y = match self.block {
            Block::Basic => {
                let y = Self::conv_bn(g, "a", x, width, 3, stride, true)?;
                Self::conv_bn(g, "b", y, width, 3, 1, false)?
            }
            Block::Bottleneck => {
                let y = Self::conv_bn(g, "a", x, width, 1, 1, true)?;
                let y = Self::conv_bn(g, "b", y, width, 3, stride, true)?;
                Self::conv_bn(g, "c", y, out_c, 1, 1, false)?
            }
        };
        let shortcut = if stride != 1 || in_c != out_c {
            Self::conv_bn(g, "downsample", x, out_c, 1, stride, false)?
        } else {
            x
        };
        let y = g.op("residual", Op::Add, &[y, shortcut], None)?;
        g.op("relu", Op::Relu, &[y], None)
    }

    pub fn graph(&self, name: &str, batch: usize) -> Result<Graph, GraphError> {
        let mut g = GraphBuilder::new(name);
        let s = self.image_size;
        let images = g.input("images", vec![batch, self.in_channels, s, s], DType::F32);
        let labels = g.input("labels", vec![batch], DType::I32);
        let first = self.widths.first().copied().unwrap_or(64);
        let mut x = match self.stem {
            Stem::ImageNet => {
                let x = Self::conv_bn(&mut g, "stem", images, first, 7, 2, true)?;
                g.op(
                    "stem.pool",
                    Op::MaxPool2d {
                        kernel: 3,
                        stride: 2,
                        padding: 1,
                    },
                    &[x],
                    None,
                )?
            }
            Stem::Small => Self::conv_bn(&mut g, "stem", images, first, 3, 1, true)?,
        };
        for (si, (&n, &w)) in self.layers.iter().zip(&self.widths).enumerate() {
            for bi in 0..n {
                let stride = if bi == 0 && si > 0 { 2 } else { 1 };
                x = g.scoped(&format!("layer{}.{bi}", si + 1), |g| {
                    self.block(g, x, w, stride)
                })?;
            }
        }
        let x = g.op("pool", Op::GlobalAvgPool, &[x], None)?;
        let logits = g.linear("fc", x, self.classes, true)?;
        let loss = g.op("loss", Op::SoftmaxCrossEntropy, &[logits, labels], None)?;
        g.output(loss);
        g.output(logits);
        g.finish()
    }
}

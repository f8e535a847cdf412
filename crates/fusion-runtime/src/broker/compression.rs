//! The compression policy in force: AdaTopK's codec per link direction.

use super::*;

/// Bytes per micro-batch that stage `from` sends stage `to` (activations downstream, their
/// gradients upstream).
pub(super) fn stage_traffic(graph: &Graph, plan: &Plan, from: usize, to: usize) -> usize {
    let (producer, consumer) = if from < to { (from, to) } else { (to, from) };
    plan.stages[consumer]
        .inputs
        .iter()
        .filter(|r| r.source == Source::Stage(producer))
        .map(|r| graph.tensor(fusion_graph::TensorId(r.tensor)).bytes())
        .sum()
}

impl Coordinator<'_> {
    /// Decides every link direction's codec (AdaTopK: the least lossy codec that makes the link
    /// fit the slowest stage's compute, `measured_compute_s` per micro-batch when known, else the
    /// estimate) and tells each node what it applies. Only changes are announced.
    pub(super) async fn set_compression(
        &mut self,
        plan: &Plan,
        layout: &Layout,
        measured_compute_s: Option<f64>,
    ) -> Flow<()> {
        let cfg = self.job.compression.clone();
        if !cfg.is_on() {
            return Ok(());
        }
        let target = match measured_compute_s {
            Some(t) if t > 0.0 => t,
            _ => self
                .predicted_stage_compute(plan, &layout.replicas[0])
                .into_iter()
                .fold(0.0, f64::max),
        };
        let mut codecs = Vec::new();
        let mut per_node: BTreeMap<usize, Vec<PeerCodecs>> = BTreeMap::new();
        for nodes in &layout.replicas {
            for (s, &me) in nodes.iter().enumerate() {
                for p in plan.peers_of(s) {
                    let bytes = stage_traffic(&self.graph, plan, s, p);
                    if bytes == 0 {
                        continue;
                    }
                    let forward = p > s;
                    let wanted = if forward { cfg.forward } else { cfg.backward };
                    let (from, to) = (
                        self.members[me].id.clone(),
                        self.members[nodes[p]].id.clone(),
                    );
                    let codec = match wanted {
                        Codec::AdaTopK => {
                            let bw = self
                                .measured_between(me, nodes[p])
                                .or_else(|| self.link_between(me, nodes[p]))
                                .map_or(1000.0, |l| l.0)
                                * 1e6
                                / 8.0;
                            let label = format!(
                                "{to} {}",
                                if forward { "activations" } else { "gradients" }
                            );
                            // The change itself is logged below, with every other link's,
                            // by comparing the new codecs with those in force.
                            self.adaptive_codecs
                                .update(&from, &label, bytes / 4, bw, target);
                            self.adaptive_codecs.get(&from, &label)
                        }
                        c => c,
                    };
                    let entry = per_node.entry(me).or_default();
                    match entry.iter_mut().find(|e| e.stage == p) {
                        Some(e) if forward => e.forward = codec,
                        Some(e) => e.backward = codec,
                        None => entry.push(PeerCodecs {
                            stage: p,
                            forward: if forward { codec } else { Codec::None },
                            backward: if forward { Codec::None } else { codec },
                        }),
                    }
                    codecs.push(LinkCodec {
                        from,
                        to,
                        direction: if forward { "activations" } else { "gradients" }.into(),
                        codec,
                        dense_bytes: bytes,
                    });
                }
            }
        }
        if codecs == self.codecs {
            return Ok(());
        }
        for (&m, peers) in &per_node {
            let settings = NodeCompression {
                peers: peers.clone(),
                error_feedback: cfg.error_feedback,
                warmup_steps: cfg.warmup_steps,
                values: cfg.values,
                selection: cfg.selection,
            };
            let json = serde_json::to_string(&settings)
                .map_err(|e| RuntimeError::Protocol(e.to_string()))?;
            self.send(
                m,
                broker_message::Body::Compression(SetCompression {
                    settings_json: json,
                }),
            )
            .await?;
        }
        for c in codecs.iter().filter(|c| !self.codecs.contains(c)) {
            tracing::info!("{} -> {} {}: {}", c.from, c.to, c.direction, c.codec);
        }
        self.codecs = codecs;
        let shown = self.codecs.clone();
        (self.on_event)(BrokerEvent::Compression(&shown));
        Ok(())
    }
}

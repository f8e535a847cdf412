//! A hostile broker. The node distrusts the broker: this test serves the control protocol over
//! mutual TLS with a genuine broker certificate of the job's CA, and sends a real node
//! assignments no honest broker would: a stage far larger than the node's memory and plans that
//! name stages that do not exist. The node must refuse each one with a failure that names what
//! was wrong (no allocation, no panic, no out-of-range index), keep its control stream, and stop
//! cleanly when told to.

use fusion_backend::ReferenceBackend;
use fusion_models::{Gpt2Config, ModelKind, ModelSpec};
use fusion_proto::{
    broker_message,
    broker_server::{Broker, BrokerServer},
    node_message, Assignment, BrokerMessage, NodeMessage, Stop,
};
use fusion_runtime::assignment::first_of_two;
use fusion_runtime::{run_node, NodeConfig};
use fusion_transport::Certificates;
use std::sync::Mutex;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::transport::{Certificate, Identity, Server, ServerTlsConfig};
use tonic::{Request, Response, Status, Streaming};

const TOKEN: &str = "secret-token";
const LIMIT: Duration = Duration::from_secs(120);
/// The memory the node says it has for an assignment.
const NODE_MEMORY: u64 = 8 << 30;

/// Answers the first node to attach with `script`, and hands everything the node sends to `seen`.
struct HostileBroker {
    script: Mutex<Option<Vec<BrokerMessage>>>,
    seen: mpsc::Sender<NodeMessage>,
}

#[tonic::async_trait]
impl Broker for HostileBroker {
    type AttachStream = ReceiverStream<Result<BrokerMessage, Status>>;

    async fn attach(
        &self,
        request: Request<Streaming<NodeMessage>>,
    ) -> Result<Response<Self::AttachStream>, Status> {
        let script = self
            .script
            .lock()
            .map_err(|_| Status::internal("poisoned"))?
            .take()
            .ok_or_else(|| Status::already_exists("this broker serves one node"))?;
        let mut from_node = request.into_inner();
        let seen = self.seen.clone();
        tokio::spawn(async move {
            while let Ok(Some(m)) = from_node.message().await {
                if seen.send(m).await.is_err() {
                    return;
                }
            }
        });
        let (tx, rx) = mpsc::channel(script.len().max(1));
        for m in script {
            tx.send(Ok(m))
                .await
                .map_err(|_| Status::internal("closed"))?;
        }
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// The script's last message: the hostile broker stops the node.
fn done() -> BrokerMessage {
    BrokerMessage {
        body: Some(broker_message::Body::Stop(Stop {
            reason: "the hostile broker is done".into(),
            evicted: false,
        })),
    }
}

/// The configuration of the node under test, of the broker at `url`.
fn node0(ca: &Certificates, url: &str) -> NodeConfig {
    NodeConfig::local(
        "node0",
        url,
        TOKEN,
        ca.issue("node0", &[]).expect("node certificate"),
    )
}

fn assign(a: Assignment) -> BrokerMessage {
    BrokerMessage {
        body: Some(broker_message::Body::Assignment(a)),
    }
}

/// Stage 0 of two of a one-layer GPT-2 with 65,536-wide embeddings: a small JSON description of
/// some 3.4 billion parameter values (about 54 GB with gradients and moments).
fn oversized(generation: u64) -> Assignment {
    let model = ModelSpec {
        name: "gpt2-huge-embedding".into(),
        kind: ModelKind::Gpt2(Gpt2Config {
            vocab: 50257,
            n_ctx: 8,
            n_embd: 65536,
            n_layer: 1,
            n_head: 1,
        }),
        fixed_vocab: false,
    };
    let graph = model.graph(1, 8).expect("graph");
    Assignment {
        generation,
        ..first_of_two(&graph).expect("assignment")
    }
}

/// An honest gpt2-tiny stage 0 of two whose plan JSON `tamper` rewrites.
fn bad_plan(generation: u64, tamper: impl Fn(&mut serde_json::Value)) -> Assignment {
    let graph = ModelSpec::preset("gpt2-tiny")
        .and_then(|m| m.graph(1, 8))
        .expect("graph");
    let a = first_of_two(&graph).expect("assignment");
    let mut plan: serde_json::Value = serde_json::from_str(&a.plan_json).expect("plan");
    tamper(&mut plan);
    Assignment {
        generation,
        plan_json: plan.to_string(),
        ..a
    }
}

/// Serves `script` to the one node that attaches; returns the broker's address and what the
/// node sends.
async fn serve(
    ca: &Certificates,
    script: Vec<BrokerMessage>,
) -> (String, mpsc::Receiver<NodeMessage>) {
    let id = ca.issue("broker", &[]).expect("broker certificate");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("address");
    let (seen, rx) = mpsc::channel(64);
    let broker = HostileBroker {
        script: Mutex::new(Some(script)),
        seen,
    };
    let tls = ServerTlsConfig::new()
        .identity(Identity::from_pem(&id.cert_pem, &id.key_pem))
        .client_ca_root(Certificate::from_pem(&id.ca_pem));
    let server = Server::builder()
        .tls_config(tls)
        .expect("tls")
        .add_service(BrokerServer::new(broker));
    tokio::spawn(server.serve_with_incoming(TcpListenerStream::new(listener)));
    (format!("https://{addr}"), rx)
}

/// The failures the node answered, in order, once it has stopped when told (after its `count`
/// answers): a Ready is a panic (the node accepted what it must refuse), and a node that ends
/// otherwise, or early, says how.
async fn failures(
    seen: &mut mpsc::Receiver<NodeMessage>,
    node: JoinHandle<fusion_runtime::Result<()>>,
    count: usize,
) -> Vec<(u64, String)> {
    let end = tokio::time::timeout(LIMIT, node)
        .await
        .expect("the node stops when told")
        .expect("no panic");
    assert!(end.is_ok(), "the node ended with {end:?}");
    // The node closes its stream only after everything it sent was taken.
    let mut failures = Vec::new();
    while let Ok(Some(m)) = tokio::time::timeout(LIMIT, seen.recv()).await {
        match m.body {
            Some(node_message::Body::Failure(f)) => failures.push((f.generation, f.message)),
            Some(node_message::Body::Ready(r)) => panic!("accepted generation {}", r.generation),
            _ => {}
        }
        if failures.len() == count {
            return failures;
        }
    }
    panic!("the node stopped after answering only {failures:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_refuses_an_oversized_stage_and_bad_plans_and_stays_in_the_job() {
    let ca = Certificates::new_ca("hostile-broker-test").expect("ca");
    let script = vec![
        assign(oversized(1)),
        // Stage 5 of a two-stage plan.
        assign(Assignment {
            stage: 5,
            ..bad_plan(2, |_| {})
        }),
        // A plan whose stage 0 sends its output to a stage 9 that does not exist.
        assign(bad_plan(3, |p| {
            p["stages"][0]["outputs"][0]["consumers"] = serde_json::json!([9]);
        })),
        // A plan with one parameter list for two stages.
        assign(bad_plan(4, |p| {
            if let Some(lists) = p["stage_params"].as_array_mut() {
                lists.truncate(1);
            }
        })),
        done(),
    ];
    let (url, mut seen) = serve(&ca, script).await;
    let mut cfg = node0(&ca, &url);
    cfg.memory_limit = NODE_MEMORY;
    cfg.reconnect_for = Duration::ZERO;
    let node = tokio::spawn(run_node(ReferenceBackend, cfg));
    let failures = failures(&mut seen, node, 4).await;
    assert_eq!(failures.len(), 4, "{failures:?}");
    let expect = [
        (1, "the stage needs"),
        (2, "the plan has 2 stages; this node was given stage 5"),
        (3, "the plan names stage 9 of 2"),
        (4, "the plan has 2 stages, 2 nodes and 1 parameter lists"),
    ];
    for ((generation, message), (want_gen, want)) in failures.iter().zip(expect) {
        assert_eq!(*generation, want_gen, "{message}");
        assert!(message.contains(want), "generation {generation}: {message}");
    }
    // The oversized stage was measured, not allocated.
    assert!(
        failures[0]
            .1
            .contains(&format!("this node has {NODE_MEMORY}")),
        "{}",
        failures[0].1
    );
}

/// An assignment keeping a state the node does not hold (it has no stage yet) is refused by
/// name once its messages are read, and the node stays in the job and stops when told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_refuses_to_keep_a_state_it_does_not_hold() {
    let ca = Certificates::new_ca("hostile-broker-test").expect("ca");
    let keep = Assignment {
        keep_state: true,
        islands: true,
        ..bad_plan(1, |_| {})
    };
    let script = vec![
        assign(keep),
        BrokerMessage {
            body: Some(broker_message::Body::ParamsDone(fusion_proto::ParamsDone {
                step: 0,
            })),
        },
        done(),
    ];
    let (url, mut seen) = serve(&ca, script).await;
    let mut cfg = node0(&ca, &url);
    cfg.reconnect_for = Duration::ZERO;
    let node = tokio::spawn(run_node(ReferenceBackend, cfg));
    let answers = failures(&mut seen, node, 1).await;
    let (generation, message) = &answers[0];
    assert_eq!(*generation, 1, "{message}");
    assert!(
        message.contains("an assignment keeping the state before any assignment"),
        "{message}"
    );
}

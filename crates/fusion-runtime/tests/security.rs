//! The hostile-peer suite. A job with intruders: nodes without the token, with a certificate from
//! another CA, revoked or expired, speaking another protocol version, and a CA-signed stranger or
//! impostor pushing tensors into a node's data plane; each is refused with a clear reason and the
//! job trains exactly as without them. Admitted nodes that lie (in their step results, on the
//! data plane, in the state they send for a snapshot) are evicted and the job finishes where a
//! single process does. Idle-connection floods are shed on both listeners.

use fusion_backend::ReferenceBackend;
use fusion_data::{Dataset, MarkovCorpus};
use fusion_models::ModelSpec;
use fusion_proto::{
    broker_client::BrokerClient, frame::Body, node_message, Direction, Frame, Hello, Join,
    NodeMessage, TensorHeader, PROTOCOL_VERSION,
};
use fusion_runtime::{
    run_broker, run_node, BadResult, BrokerConfig, ClusterOutcome, JobSpec, NodeConfig, Schedule,
    TOKEN_METADATA,
};
use fusion_train::{ScheduleConfig, TrainConfig, Trainer};
use fusion_transport::time::{Duration as Days, OffsetDateTime};
use fusion_transport::{
    client_config, open_session, send_tensor, Certificates, NodeIdentity, RevocationCheck,
    DEFAULT_MAX_FRAME,
};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls::pki_types::ServerName;
use tokio_rustls::TlsConnector;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

const TOKEN: &str = "secret-token";
const LIMIT: Duration = Duration::from_secs(300);

fn markov() -> Arc<dyn Dataset> {
    Arc::new(MarkovCorpus::new(32, 4, 0.5, 9).expect("corpus"))
}

fn config() -> TrainConfig {
    TrainConfig {
        steps: 12,
        batch_size: 2,
        seq_len: 8,
        micro_batches: 2,
        schedule: ScheduleConfig {
            lr: 3e-3,
            min_lr: 3e-4,
            warmup_steps: 2,
        },
        eval_batches: Some(1),
        ..TrainConfig::default()
    }
}

/// gpt2-tiny trained in one process with the suite's configuration: its report and parameters.
fn single_process() -> (fusion_train::Report, Vec<Vec<f32>>) {
    let model = ModelSpec::preset("gpt2-tiny").expect("preset");
    let mut single = Trainer::new(ReferenceBackend, model, markov(), config()).expect("trainer");
    let report = single.run(|_, _| {}).expect("single");
    (report, single.params().to_vec())
}

/// Waits for the broker's outcome and for every node to end cleanly.
async fn finish(
    broker: tokio::task::JoinHandle<fusion_runtime::Result<ClusterOutcome>>,
    nodes: Vec<tokio::task::JoinHandle<fusion_runtime::Result<()>>>,
) -> ClusterOutcome {
    let outcome = tokio::time::timeout(LIMIT, broker)
        .await
        .expect("in time")
        .expect("broker task")
        .expect("the job succeeds");
    for n in nodes {
        tokio::time::timeout(LIMIT, n)
            .await
            .expect("stops")
            .expect("task")
            .expect("clean end");
    }
    outcome
}

/// Attaches with `join` and no token in the call's metadata (as a client that only knows an
/// older protocol would).
async fn attach_raw(url: &str, id: &NodeIdentity, join: Join) -> Result<(), tonic::Status> {
    attach(url, id, join, false).await
}

/// Attaches with `join`, the token in the call's metadata as nodes send it.
async fn attach_with_token(url: &str, id: &NodeIdentity, join: Join) -> Result<(), tonic::Status> {
    attach(url, id, join, true).await
}

async fn attach(
    url: &str,
    id: &NodeIdentity,
    join: Join,
    metadata: bool,
) -> Result<(), tonic::Status> {
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&id.ca_pem))
        .identity(Identity::from_pem(&id.cert_pem, &id.key_pem))
        .domain_name("broker");
    let channel = Channel::from_shared(url.to_string())
        .expect("url")
        .tls_config(tls)
        .expect("tls")
        .connect()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let msg = NodeMessage {
        body: Some(node_message::Body::Join(join)),
    };
    let mut request = tonic::Request::new(tokio_stream::iter(vec![msg]));
    if metadata {
        request
            .metadata_mut()
            .insert(TOKEN_METADATA, TOKEN.parse().expect("token"));
    }
    let mut stream = BrokerClient::new(channel)
        .max_encoding_message_size(64 << 20)
        .attach(request)
        .await?
        .into_inner();
    stream.message().await.map(|_| ())
}

/// Connects to a node's data plane as `claimed` with a certificate for `cert_name` and tries to
/// push a tensor; returns the reason the node gave for refusing.
async fn intrude(addr: SocketAddr, ca: &Certificates, cert_name: &str, claimed: &str) -> String {
    let id = ca.issue(cert_name, &[]).expect("cert");
    // The node may still be starting: retry for a bounded time.
    let mut tcp = None;
    for _ in 0..100 {
        if let Ok(t) = TcpStream::connect(addr).await {
            tcp = Some(t);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let tcp = tcp.expect("the node's data plane listens");
    let tls = TlsConnector::from(client_config(&id).expect("config"))
        .connect(ServerName::try_from("node1").expect("name"), tcp)
        .await
        .expect("tls");
    let hello = Hello {
        protocol_version: PROTOCOL_VERSION,
        node_id: claimed.into(),
        token: TOKEN.into(),
        generation: 1,
        ..Default::default()
    };
    let (mut r, mut w, _) = open_session(tls, hello, DEFAULT_MAX_FRAME)
        .await
        .expect("session");
    let header = TensorHeader {
        edge: 0,
        direction: Direction::Activation as i32,
        dtype: fusion_proto::DType::F32 as i32,
        shape: vec![1],
        ..Default::default()
    };
    let _ = send_tensor(&mut w, header, &[0, 0, 0x80, 0x7f]).await;
    match tokio::time::timeout(Duration::from_secs(20), r.read()).await {
        Ok(Ok(Frame {
            body: Some(Body::Goodbye(g)),
        })) => g.reason,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn intruders_are_refused_and_the_job_is_unharmed() {
    let ca = Certificates::new_ca("job-ca").expect("ca");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("https://{}", listener.local_addr().expect("addr"));
    // No probe round before the assignment (job() turns it off): the intruders below knock on
    // node1's data plane right away, and its sessions wait a bounded time for an assignment to
    // refuse them by.
    // The CA revoked one certificate; the broker reads its list.
    let now = OffsetDateTime::now_utc();
    let (revoked, issued) = ca
        .issue_for("revoked", &[], now, now + Days::days(30))
        .expect("cert");
    let crl = ca.revocation_list(&[issued.serial], 1).expect("crl");
    let mut bcfg = BrokerConfig::new(TOKEN, ca.issue("broker", &[]).expect("cert"));
    bcfg.revocation = Some(Arc::new(
        RevocationCheck::new(&ca.ca_pem, &crl).expect("check"),
    ));
    let broker = tokio::spawn(run_broker(job(2), bcfg, listener, |_| {}));

    // Before the job starts: a wrong token, a foreign CA, another protocol version.
    let mut cfg = NodeConfig::local(
        "thief",
        &url,
        "guess",
        ca.issue("thief", &[]).expect("cert"),
    );
    cfg.heartbeat = Duration::from_millis(200);
    let err = run_node(ReferenceBackend, cfg)
        .await
        .expect_err("wrong token refused");
    assert!(err.to_string().contains("invalid join token"), "{err}");

    let other = Certificates::new_ca("other-ca").expect("ca");
    let foreign = NodeConfig::local(
        "foreigner",
        &url,
        TOKEN,
        other.issue("foreigner", &[]).expect("cert"),
    );
    let err = run_node(ReferenceBackend, foreign)
        .await
        .expect_err("foreign certificate refused");
    eprintln!("foreign certificate: {err}");
    assert!(
        err.to_string().contains("connecting to the broker"),
        "{err}"
    );

    // A revoked certificate, an expired one.
    let err = run_node(
        ReferenceBackend,
        NodeConfig::local("revoked", &url, TOKEN, revoked),
    )
    .await
    .expect_err("revoked certificate refused");
    assert!(
        err.to_string()
            .contains("the certificate of 'revoked' is refused")
            && err.to_string().contains("Revoked"),
        "{err}"
    );
    let (expired, _) = ca
        .issue_for("expired", &[], now - Days::days(40), now - Days::days(10))
        .expect("cert");
    let err = run_node(
        ReferenceBackend,
        NodeConfig::local("expired", &url, TOKEN, expired),
    )
    .await
    .expect_err("expired certificate refused");
    assert!(
        err.to_string().contains("connecting to the broker"),
        "{err}"
    );

    // A CA-signed certificate for one name, used to join under another.
    let borrowed = NodeConfig::local(
        "node0",
        &url,
        TOKEN,
        ca.issue("mallory", &[]).expect("cert"),
    );
    let err = run_node(ReferenceBackend, borrowed)
        .await
        .expect_err("name mismatch refused");
    assert!(err.to_string().contains("not issued for 'node0'"), "{err}");

    let old = Join {
        protocol_version: 99,
        node_id: "old".into(),
        token: TOKEN.into(),
        ..Default::default()
    };
    let status = attach_with_token(&url, &ca.issue("old", &[]).expect("cert"), old)
        .await
        .expect_err("refused");
    assert!(
        status
            .message()
            .contains("protocol version 99 is not supported"),
        "{}",
        status.message()
    );

    // The real nodes; node1's data plane listens where the intruders will knock.
    let probe = std::net::TcpListener::bind("127.0.0.1:0").expect("probe");
    let node1_addr = probe.local_addr().expect("addr");
    drop(probe);
    let mut nodes = Vec::new();
    for name in ["node0", "node1"] {
        let mut cfg = NodeConfig::local(name, &url, TOKEN, ca.issue(name, &[]).expect("cert"));
        if name == "node1" {
            cfg.data_listen = node1_addr;
        }
        nodes.push(tokio::spawn(run_node(ReferenceBackend, cfg)));
    }
    // A stranger with a valid certificate, and an impostor using node0's name.
    let stranger = intrude(node1_addr, &ca, "stranger", "stranger").await;
    assert!(
        stranger.contains("'stranger' does not send to this node"),
        "{stranger}"
    );
    let impostor = intrude(node1_addr, &ca, "stranger", "node0").await;
    assert!(
        impostor.contains("not issued for 'node0'") || impostor.contains("already connected"),
        "{impostor}"
    );

    let outcome = finish(broker, nodes).await;
    assert!(
        outcome.report.failures.is_empty(),
        "{:?}",
        outcome.report.failures
    );
    let (report, params) = single_process();
    assert_eq!(report.steps.len(), outcome.report.report.steps.len());
    for (a, b) in report.steps.iter().zip(&outcome.report.report.steps) {
        assert_eq!(a.loss, b.loss, "step {}", a.step);
    }
    assert_eq!(params, outcome.params().expect("final state"));
}

fn job(nodes: usize) -> JobSpec {
    JobSpec {
        precision: Default::default(),
        model: ModelSpec::preset("gpt2-tiny").expect("preset"),
        data: markov(),
        train: config(),
        nodes,
        replicas: 1,
        schedule: Schedule::OneFOneB,
        cuts: None,
        scheduler: fusion_runtime::Scheduler::Even,
        testbed: None,
        pace_links: true,
        probe: fusion_runtime::LinkProbe {
            enabled: false,
            ..Default::default()
        },
        compression: Default::default(),
    }
}

/// Runs gpt2-tiny on three nodes of which `node1` lies in its result of step 4 as `bad` says;
/// returns the broker's outcome and how node1 ended.
async fn with_a_liar(bad: BadResult) -> (ClusterOutcome, fusion_runtime::Result<()>) {
    let ca = Certificates::new_ca("job-ca").expect("ca");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("https://{}", listener.local_addr().expect("addr"));
    let mut bcfg = BrokerConfig::new(TOKEN, ca.issue("broker", &[]).expect("cert"));
    bcfg.replace_grace = Duration::from_secs(1);
    bcfg.snapshots.every_steps = 2;
    let broker = tokio::spawn(run_broker(job(3), bcfg, listener, |_| {}));
    let mut nodes = Vec::new();
    for name in ["node0", "node1", "node2"] {
        let mut cfg = NodeConfig::local(name, &url, TOKEN, ca.issue(name, &[]).expect("cert"));
        if name == "node1" {
            cfg.test_hooks.bad_result_at_step = Some((4, bad));
        }
        nodes.push(tokio::spawn(run_node(ReferenceBackend, cfg)));
    }
    let outcome = tokio::time::timeout(LIMIT, broker)
        .await
        .expect("in time")
        .expect("broker task")
        .expect("the job finishes without the liar");
    let mut ends = Vec::new();
    for n in nodes {
        ends.push(
            tokio::time::timeout(LIMIT, n)
                .await
                .expect("stops")
                .expect("task"),
        );
    }
    for (i, end) in ends.iter().enumerate() {
        if i != 1 {
            assert!(end.is_ok(), "node{i}: {end:?}");
        }
    }
    (outcome, ends.remove(1))
}

/// The run went on from its snapshot without node1 and ended where a single process does.
fn assert_evicted_and_finished(
    outcome: &ClusterOutcome,
    node1: &fusion_runtime::Result<()>,
    why: &str,
) {
    let r = &outcome.report;
    assert_eq!(r.recoveries.len(), 1, "{:?}", r.recoveries);
    let rec = &r.recoveries[0];
    assert!(rec.evicted && rec.node == "node1", "{rec:?}");
    assert!(rec.reason.contains(why), "{}", rec.reason);
    assert_eq!((rec.nodes_before, rec.nodes_after), (3, 2));
    let err = node1.as_ref().expect_err("the liar is stopped");
    assert!(err.to_string().contains("evicted"), "{err}");
    let (report, _) = single_process();
    assert_eq!(report.steps.len(), r.report.steps.len());
    for (a, b) in report.steps.iter().zip(&r.report.steps) {
        assert!(
            (a.loss - b.loss).abs() <= 1e-5 * a.loss.abs(),
            "step {}: {} vs {}",
            a.step,
            a.loss,
            b.loss
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_sending_the_wrong_number_of_losses_is_evicted_and_the_job_finishes() {
    let (outcome, node1) = with_a_liar(BadResult::ExtraLoss).await;
    assert_evicted_and_finished(
        &outcome,
        &node1,
        "losses for step 4 where its stage computes",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_reporting_non_finite_values_is_evicted_and_the_job_finishes() {
    let (outcome, node1) = with_a_liar(BadResult::NonFinite).await;
    assert_evicted_and_finished(
        &outcome,
        &node1,
        "non-finite loss or gradient norm at step 4",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_sending_int8_that_overflows_to_infinity_is_evicted_and_the_job_finishes() {
    let (outcome, node1) = with_a_liar(BadResult::Int8Overflow).await;
    // Its neighbours refuse the messages as proof against it: it never reaches a loss.
    assert_evicted_and_finished(&outcome, &node1, "overflows when dequantised");
    assert!(outcome.report.recoveries[0]
        .reason
        .contains("blamed by node"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_flooding_tensors_of_future_steps_is_evicted_and_the_job_finishes() {
    let (outcome, node1) = with_a_liar(BadResult::FutureFlood).await;
    assert_evicted_and_finished(&outcome, &node1, "only this step and the next are accepted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_sending_another_stages_state_at_a_snapshot_is_evicted_and_the_job_finishes() {
    let (outcome, node1) = with_a_liar(BadResult::ForeignState).await;
    assert_evicted_and_finished(&outcome, &node1, "which its stage does not hold");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_claiming_a_device_far_faster_than_it_has_is_found_out_and_derated() {
    let ca = Certificates::new_ca("job-ca").expect("ca");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("https://{}", listener.local_addr().expect("addr"));
    let bcfg = BrokerConfig::new(TOKEN, ca.issue("broker", &[]).expect("cert"));
    let broker = tokio::spawn(run_broker(job(3), bcfg, listener, |_| {}));
    let mut nodes = Vec::new();
    for name in ["node0", "node1", "node2"] {
        let mut cfg = NodeConfig::local(name, &url, TOKEN, ca.issue(name, &[]).expect("cert"));
        if name == "node1" {
            cfg.test_hooks.claim_speedup = Some(200.0);
        }
        nodes.push(tokio::spawn(run_node(ReferenceBackend, cfg)));
    }
    let outcome = finish(broker, nodes).await;
    let claims = &outcome.report.overclaims;
    assert_eq!(claims.len(), 1, "{claims:?}");
    assert!(claims[0].starts_with("node1 computed"), "{claims:?}");
    // Found out, not evicted: the job trains on as a single process does.
    assert!(outcome.report.recoveries.is_empty());
    let (report, _) = single_process();
    assert_eq!(report.steps.len(), outcome.report.report.steps.len());
    for (a, b) in report.steps.iter().zip(&outcome.report.report.steps) {
        assert_eq!(a.loss, b.loss, "step {}", a.step);
    }
}

/// Opens `n` TCP connections to `addr` from 127.0.0.2 that never speak; returns how many the
/// server closed within `limit` (every one: at once past the cap, the rest at the deadline of
/// their TLS handshake).
async fn idle_flood(addr: SocketAddr, n: usize, limit: Duration) -> usize {
    use tokio::io::AsyncReadExt;
    let mut conns = Vec::new();
    for _ in 0..n {
        let sock = tokio::net::TcpSocket::new_v4().expect("socket");
        sock.bind("127.0.0.2:0".parse().expect("addr"))
            .expect("bind 127.0.0.2");
        conns.push(sock.connect(addr).await.expect("connect"));
    }
    let waits: Vec<_> = conns
        .into_iter()
        .map(|mut c| {
            tokio::spawn(async move {
                let mut b = [0u8; 1];
                let read = tokio::time::timeout(limit, c.read(&mut b)).await;
                matches!(read, Ok(Ok(0)) | Ok(Err(_)))
            })
        })
        .collect();
    let mut closed = 0;
    for w in waits {
        closed += usize::from(w.await.expect("task"));
    }
    closed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idle_connection_floods_on_both_listeners_are_shed_and_the_job_trains() {
    let ca = Certificates::new_ca("job-ca").expect("ca");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let broker_addr = listener.local_addr().expect("addr");
    let url = format!("https://{broker_addr}");
    let limits = fusion_transport::ConnectionLimits {
        total: 256,
        per_address: 16,
    };
    let mut bcfg = BrokerConfig::new(TOKEN, ca.issue("broker", &[]).expect("cert"));
    bcfg.connection_limits = limits;
    let broker = tokio::spawn(run_broker(job(2), bcfg, listener, |_| {}));
    let probe = std::net::TcpListener::bind("127.0.0.1:0").expect("probe");
    let node1_addr = probe.local_addr().expect("addr");
    drop(probe);
    // The floods start before the nodes join and last through the first steps.
    let flood_broker = tokio::spawn(idle_flood(broker_addr, 120, Duration::from_secs(60)));
    let mut nodes = Vec::new();
    for name in ["node0", "node1"] {
        let mut cfg = NodeConfig::local(name, &url, TOKEN, ca.issue(name, &[]).expect("cert"));
        cfg.connection_limits = limits;
        if name == "node1" {
            cfg.data_listen = node1_addr;
        }
        nodes.push(tokio::spawn(run_node(ReferenceBackend, cfg)));
    }
    let mut flood_node = None;
    for _ in 0..100 {
        if tokio::net::TcpStream::connect(node1_addr).await.is_ok() {
            flood_node = Some(tokio::spawn(idle_flood(
                node1_addr,
                120,
                Duration::from_secs(60),
            )));
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let flood_node = flood_node.expect("node1's data plane listens");
    assert_eq!(
        flood_broker.await.expect("flood"),
        120,
        "the broker closed every idle connection"
    );
    assert_eq!(
        flood_node.await.expect("flood"),
        120,
        "node1 closed every idle connection"
    );
    let outcome = finish(broker, nodes).await;
    assert!(
        outcome.report.recoveries.is_empty(),
        "{:?}",
        outcome.report.recoveries
    );
    let (report, _) = single_process();
    for (a, b) in report.steps.iter().zip(&outcome.report.report.steps) {
        assert_eq!(a.loss, b.loss, "step {}", a.step);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_join_without_the_token_is_refused_before_it_is_read() {
    let ca = Certificates::new_ca("job-ca").expect("ca");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("https://{}", listener.local_addr().expect("addr"));
    let broker = tokio::spawn(run_broker(
        job(2),
        BrokerConfig::new(TOKEN, ca.issue("broker", &[]).expect("cert")),
        listener,
        |_| {},
    ));
    // 32 MiB of capabilities text: under the broker's message limit, never decoded without
    // the token in the call's metadata.
    let join = Join {
        protocol_version: PROTOCOL_VERSION,
        node_id: "node0".into(),
        token: TOKEN.into(),
        capabilities: Some(fusion_proto::Capabilities {
            device: "x".repeat(32 << 20),
            ..Default::default()
        }),
        ..Default::default()
    };
    let status = attach_raw(&url, &ca.issue("node0", &[]).expect("cert"), join)
        .await
        .expect_err("refused");
    assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
    assert!(
        status.message().contains("invalid join token"),
        "{}",
        status.message()
    );
    // Ids that differ from a certificate's name only in case, or name every certificate, are
    // refused with the rule.
    for id in ["NODE0", "localhost", "node_0"] {
        let join = Join {
            protocol_version: PROTOCOL_VERSION,
            node_id: id.into(),
            token: TOKEN.into(),
            ..Default::default()
        };
        let status = attach_with_token(&url, &ca.issue("node0", &[]).expect("cert"), join)
            .await
            .expect_err("refused");
        assert!(
            status.message().contains("is not a lowercase name")
                || status.message().contains("is reserved"),
            "{id}: {}",
            status.message()
        );
    }
    broker.abort();
}

//! Leadership against a real etcd (Debian's `etcd-server`, started by each test on loopback):
//! one leader at a time, a standby elected when the leader's lease lapses or it resigns, a
//! leader that loses etcd steps down, and the run record round-trips. Under `CI=true` a missing
//! etcd fails the tests instead of skipping them.

use fusion_coord::{
    campaign, read_record, takeover, write_record, CoordError, Etcd, LocalEtcd, RunRecord, Takeover,
};
use std::time::{Duration, Instant};

/// etcd, or None where it is not installed and this is not CI.
async fn etcd() -> Option<LocalEtcd> {
    LocalEtcd::start_if_installed().await.expect("etcd starts")
}

const TTL: Duration = Duration::from_secs(2);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_is_elected_only_once_the_leaders_lease_lapses() {
    let Some(server) = etcd().await else { return };
    let etcd = Etcd::new(&server.endpoint).expect("client");
    let a = campaign(&etcd, "job/e1", "https://a:7070", TTL, |_| {})
        .await
        .expect("a leads");
    assert_eq!(
        etcd.leader("job/e1").await.expect("leader").as_deref(),
        Some("https://a:7070")
    );
    let b_etcd = etcd.clone();
    let standby =
        tokio::spawn(
            async move { campaign(&b_etcd, "job/e1", "https://b:7070", TTL, |_| {}).await },
        );
    // While a keeps its lease, b waits (several TTLs).
    tokio::time::sleep(3 * TTL).await;
    assert!(!standby.is_finished(), "b was elected while a led");
    assert!(!a.is_lost());
    // a dies without resigning: its lease is no longer renewed.
    let died = Instant::now();
    drop(a);
    let b = tokio::time::timeout(10 * TTL, standby)
        .await
        .expect("b is elected after a's lease lapses")
        .expect("join")
        .expect("b leads");
    assert!(
        died.elapsed() >= TTL / 2,
        "elected before a's lease could lapse"
    );
    assert_eq!(
        etcd.leader("job/e1").await.expect("leader").as_deref(),
        Some("https://b:7070")
    );
    b.resign().await;
    assert_eq!(etcd.leader("job/e1").await.expect("leader"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resigning_leader_hands_over_at_once() {
    let Some(server) = etcd().await else { return };
    let etcd = Etcd::new(&server.endpoint).expect("client");
    // A long TTL: only the resignation can elect the standby within the bound below.
    let long = Duration::from_secs(60);
    let a = campaign(&etcd, "job/e2", "a", long, |_| {})
        .await
        .expect("a");
    let b_etcd = etcd.clone();
    let standby = tokio::spawn(async move { campaign(&b_etcd, "job/e2", "b", long, |_| {}).await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!standby.is_finished());
    a.resign().await;
    let b = tokio::time::timeout(Duration::from_secs(20), standby)
        .await
        .expect("b elected after the resignation")
        .expect("join")
        .expect("b");
    assert_eq!(b.election(), "job/e2");
    b.resign().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_that_loses_etcd_steps_down_within_its_ttl() {
    let Some(mut server) = etcd().await else {
        return;
    };
    let etcd = Etcd::new(&server.endpoint).expect("client");
    let a = campaign(&etcd, "job/e3", "a", TTL, |_| {})
        .await
        .expect("a");
    tokio::time::sleep(TTL).await;
    assert!(!a.is_lost(), "renewals keep the lease");
    server.kill();
    let why = tokio::time::timeout(5 * TTL, a.lost())
        .await
        .expect("leadership lost once etcd is gone");
    // It gave up from its own clock (renewals unconfirmed for 3/4 of the TTL), not from an
    // answer of etcd's: the step-down comes before etcd could elect anyone else.
    assert!(why.contains("lease was not renewed"), "{why}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_run_record_round_trips_and_a_foreign_one_is_named() {
    let Some(server) = etcd().await else { return };
    let etcd = Etcd::new(&server.endpoint).expect("client");
    let started = etcd.revision().await.expect("revision");
    assert_eq!(read_record(&etcd, "job/e4").await.expect("read"), None);
    let leader = campaign(&etcd, "job/e4", "a", TTL, |_| {})
        .await
        .expect("leads");
    let mut r = RunRecord {
        run_id: "0123abcd".into(),
        finished: false,
        leader: "https://a:7070".into(),
    };
    write_record(&leader, &r).await.expect("write");
    let (got, rev) = read_record(&etcd, "job/e4")
        .await
        .expect("read")
        .expect("some");
    assert_eq!(got, r);
    assert_eq!(
        takeover(Some((&got, rev)), started),
        Takeover::Continue {
            run_id: "0123abcd".into()
        }
    );
    r.finished = true;
    write_record(&leader, &r).await.expect("write");
    let (got, rev) = read_record(&etcd, "job/e4")
        .await
        .expect("read")
        .expect("some");
    assert!(matches!(
        takeover(Some((&got, rev)), started),
        Takeover::FinishedElsewhere { .. }
    ));
    // A deposed leader (its lease gone, and with it its election key) writes nothing.
    etcd.revoke(leader.key().lease).await.expect("revoke");
    let e = write_record(&leader, &r).await.expect_err("deposed");
    assert!(
        matches!(&e, CoordError::NotLeader(name) if name == "job/e4"),
        "{e}"
    );
    etcd.put("job/e5.run", "{\"not\": \"ours\"}")
        .await
        .expect("put");
    let e = read_record(&etcd, "job/e5").await.expect_err("refused");
    assert!(
        matches!(&e, CoordError::BadRecord { key, .. } if key == "job/e5.run"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_etcd_is_named() {
    // A port nothing listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port();
    let etcd = Etcd::new(&format!("http://127.0.0.1:{port}")).expect("client");
    let e = campaign(&etcd, "job/e6", "a", TTL, |_| {})
        .await
        .err()
        .expect("no etcd");
    assert!(matches!(e, CoordError::Unreachable { .. }), "{e}");
}

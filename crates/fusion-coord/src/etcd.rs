//! A client for the part of etcd's v3 API the brokers use — leases, the election service and
//! plain keys — spoken through the JSON gateway every etcd 3.4+ server serves on its client port
//! (`POST /v3/...`, keys and values in base64, 64-bit integers as decimal strings).

use crate::error::{CoordError, Result};
use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use serde::Deserialize;
use serde_json::{json, Value};
use std::time::Duration;

/// How long an ordinary request may take (a campaign waits as long as it must).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// An etcd endpoint.
#[derive(Clone, Debug)]
pub struct Etcd {
    http: reqwest::Client,
    base: String,
}

/// A lease: keys attached to it vanish when it is not kept alive for its TTL.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lease {
    pub id: i64,
    pub ttl_s: i64,
}

/// The key an election's leader holds (what `resign` gives up).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaderKey {
    pub name: Vec<u8>,
    pub key: Vec<u8>,
    pub rev: i64,
    pub lease: i64,
}

/// A key's value and the revision that last changed it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub value: Vec<u8>,
    pub mod_revision: i64,
}

/// A 64-bit integer the gateway writes as a string (or, leniently, a number); absent is 0.
fn int(v: &Value, field: &str) -> Result<i64> {
    match v.get(field) {
        None | Some(Value::Null) => Ok(0),
        Some(Value::String(s)) => s.parse().map_err(|_| bad(field, s)),
        Some(Value::Number(n)) => n.as_i64().ok_or_else(|| bad(field, &n.to_string())),
        Some(other) => Err(bad(field, &other.to_string())),
    }
}

fn bytes(v: &Value, field: &str) -> Result<Vec<u8>> {
    match v.get(field) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => B64.decode(s).map_err(|_| bad(field, s)),
        Some(other) => Err(bad(field, &other.to_string())),
    }
}

fn bad(field: &str, value: &str) -> CoordError {
    let mut shown: String = value.chars().take(40).collect();
    if shown.len() < value.len() {
        shown.push('…');
    }
    CoordError::Malformed(format!("field '{field}' holds '{shown}'"))
}

/// The gateway's error body: `{"error": ..., "code": ..., "message": ...}`.
#[derive(Deserialize)]
struct GatewayError {
    #[serde(default)]
    message: String,
    #[serde(default)]
    code: i64,
}

impl Etcd {
    /// A client of the etcd server at `endpoint` (`http://host:port`). Nothing is sent yet.
    pub fn new(endpoint: &str) -> Result<Etcd> {
        let base = endpoint.trim_end_matches('/');
        let Some(rest) = base.strip_prefix("http://") else {
            return Err(CoordError::Endpoint {
                endpoint: endpoint.into(),
                why: "give it as http://HOST:PORT (TLS to etcd is not supported; run etcd on \
                      the brokers' private network or loopback)"
                    .into(),
            });
        };
        if rest.is_empty() || rest.contains('/') {
            return Err(CoordError::Endpoint {
                endpoint: endpoint.into(),
                why: "expected http://HOST:PORT with no path".into(),
            });
        }
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(3))
            .build()
            .map_err(|e| CoordError::Endpoint {
                endpoint: endpoint.into(),
                why: e.to_string(),
            })?;
        Ok(Etcd {
            http,
            base: base.into(),
        })
    }

    pub fn endpoint(&self) -> &str {
        &self.base
    }

    /// POSTs `body` to `path`, within `timeout` when one is given; the reply's JSON.
    async fn call(&self, path: &str, body: Value, timeout: Option<Duration>) -> Result<Value> {
        let url = format!("{}{path}", self.base);
        let mut req = self.http.post(&url).json(&body);
        if let Some(t) = timeout {
            req = req.timeout(t);
        }
        let unreachable = |e: reqwest::Error| CoordError::Unreachable {
            endpoint: self.base.clone(),
            why: e.to_string(),
        };
        let reply = req.send().await.map_err(unreachable)?;
        let status = reply.status();
        let text = reply.text().await.map_err(unreachable)?;
        if !status.is_success() {
            let e: GatewayError = serde_json::from_str(&text).unwrap_or(GatewayError {
                message: text.chars().take(200).collect(),
                code: 0,
            });
            return Err(CoordError::Refused {
                call: path.into(),
                status: status.as_u16(),
                code: e.code,
                message: e.message,
            });
        }
        parse(&text)
    }

    /// The store's current revision (every change raises it).
    pub async fn revision(&self) -> Result<i64> {
        let v = self
            .call(
                "/v3/kv/range",
                json!({"key": B64.encode("\0")}),
                Some(REQUEST_TIMEOUT),
            )
            .await?;
        header_revision(&v)
    }

    /// A new lease of `ttl_s` seconds.
    pub async fn grant(&self, ttl_s: i64) -> Result<Lease> {
        let v = self
            .call(
                "/v3/lease/grant",
                json!({"TTL": ttl_s}),
                Some(REQUEST_TIMEOUT),
            )
            .await?;
        let lease = Lease {
            id: int(&v, "ID")?,
            ttl_s: int(&v, "TTL")?,
        };
        if lease.id == 0 || lease.ttl_s <= 0 {
            return Err(CoordError::Malformed(format!("lease grant answered {v}")));
        }
        Ok(lease)
    }

    /// Renews `lease`: the seconds it now has, or `None` when it has already expired.
    pub async fn keep_alive(&self, lease: i64, timeout: Duration) -> Result<Option<i64>> {
        let v = self
            .call(
                "/v3/lease/keepalive",
                json!({"ID": lease.to_string()}),
                Some(timeout),
            )
            .await?;
        // A streamed reply may carry an error in a 200 answer ("no leader", "leader changed"):
        // that is etcd's trouble, not the lease's expiry.
        if let Some(e) = v.get("error") {
            return Err(CoordError::Refused {
                call: "/v3/lease/keepalive".into(),
                status: 200,
                code: int(e, "code").unwrap_or(0),
                message: e
                    .get("message")
                    .and_then(Value::as_str)
                    .unwrap_or("an error")
                    .chars()
                    .take(200)
                    .collect(),
            });
        }
        let Some(result) = v.get("result") else {
            return Err(CoordError::Malformed(format!("keepalive answered {v}")));
        };
        let ttl = int(result, "TTL")?;
        Ok((ttl > 0).then_some(ttl))
    }

    /// Ends `lease` now, deleting the keys attached to it.
    pub async fn revoke(&self, lease: i64) -> Result<()> {
        self.call(
            "/v3/lease/revoke",
            json!({"ID": lease.to_string()}),
            Some(REQUEST_TIMEOUT),
        )
        .await
        .map(drop)
    }

    /// Waits, as long as it takes, until this candidate (`value`, attached to `lease`) leads
    /// election `name`.
    pub async fn campaign(&self, name: &str, lease: i64, value: &str) -> Result<LeaderKey> {
        let body = json!({
            "name": B64.encode(name),
            "lease": lease.to_string(),
            "value": B64.encode(value),
        });
        let v = self.call("/v3/election/campaign", body, None).await?;
        let leader = v
            .get("leader")
            .ok_or_else(|| CoordError::Malformed(format!("campaign answered {v}")))?;
        Ok(LeaderKey {
            name: bytes(leader, "name")?,
            key: bytes(leader, "key")?,
            rev: int(leader, "rev")?,
            lease: int(leader, "lease")?,
        })
    }

    /// The value the current leader of election `name` proclaimed, if it has one.
    pub async fn leader(&self, name: &str) -> Result<Option<String>> {
        let v = self
            .call(
                "/v3/election/leader",
                json!({"name": B64.encode(name)}),
                Some(REQUEST_TIMEOUT),
            )
            .await;
        let v = match v {
            Ok(v) => v,
            Err(CoordError::Refused { message, .. }) if message.contains("election: no leader") => {
                return Ok(None)
            }
            Err(e) => return Err(e),
        };
        let kv = v.get("kv").unwrap_or(&Value::Null);
        Ok(Some(
            String::from_utf8_lossy(&bytes(kv, "value")?).into_owned(),
        ))
    }

    /// Gives up leadership (the next candidate is elected at once).
    pub async fn resign(&self, leader: &LeaderKey) -> Result<()> {
        let body = json!({"leader": {
            "name": B64.encode(&leader.name),
            "key": B64.encode(&leader.key),
            "rev": leader.rev.to_string(),
            "lease": leader.lease.to_string(),
        }});
        self.call("/v3/election/resign", body, Some(REQUEST_TIMEOUT))
            .await
            .map(drop)
    }

    /// Writes `key` (no lease: it stays); the revision of the write.
    pub async fn put(&self, key: &str, value: &str) -> Result<i64> {
        let body = json!({"key": B64.encode(key), "value": B64.encode(value)});
        let v = self.call("/v3/kv/put", body, Some(REQUEST_TIMEOUT)).await?;
        header_revision(&v)
    }

    /// Writes `key` only while `guard` still exists with creation revision `created` (a
    /// leader's election key: only the current leader's write lands); whether it was written.
    pub async fn put_if_exists(
        &self,
        guard: &[u8],
        created: i64,
        key: &str,
        value: &str,
    ) -> Result<bool> {
        let body = json!({
            "compare": [{
                "target": "CREATE",
                "key": B64.encode(guard),
                "create_revision": created.to_string(),
                "result": "EQUAL",
            }],
            "success": [{"request_put": {"key": B64.encode(key), "value": B64.encode(value)}}],
        });
        let v = self.call("/v3/kv/txn", body, Some(REQUEST_TIMEOUT)).await?;
        Ok(v.get("succeeded").and_then(Value::as_bool).unwrap_or(false))
    }

    /// `key`'s value and last revision, if it exists.
    pub async fn get(&self, key: &str) -> Result<Option<Entry>> {
        let v = self
            .call(
                "/v3/kv/range",
                json!({"key": B64.encode(key)}),
                Some(REQUEST_TIMEOUT),
            )
            .await?;
        let Some(kv) = v
            .get("kvs")
            .and_then(Value::as_array)
            .and_then(|a| a.first())
        else {
            return Ok(None);
        };
        Ok(Some(Entry {
            value: bytes(kv, "value")?,
            mod_revision: int(kv, "mod_revision")?,
        }))
    }
}

fn parse(text: &str) -> Result<Value> {
    serde_json::from_str(text).map_err(|e| CoordError::Malformed(format!("not JSON ({e})")))
}

fn header_revision(v: &Value) -> Result<i64> {
    let header = v
        .get("header")
        .ok_or_else(|| CoordError::Malformed("a reply without its header".into()))?;
    int(header, "revision")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_come_as_strings_or_numbers_and_absent_is_zero() {
        let v = json!({"a": "12", "b": 7, "c": "x", "d": [1]});
        assert_eq!(int(&v, "a").ok(), Some(12));
        assert_eq!(int(&v, "b").ok(), Some(7));
        assert_eq!(int(&v, "missing").ok(), Some(0));
        assert!(matches!(int(&v, "c"), Err(CoordError::Malformed(m)) if m.contains("'c'")));
        assert!(int(&v, "d").is_err());
    }

    #[test]
    fn bytes_are_base64_and_garbage_is_named() {
        let v = json!({"k": B64.encode("run"), "bad": "@@@"});
        assert_eq!(bytes(&v, "k").ok(), Some(b"run".to_vec()));
        assert!(matches!(bytes(&v, "bad"), Err(CoordError::Malformed(m)) if m.contains("bad")));
    }

    #[test]
    fn only_plain_http_endpoints_without_a_path_are_accepted() {
        assert!(Etcd::new("http://127.0.0.1:2379").is_ok());
        assert!(Etcd::new("http://127.0.0.1:2379/").is_ok());
        for bad in [
            "https://h:2379",
            "127.0.0.1:2379",
            "http://",
            "http://h:1/v3",
        ] {
            assert!(
                matches!(Etcd::new(bad), Err(CoordError::Endpoint { .. })),
                "{bad}"
            );
        }
    }
}

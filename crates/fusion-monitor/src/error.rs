use thiserror::Error;

#[derive(Debug, Error)]
pub enum MonitorError {
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("dashboard: cannot listen on {addr}: {source}")]
    Listen {
        addr: String,
        source: std::io::Error,
    },
    #[error(
        "dashboard: {addr} is reachable beyond this machine; give it a token (--dashboard-token) \
         or bind it to loopback"
    )]
    TokenRequired { addr: String },
    #[error(
        "dashboard: the token must be at least {min} characters of letters, digits, '-', '.', \
         '_' or '~'"
    )]
    WeakToken { min: usize },
    #[error("report {path}: {source}")]
    ReadReport {
        path: String,
        source: std::io::Error,
    },
    #[error("report {path} is not a fusionllm run report: {source}")]
    BadReport {
        path: String,
        source: serde_json::Error,
    },
    #[error("writing {path}: {source}")]
    Write {
        path: String,
        source: std::io::Error,
    },
}

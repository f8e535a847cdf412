//! Watching a run: the broker's events are folded into a [`RunView`] (curves, placement,
//! links, codecs, nodes, membership events) and into Prometheus [`Metrics`]; [`serve`] puts
//! both on HTTP (a page updated by server-sent events, `/metrics`), and [`report_page`] writes
//! the same page from a finished run's JSON report.
//!
//! The monitor never talks to nodes and never blocks the broker: an event costs a lock, a fold
//! and one serialisation; slow viewers miss patches and are sent the whole view again.

mod error;
mod metrics;
mod page;
mod report;
mod server;
mod view;

pub use error::MonitorError;
pub use metrics::Metrics;
pub use page::page;
pub use report::{report_page, view_from_report};
pub use server::{serve, Dashboard, MIN_TOKEN};
pub use view::{
    codec_density, push_bounded, CodecChange, EvalPoint, LinkView, NodeView, Patch, ProbedLink,
    RunEvent, RunInfo, RunView, StepPoint, MAX_EVENTS, MAX_POINTS,
};

use fusion_runtime::BrokerEvent;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::broadcast;

/// Patches kept for a viewer that falls behind before it is sent the whole view again.
const PATCH_QUEUE: usize = 1024;

/// The live view of one run, fed by the broker's events and read by the dashboard's viewers.
pub struct Monitor {
    start: Instant,
    view: Mutex<RunView>,
    metrics: Metrics,
    patches: broadcast::Sender<Arc<str>>,
}

impl Monitor {
    pub fn new(info: RunInfo) -> Result<Arc<Self>, MonitorError> {
        let metrics = Metrics::new(&info.unit)?;
        let (patches, _) = broadcast::channel(PATCH_QUEUE);
        Ok(Arc::new(Monitor {
            start: Instant::now(),
            view: Mutex::new(RunView::new(info)),
            metrics,
            patches,
        }))
    }

    /// Folds one broker event into the view and the metrics and tells the viewers.
    pub fn observe(&self, ev: &BrokerEvent) {
        self.metrics.observe(ev);
        let t = self.start.elapsed().as_secs_f64();
        self.update(|v| v.apply(ev, t));
    }

    /// The run ended; `ok` when it trained to the last step.
    pub fn finish(&self, ok: bool, text: &str) {
        let t = self.start.elapsed().as_secs_f64();
        self.update(|v| v.finish(ok, text, t));
    }

    fn update(&self, f: impl FnOnce(&mut RunView) -> Patch) {
        let Ok(mut view) = self.view.lock() else {
            return;
        };
        let patch = f(&mut view);
        if self.patches.receiver_count() > 0 {
            if let Ok(json) = serde_json::to_string(&patch) {
                // No receiver left is not an error: nobody is watching.
                let _ = self.patches.send(json.into());
            }
        }
    }

    /// What the run is: `MODEL on DATA`.
    pub fn title(&self) -> String {
        let info = self.view.lock().map(|v| v.info.clone()).unwrap_or_default();
        format!("{} on {}", info.model, info.data)
    }

    /// A copy of the whole view.
    pub fn view(&self) -> RunView {
        self.view.lock().map(|v| v.clone()).unwrap_or_default()
    }

    /// The whole view as JSON.
    pub fn view_json(&self) -> String {
        match self.view.lock() {
            Ok(view) => serde_json::to_string(&*view).unwrap_or_default(),
            Err(_) => String::from("{}"),
        }
    }

    /// The whole view as JSON and a receiver of every patch after it.
    pub fn subscribe(&self) -> (String, broadcast::Receiver<Arc<str>>) {
        match self.view.lock() {
            Ok(view) => {
                let rx = self.patches.subscribe();
                (serde_json::to_string(&*view).unwrap_or_default(), rx)
            }
            Err(_) => (String::from("{}"), self.patches.subscribe()),
        }
    }

    /// The Prometheus exposition.
    pub fn metrics_text(&self) -> String {
        self.metrics.encode()
    }
}

//! The dashboard page: one HTML file with its style and script inlined, so that the release
//! binary serves it (and a report page works) without any network access.

use crate::RunView;

const HTML: &str = include_str!("../assets/dashboard.html");
const CSS: &str = include_str!("../assets/dashboard.css");
const JS: &str = include_str!("../assets/dashboard.js");

/// The page titled `title`; with `data`, the page shows that view instead of connecting to the
/// broker's event stream.
pub fn page(title: &str, data: Option<&RunView>) -> String {
    let data = match data {
        // JSON inside a <script> element: no `<` may close it early (`\u003c` is the same
        // JSON string).
        Some(v) => serde_json::to_string(v)
            .unwrap_or_else(|_| "null".into())
            .replace('<', "\\u003c"),
        None => "null".into(),
    };
    let title = escape_html(title);
    fill(
        HTML,
        &[
            ("{{TITLE}}", &title),
            ("/*{{CSS}}*/", CSS),
            ("/*{{JS}}*/", JS),
            ("{{DATA}}", &data),
        ],
    )
}

/// `template` with every placeholder replaced in one pass (a value is never searched again).
fn fill(template: &str, values: &[(&str, &str)]) -> String {
    let mut out =
        String::with_capacity(template.len() + values.iter().map(|v| v.1.len()).sum::<usize>());
    let mut rest = template;
    loop {
        let next = values
            .iter()
            .filter_map(|(key, value)| rest.find(key).map(|at| (at, *key, *value)))
            .min_by_key(|(at, ..)| *at);
        let Some((at, key, value)) = next else {
            out.push_str(rest);
            return out;
        };
        out.push_str(&rest[..at]);
        out.push_str(value);
        rest = &rest[at + key.len()..];
    }
}

fn escape_html(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_data_cannot_close_its_script_element() {
        let mut v = RunView::default();
        v.plan = vec!["</script><script>alert(1)</script>".into()];
        let html = page("a <b> model", Some(&v));
        assert_eq!(
            html.matches("</script>").count(),
            2,
            "only the page's own two"
        );
        assert!(html.contains("a &lt;b&gt; model"));
        let start = html
            .find("type=\"application/json\">")
            .expect("data element")
            + 24;
        let end = start + html[start..].find("</script>").expect("its end");
        let back: RunView = serde_json::from_str(&html[start..end]).expect("valid JSON");
        assert_eq!(back.plan, v.plan);
    }

    #[test]
    fn placeholders_inside_values_stay_as_they_are() {
        let mut v = RunView::default();
        v.plan = vec!["{{TITLE}} /*{{JS}}*/".into()];
        let html = page("{{DATA}}", Some(&v));
        assert!(html.contains("<title>fusionllm: {{DATA}}</title>"));
        assert!(html.contains("\"plan\":[\"{{TITLE}} /*{{JS}}*/\"]"));
    }

    #[test]
    fn the_live_page_has_no_data_and_no_placeholders_left() {
        let html = page("x", None);
        assert!(html.contains(">null</script>"));
        assert!(!html.contains("{{") && !html.contains("/*{{"));
    }
}

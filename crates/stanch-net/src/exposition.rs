//! The metrics exposition's label values, escaped.
//!
//! prometheus-client writes a label value as it is given; the text format needs
//! backslash, double quote and line feed escaped inside a value, or a name from the
//! configuration (a model called `a"} 1`) ends the value early and forges a sample.
//! Every label whose value is not a constant of the code is a [`Label`].

use std::fmt::Write;

use prometheus_client::encoding::{EncodeLabelValue, LabelValueEncoder};

/// A label value from outside the code (a configured model, pool or endpoint),
/// escaped as the text exposition format requires when it is written.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Label(pub String);

impl EncodeLabelValue for Label {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        let mut rest = self.0.as_str();
        while let Some(at) = rest.find(['\\', '"', '\n']) {
            encoder.write_str(&rest[..at])?;
            encoder.write_str(match rest.as_bytes()[at] {
                b'\\' => "\\\\",
                b'"' => "\\\"",
                _ => "\\n",
            })?;
            rest = &rest[at + 1..];
        }
        encoder.write_str(rest)
    }
}

impl From<String> for Label {
    fn from(value: String) -> Label {
        Label(value)
    }
}

impl From<&str> for Label {
    fn from(value: &str) -> Label {
        Label(value.to_owned())
    }
}

impl From<&String> for Label {
    fn from(value: &String) -> Label {
        Label(value.clone())
    }
}

#[cfg(test)]
mod tests {
    use prometheus_client::encoding::EncodeLabelSet;
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::family::Family;
    use prometheus_client::registry::Registry;

    use super::*;

    #[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
    struct Labels {
        model: Label,
    }

    #[test]
    fn a_value_is_written_escaped() {
        let family = Family::<Labels, Counter>::default();
        family
            .get_or_create(&Labels {
                model: "a\"} 1\nb\\".into(),
            })
            .inc();
        let mut registry = Registry::default();
        registry.register("requests", "Requests", family);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
        assert!(
            out.contains(r#"requests_total{model="a\"} 1\nb\\"} 1"#),
            "{out}"
        );
    }
}

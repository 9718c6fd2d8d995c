//! The configuration documented in docs/configuration.md is one stanch accepts.

#[test]
fn the_documented_configuration_is_valid() {
    let doc = include_str!("../../../../docs/configuration.md");
    let section = &doc[doc.find("## The file").expect("a section on the file")..];
    let example = section
        .split("```yaml\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("a YAML example");
    let config = stanch_core::Config::from_yaml(example).unwrap_or_else(|e| panic!("{e}"));
    assert!(config.models.contains_key("qwen-72b"));
}

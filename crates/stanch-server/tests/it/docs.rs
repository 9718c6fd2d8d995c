//! The configuration documented in docs/configuration.md is one stanch accepts, policy
//! and the controller's own settings alike.

#[test]
fn the_documented_configuration_is_valid() {
    let doc = include_str!("../../../../docs/configuration.md");
    let section = &doc[doc.find("## The file").expect("a section on the file")..];
    let example = section
        .split("```yaml\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("a YAML example");
    let file =
        stanch_server::config::ConfigFile::from_yaml(example).unwrap_or_else(|e| panic!("{e}"));
    assert!(file.policy.models.contains_key("qwen-72b"));
    assert!(file.server.alertmanager.is_some());
    assert!(file.server.auth.admin_token_file.is_some());
}

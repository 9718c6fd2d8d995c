//! The crates keep their layers, as `cargo metadata` resolves them: adapters depend
//! on the ports, not on the controller shell; the protobuf stays out of the wire types;
//! the controller binary links no data plane unless the demo is asked for; nothing
//! shipped links a test-only crate. (The pure core's own test is in stanch-core.)

use stanch_testkit::deps::Graph;

/// What only tests and benchmarks may link.
const TEST_ONLY: &[&str] = &["stanch-fake-apiserver", "stanch-testkit"];

#[test]
fn the_controller_binary_links_no_data_plane_without_the_demo() {
    let graph = Graph::load(&[]);
    let stanch = graph.normal_closure("stanch");
    let linked = graph.paths_to(&stanch, &["stanch-gateway", "stanch-mock", "stanch-demo"]);
    assert!(linked.is_empty(), "stanch links {linked:#?}");
    // What it is: the controller, its Kubernetes adapter and `stanch ctl`.
    let names = graph.names(&stanch);
    for expected in ["stanch-server", "stanch-kube", "stanch-ctl"] {
        assert!(names.contains(&expected), "{expected} in {names:?}");
    }
}

#[test]
fn the_demo_feature_links_the_gateway_and_the_mock() {
    let graph = Graph::load(&["stanch/demo"]);
    let stanch = graph.normal_closure("stanch");
    for expected in ["stanch-demo", "stanch-gateway", "stanch-mock"] {
        assert!(
            graph.names(&stanch).contains(&expected),
            "with `demo`, stanch links {expected}"
        );
    }
}

#[test]
fn adapters_depend_on_ports_not_on_the_shell() {
    let graph = Graph::load(&[]);
    let kube = graph.normal_closure("stanch-kube");
    let names = graph.names(&kube);
    assert!(names.contains(&"stanch-ports"), "{names:?}");
    let shell = graph.paths_to(&kube, &["stanch-server"]);
    assert!(
        shell.is_empty(),
        "stanch-kube reaches the shell: {shell:#?}"
    );
    // The listener is IO alone: no wire types.
    let net = graph.normal_closure("stanch-net");
    let wire = graph.paths_to(&net, &["stanch-api", "stanch-core", "stanch-ports"]);
    assert!(wire.is_empty(), "stanch-net reaches {wire:#?}");
}

#[test]
fn the_protobuf_stays_out_of_the_wire_types() {
    let graph = Graph::load(&[]);
    for package in ["stanch-api", "stanch-core", "stanch-ports"] {
        let closure = graph.normal_closure(package);
        let proto = graph.paths_to(&closure, &["stanch-proto", "prost", "tonic"]);
        assert!(proto.is_empty(), "{package} reaches {proto:#?}");
    }
    // Where the watch is spoken, it is there.
    for package in ["stanch-server", "stanch-client"] {
        let closure = graph.normal_closure(package);
        assert!(graph.names(&closure).contains(&"stanch-proto"), "{package}");
    }
}

#[test]
fn nothing_shipped_links_a_test_only_crate() {
    let graph = Graph::load(&["stanch/demo"]);
    for binary in ["stanch", "stanch-gateway", "stanch-mock"] {
        let closure = graph.normal_closure(binary);
        let linked = graph.paths_to(&closure, TEST_ONLY);
        assert!(linked.is_empty(), "{binary} links {linked:#?}");
    }
}

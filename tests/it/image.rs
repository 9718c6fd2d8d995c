//! The container image: the Dockerfile passes hadolint, and its runtime stage, built
//! by buildah, runs the controller and the gateway under podman as the chart runs them:
//! the chart's arguments, configuration and token files, its user, a read-only root
//! filesystem and no capabilities.
//!
//! No registry is reachable where the tests run, so nothing is pulled: the Dockerfile's
//! build stage is replaced by the binaries `cargo test` built (`--build-context
//! build=…`), and its runtime base by an image assembled from scratch with the shared
//! libraries they link (glibc, libgcc), the CA bundle and a `nonroot` user 65532,
//! which is what distroless' `cc:nonroot` holds. Containers share the host's network (podman's own
//! network needs more than this machine allows), so each listens on a free loopback
//! port instead of the chart's fixed one.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use serde_json::Value;
use stanch_testkit::wait::blocking::{holds_within, until_some};

use crate::chart::{CHART, render};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn run(program: &str, args: &[&str]) -> Output {
    Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e} (scripts/install-test-deps.sh installs it)"))
}

fn ok(program: &str, args: &[&str]) -> String {
    let out = run(program, args);
    assert!(
        out.status.success(),
        "{program} {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn the_dockerfile_passes_hadolint() {
    let hadolint = match std::env::var_os("STANCH_TEST_PYTHON") {
        Some(p) => Path::new(&p).with_file_name("hadolint"),
        None => Path::new(ROOT).join("target/test-venv/bin/hadolint"),
    };
    let out = Command::new(&hadolint)
        .arg(format!("{ROOT}/Dockerfile"))
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", hadolint.display()));
    assert!(
        out.status.success() && out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// A container, removed when dropped.
struct Container(String);

impl Drop for Container {
    fn drop(&mut self) {
        let _ = run("podman", &["rm", "--force", "--time", "2", &self.0]);
    }
}

/// An image, removed when dropped.
struct Image(String);

impl Drop for Image {
    fn drop(&mut self) {
        let _ = run("buildah", &["rmi", "--force", &self.0]);
    }
}

/// The shared libraries a binary links, by path.
fn libraries(binary: &Path) -> Vec<String> {
    let out = ok("ldd", &[binary.to_str().unwrap()]);
    out.lines()
        .filter_map(|l| {
            let path = match l.split_once("=>") {
                Some((_, right)) => right.split_whitespace().next()?,
                None => l.split_whitespace().next()?,
            };
            path.starts_with('/').then(|| path.to_owned())
        })
        .collect()
}

/// The runtime base: the binaries' shared libraries and a `nonroot` user, from scratch.
fn base_image(binaries: &[PathBuf], dir: &Path) -> Image {
    let tag = format!("localhost/stanch-test-base:{}", std::process::id());
    let ctr = ok("buildah", &["from", "scratch"]).trim().to_owned();
    let mut libs: Vec<String> = binaries.iter().flat_map(|b| libraries(b)).collect();
    libs.sort();
    libs.dedup();
    assert!(libs.iter().any(|l| l.contains("libc.so")), "{libs:?}");
    for lib in &libs {
        ok("buildah", &["copy", "--quiet", &ctr, lib, lib]);
    }
    let etc = dir.join("etc");
    std::fs::create_dir_all(&etc).unwrap();
    std::fs::write(
        etc.join("passwd"),
        "root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n",
    )
    .unwrap();
    std::fs::write(etc.join("group"), "root:x:0:\nnonroot:x:65532:\n").unwrap();
    ok(
        "buildah",
        &["copy", "--quiet", &ctr, etc.to_str().unwrap(), "/etc"],
    );
    // The CA bundle distroless carries: the Kubernetes client loads the system's roots
    // (beside the cluster's CA) and refuses to start without any.
    let bundle = "/etc/ssl/certs/ca-certificates.crt";
    ok("buildah", &["copy", "--quiet", &ctr, bundle, bundle]);
    ok("buildah", &["config", "--user", "65532:65532", &ctr]);
    ok("buildah", &["commit", "--quiet", "--rm", &ctr, &tag]);
    Image(tag)
}

/// What the chart writes for a pod: its container's arguments, and files by mount
/// path (configuration and tokens), with the pod's user.
struct Pod {
    args: Vec<String>,
    files: Vec<(String, String)>,
    user: String,
    readiness: String,
    liveness: String,
    /// Where the pod has an `emptyDir`: writable, as tmpfs here.
    scratch: Vec<String>,
}

fn pod_of(objects: &[Value], deployment: &str) -> Pod {
    let d = objects
        .iter()
        .find(|o| o["kind"] == "Deployment" && o["metadata"]["name"] == deployment)
        .unwrap();
    let spec = &d["spec"]["template"]["spec"];
    let c = &spec["containers"][0];
    let mut files = vec![];
    let mut scratch = vec![];
    for mount in c["volumeMounts"].as_array().unwrap() {
        let volume = spec["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == mount["name"])
            .unwrap();
        let at = mount["mountPath"].as_str().unwrap();
        if volume["emptyDir"].is_object() {
            scratch.push(at.to_owned());
        } else if let Some(name) = volume["configMap"]["name"].as_str() {
            let cm = objects
                .iter()
                .find(|o| o["kind"] == "ConfigMap" && o["metadata"]["name"] == name)
                .unwrap();
            for (k, v) in cm["data"].as_object().unwrap() {
                files.push((format!("{at}/{k}"), v.as_str().unwrap().to_owned()));
            }
        } else if let Some(name) = volume["secret"]["secretName"].as_str() {
            let secret = objects
                .iter()
                .find(|o| o["kind"] == "Secret" && o["metadata"]["name"] == name)
                .unwrap();
            for item in volume["secret"]["items"].as_array().unwrap() {
                let encoded = secret["data"][item["key"].as_str().unwrap()]
                    .as_str()
                    .unwrap();
                files.push((
                    format!("{at}/{}", item["path"].as_str().unwrap()),
                    crate::chart::unb64(encoded),
                ));
            }
        }
    }
    let security = &spec["securityContext"];
    Pod {
        args: c["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_owned())
            .collect(),
        files,
        user: format!("{}:{}", security["runAsUser"], security["runAsGroup"]),
        readiness: c["readinessProbe"]["httpGet"]["path"]
            .as_str()
            .unwrap()
            .to_owned(),
        liveness: c["livenessProbe"]["httpGet"]["path"]
            .as_str()
            .unwrap()
            .to_owned(),
        scratch,
    }
}

/// Runs `pod` from `image` as the chart's pod runs: its user, a read-only root, no
/// capabilities, no privilege escalation; its files mounted read-only where the chart
/// mounts them (owned by the pod's group, mode 0440, as `fsGroup` and `defaultMode`
/// make them), and `command` as the entrypoint when given.
fn start(
    image: &str,
    pod: &Pod,
    dir: &Path,
    command: Option<&str>,
    env: &[(&str, &str)],
    mounts: &[(&Path, &str)],
) -> Container {
    let name = format!(
        "stanch-test-{}-{}",
        std::process::id(),
        dir.file_name().unwrap().to_string_lossy()
    );
    let mut args: Vec<String> = [
        "run",
        "--detach",
        "--name",
        &name,
        "--runtime",
        "runc",
        "--read-only",
        "--cap-drop=ALL",
        "--security-opt=no-new-privileges",
        "--network=host",
        // The sandbox forbids raising these limits; podman's defaults would.
        "--ulimit=nofile=4096:4096",
        "--ulimit=nproc=4096:4096",
        "--user",
        &pod.user,
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    for (at, content) in &pod.files {
        let host = dir.join(at.trim_start_matches('/').replace('/', "_"));
        std::fs::write(&host, content).unwrap();
        let group: u32 = pod.user.split(':').nth(1).unwrap().parse().unwrap();
        ok("chown", &[&format!("0:{group}"), host.to_str().unwrap()]);
        ok("chmod", &["0440", host.to_str().unwrap()]);
        args.push(format!("--volume={}:{at}:ro", host.display()));
    }
    // An emptyDir is a world-writable directory.
    for at in &pod.scratch {
        args.push(format!("--tmpfs={at}:rw,size=16m,mode=0777"));
    }
    for (host, at) in mounts {
        args.push(format!("--volume={}:{at}:ro", host.display()));
    }
    for (k, v) in env {
        args.push(format!("--env={k}={v}"));
    }
    if let Some(c) = command {
        args.push(format!("--entrypoint={c}"));
    }
    args.push(image.to_owned());
    args.extend(pod.args.iter().cloned());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    ok("podman", &args);
    Container(name)
}

fn get(url: &str, token: Option<&str>) -> Option<u16> {
    let client = reqwest::blocking::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let mut r = client.get(url);
    if let Some(t) = token {
        r = r.bearer_auth(t);
    }
    r.send().ok().map(|r| r.status().as_u16())
}

/// The process a container runs, as the kernel sees it: its user, and whether its root
/// filesystem is read-only.
fn process_facts(container: &Container) -> (String, bool, String) {
    let pid = ok(
        "podman",
        &["inspect", "--format", "{{.State.Pid}}", &container.0],
    );
    let pid = pid.trim();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str, at: usize| {
        let line = status.lines().find(|l| l.starts_with(name)).unwrap();
        line.split_whitespace().nth(at).unwrap().to_owned()
    };
    // Uid: real, effective, saved, filesystem; CapEff: the effective set.
    let (uid, caps) = (field("Uid:", 2), field("CapEff:", 1));
    let mounts = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
    let root = mounts
        .lines()
        .find(|l| l.split_whitespace().nth(4) == Some("/"))
        .unwrap();
    let options = root.split_whitespace().nth(5).unwrap();
    (uid, options.split(',').any(|o| o == "ro"), caps)
}

/// Waits for `url` to answer 200; panics with the container's logs if it does not
/// within 30 s.
fn answers(container: &Container, url: &str) {
    assert!(
        holds_within(Duration::from_secs(30), || get(url, None) == Some(200)),
        "{url} did not answer 200 within 30 s: {}",
        logs(container)
    );
}

fn logs(container: &Container) -> String {
    let out = run("podman", &["logs", &container.0]);
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The image the chart deploys starts the controller as the chart runs it (leader
/// election and state against an API server) and the gateway beside it, as user 65532
/// on a read-only root with no capabilities: both answer their probes, the API wants
/// its tokens, and no token reaches the logs.
#[test]
fn the_image_runs_the_chart_s_pods_as_non_root_on_a_read_only_root() {
    let uid = ok("id", &["-u"]);
    assert_eq!(
        uid.trim(),
        "0",
        "the image test runs containers with podman as root (as CI does)"
    );
    let work = Path::new(ROOT).join("target/image-test");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(work.join("context/out")).unwrap();
    let bin = Path::new(env!("CARGO_BIN_EXE_stanch"));
    let binaries = [bin.to_path_buf(), bin.with_file_name("stanch-gateway")];
    for b in &binaries {
        let to = work.join("context/out").join(b.file_name().unwrap());
        std::fs::hard_link(b, &to)
            .or_else(|_| std::fs::copy(b, &to).map(|_| ()))
            .unwrap();
    }
    let base = base_image(&binaries, &work);
    let image = Image(format!("localhost/stanch-test:{}", std::process::id()));
    ok(
        "buildah",
        &[
            "bud",
            "--quiet",
            "--pull=never",
            "--build-arg",
            &format!("RUNTIME_IMAGE={}", base.0),
            "--build-context",
            &format!("build={}", work.join("context").display()),
            "--tag",
            &image.0,
            "--file",
            &format!("{ROOT}/Dockerfile"),
            ROOT,
        ],
    );
    let config = ok(
        "buildah",
        &[
            "inspect",
            "--type",
            "image",
            "--format",
            "{{.OCIv1.Config.User}} {{.OCIv1.Config.Entrypoint}}",
            &image.0,
        ],
    );
    assert_eq!(config.trim(), "65532:65532 [/usr/local/bin/stanch]");

    // The chart's pods, with the gateway, their files and arguments.
    let objects = render(&["-f", &format!("{CHART}/examples/with-gateway.yaml")]);
    let mut controller = pod_of(&objects, "stanch");
    let port = stanch_testkit::net::free_port();
    for a in &mut controller.args {
        if a.starts_with("--listen=") {
            *a = format!("--listen=127.0.0.1:{port}");
        }
    }
    let tokens: Vec<String> = controller
        .files
        .iter()
        .filter(|(at, _)| at.starts_with("/etc/stanch/tokens/"))
        .map(|(_, t)| t.clone())
        .collect();
    assert_eq!(tokens.len(), 4);
    let read = controller
        .files
        .iter()
        .find(|(at, _)| at.ends_with("/read-token"))
        .unwrap()
        .1
        .clone();

    let runtime = tokio::runtime::Runtime::new().unwrap();
    let api = runtime.block_on(stanch_fake_apiserver::FakeApiServer::start());
    let kubeconfig = work.join("kubeconfig");
    api.write_kubeconfig(&kubeconfig, crate::chart::NS).unwrap();
    ok("chmod", &["0444", kubeconfig.to_str().unwrap()]);
    let dir = work.join("controller");
    std::fs::create_dir_all(&dir).unwrap();
    let c = start(
        &image.0,
        &controller,
        &dir,
        None,
        &[("KUBECONFIG", "/etc/kube/config"), ("POD_NAME", "stanch-0")],
        &[(&kubeconfig, "/etc/kube/config")],
    );
    let base_url = format!("http://127.0.0.1:{port}");
    answers(&c, &format!("{base_url}{}", controller.readiness));
    assert_eq!(
        get(&format!("{base_url}{}", controller.liveness), None),
        Some(200)
    );
    assert_eq!(get(&format!("{base_url}/v1/status"), None), Some(401));
    assert_eq!(
        get(&format!("{base_url}/v1/status"), Some(&read)),
        Some(200)
    );
    // It took the Lease and wrote its state through the API.
    assert!(
        api.object(
            "apis/coordination.k8s.io/v1",
            "leases",
            crate::chart::NS,
            "stanch"
        )
        .is_some()
    );
    let (uid, read_only, caps) = process_facts(&c);
    assert_eq!(uid, "65532");
    assert!(read_only, "the root filesystem is writable");
    assert_eq!(caps, "0000000000000000");

    // The gateway, watching the controller (at its loopback port here).
    let mut gateway = pod_of(&objects, "stanch-gateway");
    let (gport, sport) = (
        stanch_testkit::net::free_port(),
        stanch_testkit::net::free_port(),
    );
    let mut status_apart = false;
    for a in &mut gateway.args {
        if a.starts_with("--listen=") {
            *a = format!("--listen=127.0.0.1:{gport}");
        } else if a.starts_with("--status-listen=") {
            *a = format!("--status-listen=127.0.0.1:{sport}");
            status_apart = true;
        }
    }
    assert!(status_apart, "the chart serves the gateway's status apart");
    for (at, content) in &mut gateway.files {
        if at.ends_with("gateway.yaml") {
            *content = content.replace("http://stanch.monitoring.svc:9797", &base_url);
        }
    }
    assert_eq!(gateway.scratch, ["/var/lib/stanch-gateway"]);
    let dir = work.join("gateway");
    std::fs::create_dir_all(&dir).unwrap();
    let g = start(
        &image.0,
        &gateway,
        &dir,
        Some("/usr/local/bin/stanch-gateway"),
        // Kubernetes names a pod's host by the pod: its gateway identity.
        &[
            ("VLLM_KEY", "upstream-key"),
            ("HOSTNAME", "stanch-gateway-7c9f-x2"),
        ],
        &[],
    );
    let gbase = format!("http://127.0.0.1:{gport}");
    answers(&g, &format!("{gbase}{}", gateway.readiness));
    let (uid, read_only, _) = process_facts(&g);
    assert_eq!(uid, "65532");
    assert!(read_only);
    // The status and the metrics on their own port, not on the callers'.
    let sbase = format!("http://127.0.0.1:{sport}");
    for path in ["/metrics", "/v1/status"] {
        assert_eq!(get(&format!("{sbase}{path}"), None), Some(200), "{path}");
        assert_eq!(get(&format!("{gbase}{path}"), None), Some(404), "{path}");
    }
    // It watches the controller with the read token: the controller counts it.
    until_some("the gateway watching", Duration::from_secs(20), || {
        let status: Value = reqwest::blocking::Client::builder()
            .no_proxy()
            .build()
            .unwrap()
            .get(format!("{base_url}/v1/status"))
            .bearer_auth(&read)
            .send()
            .ok()?
            .json()
            .ok()?;
        status["gateways"]
            .as_array()?
            .iter()
            .any(|g| g.to_string().contains("stanch-gateway-7c9f-x2"))
            .then_some(())
    });

    // Logs are written within a second (stanch-log's flush interval).
    let said = until_some("both logging", Duration::from_secs(5), || {
        let said = format!("{}{}", logs(&c), logs(&g));
        (said.contains("stanch controller listening") && said.contains("stanch-gateway listening"))
            .then_some(said)
    });
    for token in &tokens {
        assert!(!said.contains(token.as_str()), "a token in the logs");
    }
}

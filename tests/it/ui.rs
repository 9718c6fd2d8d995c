//! The status page in a real browser: Debian's Chromium, driven by `tests/ui/page.mjs`
//! (playwright-core over the DevTools protocol), against the real controller and, for
//! the path-prefix case, the real nginx in front of it as an ingress would be.
//! Screenshots of the key states land in `target/ui-artefacts/`.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use stanch_testkit::http::blocking::ready_within;
use stanch_testkit::process::Running;

use crate::chart::tool;
use crate::process::Server;

/// Two models, the larger one falling back to the smaller: all four rungs reachable.
const CONFIG: &str = "\
models:
  qwen-72b: {pools: [dc-a, dc-b], fallback: qwen-14b, faq: default}
  qwen-14b: {pools: [dc-a, dc-b], faq: default}
ladder: {recover_after: 30s, min_dwell: 2s, lease: 2m}
";

/// nginx in the foreground, serving the controller under `/stanch/`.
struct Nginx {
    _child: Running,
    base: String,
}

impl Nginx {
    fn start(dir: &Path, upstream: &str) -> Nginx {
        let port = stanch_testkit::net::free_port();
        let d = dir.display();
        let conf = dir.join("nginx.conf");
        std::fs::write(
            &conf,
            format!(
                "daemon off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/nginx-error.log;
events {{ worker_connections 64; }}
http {{
  access_log off;
  client_body_temp_path {d}/body;
  proxy_temp_path {d}/proxy;
  fastcgi_temp_path {d}/fastcgi;
  uwsgi_temp_path {d}/uwsgi;
  scgi_temp_path {d}/scgi;
  server {{
    listen 127.0.0.1:{port};
    location /stanch/ {{
      proxy_pass {upstream}/;
      proxy_http_version 1.1;
      proxy_buffering off;
      proxy_read_timeout 1h;
    }}
  }}
}}
"
            ),
        )
        .unwrap();
        let child = Running::spawn(
            Command::new(stanch_testkit::process::program(&["nginx"]))
                .args(["-p"])
                .arg(dir)
                .arg("-c")
                .arg(&conf)
                .stdout(Stdio::null())
                .stderr(Stdio::inherit()),
        );
        let nginx = Nginx {
            _child: child,
            base: format!("http://127.0.0.1:{port}/stanch/"),
        };
        let readyz = format!("{}readyz", nginx.base);
        assert!(
            ready_within(&crate::process::client(), &readyz, Duration::from_secs(5)),
            "nginx did not proxy to the controller: {}",
            std::fs::read_to_string(dir.join("nginx-error.log")).unwrap_or_default()
        );
        nginx
    }
}

/// What an on-call engineer checks on the page during an incident: the token prompt,
/// the rung highlighted, why and what comes next, a hostile label shown as text, the
/// live update without reload, an override refused without the admin token and done
/// with it, the timeline in order and linkable, the layout at phone width, dark mode,
/// and all of it behind a path prefix. Each step is named in the output.
#[test]
fn the_status_page_in_a_real_browser() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.yaml");
    std::fs::write(&config, CONFIG).unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    // Tokens that appear nowhere else, so the page can be searched for them.
    let [admin, ingest, read] = ["admin-7f3c91", "ingest-2b8e40", "read-c45d17"];
    let server = Server::start_with(
        &data,
        &["--config", config.to_str().unwrap()],
        "http",
        "warn",
        Stdio::null(),
        [admin, ingest, read],
    );
    let nginx_dir = dir.path().join("nginx");
    std::fs::create_dir(&nginx_dir).unwrap();
    let nginx = Nginx::start(&nginx_dir, &server.base);
    let artefacts = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/ui-artefacts");
    let _ = std::fs::remove_dir_all(&artefacts);

    let out = Command::new("node")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/ui/page.mjs"))
        .env("STANCH_URL", format!("{}/", server.base))
        .env("STANCH_PREFIXED", &nginx.base)
        .env("STANCH_READ", read)
        .env("STANCH_ADMIN", admin)
        .env("STANCH_INGEST", ingest)
        .env(
            "NODE_MODULES",
            tool("STANCH_TEST_NODE_MODULES", "test-tools/node/node_modules"),
        )
        .env("ARTEFACTS", &artefacts)
        .output()
        .expect("node runs");
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{report}");
    assert!(
        out.status.success(),
        "{report}\n(screenshots in {})",
        artefacts.display()
    );
    assert!(!report.contains("not ok"), "{report}");
    for shot in [
        "token-prompt",
        "incident",
        "override-dialog",
        "incident-dark",
        "phone",
    ] {
        assert!(
            artefacts.join(format!("{shot}.png")).exists(),
            "no screenshot {shot}.png"
        );
    }
}
